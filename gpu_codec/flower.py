"""Flower: records that carry a gpu_codec payload, a client ``Mod`` and a server strategy wrapper.

Records, as Flower has them (``flwr`` is needed only for the app parts and the conversions):

* :class:`Array`: ``Array(ndarray)``, ``Array(ndarray=...)``, ``Array(torch_tensor=...)`` or
  ``Array(dtype, shape, stype, data)``, as flwr accepts them, with :meth:`Array.numpy`. A compressed update is one
  Array (:meth:`Array.from_payload`) whose bytes are a ``.npy`` guard header followed by the payload's wire
  format: a stock Flower peer that tries to read it gets ``ValueError: ... gpu_codec.v1 ... pip install
  'gpu_codec[flower]'`` instead of a silent misread. Its bytes stay unserialized (on the GPU, if made there) until
  ``data`` is first read.
* :class:`ArrayRecord` (flwr's current record: ``ArrayRecord(numpy_ndarrays=...)``, ``torch_state_dict=...``,
  ``array_dict=...``, ``keep_input=True``) and :class:`ParametersRecord` (the earlier name, with its signature
  ``ParametersRecord(array_dict=None, keep_input=False)``: the input dict is emptied as it is consumed), plus
  :meth:`ArrayRecord.compressed`, :meth:`ArrayRecord.decompress`, :meth:`ArrayRecord.to_flwr` and
  :meth:`ArrayRecord.from_flwr`.
* bfloat16, which ``.npy`` cannot hold, is widened to float32 (exactly) rather than sent as a uint16 array.

In a Flower app:

* :func:`compression_mod`: a client ``Mod``. It decodes a compressed global model before the ``ClientApp`` sees
  it, and compresses the ``ArrayRecord`` of a train reply as top-k of ``reply - received model`` (error feedback
  kept in the client's ``Context.state`` across rounds), when the server said it can decode it.
* :class:`CompressedStrategy` (needs flwr): wraps ``FedAvg`` or any strategy with the same hooks. It sends the
  global model compressed (lossless by default), says so in the train config, and aggregates the replies with
  :func:`gpu_codec.aggregate` straight from the sparse form (FedAvg's weighted mean, the same bytes in any arrival
  order); metrics stay the wrapped strategy's.

>>> import numpy as np
>>> update = {"w": np.array([0.5, -4.0, 0.0, 2.0], np.float32), "b": np.zeros(2, np.float32)}
>>> rec = ArrayRecord.compressed(update, fraction=0.5)       # keep ceil(0.5 x 6) = 3 entries
>>> list(rec), rec["gpu_codec"].dtype, rec["gpu_codec"].stype, rec["gpu_codec"].is_payload
(['gpu_codec'], 'gpu_codec.v1', 'numpy.ndarray', True)
>>> {k: v.tolist() for k, v in rec.decompress().items()}
{'w': [0.5, -4.0, 0.0, 2.0], 'b': [0.0, 0.0]}
>>> np.load(io.BytesIO(rec["gpu_codec"].data), allow_pickle=False)     # what a stock peer sees
Traceback (most recent call last):
...
ValueError: descr is not a valid dtype descriptor: "gpu_codec.v1 ... pip install 'gpu_codec[flower]' ..."
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import struct
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

from . import adapt
from . import engine as _engine
from .aggregate import Aggregator
from .arrays import array_kind, to_tensor
from .error_feedback import ErrorFeedback
from .errors import GpuCodecError, InvalidInputError, PayloadLayoutError, PayloadLimitError

__all__ = [
    "ACCEPT_KEY",
    "STYPE_GPU_CODEC",
    "STYPE_NUMPY",
    "Array",
    "ArrayRecord",
    "CompressedStrategy",  # noqa: F822  (built on first use by the module's __getattr__)
    "ParametersRecord",
    "compression_mod",
    "decode_record",
]

STYPE_NUMPY = "numpy.ndarray"
STYPE_GPU_CODEC = "gpu_codec.v1"  # the dtype of a compressed Array (its stype, in records made before the guard)
ACCEPT_KEY = "gpu_codec.accept"  # config entry a server sends when it decodes gpu_codec replies
DEFAULT_KEY = "gpu_codec"
_EF_STATE = "gpu_codec.error_feedback"
_FLOAT_NPY = frozenset({"float16", "float32", "float64"})
_GUARD_NOTE = f"{STYPE_GPU_CODEC} payload: a gpu_codec compressed update and not a NumPy array"
log = logging.getLogger(__name__)


def _npy_guard() -> bytes:
    """A ``.npy`` v1 header whose dtype descriptor is a message: ``np.load`` stops there with a ValueError."""
    descr = (  # no commas: NumPy would read them as a list of fields
        f"{_GUARD_NOTE}; to read it pip install 'gpu_codec[flower]' and decode it with gpu_codec.flower"
    )
    head = repr({"descr": descr, "fortran_order": False, "shape": (0,)}).encode("ascii")
    head += b" " * ((-(10 + len(head) + 1)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head


_GUARD = _npy_guard()


class Array:
    """A serialized array: ``dtype`` (str), ``shape`` (tuple of int), ``stype`` (how ``data`` was made), ``data``.

    Built as flwr builds it: ``Array(ndarray)``, ``Array(ndarray=...)``, ``Array(torch_tensor=...)`` (also a CuPy
    array, positionally) or the four fields. Invalid arguments raise ``TypeError``, as flwr does.

    >>> a = Array(np.arange(3, dtype=np.float32))
    >>> a.dtype, a.shape, a.stype, a.numpy().tolist()
    ('float32', (3,), 'numpy.ndarray', [0.0, 1.0, 2.0])
    >>> Array(ndarray=np.zeros(2)) == Array.from_numpy_ndarray(np.zeros(2))
    True
    """

    def __init__(
        self,
        *args: Any,
        dtype: str | None = None,
        shape: tuple[int, ...] | None = None,
        stype: str | None = None,
        data: bytes | None = None,
        ndarray: Any = None,
        torch_tensor: Any = None,
    ) -> None:
        fields = (dtype, shape, stype, data)
        given = [x for x in (ndarray, torch_tensor) if x is not None]
        if len(args) == 1 and not given and all(f is None for f in fields):
            given = [args[0]]
            args = ()
        if given:
            if args or len(given) != 1 or any(f is not None for f in fields):
                _array_init_error()
            self._from(Array.from_array(given[0]) if torch_tensor is None else Array.from_torch_tensor(given[0]))
            return
        if len(args) > 4:
            _array_init_error()
        vals = list(args) + [None] * (4 - len(args))
        for i, f in enumerate(fields):
            if f is not None:
                if vals[i] is not None:
                    _array_init_error()
                vals[i] = f
        dtype, shape, stype, data = vals
        if not (
            isinstance(dtype, str)
            and isinstance(stype, str)
            and isinstance(data, (bytes, bytearray))
            and isinstance(shape, (tuple, list))
            and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape)
        ):
            _array_init_error()
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.stype = stype
        self._data: bytes | None = bytes(data)
        self._payload: Any = None

    def _from(self, other: Array) -> None:
        self.dtype, self.shape, self.stype = other.dtype, other.shape, other.stype
        self._data, self._payload = other._data, other._payload

    # -------------------------------------------------------- data, lazily for payloads

    @property
    def data(self) -> bytes:
        """The serialized bytes (for a payload made on the GPU: its one device-to-host copy, on first read)."""
        if self._data is None:
            self._data = _GUARD + self._payload.to_bytes()
        return self._data

    @data.setter
    def data(self, value: bytes) -> None:
        self._data = bytes(value)
        self._payload = None

    @property
    def nbytes(self) -> int:
        """``len(data)``, without serializing a payload that has not been serialized yet."""
        return len(self._data) if self._data is not None else len(_GUARD) + self._payload.nbytes

    @property
    def is_payload(self) -> bool:
        """Whether this Array holds a gpu_codec payload (either form)."""
        if self._payload is not None or self.stype == STYPE_GPU_CODEC:
            return True
        return self.stype == STYPE_NUMPY and self.dtype == STYPE_GPU_CODEC and self.data.startswith(_GUARD)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array) and type(other).__name__ != "Array":
            return NotImplemented
        mine = (self.dtype, tuple(self.shape), self.stype, self.data)
        return mine == (other.dtype, tuple(other.shape), other.stype, other.data)

    __hash__ = None  # mutable, as flwr's

    def __repr__(self) -> str:
        return f"Array(dtype={self.dtype!r}, shape={self.shape}, stype={self.stype!r}, {self.nbytes} bytes)"

    # -------------------------------------------------------- constructors

    @classmethod
    def from_numpy_ndarray(cls, ndarray: np.ndarray) -> Array:
        """The ``.npy`` bytes of ``ndarray`` (never pickled), byte for byte flwr's ``Array.from_numpy_ndarray``."""
        if not isinstance(ndarray, np.ndarray):
            raise TypeError(f"Expected NumPy ndarray, got {type(ndarray)}")
        if ndarray.dtype.name == "bfloat16":  # ml_dtypes: .npy would store it as a void type
            ndarray = ndarray.astype(np.float32)
        if ndarray.dtype.hasobject:
            raise InvalidInputError("an object array cannot travel without pickle; convert it to a numeric dtype")
        buf = io.BytesIO()
        np.save(buf, ndarray, allow_pickle=False)
        return cls(dtype=str(ndarray.dtype), shape=tuple(ndarray.shape), stype=STYPE_NUMPY, data=buf.getvalue())

    @classmethod
    def from_torch_tensor(cls, tensor: Any) -> Array:
        """A torch tensor (any device; copied to the host). bfloat16 is widened to float32, exactly."""
        if array_kind(tensor) != "torch":
            raise TypeError(f"Expected PyTorch Tensor, got {type(tensor)}")
        return cls.from_array(tensor)

    @classmethod
    def from_array(cls, x: Any) -> Array:
        """A NumPy, CuPy or torch array (CPU or GPU). bfloat16 is widened to float32, exactly: ``.npy`` has no
        bfloat16, and its uint16 bits would reach a stock peer as a wrong array."""
        kind = array_kind(x)
        if kind == "numpy":
            return cls.from_numpy_ndarray(np.asarray(x))
        t = to_tensor(x, "array")
        host = np.ascontiguousarray(t.data.get() if t.on_gpu else t.data)
        if t.dtype == "bfloat16":
            host = (host.astype(np.uint32) << 16).view(np.float32)
        return cls.from_numpy_ndarray(host.reshape(t.shape))

    @classmethod
    def from_payload(cls, payload: Any) -> Array:
        """A compressed update (a :class:`~gpu_codec.Payload`, or its bytes) as one Array: ``dtype="gpu_codec.v1"``,
        ``stype="numpy.ndarray"``, data = a ``.npy`` guard header that stock readers stop at, then the payload."""
        if isinstance(payload, (bytes, bytearray, memoryview)):
            blob = bytes(payload)
            _engine.Payload.from_bytes(blob)  # validate now rather than at the receiver
            return cls(dtype=STYPE_GPU_CODEC, shape=(len(_GUARD) + len(blob),), stype=STYPE_NUMPY, data=_GUARD + blob)
        if not isinstance(payload, _engine.Payload):
            raise InvalidInputError(f"expected a gpu_codec Payload or its bytes, got {type(payload).__name__}")
        arr = cls(dtype=STYPE_GPU_CODEC, shape=(len(_GUARD) + payload.nbytes,), stype=STYPE_NUMPY, data=b"")
        arr._data, arr._payload = None, payload
        return arr

    # -------------------------------------------------------- readers

    def numpy(self, *, max_bytes: int | None = None) -> np.ndarray:
        """The array, for ``stype="numpy.ndarray"``: its ``.npy`` header is read first, and the array is made only
        if the bytes after it are exactly what the header declares (never unpickled), and at most ``max_bytes``
        (``None``: no cap beyond the data itself)."""
        if self.is_payload:
            raise InvalidInputError(
                "this Array holds a gpu_codec payload, not an array: use Array.payload() or ArrayRecord.decompress()"
            )
        if self.stype != STYPE_NUMPY:
            raise TypeError(f"Unsupported serialization type for numpy conversion: '{self.stype}'")
        a = _read_npy(self.data, max_bytes)
        if self.dtype == "bfloat16" and a.dtype == np.uint16:  # records of earlier gpu_codec versions
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a

    def to_torch(self, device: Any = None) -> Any:
        """The array as a torch tensor, on ``device``."""
        import torch

        t = torch.from_numpy(np.ascontiguousarray(self.numpy()))
        return t.to(device) if device is not None else t

    def payload(self) -> Any:
        """The :class:`~gpu_codec.Payload` this Array holds (validated; the original object where this Array was
        made from one)."""
        if not self.is_payload:
            raise TypeError(f"Array has stype '{self.stype}' and dtype '{self.dtype}': it holds no gpu_codec payload")
        if self._payload is not None:
            return self._payload
        blob = self.data
        if self.stype == STYPE_NUMPY:
            blob = memoryview(blob)[len(_GUARD) :]
        return _engine.Payload.from_bytes(blob)

    # -------------------------------------------------------- flwr

    def to_flwr(self) -> Any:
        """This Array as a ``flwr.app.Array`` (same four fields; an earlier bfloat16 record is widened)."""
        from flwr.common import Array as FlwrArray

        if self.stype == STYPE_NUMPY and self.dtype == "bfloat16":
            return Array.from_numpy_ndarray(self.numpy()).to_flwr()
        return FlwrArray(dtype=self.dtype, shape=tuple(self.shape), stype=self.stype, data=self.data)

    @classmethod
    def from_flwr(cls, a: Any) -> Array:
        return cls(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=a.data)


