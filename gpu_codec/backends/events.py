"""Ordering across streams: an event recorded where work was queued, waited on where its result is read.

On a device backend (``on_device``), work runs on whichever CuPy stream is current (the caller's torch stream
inside :meth:`~gpu_codec.backends.base.Backend.stream`, CuPy's current stream outside it); state kept between
calls (error-feedback residuals, an aggregator's limbs) can be read later on another stream. :func:`record` marks
the end of the work queued so far on the current stream; :func:`wait` makes the current stream wait for it
(on the device, without blocking the host). Both do nothing on host backends, where every op has finished when
it returns.

>>> from gpu_codec.backends.numpy import NumpyBackend
>>> record(NumpyBackend()) is None
True
"""

from __future__ import annotations

from typing import Any

__all__ = ["record", "wait"]


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
