"""The backends and their choice: the GPU (CuPy kernels), the NumPy fallback, or the emulated GPU (kernels run
on the CPU).

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
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, InvalidInputError
from .base import Backend

logger = logging.getLogger("gpu_codec")

ENV = "GPU_CODEC_BACKEND"
_CHOICES = ("cpu", "gpu", "emulated")


_lock = threading.Lock()
_cache: dict[str, Backend] = {}
_info: dict[str, Any] = {}


def gpu_probe() -> tuple[bool, str]:
    """Whether the GPU backend can run here: CuPy imports, a CUDA device is usable and NVRTC loads."""
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
    ok, nv = _nvrtc_probe()
    if not ok:
        return False, f"CuPy {cupy.__version__} with {n} CUDA device(s), but NVRTC cannot be loaded ({nv})"
    ok, target = _target_probe(n)
    if not ok:
        return False, f"CuPy {cupy.__version__} with {n} CUDA device(s), {nv}, but the kernels cannot load: {target}"
    return True, f"CuPy {cupy.__version__} with {n} CUDA device(s), {nv}; kernels: {target}"


def require_cupy(what: str) -> None:
    """Raise :class:`~gpu_codec.errors.BackendUnavailableError` where CuPy arrays cannot be made here (``what``: the
    argument that asks for them): CuPy not importable, or no usable CUDA device."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        raise BackendUnavailableError(f"{what} needs CuPy and a CUDA device: {type(e).__name__}: {e}") from None
    if n < 1:
        raise BackendUnavailableError(f"{what} needs CuPy and a CUDA device: CuPy finds none")


def _target_probe(n: int) -> tuple[bool, str]:
    """Whether NVRTC can build code every visible device's driver loads (see :func:`.nvrtc.target_for`)."""
    try:
        import cupy

        from .nvrtc import describe_target

        seen = []
        for d in range(n):
            what = describe_target(int(cupy.cuda.Device(d).compute_capability))
            if what not in seen:
                seen.append(what)
    except BackendUnavailableError as e:
        return False, str(e)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, "; ".join(seen)


def _nvrtc_probe() -> tuple[bool, str]:
    try:
        from .nvrtc import nvrtc_version

        major, minor = nvrtc_version()
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, f"NVRTC {major}.{minor}"


def format_uuid(raw: Any) -> str:
    """A CUDA device UUID (16 bytes, as ``cudaDeviceProp.uuid``) as NVML writes it, without its prefix.

    >>> format_uuid(bytes(range(16)))
    '00010203-0405-0607-0809-0a0b0c0d0e0f'
    """
    if isinstance(raw, str):
        return raw.split("-", 1)[1] if raw[:4] in ("GPU-", "MIG-") else raw
    h = bytes(raw).hex()
    if len(h) != 32:
        raise ValueError(f"a CUDA UUID has 16 bytes, got {len(h) // 2}")
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _nvml_handle(pynvml: Any, uuid: str | bytes, bus_id: str | None = None) -> tuple[Any, bool]:
    """NVML's handle of the device (or MIG instance) with CUDA UUID ``uuid``: (handle, is a MIG instance).

    ``uuid`` is the UUID as text, or CUDA's 16 bytes. CuPy reads ``cudaDeviceProp.uuid`` as a C string, so a UUID
    with a zero byte comes back cut before it; such a prefix is looked up among the GPU at PCI bus ``bus_id`` and
    its MIG instances, and must match exactly one of them.
    """
    if isinstance(uuid, (bytes, bytearray)):
        if len(uuid) == 16:
            uuid = format_uuid(uuid)
        else:
            return _nvml_handle_by_prefix(pynvml, bytes(uuid), bus_id)
    for prefix in ("GPU-", "MIG-"):
        try:
            h = pynvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
        except Exception:
            continue
        return h, _is_mig(pynvml, h, prefix == "MIG-")
    raise LookupError(f"NVML knows no device with UUID {uuid} (as GPU- or MIG-)")


def _is_mig(pynvml: Any, h: Any, default: bool) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(h))
    except Exception:
        return default