def _read_npy(data: bytes, max_bytes: int | None) -> np.ndarray:
    """A ``.npy`` array whose header is checked before anything is allocated: no object dtype, the declared bytes
    within ``max_bytes``, and exactly that many bytes after the header (``np.load`` allocates what the header says
    before it reads)."""
    f = io.BytesIO(data)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except ValueError as e:
        if _GUARD_NOTE in str(e):
            raise
        raise PayloadLayoutError(f"not a valid .npy array: {e}") from None
    if dtype.hasobject:
        raise PayloadLayoutError("the .npy array has an object dtype, which cannot be read without pickle")
    nbytes = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and nbytes > max_bytes:
        raise PayloadLimitError(f"the .npy array declares {nbytes} bytes, over the cap of {max_bytes}")
    if len(data) - f.tell() != nbytes:
        raise PayloadLayoutError(
            f"the .npy array declares {dtype}{list(shape)} ({nbytes} bytes), its data holds {len(data) - f.tell()}"
        )
    flat = np.frombuffer(memoryview(data)[f.tell() :], dtype=dtype)
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


def _array_init_error() -> None:
    raise TypeError(
        "Invalid arguments for Array. Expected either a PyTorch tensor, a NumPy ndarray, or explicit "
        "dtype/shape/stype/data values."
    )


