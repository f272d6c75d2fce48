"""Array interchange: NumPy, CuPy and torch (CPU or CUDA) in, the same kind on the same device out.

Arrays are handled internally as :class:`Tensor`: a flat, C-contiguous backend array (NumPy on the host, CuPy on
the device) plus the logical dtype and shape. torch <-> CuPy goes through DLPack with no copy. bfloat16, which
neither NumPy nor CuPy has, travels as its uint16 bit pattern.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from .backends.base import DeviceViews, sizes_of
from .dtypes import dtype_name
from .errors import InvalidInputError

_NP_TO_LOGICAL = {
    np.dtype("float32"): "float32",
    np.dtype("float16"): "float16",
    np.dtype("float64"): "float64",
}
_NP_FLOAT_KINDS = frozenset({np.ndarray, np.float32, np.float16, np.float64})  # what numpy_tensors takes
# (an array's attributes, read for a whole list by one C call each)
_C_CONTIGUOUS, _DTYPE, _SHAPE = attrgetter("flags.c_contiguous"), attrgetter("dtype"), attrgetter("shape")
_TORCH_LOGICAL = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float64": "float64",
}


@dataclass
class Tensor:
    """A flat backend array with its logical dtype, shape and origin kind ('numpy', 'cupy' or 'torch')."""

    data: Any  # 1-D, C-contiguous numpy.ndarray or cupy.ndarray (uint16 for bfloat16)
    dtype: str  # logical dtype name, or a non-float NumPy dtype name for inputs that are rejected later
    shape: tuple[int, ...]
    kind: str
    device: Any = None  # torch.device for torch inputs, CUDA device id for CuPy

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def on_gpu(self) -> bool:
        return type(self.data).__module__.startswith("cupy")


class TensorTable(Sequence):
    """Tensors as columns, a list a field and no object a tensor: row ``i`` is the :class:`Tensor` ``(data[i],
    dtypes[i], shapes[i], kinds[i], devices[i])``, made only when it is read. What :func:`tensor_table` gives:
    callers that want a field of every tensor read its column (one list, no call a tensor).

    >>> t = TensorTable([np.zeros(6, np.float32)], ["float32"], [(2, 3)], ["numpy"], [None])
    >>> len(t), t[0].shape, t.sizes(), t.dtypes, (t + t).shapes
    (1, (2, 3), [6], ['float32'], [(2, 3), (2, 3)])
    """

    __slots__ = ("_sizes", "data", "devices", "dtypes", "kinds", "shapes")

    def __init__(self, data: list, dtypes: list[str], shapes: list[tuple], kinds: list[str], devices: list):
        self.data, self.dtypes, self.shapes, self.kinds, self.devices = data, dtypes, shapes, kinds, devices
        self._sizes: list[int] | None = None

    @classmethod
    def of(cls, tensors: Sequence[Tensor]) -> TensorTable:
        """The table of tensors wrapped one by one."""
        cols = ([t.data, t.dtype, t.shape, t.kind, t.device] for t in tensors)
        return cls(*map(list, zip(*cols))) if tensors else cls([], [], [], [], [])

    def sizes(self) -> list[int]:
        """Each tensor's element count (its flat data's size; read once, the table's data being fixed)."""
        if self._sizes is None:
            self._sizes = sizes_of(self.data)
        return self._sizes

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return TensorTable(self.data[i], self.dtypes[i], self.shapes[i], self.kinds[i], self.devices[i])
        return Tensor(self.data[i], self.dtypes[i], self.shapes[i], self.kinds[i], self.devices[i])

    def __add__(self, other: Sequence) -> Sequence:
        if isinstance(other, TensorTable):
            return TensorTable(
                self.data + other.data,
                self.dtypes + other.dtypes,
                self.shapes + other.shapes,
                self.kinds + other.kinds,
                self.devices + other.devices,
            )
        return list(self) + list(other)


MAX_DECLARED_NDIM = 32  # dimensions a received array header may declare (NumPy before 2.0 holds 32; no model's
# tensor comes near)
MAX_DECLARED_ELEMENTS = 1 << 56  # elements it may declare, zero sizes counted as one (times any itemsize, within
# NumPy's byte range; 7.2e16, far past any model's tensor)


