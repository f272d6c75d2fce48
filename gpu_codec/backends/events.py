"""Ordering across streams: an event recorded where work was queued, waited on where its result is read.

On a device backend (``on_device``), work runs on whichever CuPy stream is current (the caller's torch stream
inside :meth:`~gpu_codec.backends.base.Backend.stream`, CuPy's current stream outside it); state kept between
calls (error-feedback residuals, an aggregator's limbs) can be read later on another stream. :func:`record` marks
the end of the work queued so far on the current stream; :func:`wait` makes the current stream wait for it
(on the device, without blocking the host). Both do nothing on host backends, where every op has finished when
it returns.

A call's scope (:meth:`~gpu_codec.backends.base.Backend.stream`, through :func:`scope`) ends with
:func:`finish`: the host waits for the call's stream, unless the caller asked not to (:func:`deferred`, used by
``compress(..., blocking=False)``): then an event is recorded there instead, and the caller waits on it when it
needs the bytes. A call whose last device step was a blocking copy to the host (:func:`.base.gathered`, which
marks it with :func:`waited`) has already waited for everything queued on the stream: its scope ends without a
second wait.

>>> from gpu_codec.backends.cpu import CpuBackend
>>> record(CpuBackend()) is None
True
>>> with deferred() as pending:
...     finish(CpuBackend())                   # a host backend has nothing left to wait for
>>> pending
[]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["deferred", "finish", "record", "scope", "wait", "waited"]

_local = threading.local()


def record(backend: Any) -> Any:
    """An event recorded on the current stream of ``backend``'s array module (None on a host backend)."""
    if not getattr(backend, "on_device", False):
        return None
    cuda = backend.xp.cuda
    ev = cuda.Event(disable_timing=True)
    ev.record(cuda.get_current_stream())
    return ev


def wait(backend: Any, event: Any) -> None:
    """The current stream waits (on the device) for ``event`` (nothing for None or on a host backend)."""
    if event is not None and getattr(backend, "on_device", False):
        backend.xp.cuda.get_current_stream().wait_event(event)


@contextlib.contextmanager
def deferred() -> Iterator[list[Any]]:
    """Inside the block, :func:`finish` does not block the host: it appends an event recorded on the call's stream
    to the list this yields (one per call scope that ended in the block, in this thread)."""
    prev = getattr(_local, "pending", None)
    _local.pending = []
    try:
        yield _local.pending
    finally:
        _local.pending = prev


@contextlib.contextmanager
def scope(backend: Any) -> Iterator[None]:
    """A call's scope on ``backend`` (inside its device and stream contexts): on the way out, :func:`finish`, which
    is left out where the block's last device step was a host read that waited for the stream (:func:`waited`)
    and the caller did not ask for an event (:func:`deferred`). Scopes nest; each has its own mark."""
    prev = getattr(_local, "waited", None)
    _local.waited = False
    try:
        yield
        if not (_local.waited and getattr(_local, "pending", None) is None):
            finish(backend)
    finally:
        _local.waited = prev


def waited() -> None:
    """Mark, inside a :func:`scope`, that the host has just waited for the current stream (a blocking copy of
    what everything queued on it wrote), so that the scope need not wait again. Called only where no device work
    is queued after it in the scope; outside one it does nothing."""
    if getattr(_local, "waited", None) is not None:
        _local.waited = True


def finish(backend: Any) -> None:
    """The end of a call's scope on ``backend``: the host waits for the current stream (everything queued on it,
    the call's work and whatever the caller queued before), or, inside :func:`deferred`, records an event there."""
    if not getattr(backend, "on_device", False):
        return
    pending = getattr(_local, "pending", None)
    if pending is not None:
        pending.append(record(backend))
    else:
        backend.xp.cuda.get_current_stream().synchronize()