def _record_init_error() -> None:
    raise TypeError(
        "Invalid arguments for ArrayRecord. Expected either a list of NumPy ndarrays, a PyTorch state_dict, "
        "or a dictionary of Arrays. The `keep_input` argument is keyword-only."
    )


def _check_key(key: Any) -> None:
    if not isinstance(key, str):
        raise TypeError(f"Key must be of type `str` but `{type(key)}` was passed.")


class ArrayRecord(MutableMapping):
    """An ordered ``str -> Array`` record, as flwr's current ``ArrayRecord``.

    ``ArrayRecord(array_dict)`` (a dict of Array), ``ArrayRecord(list_of_ndarrays)`` (keys ``"0"``, ``"1"``, ...)
    or ``ArrayRecord(state_dict)`` (name -> torch, NumPy or CuPy array), positionally or as ``array_dict=``,
    ``numpy_ndarrays=``, ``torch_state_dict=``. ``keep_input=False`` empties the input as it is consumed.

    >>> rec = ArrayRecord(numpy_ndarrays=[np.zeros(2, np.float32), np.ones(3, np.int64)])
    >>> list(rec), [a.tolist() for a in rec.to_numpy_ndarrays()]
    (['0', '1'], [[0.0, 0.0], [1, 1, 1]])
    >>> rec.count_bytes() == sum(len(a.data) + len(k) for k, a in rec.items())
    True
    """

    def __init__(
        self,
        *args: Any,
        numpy_ndarrays: list | None = None,
        torch_state_dict: Mapping[str, Any] | None = None,
        array_dict: Mapping[str, Array] | None = None,
        keep_input: bool = True,
    ) -> None:
        self._d: dict[str, Array] = {}
        named = [
            (v, m)
            for v, m in ((array_dict, "dict"), (numpy_ndarrays, "list"), (torch_state_dict, "sd"))
            if v is not None
        ]
        if len(args) > 1 or len(args) + len(named) > 1:
            _record_init_error()
        arg, method = (args[0], "any") if args else (named[0] if named else (None, "any"))
        if arg is None:
            return
        if isinstance(arg, list) and method in ("any", "list"):
            self._d = ArrayRecord.from_numpy_ndarrays(arg, keep_input=keep_input)._d
            return
        if isinstance(arg, Mapping) and method != "list":
            serialized = [isinstance(v, Array) or _is_flwr_array(v) for v in arg.values()]
            if all(serialized) and method in ("any", "dict"):
                self._d = ArrayRecord.from_array_dict(arg, keep_input=keep_input)._d
                return
            if not any(serialized) and method in ("any", "sd"):
                self._d = ArrayRecord.from_arrays(arg, keep_input=keep_input)._d
                return
        _record_init_error()

    # -------------------------------------------------------- mapping

    def __setitem__(self, key: str, value: Array) -> None:
        _check_key(key)
        if not isinstance(value, Array):
            raise TypeError(f"Value must be of type `{Array}` but `{type(value)}` was passed.")
        self._d[key] = value

    def __getitem__(self, key: str) -> Array:
        return self._d[key]

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._d!r})"

    def count_bytes(self) -> int:
        """Bytes of every Array's data plus every key (as flwr counts), without serializing lazy payloads."""
        return sum(v.nbytes + len(k) for k, v in self._d.items())

    # -------------------------------------------------------- constructors

    @classmethod
    def from_array_dict(cls, array_dict: Mapping[str, Any], *, keep_input: bool = True) -> ArrayRecord:
        """A dict of Arrays (ours or flwr's)."""
        rec = cls()
        for k in list(array_dict.keys()):
            v = array_dict[k]
            rec[k] = v if isinstance(v, Array) else Array.from_flwr(v)
            if not keep_input:
                del array_dict[k]  # type: ignore[attr-defined]
        return rec

    @classmethod
    def from_numpy_ndarrays(cls, ndarrays: list, *, keep_input: bool = True) -> ArrayRecord:
        """Keys ``"0"``, ``"1"``, ... in list order."""
        rec = cls()
        for i in range(len(ndarrays)):
            rec[str(i)] = Array.from_numpy_ndarray(ndarrays[i])
            if not keep_input:
                ndarrays[i] = None
        if not keep_input:
            ndarrays.clear()
        return rec

    @classmethod
    def from_torch_state_dict(cls, state_dict: Mapping[str, Any], *, keep_input: bool = True) -> ArrayRecord:
        return cls.from_arrays(state_dict, keep_input=keep_input)

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], *, keep_input: bool = True) -> ArrayRecord:
        """Name -> NumPy, CuPy or torch array (any device)."""
        rec = cls()
        for k in list(arrays.keys()):
            _check_key(k)
            v = arrays[k] if keep_input else arrays.pop(k)  # type: ignore[attr-defined]
            rec[k] = Array.from_array(v)
        return rec

    @classmethod
    def compressed(
        cls,
        update: Mapping[str, Any],
        base: Mapping[str, Any] | None = None,
        *,
        key: str = DEFAULT_KEY,
        fraction: float | None = 0.01,
        scope: str = "global",
        score: Any = "magnitude",
        pipeline: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ArrayRecord:
        """Compress ``update - base`` (:func:`gpu_codec.compress`; ``fraction=None`` for dense) into a record
        holding one compressed Array under ``key``. On the GPU the payload stays there until sent."""
        payload = adapt.engine_compress(
            update, base, fraction=fraction, scope=scope, score=score, pipeline=pipeline, metadata=metadata
        )
        rec = cls()
        rec[key] = Array.from_payload(payload)
        return rec

    # -------------------------------------------------------- readers

    def to_numpy_ndarrays(self, *, keep_input: bool = True) -> list[np.ndarray]:
        out = [v.numpy() for v in self._d.values()]
        if not keep_input:
            self._d.clear()
        return out

    def to_torch_state_dict(self, *, keep_input: bool = True, device: Any = None) -> dict[str, Any]:
        out = {k: v.to_torch(device) for k, v in self._d.items()}
        if not keep_input:
            self._d.clear()
        return out

    def decompress(
        self,
        base: Mapping[str, Any] | None = None,
        *,
        like: str | None = None,
        max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
    ) -> dict[str, Any]:
        """Dense tensors: every compressed Array decompressed (``base + delta`` where ``base`` is given,
        returned as the base's kind on its device, else the delta as ``like``), every plain Array as its value
        (as ``like``, or as the base's kind where the base has that name).

        ``max_output_bytes`` caps the dense output of the whole record, as :func:`gpu_codec.decompress` counts it
        (each Array is refused before it is decoded if it declares more than what is left); ``None``: no cap.

        >>> rec = ArrayRecord.compressed({"w": np.zeros(10**6, np.float32)}, fraction=1e-6)
        >>> rec.decompress(max_output_bytes=1 << 20)
        Traceback (most recent call last):
        ...
        gpu_codec.errors.PayloadLimitError: payload declares 4000000 bytes of dense output (1 tensors), over ...
        """
        left = _check_cap(max_output_bytes)
        out: dict[str, Any] = {}
        for key, arr in self._d.items():
            if arr.is_payload:
                payload = arr.payload()
                b = None
                if base is not None:
                    b = {r.name: base[r.name] for r in payload.tensors if r.name in base}
                dense = _engine.decompress(payload, base=b or None, like=like, max_output_bytes=left)
                left = _spent(left, dense.values())
                clash = set(dense) & set(out)
                if clash:
                    raise InvalidInputError(f"tensors {sorted(clash)[:5]} appear in more than one Array")
                out.update(dense)
            elif arr.stype == STYPE_NUMPY:
                if key in out:
                    raise InvalidInputError(f"tensor {key!r} appears in more than one Array")
                kind = array_kind(base[key]) if base is not None and key in base else (like or "numpy")
                out[key] = _as_kind(arr, kind, base[key] if base is not None and key in base else None, left)
                left = _spent(left, [out[key]])
            else:
                raise TypeError(f"Array {key!r} has stype '{arr.stype}', which gpu_codec cannot read")
        return out

    # -------------------------------------------------------- flwr

    def to_flwr(self) -> Any:
        """This record as a ``flwr.app.ArrayRecord``."""
        import flwr.common as fc

        cls_ = getattr(fc, "ArrayRecord", None) or fc.ParametersRecord
        return cls_({k: v.to_flwr() for k, v in self._d.items()})

    @classmethod
    def from_flwr(cls, record: Any, *, keep_input: bool = True) -> ArrayRecord:
        """A ``flwr.app.ArrayRecord`` (or ``ParametersRecord``) as this record."""
        rec = cls()
        for k in list(record.keys()):
            rec[k] = Array.from_flwr(record[k])
            if not keep_input:
                del record[k]
        return rec


class ParametersRecord(ArrayRecord):
    """The earlier name of the record, with its signature: ``ParametersRecord(array_dict=None, keep_input=False)``.

    ``array_dict`` is a dict of Array; by default it is emptied as it is consumed (``keep_input=False``). A list
    of NumPy arrays or a dict of arrays is also taken, as by :class:`ArrayRecord`.

    >>> arrays = {"a": Array(np.ones(2, np.float32))}
    >>> rec = ParametersRecord(arrays)
    >>> list(rec), arrays
    (['a'], {})
    """

    def __init__(self, array_dict: Any = None, keep_input: bool = False) -> None:
        super().__init__(array_dict, keep_input=keep_input)


def _is_flwr_array(v: Any) -> bool:
    return type(v).__name__ == "Array" and all(hasattr(v, f) for f in ("dtype", "shape", "stype", "data"))


def _check_cap(cap: Any) -> int | None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
        raise InvalidInputError(f"max_output_bytes must be a non-negative integer or None, got {cap!r}")
    return cap


def _spent(left: int | None, arrays: Any) -> int | None:
    """What is left of a cap once ``arrays`` were made."""
    return None if left is None else max(0, left - sum(int(a.nbytes) for a in arrays))


def _as_kind(arr: Array, kind: str, like_tensor: Any, max_bytes: int | None = None) -> Any:
    a = arr.numpy(max_bytes=max_bytes)
    if kind == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(a))
        dev = getattr(like_tensor, "device", None)
        return t.to(dev) if dev is not None else t
    if kind == "cupy":
        import cupy

        if like_tensor is not None:
            with cupy.cuda.Device(like_tensor.device.id):
                return cupy.asarray(a)
        return cupy.asarray(a)
    if kind != "numpy":
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {kind!r}")
    return a


