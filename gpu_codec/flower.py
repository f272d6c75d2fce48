"""Flower's ``Array`` and ``ParametersRecord`` (``ArrayRecord``), able to carry a gpu_codec payload.

Someone arriving from Flower (``flwr.common``) finds:

* :class:`Array` ``(dtype, shape, stype, data)`` with :meth:`Array.numpy`, built from NumPy
  (:meth:`Array.from_numpy_ndarray`, byte for byte what flwr makes), torch (:meth:`Array.from_torch_tensor`) or
  any of NumPy, CuPy, torch (:meth:`Array.from_array`). A compressed update is one Array of
  ``stype="gpu_codec.v1"`` (:meth:`Array.from_payload`): its bytes are the payload's wire format, and they stay
  unserialized (on the GPU, if made there) until ``data`` is first read;
* :class:`ParametersRecord` (alias :data:`ArrayRecord`): an ordered ``str -> Array`` mapping with flwr's
  ``keep_input`` semantics and ``count_bytes``, its constructors from NumPy lists and torch state dicts, plus
  :meth:`ParametersRecord.compressed` (compress an update into a record) and :meth:`ParametersRecord.decompress`;
* :meth:`ParametersRecord.to_flwr` / :meth:`ParametersRecord.from_flwr`: conversion to and from the real
  ``flwr.common.ArrayRecord`` when flwr is installed (``pip install gpu_codec[flower]``), so a record travels in a
  Flower ``Message`` and comes back intact.

Deliberate differences: ``numpy()`` on a ``gpu_codec.v1`` Array raises ``TypeError`` as flwr does for an unknown
stype (use :meth:`Array.payload` or :meth:`ParametersRecord.decompress`); a bfloat16 tensor, which flwr cannot
convert, is stored with ``dtype="bfloat16"`` as its uint16 bit pattern in the ``.npy`` bytes.

>>> import numpy as np
>>> update = {"w": np.array([0.5, -4.0, 0.0, 2.0], np.float32), "b": np.zeros(2, np.float32)}
>>> rec = ParametersRecord.compressed(update, fraction=0.5)       # keep ceil(0.5 x 6) = 3 entries
>>> list(rec), rec["gpu_codec"].stype, rec["gpu_codec"].dtype
(['gpu_codec'], 'gpu_codec.v1', 'uint8')
>>> {k: v.tolist() for k, v in rec.decompress().items()}
{'w': [0.5, -4.0, 0.0, 2.0], 'b': [0.0, 0.0]}
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np

from . import adapt
from . import engine as _engine
from .arrays import array_kind, to_tensor
from .errors import InvalidInputError

__all__ = ["STYPE_GPU_CODEC", "STYPE_NUMPY", "Array", "ArrayRecord", "ParametersRecord"]

STYPE_NUMPY = "numpy.ndarray"
STYPE_GPU_CODEC = "gpu_codec.v1"


class Array:
    """A serialized array: ``dtype`` (str), ``shape`` (tuple of int), ``stype`` (how ``data`` was made), ``data``.

    >>> a = Array.from_numpy_ndarray(np.arange(3, dtype=np.float32))
    >>> a.dtype, a.shape, a.stype, a.numpy().tolist()
    ('float32', (3,), 'numpy.ndarray', [0.0, 1.0, 2.0])
    """

    def __init__(self, dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> None:
        if not (
            isinstance(dtype, str)
            and isinstance(stype, str)
            and isinstance(data, (bytes, bytearray))
            and isinstance(shape, (tuple, list))
            and all(isinstance(s, (int, np.integer)) for s in shape)
        ):
            raise TypeError(
                "Array needs dtype (str), shape (tuple of int), stype (str) and data (bytes), got "
                f"{type(dtype).__name__}, {type(shape).__name__}, {type(stype).__name__}, "
                f"{type(data).__name__}"
            )
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.stype = stype
        self._data: bytes | None = bytes(data)
        self._payload: Any = None

    # -------------------------------------------------------- data, lazily for payloads

    @property
    def data(self) -> bytes:
        """The serialized bytes (for a payload made on the GPU: its one device-to-host copy, on first read)."""
        if self._data is None:
            self._data = self._payload.to_bytes()
        return self._data

    @data.setter
    def data(self, value: bytes) -> None:
        self._data = bytes(value)
        self._payload = None

    @property
    def nbytes(self) -> int:
        """``len(data)``, without serializing a payload that has not been serialized yet."""
        return len(self._data) if self._data is not None else self._payload.nbytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array) and not type(other).__name__ == "Array":
            return NotImplemented
        return (self.dtype, tuple(self.shape), self.stype, self.data) == (
            other.dtype,
            tuple(other.shape),
            other.stype,
            other.data,
        )

    def __repr__(self) -> str:
        return f"Array(dtype={self.dtype!r}, shape={self.shape}, stype={self.stype!r}, {self.nbytes} bytes)"

    # -------------------------------------------------------- constructors

    @classmethod
    def from_numpy_ndarray(cls, ndarray: np.ndarray) -> Array:
        """The ``.npy`` bytes of ``ndarray`` (never pickled), as flwr's ``Array.from_numpy_ndarray``."""
        if not isinstance(ndarray, np.ndarray):
            raise TypeError(f"Expected NumPy ndarray, got {type(ndarray)}")
        buf = io.BytesIO()
        np.save(buf, ndarray, allow_pickle=False)
        return cls(dtype=str(ndarray.dtype), shape=tuple(ndarray.shape), stype=STYPE_NUMPY, data=buf.getvalue())

    @classmethod
    def from_torch_tensor(cls, tensor: Any) -> Array:
        """A torch tensor (any device; copied to the host, since ``.npy`` bytes live there)."""
        if array_kind(tensor) != "torch":
            raise TypeError(f"Expected PyTorch Tensor, got {type(tensor)}")
        return cls.from_array(tensor)

    @classmethod
    def from_array(cls, x: Any) -> Array:
        """A NumPy, CuPy or torch array (CPU or GPU). bfloat16 is kept as its uint16 bits, ``dtype="bfloat16"``."""
        kind = array_kind(x)
        if kind == "numpy":
            return cls.from_numpy_ndarray(np.asarray(x))
        t = to_tensor(x, "array")
        host = t.data.get() if t.on_gpu else t.data
        arr = cls.from_numpy_ndarray(np.ascontiguousarray(host).reshape(t.shape))
        if t.dtype == "bfloat16":
            arr.dtype = "bfloat16"
        return arr

    @classmethod
    def from_payload(cls, payload: Any) -> Array:
        """A compressed update (a :class:`~gpu_codec.Payload`, or its bytes) as one ``gpu_codec.v1`` Array."""
        if isinstance(payload, (bytes, bytearray, memoryview)):
            blob = bytes(payload)
            _engine.Payload.from_bytes(blob)  # validate now rather than at the receiver
            return cls(dtype="uint8", shape=(len(blob),), stype=STYPE_GPU_CODEC, data=blob)
        if not isinstance(payload, _engine.Payload):
            raise InvalidInputError(f"expected a gpu_codec Payload or its bytes, got {type(payload).__name__}")
        arr = cls(dtype="uint8", shape=(payload.nbytes,), stype=STYPE_GPU_CODEC, data=b"")
        arr._data, arr._payload = None, payload
        return arr

    # -------------------------------------------------------- readers

    def numpy(self) -> np.ndarray:
        """The array, for ``stype="numpy.ndarray"`` (loaded with ``allow_pickle=False``)."""
        if self.stype != STYPE_NUMPY:
            raise TypeError(f"Unsupported serialization type for numpy conversion: '{self.stype}'")
        return np.load(io.BytesIO(self.data), allow_pickle=False)

    def to_torch(self, device: Any = None) -> Any:
        """The array as a torch tensor (bfloat16 restored), on ``device``."""
        import torch

        a = self.numpy()
        if self.dtype == "bfloat16":
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        return t.to(device) if device is not None else t

    def payload(self) -> Any:
        """The :class:`~gpu_codec.Payload` of a ``gpu_codec.v1`` Array (validated; the original object where this
        Array was made from one)."""
        if self.stype != STYPE_GPU_CODEC:
            raise TypeError(f"Array has stype '{self.stype}', not '{STYPE_GPU_CODEC}': it holds no gpu_codec payload")
        if self._payload is not None:
            return self._payload
        return _engine.Payload.from_bytes(self.data)

    # -------------------------------------------------------- flwr

    def to_flwr(self) -> Any:
        """This Array as a ``flwr.common.Array`` (same four fields)."""
        from flwr.common import Array as FlwrArray

        return FlwrArray(dtype=self.dtype, shape=tuple(self.shape), stype=self.stype, data=self.data)

    @classmethod
    def from_flwr(cls, a: Any) -> Array:
        return cls(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=a.data)


