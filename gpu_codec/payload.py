"""A compressed update as it travels: :class:`Payload` (tensor records, pipeline, metadata; its bytes in the wire
format), and the checks of what a payload may hold (metadata JSON, names, shapes, the header's size)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import dtypes
from .codecs import wire_layouts
from .collector import holds_collector
from .errors import InvalidInputError
from .format import (
    MAX_HEADER_BYTES,
    MAX_NAME,
    MAX_NAMES_BYTES,
    MAX_NDIM,
    MAX_TENSOR_ELEMENTS,
    RecordTable,
    TensorRecord,
    header_size,
    pack,
    packed_size,
    table_frame,
    unpack,
)
from .format.common import MAX_JSON_VALUES, check_name, json_shape, record_column

MAX_METADATA_DEPTH = 64  # nesting levels of metadata containers
MAX_METADATA_INT = 10**40  # the header parser rejects longer integers


def check_json(value: Any, path: str = "", depth: int = 0, *, numpy_scalars: bool = False) -> Any:
    """``value`` as the header stores it, checked: None, bools, strings, finite numbers (integers of at most 40
    digits), lists and str-keyed dicts of those, nested at most MAX_METADATA_DEPTH deep; tuples become lists and
    NumPy scalars (with ``numpy_scalars``, as frameworks' metadata holds them) Python numbers. The one check of
    metadata, for the engine and for every adapter.

    >>> check_json({"a": (1, 2.5)}), check_json(np.float32(0.5), numpy_scalars=True)
    ({'a': [1, 2.5]}, 0.5)
    >>> check_json({"x": np.int64(3)})
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: metadata['x']: a numpy.int64 is not a JSON value (use None, bool, ...)
    """
    if numpy_scalars and isinstance(value, np.generic) and isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if depth > MAX_METADATA_DEPTH:
        raise InvalidInputError(f"metadata{path}: nested deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -MAX_METADATA_INT < value < MAX_METADATA_INT:
            raise InvalidInputError(f"metadata{path}: integer with more than 40 digits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInputError(f"metadata{path}: {value!r} is not a finite number (JSON cannot hold it)")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [check_json(v, f"{path}[{i}]", depth + 1, numpy_scalars=numpy_scalars) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidInputError(f"metadata{path}: key {k!r} is a {type(k).__name__}; JSON keys are strings")
            out[k] = check_json(v, f"{path}[{k!r}]", depth + 1, numpy_scalars=numpy_scalars)
        return out
    raise InvalidInputError(
        f"metadata{path}: a {type(value).__module__}.{type(value).__name__} is not a JSON value "
        "(use None, bool, int, float, str, list or dict; convert NumPy scalars with .item())"
    )


def check_metadata(metadata: Any) -> dict[str, Any]:
    """Metadata as the header will store it: a dict of JSON values (str keys, finite floats, integers of at most
    40 digits, at most 64 levels deep, small enough for the header). Raises InvalidInputError otherwise.

    >>> check_metadata({"round": 3, "lr": 0.1, "tags": ("a", "b")})
    {'round': 3, 'lr': 0.1, 'tags': ['a', 'b']}
    >>> check_metadata({"loss": float("nan")})
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: metadata['loss']: nan is not a finite number (JSON cannot hold it)
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    out = check_json(metadata)
    text = json.dumps(out, separators=(",", ":"), ensure_ascii=True)  # (as the writers write it)
    if len(text) > MAX_HEADER_BYTES // 2:
        raise InvalidInputError(
            f"metadata is {len(text)} bytes as JSON, over {MAX_HEADER_BYTES // 2} (half the header limit of "
            f"{MAX_HEADER_BYTES} bytes); send large data as tensors"
        )
    if json_shape(text)[0] > MAX_JSON_VALUES:  # (what a reader refuses: format.common.MAX_JSON_VALUES)
        raise InvalidInputError(
            f"metadata counts more than {MAX_JSON_VALUES} JSON values (one plus its commas, brackets and braces "
            "outside strings, as a reader counts them); send large data as tensors"
        )
    return out


def check_limits(name: Any, shape: tuple[int, ...]) -> None:
    """A tensor the reader will accept: the wire format's name, rank and element limits."""
    check_name(name)
    if len(name) > MAX_NAME:
        raise InvalidInputError(f"tensor {name[:40]!r}...: name of {len(name)} characters, the limit is {MAX_NAME}")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"tensor {name!r}: the name has no UTF-8 form (a lone surrogate)") from None
    if len(shape) > MAX_NDIM:
        raise InvalidInputError(f"tensor {name!r}: {len(shape)} dimensions, the wire format allows {MAX_NDIM}")
    if math.prod(s for s in shape if s) > MAX_TENSOR_ELEMENTS:
        raise InvalidInputError(f"tensor {name!r}: shape {shape} exceeds {MAX_TENSOR_ELEMENTS} elements")