# ============================================================ Flower apps: models in messages


def _holds_payload(a: Any) -> bool:
    """Whether a flwr Array carries a gpu_codec payload (either form), without copying its data."""
    if a.stype == STYPE_GPU_CODEC:
        return True
    return a.stype == STYPE_NUMPY and a.dtype == STYPE_GPU_CODEC and a.data[: len(_GUARD)] == _GUARD


def _is_compressed(record: Any) -> bool:
    return any(_holds_payload(a) for a in record.values())


def _decode_model(record: Any, max_output_bytes: int | None) -> dict[str, np.ndarray]:
    """A flwr ArrayRecord (compressed or not) as name -> NumPy array, in the sender's order and dtypes (a payload's
    float16 comes back as float16; bfloat16, which ``.npy`` lacks, as float32), at most ``max_output_bytes`` of
    output in all (each Array refused before it is decoded if it declares more than what is left)."""
    left = _check_cap(max_output_bytes)
    out: dict[str, np.ndarray] = {}
    order: list[str] = []
    for k in record:
        a = Array.from_flwr(record[k])
        if not a.is_payload:
            out[k] = a.numpy(max_bytes=left)
            left = _spent(left, [out[k]])
            order.append(k)
            continue
        payload = a.payload()
        dense = _engine.decompress(payload, max_output_bytes=left)
        left = _spent(left, dense.values())
        for r in payload.tensors:
            if r.name in out:
                raise InvalidInputError(f"tensor {r.name!r} appears twice in the record")
            out[r.name] = adapt.cast_to_logical(dense[r.name], r.dtype, "numpy")
        sent = payload.metadata.get("order")
        order.extend(r.name for r in payload.tensors)
        if isinstance(sent, list) and all(isinstance(n, str) for n in sent):
            order = sent  # used only if it names exactly the same arrays (checked below)
    if sorted(order) != sorted(out):
        order = list(out)
    return {n: out[n] for n in order}