def declared_shape_problem(shape: Any) -> str | None:
    """Why no array can have ``shape`` as a file or a message declares it (an ``.npy`` header, a checkpoint's
    tensor), checked before its sizes are multiplied or printed: sizes that are not integers (a bool either),
    negative (two of them multiply to a plausible byte count), more than 32 dimensions, or sizes whose product,
    zeros counted as ones, passes 2^56 (an empty tensor of huge sizes); None where it is a shape.

    >>> declared_shape_problem((3, 4)), declared_shape_problem((-2, -2)), declared_shape_problem((2**40, 2**40, 0))
    (None, 'declares a shape with a negative size', 'declares a shape whose sizes multiply past 2^56')
    """
    dims = tuple(shape)
    if len(dims) > MAX_DECLARED_NDIM:
        return f"has {len(dims)} dimensions; at most {MAX_DECLARED_NDIM} are read"
    if any(type(d) is not int for d in dims):
        return "declares a shape whose sizes are not all integers"
    if any(d < 0 for d in dims):
        return "declares a shape with a negative size"
    if math.prod(max(d, 1) for d in dims) > MAX_DECLARED_ELEMENTS:
        return "declares a shape whose sizes multiply past 2^56"
    return None


def _is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, a subclass's included (torch is not imported for it: a tensor's class
    comes from a module that has imported torch)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return isinstance(x, torch.Tensor)
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is an array in GPU memory (a CuPy array), which the host reads only by a copy."""
    return _is_cupy(x)


def array_kind(x: Any) -> str:
    if isinstance(x, (np.ndarray, list, tuple, float, int, np.generic)):
        return "numpy"
    if _is_cupy(x):
        return "cupy"
    if _is_torch(x):
        return "torch"
    raise InvalidInputError(f"expected a NumPy array, CuPy array or torch tensor, got {type(x).__name__}")


def to_tensor(x: Any, name: str) -> Tensor:
    """Wrap an input array without copying it where its memory is already contiguous."""
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case, without the general path's checks
        logical = _NP_TO_LOGICAL.get(x.dtype)
        if logical is not None:  # (a flat array is its own data, as numpy_tensors gives it)
            return Tensor(x if x.ndim == 1 else x.reshape(-1), logical, x.shape, "numpy", None)
    try:
        kind = array_kind(x)
    except InvalidInputError as e:
        raise InvalidInputError(f"tensor {name!r}: {e}") from None
    if kind == "torch":
        import torch

        if x.layout != torch.strided or x.is_nested:
            what = "nested" if x.is_nested else str(x.layout)
            raise InvalidInputError(f"tensor {name!r}: a {what} torch tensor is not supported; pass a dense one")
        if x.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(
                f"tensor {name!r}: a torch tensor on device {x.device.type!r} holds no data gpu_codec can read "
                "(expected 'cpu' or 'cuda')"
            )
        logical = _TORCH_LOGICAL.get(str(x.dtype), str(x.dtype).replace("torch.", ""))
        shape = tuple(int(s) for s in x.shape)
        t = x.detach()
        if t.is_neg():  # (a negated view: its memory holds the values' negations)
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        if logical == "bfloat16":
            t = t.view(torch.int16)
        flat = t.reshape(-1)
        try:
            if flat.is_cuda:
                import cupy

                data = cupy.from_dlpack(flat)
            else:
                data = flat.numpy()
        except (TypeError, BufferError, RuntimeError) as e:  # (a dtype with no NumPy or DLPack form: float8, ...)
            if logical in _TORCH_LOGICAL.values():  # (a subclass torch does not hand over: MaskedTensor, ...)
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise InvalidInputError(
                    f"tensor {name!r}: torch does not hand over this {type(x).__name__} as an array ({why}); "
                    "pass a plain dense tensor"
                ) from None
            raise InvalidInputError(
                f"tensor {name!r}: dtype {logical} is not supported (float32, float16, bfloat16, float64)"
            ) from None
        if logical == "bfloat16":
            data = data.view(np.uint16)
        return Tensor(data, logical, shape, "torch", x.device)
    if kind == "cupy":
        import cupy

        dt = np.dtype(x.dtype)
        logical = _NP_TO_LOGICAL.get(dt) or dtype_name(dt)
        data = cupy.ascontiguousarray(x).reshape(-1)
        return Tensor(data, logical, tuple(x.shape), "cupy", x.device.id)
    if isinstance(x, np.ma.MaskedArray):  # (np.asarray would drop the mask: the masked elements' data is arbitrary)
        raise InvalidInputError(f"tensor {name!r}: a masked array; pass its .filled(value) or its .data")
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise InvalidInputError(f"tensor {name!r}: not convertible to an array ({e})") from None
    dt = arr.dtype
    if dtype_name(dt) == "bfloat16":  # ml_dtypes
        logical = "bfloat16"
        arr = arr.view(np.uint16)
    else:
        logical = _NP_TO_LOGICAL.get(dt) or dtype_name(dt)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(arr).reshape(-1)
    return Tensor(data, logical, tuple(arr.shape), "numpy", None)


def numpy_tensors(xs: list[Any]) -> TensorTable | None:
    """:func:`to_tensor` of every array of ``xs`` where each is a C-contiguous NumPy float32, float16 or float64
    array (the common case: checked and wrapped with a few calls over the whole list, not a call per array);
    None where one is not (then :func:`to_tensor` wraps them one by one, with its errors).

    >>> ts = numpy_tensors([np.zeros((2, 3), np.float32), np.ones(4, np.float16)])
    >>> [(t.dtype, t.shape, t.data.shape) for t in ts]
    [('float32', (2, 3), (6,)), ('float16', (4,), (4,))]
    >>> numpy_tensors([np.zeros(3, np.float32), np.zeros(3, np.int8)]) is None
    True
    >>> [(t.shape, t.data.tolist()) for t in numpy_tensors([np.float32(2.5), np.ones(1, np.float32)])]
    [((), [2.5]), ((1,), [1.0])]
    """
    kinds = set(map(type, xs))
    if kinds != {np.ndarray}:
        if not kinds <= _NP_FLOAT_KINDS:
            return None
        xs = [x if type(x) is np.ndarray else np.asarray(x) for x in xs]  # (a NumPy float scalar: a 0-d array)
    if not all(map(_C_CONTIGUOUS, xs)):
        return None
    dts = set(map(_DTYPE, xs))
    if len(dts) == 1:  # (one dtype, the common case: its name looked up once)
        logical = [_NP_TO_LOGICAL.get(dts.pop())] * len(xs)
    else:
        logical = list(map(_NP_TO_LOGICAL.get, map(_DTYPE, xs)))
    if None in logical:
        return None
    shapes = list(map(_SHAPE, xs))
    flat = [x if len(s) == 1 else x.ravel() for x, s in zip(xs, shapes)]  # (a flat array is its own data)
    return TensorTable(flat, logical, shapes, ["numpy"] * len(xs), [None] * len(xs))


def tensor_table(xs: list[Any]) -> TensorTable | None:
    """:func:`to_tensor` of every array of ``xs`` where they form a table the fast wrappers take whole
    (:func:`numpy_tensors`, :func:`torch_tensors`, :func:`cupy_tensors`: a few calls over the list); None
    otherwise, and for an empty list (then :func:`to_tensor` wraps them one by one, with its errors).

    >>> [t.kind for t in tensor_table([np.zeros(2, np.float32)])], tensor_table([]), tensor_table([[1.0]])
    (['numpy'], None, None)
    """
    return (numpy_tensors(xs) or torch_tensors(xs) or cupy_tensors(xs)) if xs else None


def torch_tensors(xs: list[Any]) -> TensorTable | None:
    """:func:`to_tensor` of every tensor of ``xs`` where each is a dense, contiguous torch tensor of float32,
    float16, bfloat16 or float64, all on the CPU or all on one CUDA device (checked over the whole list, then a
    few calls a tensor: no copy); None where one is not (then :func:`to_tensor` wraps them one by one, with its
    errors). CUDA tensors are given by address (:class:`~gpu_codec.backends.base.DeviceViews`: CuPy arrays over
    their memory, made only where one is read), which the call's work then orders on the caller's torch stream.

    >>> import torch
    >>> ts = torch_tensors([torch.zeros(2, 3), torch.ones(4, dtype=torch.bfloat16)])
    >>> [(t.dtype, t.shape, t.data.dtype.name, t.kind) for t in ts]
    [('float32', (2, 3), 'float32', 'torch'), ('bfloat16', (4,), 'uint16', 'torch')]
    >>> torch_tensors([torch.zeros(3), torch.zeros(4, 2).T]) is None  # (not contiguous)
    True
    """
    types = set(map(type, xs))
    if not all(t.__module__.startswith("torch") for t in types):
        return None
    import torch

    if not all(issubclass(t, torch.Tensor) for t in types) or set(map(_LAYOUT, xs)) != {torch.strided}:
        return None
    devices = set(map(_DEVICE, xs))
    if len(devices) != 1:
        return None
    (device,) = devices
    logical = list(map(_torch_logical().get, map(_DTYPE, xs)))
    if None in logical or not all(map(torch.Tensor.is_contiguous, xs)):
        return None
    # (a subclass, a nested tensor or a negated view is not its memory's values: to_tensor takes each, or refuses it)
    if not types <= {torch.Tensor, torch.nn.Parameter} or any(map(_IS_NESTED, xs)) or any(map(torch.Tensor.is_neg, xs)):
        return None
    if any(map(_REQUIRES_GRAD, xs)):
        xs = [x.detach() for x in xs]
    shapes = list(map(tuple, map(_SHAPE, xs)))
    if device.type == "cuda":
        import cupy

        index = device.index if device.index is not None else torch.cuda.current_device()
        ptrs, numels = list(map(torch.Tensor.data_ptr, xs)), list(map(torch.Tensor.numel, xs))
        views = DeviceViews(cupy, ptrs, numels, list(map(_STORAGE.__getitem__, logical)), xs, [index] * len(xs))
        return TensorTable(views, logical, shapes, ["torch"] * len(xs), [device] * len(xs))
    if device.type != "cpu":
        return None
    host = [
        x.view(torch.int16).numpy().view(np.uint16) if lg == "bfloat16" else x.numpy() for x, lg in zip(xs, logical)
    ]
    return TensorTable([a.reshape(-1) for a in host], logical, shapes, ["torch"] * len(xs), [device] * len(xs))


def cupy_tensors(xs: list[Any]) -> TensorTable | None:
    """:func:`to_tensor` of every array of ``xs`` where each is a C-contiguous CuPy array of float32, float16 or
    float64, all on one CUDA device (checked over the whole list: no CuPy call a tensor, no copy); None where one
    is not (then :func:`to_tensor` wraps them one by one, with its errors). They are given by address
    (:class:`~gpu_codec.backends.base.DeviceViews`), as torch CUDA tensors are.

    >>> cupy_tensors([np.zeros(3, np.float32)]) is None  # (NumPy arrays: numpy_tensors' table)
    True
    """
    types = set(map(type, xs))
    if len(types) != 1 or not next(iter(types)).__module__.startswith("cupy"):
        return None
    import cupy

    if types != {cupy.ndarray} or not all(map(_C_CONTIGUOUS, xs)):
        return None
    devices = set(map(_DEVICE_ID, xs))
    logical = list(map(_NP_TO_LOGICAL.get, map(_DTYPE, xs)))
    if len(devices) != 1 or None in logical:
        return None
    (dev,) = devices
    ptrs, numels, n = list(map(_DATA_PTR, xs)), sizes_of(xs), len(xs)
    views = DeviceViews(cupy, ptrs, numels, list(map(_STORAGE.__getitem__, logical)), list(xs), [dev] * n)
    return TensorTable(views, logical, list(map(_SHAPE, xs)), ["cupy"] * n, [dev] * n)


_DEVICE, _LAYOUT, _REQUIRES_GRAD = attrgetter("device"), attrgetter("layout"), attrgetter("requires_grad")
_IS_NESTED = attrgetter("is_nested")
_DEVICE_ID, _DATA_PTR = attrgetter("device.id"), attrgetter("data.ptr")
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64}


def _torch_logical() -> dict:
    """torch dtype -> logical dtype name (made once torch is imported: only for torch inputs)."""
    global _torch_dtypes
    if _torch_dtypes is None:
        import torch

        _torch_dtypes = {getattr(torch, k.removeprefix("torch.")): v for k, v in _TORCH_LOGICAL.items()}
    return _torch_dtypes


_torch_dtypes: dict | None = None


def from_backend(data: Any, logical: str, shape: tuple[int, ...], kind: str, device: Any = None) -> Any:
    """Turn a flat backend array into the caller's kind (no copy where the memory can be shared)."""
    on_gpu = _is_cupy(data)
    if kind == "torch":
        import torch

        if logical == "bfloat16":
            data = data.view(np.int16)
        t = torch.from_dlpack(data) if on_gpu else torch.from_numpy(data)
        if logical == "bfloat16":
            t = t.view(torch.bfloat16)
        t = t.reshape(shape)
        if device is not None and t.device != device:
            t = t.to(device)
        return t
    if kind == "cupy":
        import cupy

        arr = data if on_gpu else cupy.asarray(data)
        return _np_logical_view(arr, logical).reshape(shape)
    arr = data.get() if on_gpu else data
    return _np_logical_view(arr, logical).reshape(shape)