def _check_key(key: Any) -> None:
    if not isinstance(key, str):
        raise TypeError(f"Key must be of type `str` but `{type(key)}` was passed.")


class ParametersRecord(MutableMapping):
    """An ordered ``str -> Array`` record, as flwr's ``ArrayRecord`` (formerly ``ParametersRecord``).

    ``keep_input=False`` empties the input (dict or list) as it is consumed, to free memory early; the default
    keeps it, as flwr does.

    >>> rec = ParametersRecord.from_numpy_ndarrays([np.zeros(2, np.float32), np.ones(3, np.int64)])
    >>> list(rec), [a.tolist() for a in rec.to_numpy_ndarrays()]
    (['0', '1'], [[0.0, 0.0], [1, 1, 1]])
    >>> rec.count_bytes() == sum(len(a.data) + len(k) for k, a in rec.items())
    True
    """

    def __init__(self, array_dict: Any = None, *, keep_input: bool = True) -> None:
        self._d: dict[str, Array] = {}
        if array_dict is None:
            return
        if isinstance(array_dict, list):  # flwr's ArrayRecord(list of ndarrays)
            self._d = ParametersRecord.from_numpy_ndarrays(array_dict, keep_input=keep_input)._d
            return
        if not isinstance(array_dict, Mapping):
            raise TypeError(
                f"ParametersRecord takes a dict of Array, a list of NumPy arrays or a dict of arrays "
                f"(a torch state_dict), got {type(array_dict).__name__}"
            )
        if array_dict and not all(isinstance(v, Array) for v in array_dict.values()):
            self._d = ParametersRecord.from_arrays(array_dict, keep_input=keep_input)._d
            return
        for k in list(array_dict.keys()):
            self[k] = array_dict[k]
            if not keep_input:
                del array_dict[k]  # type: ignore[attr-defined]

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
        return f"ParametersRecord({self._d!r})"

    def count_bytes(self) -> int:
        """Bytes of every Array's data plus every key (as flwr counts), without serializing lazy payloads."""
        return sum(v.nbytes + len(k) for k, v in self._d.items())

    # -------------------------------------------------------- constructors

    @classmethod
    def from_numpy_ndarrays(cls, ndarrays: list, *, keep_input: bool = True) -> ParametersRecord:
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
    def from_torch_state_dict(cls, state_dict: Mapping[str, Any], *, keep_input: bool = True) -> ParametersRecord:
        return cls.from_arrays(state_dict, keep_input=keep_input)

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], *, keep_input: bool = True) -> ParametersRecord:
        """Name -> NumPy, CuPy or torch array (any device)."""
        rec = cls()
        for k in list(arrays.keys()):
            v = arrays[k] if keep_input else arrays.pop(k)  # type: ignore[attr-defined]
            rec[k] = Array.from_array(v)
        return rec

    @classmethod
    def compressed(
        cls,
        update: Mapping[str, Any],
        base: Mapping[str, Any] | None = None,
        *,
        key: str = "gpu_codec",
        fraction: float | None = 0.01,
        scope: str = "global",
        score: Any = "magnitude",
        pipeline: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ParametersRecord:
        """Compress ``update - base`` (:func:`gpu_codec.compress`; ``fraction=None`` for dense) into a record
        holding one ``gpu_codec.v1`` Array under ``key``. On the GPU the payload stays there until sent."""
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

    def decompress(self, base: Mapping[str, Any] | None = None, *, like: str | None = None) -> dict[str, Any]:
        """Dense tensors: every ``gpu_codec.v1`` Array decompressed (``base + delta`` where ``base`` is given,
        returned as the base's kind on its device, else the delta as ``like``), every ``numpy.ndarray`` Array
        as its value (as ``like``, or as the base's kind where the base has that name)."""
        out: dict[str, Any] = {}
        for key, arr in self._d.items():
            if arr.stype == STYPE_GPU_CODEC:
                payload = arr.payload()
                b = None
                if base is not None:
                    b = {r.name: base[r.name] for r in payload.tensors if r.name in base}
                dense = _engine.decompress(payload, base=b or None, like=like)
                clash = set(dense) & set(out)
                if clash:
                    raise InvalidInputError(f"tensors {sorted(clash)[:5]} appear in more than one Array")
                out.update(dense)
            elif arr.stype == STYPE_NUMPY:
                if key in out:
                    raise InvalidInputError(f"tensor {key!r} appears in more than one Array")
                kind = array_kind(base[key]) if base is not None and key in base else (like or "numpy")
                out[key] = _as_kind(arr, kind, base[key] if base is not None and key in base else None)
            else:
                raise TypeError(f"Array {key!r} has stype '{arr.stype}', which gpu_codec cannot read")
        return out

    # -------------------------------------------------------- flwr

    def to_flwr(self) -> Any:
        """This record as a ``flwr.common.ArrayRecord`` (flwr >= 1.20; ``ParametersRecord`` on older flwr)."""
        import flwr.common as fc

        cls_ = getattr(fc, "ArrayRecord", None) or fc.ParametersRecord
        return cls_({k: v.to_flwr() for k, v in self._d.items()})

    @classmethod
    def from_flwr(cls, record: Any, *, keep_input: bool = True) -> ParametersRecord:
        """A ``flwr.common.ArrayRecord`` (or ``ParametersRecord``) as this record."""
        rec = cls()
        for k in list(record.keys()):
            rec[k] = Array.from_flwr(record[k])
            if not keep_input:
                del record[k]
        return rec


ArrayRecord = ParametersRecord


def _as_kind(arr: Array, kind: str, like_tensor: Any) -> Any:
    if kind == "torch":
        dev = getattr(like_tensor, "device", None)
        return arr.to_torch(dev)
    a = arr.numpy()
    if kind == "cupy":
        import cupy

        if like_tensor is not None:
            with cupy.cuda.Device(like_tensor.device.id):
                return cupy.asarray(a)
        return cupy.asarray(a)
    if kind != "numpy":
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {kind!r}")
    return a