def decode_record(record: Any, *, max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES) -> Any:
    """A flwr ``ArrayRecord`` holding gpu_codec payloads as a plain flwr ``ArrayRecord`` of NumPy arrays (a
    record with none is returned as it is). ``max_output_bytes`` caps the record's dense output, as
    :meth:`ArrayRecord.decompress` does (``PayloadLimitError`` before anything over it is decoded)."""
    if not _is_compressed(record):
        return record
    from flwr.app import Array as FlwrArray
    from flwr.app import ArrayRecord as FlwrRecord

    return FlwrRecord({k: FlwrArray(v) for k, v in _decode_model(record, max_output_bytes).items()})


def _split_floats(arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None) -> list[str]:
    names = []
    for n, a in arrays.items():
        if a.dtype.name not in _FLOAT_NPY:
            continue
        if base is not None and (n not in base or base[n].shape != a.shape or base[n].dtype != a.dtype):
            continue
        names.append(n)
    return names


def _compressed_record(
    arrays: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray] | None,
    key: str,
    *,
    fraction: float | None,
    scope: str = "global",
    pipeline: Any = None,
    residual: Any = None,
) -> tuple[Any, list[str]]:
    """(flwr ArrayRecord with one compressed Array under ``key`` and the other arrays plain, compressed names)."""
    from flwr.app import Array as FlwrArray
    from flwr.app import ArrayRecord as FlwrRecord

    if key in arrays:
        raise InvalidInputError(f"the record already has an array named {key!r}; pass another key")
    names = _split_floats(arrays, base)
    out = FlwrRecord()
    if names:
        payload = _engine.compress(
            {n: arrays[n] for n in names},
            None if base is None else {n: base[n] for n in names},
            fraction=fraction,
            scope=scope,
            pipeline=pipeline,
            residual=residual,
            metadata={"order": list(arrays)},
        )
        out[key] = Array.from_payload(payload).to_flwr()
    for n, a in arrays.items():
        if n not in names:
            out[n] = FlwrArray(np.asarray(a))
    return out, names