def within_limits(names: list[Any], shapes: list[tuple[int, ...]], sizes: list[int] | None = None) -> bool:
    """Whether every tensor passes :func:`check_limits` (names and shapes, in order; ``sizes``, the shapes'
    element counts where known), with a few calls over the whole list; where one may not, :func:`check_limits`
    of each tells which and why. A shape with a zero dimension is left to :func:`check_limits` (its non-zero
    dimensions count).

    >>> within_limits(["a", "b"], [(2, 3), ()]), within_limits(["a", ""], [(2,), (2,)])
    (True, False)
    >>> big = MAX_TENSOR_ELEMENTS // 2  # (tensors within the limit whose sum is past it; one past it; none)
    >>> within_limits(["a", "b", "c"], [(big,)] * 3), within_limits(["a"], [(2 * big + 1,)])
    (True, False)
    >>> within_limits(["a"], [(0, 3)])
    False
    """
    if not names:
        return True
    if set(map(type, names)) != {str}:
        return False
    lengths = list(map(len, names))
    if not 0 < min(lengths) <= max(lengths) <= MAX_NAME:
        return False
    joined = "".join(names)
    if not joined.isascii():  # (every name has a UTF-8 form: no lone surrogate)
        try:
            joined.encode("utf-8")
        except UnicodeEncodeError:
            return False
    if max(map(len, shapes)) > MAX_NDIM:
        return False
    sizes = list(map(math.prod, shapes)) if sizes is None else sizes
    if 0 in sizes:
        return False
    return sum(sizes) <= MAX_TENSOR_ELEMENTS or max(sizes) <= MAX_TENSOR_ELEMENTS  # (the sum: one cheaper call)


# Bytes a tensor's entry in the v2 table can take beside its name: kind, form, 8 dimensions, nnz and the codec
# fields are each a byte or a varint of at most 10 bytes (about 140 in all at the most), and the name's own varints.
TABLE_ENTRY_BOUND = 512


def _header_bound(payload: Payload) -> int:
    """An upper bound on the header's bytes from the names, the stage and metadata JSON and the tensor count alone
    (no layout of the table): where it is within the reader's limit, the exact size need not be computed."""
    records = payload_records(payload)
    names = sum(map(len, record_column(records, "name")))
    cfg = json.dumps([payload.pipeline, payload.metadata], separators=(",", ":"), ensure_ascii=True)
    # (UTF-8 takes at most 4 bytes a character)
    return 4 * names + TABLE_ENTRY_BOUND * (len(records) + len(payload.pipeline)) + 4 * len(cfg) + 4096


def check_header_size(payload: Payload) -> None:
    if _header_bound(payload) <= MAX_HEADER_BYTES:
        return
    names = record_column(payload_records(payload), "name")
    named = sum(len(n.encode("utf-8", "surrogatepass")) for n in names)
    if named > MAX_NAMES_BYTES:  # (what the reader bounds: the names as read, each whole)
        raise InvalidInputError(
            f"the {len(names)} tensor names take {named} bytes in UTF-8, over the reader's limit of {MAX_NAMES_BYTES}"
        )
    header = payload.header_nbytes
    if header > MAX_HEADER_BYTES:
        raise InvalidInputError(
            f"the payload header would be {header} bytes, over the reader's limit of {MAX_HEADER_BYTES}: "
            f"{len(payload_records(payload))} tensors, their names and the metadata do not fit"
        )


