"""The GPU backend: kernels/*.cu compiled lazily, once per source and device, launched through CuPy.

Kernels launch on CuPy's current stream; :meth:`GpuBackend.stream` makes that the caller's torch stream when
the inputs are CUDA torch tensors.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from ..constants import compile_options
from .decode import ArrayDecoders
from .kernels import KernelBackendBase
from .sources import kernel_signatures, kernel_source


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
                    mod = self._cupy.RawModule(code=kernel_source(fname), options=compile_options())
                    self._modules[(dev, fname)] = mod
                fn = mod.get_function(name)
                self._functions[(dev, name)] = fn
        return fn

    def launch(self, name: str, grid: int, block: int, args: tuple) -> None:
        self._function(name)((int(grid),), (int(block),), args)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def to_host(self, a: Any) -> np.ndarray:
        return self._cupy.asnumpy(a)


class GpuBackend(ArrayDecoders, KernelBackendBase):
    """The kernels on a CUDA device, through CuPy."""

    name = "gpu"
    on_device = True

    def __init__(self, runner: CupyRunner | None = None):
        super().__init__(runner or CupyRunner())

    def asarray(self, a: Any) -> Any:
        return self.xp.asarray(a)

    def info(self) -> dict[str, Any]:
        return {"allocator": "cupy"}

    def stream(self, tensors) -> contextlib.AbstractContextManager:
        """Run on the caller's current torch stream when any input is a CUDA torch tensor."""
        for t in tensors:
            if t is not None and t.kind == "torch" and getattr(t.device, "type", "") == "cuda":
                import torch

                return self.xp.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)
        return contextlib.nullcontext()
