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


def thread_count() -> int:
    """Threads the NumPy backend uses: ``GPU_CODEC_THREADS`` if set (a positive integer), else every core."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return max(1, os.cpu_count() or 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        from gpu_codec.errors import InvalidInputError

        raise InvalidInputError(f"{ENV} must be a positive integer (threads), got {raw!r}")
    return n


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="gpu_codec")
            _pool_size = n
        return _pool


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, run on the pool; results in item order."""
    items = list(items)
    n = thread_count()
    if n == 1 or len(items) <= 1:
        return [fn(x) for x in items]
    return list(_executor(n).map(fn, items))