def _nvml_handle_by_prefix(pynvml: Any, head: bytes, bus_id: str | None) -> tuple[Any, bool]:
    """The device whose UUID starts with ``head`` and a zero byte (a UUID cut at its first zero byte), among the GPU
    at PCI bus ``bus_id`` and its MIG instances."""
    if len(head) > 15 or bus_id is None:
        raise LookupError(f"a CUDA UUID has 16 bytes, got {len(head)} and no PCI bus id to find the device by")
    want = (head + b"\0").hex()
    gpu = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    found = [(gpu, False)]
    try:
        count = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)) if pynvml.nvmlDeviceGetMigMode(gpu)[0] else 0
    except Exception:
        count = 0
    for i in range(count):
        try:
            found.append((pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i), True))
        except Exception:
            continue
    hits = [
        (h, mig)
        for h, mig in found
        if format_uuid(_text(pynvml.nvmlDeviceGetUUID(h))).replace("-", "").startswith(want)
    ]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} devices at PCI bus {bus_id} have a UUID starting {want}")
    return hits[0]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml_info() -> dict[str, Any]:
    """NVML's view of the current CUDA device, found by UUID (CUDA ordinals differ from NVML's under
    CUDA_VISIBLE_DEVICES); a MIG instance is reported as itself, with its parent GPU's name."""
    try:
        import cupy
        import pynvml

        dev = cupy.cuda.Device().id
        raw = bytes(cupy.cuda.runtime.getDeviceProperties(dev)["uuid"])
        bus_id = cupy.cuda.runtime.deviceGetPCIBusId(dev) if len(raw) != 16 else None
        pynvml.nvmlInit()
        try:
            h, mig = _nvml_handle(pynvml, raw, bus_id)
            uuid = format_uuid(raw) if bus_id is None else format_uuid(_text(pynvml.nvmlDeviceGetUUID(h)))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out = {
                "cuda_device": dev,
                "uuid": uuid,
                "mig": mig,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_total_bytes": int(mem.total),
                "driver": str(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": int(pynvml.nvmlSystemGetCudaDriverVersion()),
            }
            clock_handle = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h) if mig else h
            out["sm_clock_max_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(clock_handle, pynvml.NVML_CLOCK_SM))
            out["mem_clock_max_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(clock_handle, pynvml.NVML_CLOCK_MEM))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        return {"nvml_error": f"{type(e).__name__}: {e}"}


def _numpy_backend() -> Backend:
    from .cpu import CpuBackend

    return CpuBackend()


def _choose() -> Backend:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in _CHOICES:
        raise InvalidInputError(f"{ENV} must be one of {', '.join(_CHOICES)}, got {forced!r}")
    if forced == "cpu":
        _info.update(backend="cpu", reason=f"forced by {ENV}=cpu")
        return _numpy_backend()
    if forced == "emulated":
        from .emulated import EmulatedBackend

        _info.update(backend="emulated", reason=f"forced by {ENV}=emulated: kernels/*.cu run on the CPU")
        return EmulatedBackend()
    ok, why = gpu_probe()
    if ok:
        from .gpu import GpuBackend

        _info.update(backend="gpu", reason=why if not forced else f"forced by {ENV}=gpu; {why}")
        _info["device"] = _nvml_info()
        return GpuBackend()
    if forced == "gpu":
        raise BackendUnavailableError(f"{ENV}=gpu but no GPU backend is usable: {why}")
    _info.update(backend="cpu", reason=f"{why}; using the NumPy fallback")
    logger.info("gpu_codec: %s", _info["reason"])
    return _numpy_backend()


def get_backend() -> Backend:
    """The backend in use (chosen on first call, then cached; :func:`reset_backend` chooses again)."""
    if _override:
        return _override[-1]
    return _chosen(os.environ.get(ENV, "").strip().lower())[0]


def _chosen(key: str) -> tuple[Backend, dict[str, Any]]:
    """The backend for ``GPU_CODEC_BACKEND`` = ``key`` and what :func:`backend_info` says of its choice, read
    together (a :func:`reset_backend` in another thread in between left the second missing)."""
    with _lock:
        b = _cache.get(key)
        if b is None:
            _info.clear()
            b = _choose()
            _cache[key] = b
            _info_by_key[key] = dict(_info)
        return b, _info_by_key[key]


_info_by_key: dict[str, dict[str, Any]] = {}


_override: list[Backend] = []


@contextlib.contextmanager
def using_backend(backend: Backend) -> Iterator[Backend]:
    """Run the library on ``backend`` inside the block (tools that measure a backend they built themselves,
    e.g. an emulator that counts memory traffic). The choice is the process's, every thread's, while the block
    runs: blocks in several threads at once are not kept apart."""
    if not isinstance(backend, Backend):
        raise InvalidInputError(f"using_backend needs a Backend, got {type(backend).__name__}")
    _override.append(backend)
    try:
        yield backend
    finally:
        _override.pop()


def reset_backend() -> None:
    """Forget the cached choice (tests use it after changing ``GPU_CODEC_BACKEND``)."""
    with _lock:
        _cache.clear()
        _info_by_key.clear()


def backend_info() -> dict[str, Any]:
    """What backend is in use and why, with NVML device details when a GPU is there."""
    over = _override[-1:]
    if over:
        b, info = over[0], {"backend": over[0].name, "reason": "set by using_backend"}
    else:
        b, chosen = _chosen(os.environ.get(ENV, "").strip().lower())
        info = dict(chosen)
    info.update(b.info())
    info["numpy"] = np.__version__
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    return info


__all__ = [
    "ENV",
    "Backend",
    "backend_info",
    "get_backend",
    "gpu_probe",
    "require_cupy",
    "reset_backend",
    "using_backend",
]