def as_mapping(x: Any, what: str) -> Mapping[str, Any]:
    """``x`` if it is a mapping (of names to arrays), else an InvalidInputError naming ``what``."""
    if not isinstance(x, Mapping):
        raise InvalidInputError(f"{what} must be a mapping of name -> array, got {type(x).__name__}")
    return x


def in_order(m: Mapping[str, Any], names: list[str]) -> list[Any] | None:
    """``[m[n] for n in names]`` read in one call (``values()``, no lookup a name) where ``m``'s keys are ``names``
    in that order and it reads its values as a dict does; None otherwise (a dict whose own ``__getitem__`` differs
    from what its ``values()`` gives is read name by name by the caller).

    >>> in_order({"a": 1, "b": 2}, ["a", "b"]), in_order({"b": 2, "a": 1}, ["a", "b"])
    ([1, 2], None)
    >>> class Doubled(dict):
    ...     def __getitem__(self, k):
    ...         return 2 * super().__getitem__(k)
    >>> in_order(Doubled(a=1), ["a"]) is None
    True
    """
    if isinstance(m, dict) and type(m).__getitem__ is not dict.__getitem__:
        return None
    return list(m.values()) if list(m.keys()) == names else None


class Payload:
    """A compressed update: tensor records whose buffers stay where they were computed (the GPU on the GPU path)
    until :meth:`to_bytes`.

    Attributes: ``tensors`` (list of :class:`~gpu_codec.format.TensorRecord`), ``pipeline`` (codec configs, as
    stored in the header), ``metadata`` (str -> JSON value), ``backend`` (the backend that made it, not stored).
    A payload may hold its records as columns (:class:`~gpu_codec.format.common.RecordTable`: a compress with no
    stage after top-k, a table read before): ``tensors`` makes the list when it is first read, and the payload
    holds that list from then on.
    """

    def __init__(
        self,
        tensors: list[TensorRecord] | RecordTable,
        pipeline: list[dict],
        metadata: dict | None = None,
        backend: str = "cpu",
    ):
        self._records = tensors
        self.pipeline = pipeline
        self.metadata = dict(metadata or {})
        self.backend = backend
        self._wire_cache: dict = {}  # the bytes stage's layout, shared by nbytes, header_nbytes and to_bytes
        self.version: int | None = None  # the wire version it was read from (None: made here)
        self.base_fingerprint: str | None = None  # of the base it was made against (compress(fingerprint_base=True))

    @property
    def tensors(self) -> list[TensorRecord]:
        """The records, one :class:`~gpu_codec.format.TensorRecord` a tensor (made here, once, where the payload
        holds them as columns).

        >>> import numpy as np, gpu_codec
        >>> p = gpu_codec.compress({"a": np.arange(9, dtype=np.float32), "b": -np.ones(3, np.float32)}, fraction=0.25)
        >>> [(r.name, r.buffers["indices"].tolist()) for r in p.tensors], p.tensors is p.tensors
        ([('a', [6, 7, 8]), ('b', [])], True)
        """
        records = self._records
        if type(records) is RecordTable:
            records = self._records = records.records()
        return records

    @tensors.setter
    def tensors(self, records: list[TensorRecord]) -> None:
        self._records = records

    @holds_collector
    def to_bytes(self, version: int | None = None) -> bytes:
        """Serialize: wire format v2 (``version=None`` or 2; v1 for records v2 cannot describe, which no
        built-in codec makes; v3 where an ``nvcomp`` tensor is more than one zstd frame, more than 16 MiB of
        encoded bytes), or v1 or v2 on request (``version=1`` or ``2``, for readers that predate the later
        versions: a tensor of several frames is then compressed again, on the CPU, as one). On the GPU path this
        is where the payload leaves the device: one copy of each array the selection wrote for all tensors
        (indices, values), of the range the records cover, and one of any other device buffers.

        >>> import numpy as np, gpu_codec
        >>> p = gpu_codec.compress({"w": np.arange(100, dtype=np.float32)}, fraction=0.05)
        >>> blob = p.to_bytes()
        >>> blob[:8], blob[8], len(blob) == p.nbytes, len(p.to_bytes(version=1)) > len(blob)
        (b'GPUCODEC', 2, True, True)
        """
        return pack(
            self._records,
            pipeline=self.pipeline,
            metadata=self.metadata,
            layouts=wire_layouts(),
            version=version,
            cache=self._wire_cache,
            fingerprint=self.base_fingerprint,
        )

    @classmethod
    @holds_collector
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> Payload:
        """Parse and validate a payload of either format version (hostile input is rejected with a
        PayloadError). Written again with :meth:`to_bytes` (a filter passing it on), it keeps the zstd frame its
        table was read with while the table is the same: a payload this library wrote gives back the bytes it was
        read from. The payload reads ``blob`` where it lies, without a copy: a buffer that can change (a
        ``bytearray``, a view of one) must not change while the payload is in use, or what it decodes and writes
        changes with it; ``bytes`` cannot."""
        header, records = unpack(blob, wire_layouts(), describe=False, columns=True)
        p = cls(records, header.get("pipeline", []), header.get("metadata", {}), backend="cpu")
        p.version = int(header["version"])
        p.base_fingerprint = header.get("base_fingerprint")
        frame = table_frame(blob)
        if frame is not None:  # (written again with the same table, the payload keeps its table's bytes)
            p._wire_cache["read table"] = frame
        return p

    def _laid_out(self, measure: Callable[..., int]) -> int:
        """A size of the wire layout (sharing the layout with :meth:`to_bytes` through the cache)."""
        return measure(
            self._records,
            self.pipeline,
            self.metadata,
            wire_layouts(),
            cache=self._wire_cache,
            fingerprint=self.base_fingerprint,
        )

    @property
    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes`, computed without copying anything off the device."""
        return self._laid_out(packed_size)

    @property
    def header_nbytes(self) -> int:
        """Bytes of :meth:`to_bytes` that are neither buffer data nor checksum: the prefix, the tensor table
        and the metadata (no device copy).

        >>> import numpy as np, gpu_codec
        >>> u = {f"layer{i}.weight": np.ones(1000, np.float32) * i for i in range(1, 11)}
        >>> gpu_codec.compress(u, fraction=0.01).header_nbytes / len(u) < 16
        True
        """
        return self._laid_out(header_size)

    @property
    def dense_nbytes(self) -> int:
        """Size of the dense update in its original dtypes."""
        shapes, logical = record_column(self._records, "shape"), record_column(self._records, "dtype")
        return sum(map(_storage_bytes, map(math.prod, shapes), logical))

    @property
    def ratio(self) -> float:
        """Dense size over compressed size."""
        return self.dense_nbytes / max(1, self.nbytes)

    @property
    def nnz(self) -> int:
        return sum(record_column(self._records, "nnz"))

    def __repr__(self) -> str:
        return (
            f"Payload({len(self._records)} tensors, {self.nnz} kept entries, {self.nbytes} bytes, "
            f"ratio {self.ratio:.1f}x, backend={self.backend!r})"
        )


def payload_records(payload: Payload) -> list[TensorRecord] | RecordTable:
    """A payload's records as it holds them: the list, or a :class:`~gpu_codec.format.common.RecordTable` of
    columns that reading :attr:`Payload.tensors` would turn into the list (the engine's readers take either)."""
    return payload._records


def _storage_bytes(numel: int, dtype: str) -> int:
    return numel * dtypes.storage_dtype(dtype).itemsize


__all__ = ["Payload", "as_mapping", "check_header_size", "check_json", "check_limits", "check_metadata"]