def compression_mod(
    fraction: float | None = 0.01,
    *,
    scope: str = "global",
    pipeline: Any = None,
    error_feedback: bool = True,
    key: str = DEFAULT_KEY,
    max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
) -> Callable[[Any, Any, Callable[[Any, Any], Any]], Any]:
    """A Flower client ``Mod``: compressed models in, compressed train replies out.

    Incoming: every ``ArrayRecord`` holding gpu_codec payloads is decoded to a plain one before the
    ``ClientApp`` runs. Outgoing, for a train message whose config carries ``gpu_codec.accept`` (what
    :class:`CompressedStrategy` sends): each ``ArrayRecord`` of the reply that has a received counterpart becomes
    top-k of ``reply - received`` (float arrays of matching shape and dtype, in one payload under ``key``; other
    arrays stay plain). Without that config entry the reply goes out as it is, so a stock server is never sent a
    record it cannot read.

    Parameters
    ----------
    fraction, scope, pipeline
        As for :func:`gpu_codec.compress` (``fraction=None``: dense, value codecs only).
    error_feedback
        Keep what compression dropped in ``context.state`` (as a checksummed gpu_codec record, no pickle) and add
        it to the next round's delta.
    key
        Name of the compressed Array in the record.
    max_output_bytes
        Cap on the dense output of each incoming record, as :func:`decode_record` applies it.

    >>> mod = compression_mod(0.05, pipeline=[{"id": "quantize", "dtype": "float16"}])
    >>> callable(mod)
    True
    """
    if fraction is not None:
        fraction = _engine.check_fraction(fraction)
    pipeline_cfg = adapt.pipeline_configs(pipeline)
    cap = _check_cap(max_output_bytes)

    def gpu_codec_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        from flwr.app import ConfigRecord

        received: dict[str, dict[str, np.ndarray]] = {}
        accepts = False
        if msg.has_content():
            content = msg.content
            accepts = any(c.get(ACCEPT_KEY) == STYPE_GPU_CODEC for c in content.config_records.values())
            for rk in list(content.array_records.keys()):
                rec = content.array_records[rk]
                if _is_compressed(rec):
                    rec = decode_record(rec, max_output_bytes=cap)
                    content[rk] = rec
                received[rk] = {k: rec[k].numpy() for k in rec}
        reply = call_next(msg, context)
        kind = msg.metadata.message_type.split(".")[0]
        if not accepts or kind != "train" or reply.has_error() or not reply.has_content():
            return reply
        for rk in list(reply.content.array_records.keys()):
            if rk not in received:
                continue
            rec = reply.content.array_records[rk]
            arrays = {k: rec[k].numpy() for k in rec}
            ef = None
            state_key = f"{_EF_STATE}.{rk}"
            if error_feedback:
                saved = context.state.config_records.get(state_key)
                ef = ErrorFeedback.from_bytes(saved["state"]) if saved is not None else ErrorFeedback()
            new_rec, names = _compressed_record(
                arrays, received[rk], key, fraction=fraction, scope=scope, pipeline=pipeline_cfg, residual=ef
            )
            if names:
                reply.content[rk] = new_rec
                if ef is not None:
                    context.state[state_key] = ConfigRecord({"state": ef.to_bytes()})
        return reply

    return gpu_codec_mod


