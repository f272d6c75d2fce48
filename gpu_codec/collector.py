"""The interpreter's cyclic garbage collector held off while the engine's calls run.

A compress, a decompress, an aggregator's ``add`` or a payload's ``to_bytes`` of a model of many tensors makes a few
Python objects a tensor (its record, its views, its row of the tensor table). Those that live through two of the
collector's young passes are promoted to its oldest generation, and once enough have been promoted the collector
scans the whole heap: in a training process, torch's and the model's hundreds of thousands of objects. That pass
lands on one call in tens and costs tens to hundreds of milliseconds, which averages to milliseconds a call at
1,000 tensors (``benchmarks/bench_collector.py``). So these calls hold automatic collection off while they run and
hand it back as they found it. The objects they make are freed by reference counting as ever; a reference cycle
among them waits for the next collection.

Calls in several threads share one hold: the first to enter turns automatic collection off, where it was on, and the
last to leave turns it back on (a call inside another of its thread's, as ``Aggregator.add`` reads its payload,
holds nothing of its own). A call that leaves while calls in other threads are still inside runs the collection that
automatic collection owes by then (the oldest generation whose count is past its threshold, once the youngest's is),
so calls that overlap without a break, as a server's threads decoding back to back do, never starve the collector. A
thread that turns the collector off itself while another thread is inside one of these calls finds it on again when
that call returns. :func:`set_paused` (``False``) leaves the collector alone.

>>> import gc
>>> with collector_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
>>> set_paused(False)
>>> with collector_paused():
...     gc.isenabled()
True
>>> set_paused(True)
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .errors import InvalidInputError

_F = TypeVar("_F", bound=Callable[..., Any])

_lock = threading.Lock()
_inside = 0  # threads inside a hold (their outermost calls)
_local = threading.local()  # .depth: this thread's calls inside one another
_turned_off = False  # whether the hold turned automatic collection off (and so turns it back on)
_paused = True


def set_paused(on: bool) -> None:
    """Whether the engine's calls hold the collector off (default ``True``); ``False`` leaves it alone."""
    global _paused
    if not isinstance(on, bool):
        raise InvalidInputError(f"set_paused takes True or False, got {on!r}")
    _paused = on


def paused() -> bool:
    """Whether the engine's calls hold the collector off (:func:`set_paused`)."""
    return _paused


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic garbage collection off inside the block (where :func:`paused`), as it was after it."""
    global _inside, _turned_off
    if not _paused:
        yield
        return
    depth = getattr(_local, "depth", 0)
    if depth:  # (a call inside another of this thread's: the outer one holds, and hands back)
        _local.depth = depth + 1
        try:
            yield
        finally:
            _local.depth = depth
        return
    _local.depth = 1
    with _lock:
        if not _inside:
            _turned_off = gc.isenabled()
            if _turned_off:
                gc.disable()
        _inside += 1
    try:
        yield
    finally:
        _local.depth = 0
        owed = None
        with _lock:
            _inside -= 1
            if not _inside and _turned_off:
                _turned_off = False
                gc.enable()
            elif _inside and _turned_off:
                owed = _owed()
        if owed is not None:
            gc.collect(owed)


def _owed() -> int | None:
    """The generation automatic collection would collect now, were it on (None: none is due)."""
    count, threshold = gc.get_count(), gc.get_threshold()
    if not threshold[0] or count[0] <= threshold[0]:
        return None
    for gen in (2, 1):
        if threshold[gen] and count[gen] >= threshold[gen]:
            return gen
    return 0


def holds_collector(fn: _F) -> _F:
    """``fn`` run inside :func:`collector_paused`."""

    @functools.wraps(fn)
    def held(*args: Any, **kwargs: Any) -> Any:
        with collector_paused():
            return fn(*args, **kwargs)

    return held  # type: ignore[return-value]


__all__ = ["collector_paused", "holds_collector", "paused", "set_paused"]
