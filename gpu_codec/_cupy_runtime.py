"""The CuPy runner: kernels/*.cu compiled lazily into one ``RawModule`` per source and device.

CuPy's own on-disk cache keeps compiled modules across processes. Kernels launch on CuPy's current stream; the
engine makes that the caller's torch stream (``cupy.cuda.ExternalStream``) when the inputs are torch tensors.
"""

from __future__ import annotations

import threading
from typing import Any

from ._sources import kernel_signatures, kernel_source

# --fmad=false: no multiply-add contraction, so the device rounds exactly where the NumPy twins do.
COMPILE_OPTIONS = ("-std=c++17", "-DBLOCK=256", "-DITEMS=16", "--fmad=false")


class CupyRunner:
    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self._cupy = cupy
        self._lock = threading.Lock()
        self._modules: dict[tuple[int, str], Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}

    def _function(self, name: str):
        dev = self._cupy.cuda.Device().id
        fn = self._functions.get((dev, name))
        if fn is None:
            with self._lock:
                fname = kernel_signatures()[name][0]
                mod = self._modules.get((dev, fname))
                if mod is None:
                    mod = self._cupy.RawModule(code=kernel_source(fname), options=COMPILE_OPTIONS)
                    self._modules[(dev, fname)] = mod
                fn = mod.get_function(name)
                self._functions[(dev, name)] = fn
        return fn

    def launch(self, name: str, grid: int, block: int, args: tuple) -> None:
        self._function(name)((int(grid),), (int(block),), args)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def to_host(self, a: Any):
        return self._cupy.asnumpy(a)