def _weighted_plain_mean(entries: list[tuple[float, np.ndarray]], total: float) -> np.ndarray:
    """Weighted mean of dense arrays in an order fixed by their bytes (so by content, not arrival)."""
    entries = sorted(entries, key=lambda e: (hashlib.sha256(e[1].tobytes()).digest(), e[0]))
    acc = np.zeros(entries[0][1].shape, np.float64)
    for w, a in entries:
        acc += w * a.astype(np.float64)
    mean = acc / total
    dt = entries[0][1].dtype
    if dt.kind in "iub":
        mean = np.rint(mean)
    return mean.astype(dt)


def _make_strategy_class() -> type:
    from flwr.app import Array as FlwrArray
    from flwr.app import ArrayRecord as FlwrRecord
    from flwr.app import Message, RecordDict
    from flwr.serverapp.strategy import Strategy
    from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

    class CompressedStrategy(Strategy):
        """Wraps a Flower strategy (``FedAvg``, or any with the same hooks and keys) to send the global model
        compressed and aggregate compressed replies from their sparse form.

        Parameters
        ----------
        strategy
            The wrapped strategy: it samples nodes, builds the messages and aggregates the metrics; its
            ``weighted_by_key`` and ``arrayrecord_key`` are used.
        downlink
            Codec stages for the global model sent down, dense (``fraction=None``); the default, zstd, is lossless.
            ``None``: the model goes down uncompressed.
        key
            Name of the compressed Array in the records.
        max_output_bytes
            Cap on the memory of the round's :class:`~gpu_codec.Aggregator` (its ``max_output_bytes``: 20 bytes
            per fp32 parameter of the global model, more for a reply sending every entry sparse); a reply that
            needs more is left out. Default 4 GiB; ``None``: no cap.

        The arrays a round produces are ``received + sum(w_i delta_i) / sum(w_i)`` (FedAvg's rule), where
        ``received`` is the model the clients decoded; :func:`gpu_codec.aggregate` makes it the same to the byte
        in any arrival order. Fleets may be mixed: a reply without a payload (a client without
        :func:`compression_mod`) is taken losslessly beside compressed ones, and a node whose reply says it could
        not read the compressed model (a stock Flower client fails on the ``.npy`` guard) is logged and sent the
        model uncompressed from then on. A reply that cannot be used (a bad payload, arrays that do not match the
        global model, a bad weight) is logged and left out of the arrays and the metrics, and the round goes on
        with the others. Non-float arrays are averaged densely, in an order fixed by their content.
        """

        def __init__(
            self,
            strategy: Any,
            *,
            downlink: Any = ({"id": "zstd", "level": 3},),
            key: str = DEFAULT_KEY,
            max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
        ):
            for hook in ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate"):
                if not callable(getattr(strategy, hook, None)):
                    raise InvalidInputError(f"the wrapped strategy has no {hook}() hook")
            self.max_output_bytes = _check_cap(max_output_bytes)
            self._plain_nodes: set[int] = set()  # nodes that cannot read a compressed model
            self.strategy = strategy
            self.downlink = None if downlink is None else adapt.pipeline_configs(list(downlink))
            if self.downlink and any(s["id"] == "topk" for s in self.downlink):
                raise InvalidInputError("the global model goes down dense: a downlink pipeline takes no topk stage")
            self.key = key
            self._sent: tuple[Any, Any, dict[str, np.ndarray]] | None = None

        def __getattr__(self, name: str) -> Any:
            if name == "strategy":
                raise AttributeError(name)
            return getattr(self.strategy, name)

        @property
        def weighted_by_key(self) -> str:
            return getattr(self.strategy, "weighted_by_key", "num-examples")

        def summary(self) -> None:
            if hasattr(self.strategy, "summary"):
                self.strategy.summary()

        # ---------------------------------------------------------------- down

        def _down(self, arrays: Any) -> Any:
            """The record sent for ``arrays`` (compressed once per model), remembering what clients decode."""
            if self._sent is not None and self._sent[0] is arrays:
                return self._sent[1]
            plain = {k: arrays[k].numpy() for k in arrays}
            if self.downlink is None:
                sent = arrays
            else:
                sent, _ = _compressed_record(plain, None, self.key, fraction=None, pipeline=self.downlink)
            self._sent = (arrays, sent, _decode_model(sent, None))
            return sent

        def _with_down(self, messages: Any, arrays: Any) -> list:
            sent = self._down(arrays)
            out = []
            for m in messages:
                if m.metadata.dst_node_id not in self._plain_nodes:  # those get the model as it is
                    # a RecordDict of its own: the wrapped strategy may give every message the same one
                    m.content = RecordDict({k: (sent if v is arrays else v) for k, v in m.content.items()})
                out.append(m)
            return out

        def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
            config[ACCEPT_KEY] = STYPE_GPU_CODEC
            return self._with_down(self.strategy.configure_train(server_round, arrays, config, grid), arrays)

        def configure_evaluate(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
            return self._with_down(self.strategy.configure_evaluate(server_round, arrays, config, grid), arrays)

        def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            self._note_unreadable(server_round, replies)
            return self.strategy.aggregate_evaluate(server_round, replies)

        def _note_unreadable(self, server_round: int, replies: list) -> None:
            """Nodes whose reply is the error a stock client gives on the compressed model: sent it plain from now."""
            for m in replies:
                if not m.has_error() or _GUARD_NOTE not in str(m.error.reason):
                    continue
                node = m.metadata.src_node_id
                if self.downlink is not None and node not in self._plain_nodes:
                    self._plain_nodes.add(node)
                    log.warning(
                        "round %d: node %d could not read the compressed global model (gpu_codec is not installed "
                        "there); it is sent the model uncompressed from the next round on",
                        server_round,
                        node,
                    )

        # ---------------------------------------------------------------- up

        def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
            replies = list(replies)
            self._note_unreadable(server_round, replies)
            valid = [m for m in replies if not m.has_error()]
            arrays, taken = None, []
            if valid:
                # the metric records as the wrapped strategy checks them; the array records reply by reply below
                contents = [m.content for m in valid]
                validate_message_reply_consistency(contents, self.weighted_by_key, check_arrayrecord=False)
                arrays, taken = self._aggregate(server_round, valid)
            # the wrapped strategy sees the replies taken, with empty arrays: it checks, logs and aggregates metrics
            kept = {id(m) for m in taken}
            stubbed = []
            for m in replies:
                if m.has_error():
                    stubbed.append(m)
                elif id(m) in kept:
                    rd = RecordDict(
                        {k: (FlwrRecord() if k in m.content.array_records else v) for k, v in m.content.items()}
                    )
                    stubbed.append(Message(content=rd, metadata=m.metadata))
            _, metrics = self.strategy.aggregate_train(server_round, stubbed)
            return arrays, metrics

        def _aggregate(self, server_round: int, replies: list) -> tuple[Any, list]:
            """(the new model, or None if no reply could be used; the replies used)."""
            if self._sent is None:
                raise InvalidInputError("aggregate_train before configure_train: no global model to add deltas to")
            base = self._sent[2]
            floats = _split_floats(base, None)
            agg = None
            if floats:
                agg = Aggregator(base={n: base[n] for n in floats}, max_output_bytes=self.max_output_bytes)
            plain: dict[str, list[tuple[float, np.ndarray]]] = {n: [] for n in base if n not in floats}
            weights, taken = [], []
            for i, m in enumerate(replies):
                try:
                    w, payload, others = self._read_reply(m.content, base, floats, set(plain))
                    if payload is not None:
                        agg.add(payload, w)  # a payload it refuses leaves the accumulator as it was
                except GpuCodecError as e:
                    log.warning(
                        "round %d: the reply of node %d is left out of the aggregation: reply %d: %s",
                        server_round,
                        m.metadata.src_node_id,
                        i,
                        e,
                    )
                    continue
                for n, a in others.items():
                    plain[n].append((w, a))
                weights.append(w)
                taken.append(m)
            total = math.fsum(weights)
            if not taken or total <= 0:
                log.warning("round %d: no reply with a positive weight could be aggregated", server_round)
                return None, taken
            merged = agg.result() if agg is not None else {}
            merged.update({n: _weighted_plain_mean(v, total) for n, v in plain.items()})
            return FlwrRecord({n: FlwrArray(np.asarray(merged[n])) for n in base}), taken

        def _read_reply(
            self, content: Any, base: dict[str, np.ndarray], floats: list[str], plain: set[str]
        ) -> tuple[float, Any, dict[str, np.ndarray]]:
            """One reply's weight, payload (a reply without one: its full model, compressed losslessly) and plain
            arrays, each checked against the global model before it is read."""
            if len(content.array_records) != 1:
                raise InvalidInputError(f"it holds {len(content.array_records)} ArrayRecords, expected one")
            w = next(iter(content.metric_records.values()))[self.weighted_by_key]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
                raise InvalidInputError(f"its weight {self.weighted_by_key!r} is {w!r}, not a non-negative number")
            rec = next(iter(content.array_records.values()))
            keys = [k for k in rec if _holds_payload(rec[k])]
            if len(keys) > 1:
                raise PayloadLayoutError(f"it holds {len(keys)} gpu_codec payloads, expected one")
            others = {}
            for k in rec:
                if k in keys:
                    continue
                want = base.get(k)
                a = Array.from_flwr(rec[k])
                if want is None or a.stype != STYPE_NUMPY or (a.dtype, tuple(a.shape)) != (str(want.dtype), want.shape):
                    expected = "nothing" if want is None else f"{want.dtype}{list(want.shape)}"
                    raise InvalidInputError(f"its array {k!r} is {a.dtype}{list(a.shape)}, expected {expected}")
                arr = a.numpy(max_bytes=want.nbytes)
                if arr.dtype != want.dtype or arr.shape != want.shape:
                    raise InvalidInputError(f"its array {k!r} holds {arr.dtype}{list(arr.shape)}")
                others[k] = arr
            payload = Array.from_flwr(rec[keys[0]]).payload() if keys else None
            if payload is None and floats:  # a client without the mod: its full model, taken losslessly
                missing = [n for n in floats if n not in others]
                if missing:
                    raise InvalidInputError(f"it lacks arrays {missing[:5]} of the global model")
                full = {n: others.pop(n) for n in floats}
                payload = _engine.compress(full, {n: base[n] for n in floats}, fraction=None)
            if payload is not None and not floats:
                raise InvalidInputError("it holds a payload, but the global model has no float array")
            if set(others) != plain:
                raise InvalidInputError(f"it carries plain arrays {sorted(others)[:5]}, expected {sorted(plain)[:5]}")
            return float(w), payload, others

    CompressedStrategy.__module__ = __name__
    return CompressedStrategy


def __getattr__(name: str) -> Any:
    if name == "CompressedStrategy":  # built on first use, so importing this module does not import flwr
        try:
            cls = _make_strategy_class()
        except ImportError as e:
            raise ImportError(f"CompressedStrategy needs flwr: pip install 'gpu_codec[flower]' ({e})") from e
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
