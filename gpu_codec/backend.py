"""Backend choice: the GPU (CuPy kernels), the NumPy fallback, or the emulated GPU (kernels run on the CPU).

The GPU is chosen when CuPy imports and a CUDA device is usable; otherwise the NumPy backend, said once in a log
line. ``GPU_CODEC_BACKEND=cpu|gpu|emulated`` forces one; forcing ``gpu`` where none is usable raises
:class:`~gpu_codec.errors.BackendUnavailableError`.

>>> import os
>>> info = backend_info()
>>> info["backend"] in ("cpu", "gpu", "emulated") and isinstance(info["reason"], str)
True
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import numpy as np

from .cpu_fallback import kernels as _twins
from .cpu_fallback import select as _select
from .errors import BackendUnavailableError, InvalidInputError

logger = logging.getLogger("gpu_codec")

ENV = "GPU_CODEC_BACKEND"
_CHOICES = ("cpu", "gpu", "emulated")


class NumpyBackend:
    """Host memory, NumPy arithmetic: :mod:`gpu_codec.cpu_fallback`."""

    name = "cpu"
    xp = np
    on_device = False

    def asarray(self, a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("cupy"):
            return a.get()
        return np.asarray(a)

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def stream(self, tensors) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def topk_select(self, *args):
        return _select.topk_select(*args)

    def scatter(self, outs, out_dtypes, numels, indices, values, mode):
        from ._kernel_ops import U64_MAX, scatter_args

        packed = scatter_args(np, indices, values)
        if packed is None:
            return None
        total, ent_start, idx, vals32, vals64 = packed
        err = np.full(1, U64_MAX, dtype=np.uint64)
        _twins._scatter(len(outs), total, ent_start, numels, out_dtypes, outs, idx, vals32, vals64, mode, err)
        bad = int(err[0])
        return None if bad == U64_MAX else bad


class KernelBackend:
    """The kernels of kernels/*.cu, launched through a runner (CuPy on a GPU, or the host emulator)."""

    def __init__(self, name: str, runner: Any):
        from ._kernel_ops import KernelOps

        self.name = name
        self.runner = runner
        self.xp = runner.xp
        self.on_device = name == "gpu"
        self._ops = KernelOps(runner)

    def asarray(self, a: Any):
        if self.on_device:
            return self.xp.asarray(a)
        if type(a).__module__.startswith("cupy"):
            return a.get()
        return np.asarray(a)

    def to_host(self, a: Any) -> np.ndarray:
        return self.runner.to_host(a)

    def stream(self, tensors) -> contextlib.AbstractContextManager:
        """Run on the caller's current torch stream when any input is a CUDA torch tensor."""
        if not self.on_device:
            return contextlib.nullcontext()
        for t in tensors:
            if t is not None and t.kind == "torch" and getattr(t.device, "type", "") == "cuda":
                import torch

                return self.xp.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)
        return contextlib.nullcontext()

    def topk_select(self, *args):
        return self._ops.topk_select(*args)

    def scatter(self, *args):
        return self._ops.scatter(*args)


_lock = threading.Lock()
_cache: dict[str, Any] = {}
_info: dict[str, Any] = {}


def _gpu_probe() -> tuple[bool, str]:
    try:
        import cupy
    except Exception as e:
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"CuPy {cupy.__version__} finds no usable CUDA device ({e})"
    if n < 1:
        return False, f"CuPy {cupy.__version__} finds no CUDA device"
    return True, f"CuPy {cupy.__version__} with {n} CUDA device(s)"


def _nvml_info() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            import cupy

            h = pynvml.nvmlDeviceGetHandleByIndex(cupy.cuda.Device().id)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            return {
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_total_bytes": int(mem.total),
                "driver": str(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": int(pynvml.nvmlSystemGetCudaDriverVersion()),
                "sm_clock_max_mhz": int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "mem_clock_max_mhz": int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        return {"nvml_error": f"{type(e).__name__}: {e}"}


def _choose() -> Any:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in _CHOICES:
        raise InvalidInputError(f"{ENV} must be one of {', '.join(_CHOICES)}, got {forced!r}")
    if forced == "cpu":
        _info.update(backend="cpu", reason=f"forced by {ENV}=cpu")
        return NumpyBackend()
    if forced == "emulated":
        from ._emulator import EmulatorRunner

        _info.update(backend="emulated", reason=f"forced by {ENV}=emulated: kernels/*.cu run on the CPU")
        return KernelBackend("emulated", EmulatorRunner())
    ok, why = _gpu_probe()
    if ok:
        from ._cupy_runtime import CupyRunner

        _info.update(backend="gpu", reason=why if not forced else f"forced by {ENV}=gpu; {why}")
        _info["device"] = _nvml_info()
        return KernelBackend("gpu", CupyRunner())
    if forced == "gpu":
        raise BackendUnavailableError(f"{ENV}=gpu but no GPU backend is usable: {why}")
    _info.update(backend="cpu", reason=f"{why}; using the NumPy fallback")
    logger.info("gpu_codec: %s", _info["reason"])
    return NumpyBackend()


def get_backend() -> Any:
    """The backend in use (chosen on first call, then cached; :func:`reset_backend` chooses again)."""
    key = os.environ.get(ENV, "").strip().lower()
    with _lock:
        b = _cache.get(key)
        if b is None:
            _info.clear()
            b = _choose()
            _cache[key] = b
            _info_by_key[key] = dict(_info)
        return b


_info_by_key: dict[str, dict[str, Any]] = {}


def reset_backend() -> None:
    """Forget the cached choice (tests use it after changing ``GPU_CODEC_BACKEND``)."""
    with _lock:
        _cache.clear()
        _info_by_key.clear()


def backend_info() -> dict[str, Any]:
    """What backend is in use and why, with NVML device details when a GPU is there."""
    get_backend()
    key = os.environ.get(ENV, "").strip().lower()
    info = dict(_info_by_key[key])
    info["numpy"] = np.__version__
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    return info