def _np_logical_view(arr: Any, logical: str) -> Any:
    if logical == "bfloat16":
        try:
            import ml_dtypes

            return arr.view(ml_dtypes.bfloat16) if isinstance(arr, np.ndarray) else arr
        except ImportError:
            return arr  # uint16 bit pattern
    return arr


def backend_to_torch(a: Any, device: Any = None) -> Any:
    """A NumPy or CuPy array as a torch tensor on ``device``: zero-copy (DLPack, or shared host memory) where the
    array already lives there; one copy of just this array otherwise."""
    import torch

    if type(a).__module__.startswith("cupy"):
        t = torch.from_dlpack(a)
    else:
        t = torch.from_numpy(np.asarray(a, order="C"))  # (np.ascontiguousarray would make a 0-d array 1-d)
    if device is not None and t.device != torch.device(device):
        t = t.to(device)
    return t


def torch_to_backend(t: Any, on_device: bool) -> Any:
    """A torch tensor as the backend's array kind (CuPy on the GPU backend, NumPy otherwise), zero-copy where the
    memory allows. bfloat16 becomes its uint16 bit pattern."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    t = t.contiguous()
    if t.is_cuda:
        import cupy

        a = cupy.from_dlpack(t)
        return a if on_device else cupy.asnumpy(a)
    a = t.numpy()
    if on_device:
        import cupy

        return cupy.asarray(a)
    return a
