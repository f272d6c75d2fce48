"""The GPU backend: kernels/*.cu compiled by NVRTC (:mod:`.nvrtc`), loaded and launched through CuPy.

One call of the library (a compress, a decompress) runs inside :meth:`GpuBackend.stream`:

- on the CUDA device of its inputs (inputs on two devices are an :class:`~gpu_codec.errors.InvalidInputError`);
- on the caller's current torch stream when an input is a CUDA torch tensor (wrapped with
  ``cupy.cuda.Stream.from_external``, the CUDA stream protocol), else on CuPy's current stream;
- with torch's caching allocator for every temporary and output when the inputs are torch tensors (CuPy's pool
  would keep them where torch cannot reuse them), CuPy's pool otherwise;
- and it synchronizes that stream before handing back, so a later ``Payload.to_bytes()`` (a copy on another
  stream) never reads unfinished words; inside :func:`.events.deferred` (``compress(..., blocking=False)``) it
  records an event on that stream instead, which the pending payload waits on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from operator import attrgetter, is_not
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from . import events
from .base import DeviceViews
from .decode import ArrayDecoders
from .float_ops import KernelFloatOps
from .kernels import KernelBackendBase
from .nvrtc import cached_image, describe_target, target_for
from .sources import kernel_signatures, kernel_source


class CupyRunner:
    """Loads each kernel source once per device (NVRTC image through ``cupy.cuda.function.Module``)."""

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self._cupy = cupy
        self._lock = threading.Lock()
        self._modules: dict[tuple[int, str], Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}

    def _module(self, dev: int, fname: str) -> Any:
        mod = self._modules.get((dev, fname))
        if mod is None:
            from cupy.cuda import function

            cc = int(self._cupy.cuda.Device(dev).compute_capability)
            arch, _ = target_for(cc)
            image = cached_image(kernel_source(fname), fname, arch)
            if not arch.startswith("sm_") and not image.endswith(b"\x00"):
                image += b"\x00"  # the driver reads PTX as a C string
            mod = function.Module()
            mod.load(image)
            self._modules[(dev, fname)] = mod
        return mod

    def _function(self, name: str):
        dev = self._cupy.cuda.Device().id
        fn = self._functions.get((dev, name))
        if fn is None:
            with self._lock:
                fn = self._module(dev, kernel_signatures()[name][0]).get_function(name)
                self._functions[(dev, name)] = fn
        return fn

    def launch(self, name: str, grid: int, block: int, args: tuple) -> None:
        self._function(name)((int(grid),), (int(block),), args)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def ptrs(self, arrays: list) -> list[int]:
        """:meth:`ptr` of each array, in one C loop."""
        return list(map(_DATA_PTR, arrays))

    def to_host(self, a: Any) -> np.ndarray:
        return self._cupy.asnumpy(a)


def device_of(tensors: Sequence[Any]) -> int | None:
    """The one CUDA device id the inputs live on (None when none is on a GPU); inputs on two devices raise
    :class:`~gpu_codec.errors.InvalidInputError`. ``tensors`` are :class:`gpu_codec.arrays.Tensor` (or None), or
    a :class:`gpu_codec.arrays.TensorTable`."""
    seen: dict[int, str] = {}
    # each (kind, device) once, in the order of first appearance (a model's tensors share one or two)
    for kind, device in dict.fromkeys(_kinds_devices(tensors)):
        dev = None
        if kind == "torch" and getattr(device, "type", "") == "cuda":
            dev = device.index if device.index is not None else _torch_current_device()
        elif kind == "cupy" and device is not None:
            dev = int(device)
        if dev is not None:
            seen.setdefault(int(dev), str(device))
    if len(seen) > 1:
        raise InvalidInputError(
            "inputs are on different CUDA devices ("
            + ", ".join(f"{d}: {where}" for d, where in sorted(seen.items()))
            + "); move them to one device"
        )
    return next(iter(seen), None)


_KIND_DEVICE = attrgetter("kind", "device")
_DATA_PTR = attrgetter("data.ptr")
_NOT_NONE = partial(is_not, None)


def _kinds_devices(tensors: Sequence[Any]) -> Iterable[tuple[str, Any]]:
    """(kind, device) of each tensor: a table's two columns, read whole, or each Tensor's (None skipped)."""
    kinds = getattr(tensors, "kinds", None)
    if kinds is not None:
        return zip(kinds, tensors.devices)  # type: ignore[attr-defined]
    return map(_KIND_DEVICE, filter(_NOT_NONE, tensors))


def _torch_current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def _has_torch_cuda(tensors: Sequence[Any]) -> bool:
    return any(k == "torch" and getattr(d, "type", "") == "cuda" for k, d in dict.fromkeys(_kinds_devices(tensors)))


def torch_malloc_free() -> tuple[Any, Any]:
    """(malloc(size, device_id) -> ptr, free(ptr, device_id)) on torch's caching allocator, each allocation
    tied to the current torch stream of its device (the stream the call runs on)."""
    import torch

    def malloc(size: int, device_id: int) -> int:
        return int(torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream(device_id)))

    def free(ptr: int, device_id: int) -> None:
        torch.cuda.caching_allocator_delete(ptr)

    return malloc, free


def torch_allocator() -> Any:
    """A CuPy allocator (``cupy.cuda.using_allocator``) that takes its memory from torch's caching allocator."""
    import cupy

    return cupy.cuda.memory.PythonFunctionAllocator(*torch_malloc_free()).malloc


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``: version 0, the handle).

    CuPy 14's ``Stream.from_external`` reads nothing but ``__cuda_stream__()``, which torch's streams gained only
    in late 2025; ``torch.cuda.Stream.cuda_stream`` (the raw handle) exists in every torch release.
    """

    __slots__ = ("owner", "ptr")

    def __init__(self, ptr: int, owner: Any):
        self.ptr = int(ptr)
        self.owner = owner  # the torch stream, kept alive as long as CuPy holds this handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def caller_stream(device_id: int) -> Any:
    """The caller's current torch stream on ``device_id`` as a CuPy stream, from its raw handle
    (``torch.cuda.Stream.cuda_stream``, in every torch release): ``Stream.from_external`` on a
    :class:`_StreamHandle` from CuPy 14 (which deprecates ``cupy.cuda.ExternalStream`` and reads only
    ``__cuda_stream__``, absent from torch streams before late 2025); ``ExternalStream(handle, device_id)`` on
    CuPy 13, which has no ``from_external``. ``from_external`` takes the device from the current one: the caller
    (:meth:`GpuBackend.stream`) has entered ``device_id`` already."""
    import cupy
    import torch

    s = torch.cuda.current_stream(device_id)
    ptr = int(s.cuda_stream)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy 13, where ExternalStream is the supported way and not deprecated
        return cupy.cuda.ExternalStream(ptr, device_id)
    return from_external(_StreamHandle(ptr, s))


class GpuBackend(KernelFloatOps, ArrayDecoders, KernelBackendBase):
    """The kernels on a CUDA device, through CuPy."""

    name = "gpu"
    on_device = True

    def __init__(self, runner: CupyRunner | None = None):
        super().__init__(runner or CupyRunner())
        self._last_allocator = "cupy"

    def asarray(self, a: Any) -> Any:
        if type(a) is self.xp.ndarray:  # (a device array already: what cupy.asarray returns, without its checks)
            return a
        return self.xp.asarray(a)

    def asarrays(self, arrays: Sequence[Any]) -> Sequence[Any]:
        if type(arrays) is DeviceViews:  # (device arrays already, made where one is read)
            return arrays
        nd, asarray = self.xp.ndarray, self.xp.asarray
        return [a if a is None or type(a) is nd else asarray(a) for a in arrays]

    def info(self) -> dict[str, Any]:
        return {
            "allocator": "torch caching allocator for torch CUDA inputs, CuPy's memory pool otherwise",
            "last_allocator": self._last_allocator,
            "stream": "the caller's current torch stream for torch CUDA inputs, CuPy's current stream otherwise",
            "compile": "NVRTC with gpu_codec.constants.compile_options() (IEEE subnormals, no FMA contraction)",
            "kernels": describe_target(int(self.xp.cuda.Device().compute_capability)),
        }

    @contextlib.contextmanager
    def stream(self, tensors: Sequence[Any]) -> Iterator[None]:
        """Device, stream and allocator of one call (see the module docstring); synchronizes on the way out
        (:func:`.events.scope`)."""
        cupy = self.xp
        dev = device_of(tensors)
        with contextlib.ExitStack() as stack:
            if dev is not None:
                stack.enter_context(cupy.cuda.Device(dev))
            dev_id = cupy.cuda.Device().id
            if _has_torch_cuda(tensors):
                stack.enter_context(caller_stream(dev_id))
                stack.enter_context(cupy.cuda.using_allocator(torch_allocator()))
                self._last_allocator = "torch"
            else:
                self._last_allocator = "cupy"
            # the host waits for this stream on the way out (or, deferred, an event is recorded on it)
            stack.enter_context(events.scope(self))
            yield
