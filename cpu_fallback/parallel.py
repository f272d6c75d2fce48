"""The NumPy backend's thread pool: blocks of a tensor run on every core (NumPy releases the GIL in its loops).

``GPU_CODEC_THREADS`` sets the number of threads (default: ``os.cpu_count()``). Work is split into blocks whose
results are combined in block order, so every result is the same for any thread count.

>>> parallel_map(lambda x: x * x, range(5))
[0, 1, 4, 9, 16]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

ENV = "GPU_CODEC_THREADS"

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_CORES = max(1, os.cpu_count() or 1)  # read once: os.cpu_count() reads the system's files on every call


def _forget_pool() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def thread_count() -> int:
    """Threads the NumPy backend uses: ``GPU_CODEC_THREADS`` if set (a positive integer), else every core."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return _CORES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        from gpu_codec.errors import InvalidInputError

        raise InvalidInputError(f"{ENV} must be a positive integer (threads), got {raw!r}")
    return n


def _executor(n: int) -> ThreadPoolExecutor:
    """The module's pool, of at least ``n`` threads (the caller is the extra one; a call submits only as many
    items as it has threads for). A larger count makes a larger pool; the one before it is dropped, never shut
    down, since a call in another thread may still be handing it work (its idle threads end once it is freed)."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="gpu_codec")
            _pool_size = n
        return _pool


def spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) cut into pieces of ``step`` (the last one shorter): the pool's items.

    >>> spans(0, 10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    return [(s, min(stop, s + step)) for s in range(start, stop, step)]


def parallel_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None, together: list[bool] | None = None
) -> list[R]:
    """``[fn(x) for x in items]`` on the pool, results in item order; the calling thread works too. At most
    ``workers`` threads (default: :func:`thread_count`) work on it. The items that ``together`` marks (one flag an
    item) are one turn of the pool, run in order by one thread: items whose work is many short NumPy calls, which
    cost more in turns at the interpreter lock on two threads than the second core gives back (the others still go
    to the other threads meanwhile).

    Items go to whichever thread asks next, so a pool thread that starts late (on a busy machine) delays
    nothing: the caller waits only for items already taken. An exception is raised for the lowest item that
    failed, after every item has finished.

    >>> parallel_map(lambda x: x + 1, [1, 2, 3, 4], 2, together=[True, False, True, False])
    [2, 3, 4, 5]
    """
    items = list(items)
    marked = [i for i, t in enumerate(together) if t] if together is not None else []
    if len(marked) > 1:  # (one turn, where the first of them was: every item before it is a turn of its own)
        turns = [[i] for i in range(len(items)) if not together[i]]
        turns.insert(marked[0], marked)
    else:
        turns = [[i] for i in range(len(items))]
    n = min(thread_count() if workers is None else max(1, workers), len(turns))
    if n <= 1:
        return [fn(x) for x in items]
    out: list = [None] * len(items)
    errors: list[tuple[int, BaseException]] = []
    order = iter(turns)
    left = [len(turns)]
    lock, done = threading.Lock(), threading.Event()

    def work() -> None:
        while True:
            with lock:
                turn = next(order, None)
            if turn is None:
                return
            try:
                for i in turn:
                    try:
                        out[i] = fn(items[i])
                    except BaseException as e:  # re-raised in the caller
                        errors.append((i, e))
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

    pool = _executor(n - 1)
    for _ in range(n - 1):
        pool.submit(work)
    work()
    done.wait()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return out
