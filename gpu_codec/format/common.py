"""What the wire format versions share: the tensor record, the dtype whitelists, the limits, the container's own
layout rules, strict JSON, the shape check and bounded zstd frames."""

from __future__ import annotations

import json
import math
import operator
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import zstandard

from ..constants import index_itemsizes
from ..dtypes import dtype_name, index_dtype
from ..errors import InvalidInputError, PayloadHeaderError, PayloadLayoutError, PayloadLimitError

MAGIC = b"GPUCODEC"
ALIGN = 8  # v1 buffer alignment
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
MAX_NDIM = 8
MAX_NAME = 1024
# the names of one payload, as read (UTF-8), take at most this many bytes: a v2 name coded against an earlier one
# copies up to 4 KiB of it for a few bytes of table, so without a bound a 5 KB payload declared 100,000 names of
# 4 KiB (a reader's peak of about 1 GB, with no dense output for max_output_bytes to count)
MAX_NAMES_BYTES = 4 * MAX_HEADER_BYTES
MAX_TENSOR_ELEMENTS = 1 << 40
MAX_WINDOW = 1 << 27  # the largest zstd window a reader accepts
MAX_INT_DIGITS = 40  # a header integer longer than this is junk (every bounded field fits in 20 digits)
# values (containers and scalars) of one JSON text a payload carries apart from v1's header (metadata, a stage's
# config): a v2 table is compressed, so without a bound 1.5 KB of payload declared 16 MiB of metadata `[{},{},...]`,
# 5.6 million objects a reader built (about 430 MiB, with no dense output for max_output_bytes to count)
MAX_JSON_VALUES = 1 << 18
# ... and their nesting of brackets and braces: metadata is at most 64 levels below its own object (a deeper text
# parsed near the interpreter's recursion limit, and the payload then could not be written or shown)
MAX_JSON_DEPTH = 65
# v3: an nvcomp tensor's raw bytes are cut into chunks of 2^16 to 2^24 bytes (nvCOMP's zstd takes at most 16 MiB
# per chunk), one zstd frame each
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 16, 24

TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64")
# Buffer dtype name -> NumPy storage dtype (bfloat16 travels as its uint16 bit pattern).
BUFFER_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}


class SharedFrame:
    """The data section of a v2 payload whose bytes stage ran over every tensor at once: one zstd frame (or the
    same bytes stored plainly) holding each tensor's inner buffers back to back. It is read a range at a time, at
    decode time (after the caller's limits on element counts), never while a payload is parsed and never whole:
    a compressed frame is checked by one pass over it on first use, then read through :class:`FrameStream`'s
    forward cursors; plain bytes are read in place. Threads may read one frame at once (a payload decoded by
    several): its stream is made once, under a lock, and reads through it take turns."""

    def __init__(self, data: memoryview, raw: int, compressed: bool):
        self._data, self._raw, self._compressed = data, raw, compressed
        self._stream: FrameStream | None = None
        self._made = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The frame's size on the wire."""
        return len(self._data)

    def wire(self) -> bytes:
        return bytes(self._data)

    def read(self, start: int, end: int, what: str = "payload") -> bytes | memoryview:
        """Bytes ``[start, end)`` of the content (a view of the payload where it is stored plainly)."""
        if not self._compressed:
            return self._data[start:end]
        stream = self._stream
        if stream is None:
            with self._made:
                if self._stream is None:
                    self._stream = FrameStream(self._data, self._raw, self._raw, f"{what}: shared zstd frame")
                stream = self._stream
        return stream.read(start, end)


@dataclass(frozen=True)
class FrameSlice:
    """One tensor's inner bytes inside a :class:`SharedFrame`: ``nbytes`` from ``offset``."""

    frame: SharedFrame
    offset: int
    nbytes: int

    def read(self, what: str = "payload") -> bytes:
        return bytes(self.frame.read(self.offset, self.offset + self.nbytes, what))

    def source(self, what: str = "payload") -> _SliceSource:
        """The slice as a source of byte ranges, read through the shared frame's cursors."""
        return _SliceSource(self, what)


class _SliceSource:
    def __init__(self, s: FrameSlice, what: str):
        self.s, self.what = s, what

    def read(self, start: int, end: int) -> bytes | memoryview:
        return self.s.frame.read(self.s.offset + start, self.s.offset + end, self.what)


class Segmented(Sequence):
    """Per-tensor ranges of a few shared 1-D arrays, one allocation each for every tensor of an update (a
    selection's output): item ``t`` is ``sources[which[t]][offsets[t]:offsets[t + 1]]``, sliced when it is read.
    ``which`` (one source index per tensor) defaults to source 0 for every tensor; ``offsets`` is a host sequence
    of ``len + 1`` ascending positions.

    >>> s = Segmented((np.arange(5), np.zeros(5)), [0, 4, 5], which=[0, 1])
    >>> len(s), s[0].tolist(), s[1].tolist(), s.range(1)[1:]
    (2, [0, 1, 2, 3], [0.0], (4, 5))
    """

    __slots__ = ("offsets", "sources", "which")

    def __init__(self, sources: tuple, offsets: Sequence[int], which: Sequence[int] | None = None):
        self.sources, self.offsets, self.which = tuple(sources), offsets, which

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def range(self, t: int) -> tuple[Any, int, int]:
        """(source array, start, stop) of tensor ``t``, without slicing."""
        src = self.sources[0 if self.which is None else self.which[t]]
        return src, self.offsets[t], self.offsets[t + 1]

    def __getitem__(self, t):  # type: ignore[override]
        if isinstance(t, slice):  # (a run of tensors: one slice of its source each)
            return [src[a:b] for src, a, b in map(self.range, range(*t.indices(len(self))))]
        if not -len(self) <= t < len(self):
            raise IndexError(t)
        src, a, b = self.range(t % len(self))
        return src[a:b]

    def __add__(self, other: Sequence) -> list:  # as the lists it stands for
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)


class Ranges(Segmented):
    """:class:`Segmented` ranges ``[starts[t], stops[t])`` of one shared 1-D array, not end to end: the buffers of
    the records a reader found back to back in one payload's data, one role each (``starts`` and ``stops``: host
    lists of ints).

    >>> r = Ranges(np.arange(8), [0, 5], [2, 8])
    >>> len(r), r[0].tolist(), r[1].tolist(), r.range(1)[1:], [x.tolist() for x in r[::-1]]
    (2, [0, 1], [5, 6, 7], (5, 8), [[5, 6, 7], [0, 1]])
    """

    __slots__ = ("starts", "stops")

    def __init__(self, source: Any, starts: list[int], stops: list[int]):
        super().__init__((source,), starts)
        self.starts, self.stops = starts, stops

    @property
    def source(self) -> Any:
        return self.sources[0]

    def __len__(self) -> int:
        return len(self.starts)

    def range(self, t: int) -> tuple[Any, int, int]:
        """(source array, start, stop) of tensor ``t``, without slicing."""
        return self.sources[0], self.starts[t], self.stops[t]


class SegmentPart(NamedTuple):
    """A buffer of a record as a range of a shared array (what :class:`SegmentBuffers` hands the writer): the
    writer copies each shared array off the device once and slices it there."""

    source: Any
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def dtype(self) -> Any:
        return self.source.dtype


class SegmentBuffers(Mapping):
    """A record's buffers (role -> 1-D array) as tensor ``t`` of :class:`Segmented` outputs (or :class:`Ranges`):
    reading a role slices it (once); :meth:`part` gives the range without slicing. Made per tensor by a selection
    whose outputs are one allocation per role, and by the v2 reader for plain ``coo`` records, whose buffers lie
    back to back in the payload's data, so that a payload of many tensors makes no per-tensor array until one is
    read.

    >>> b = SegmentBuffers({"indices": Segmented((np.arange(3, dtype=np.uint32),), [0, 1, 3])}, 1)
    >>> list(b), b["indices"].tolist(), b.part("indices").size
    (['indices'], [1, 2], 2)
    """

    __slots__ = ("_made", "_roles", "_t")

    def __init__(self, roles: dict[str, Any], t: int):
        self._roles, self._t, self._made = roles, t, None

    def part(self, role: str) -> SegmentPart:
        return SegmentPart(*self._roles[role].range(self._t))

    @property
    def roles(self) -> dict[str, Any]:
        """role -> the shared :class:`Segmented` (or :class:`Ranges`) this record's buffers are tensor ``t`` of."""
        return self._roles

    @property
    def t(self) -> int:
        return self._t

    def __getitem__(self, role: str) -> Any:
        made = self._made
        if made is None:
            made = self._made = {}
        a = made.get(role)
        if a is None:
            a = made[role] = self._roles[role][self._t]
        return a

    def __iter__(self) -> Iterator[str]:
        return iter(self._roles)

    def __len__(self) -> int:
        return len(self._roles)


@dataclass
class TensorRecord:
    """One tensor of a payload: what it was, how it is encoded, and its buffers (role -> 1-D array).

    Buffers are NumPy arrays after :func:`unpack`, and backend arrays (possibly on the GPU) before :func:`pack`,
    held in a dict or, from a selection whose outputs are shared arrays, in :class:`SegmentBuffers`.
    ``codec`` holds per-tensor codec parameters (JSON values) that the encoding's layout rule may use.
    ``frame`` is set instead of buffers on a ``zstd`` record read from a v2 payload whose bytes stage ran over
    all tensors as one frame: the record's share of that frame, decompressed when the record is decoded.
    ``chunk`` is set on an ``nvcomp`` record whose ``compressed`` buffer is a sequence of zstd frames of ``chunk``
    raw bytes each, the last one shorter (wire format v3); None: one frame (versions 1 and 2).
    ``raw`` is ``(compressed, content)``, set by a bytes stage that kept the bytes it compressed into the
    ``compressed`` buffer (not written: the writer reads them instead of decompressing the buffer, which it does
    where ``raw`` is None or names another array than the record's ``compressed`` buffer).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    nnz: int
    buffers: Mapping[str, Any]
    codec: dict[str, Any] = field(default_factory=dict)
    buffer_dtypes: dict[str, str] = field(default_factory=dict)
    frame: FrameSlice | None = None
    chunk: int | None = None
    raw: tuple[Any, bytes] | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class RecordTable(Sequence):
    """Plain ``coo`` records as columns, with no object a record until one is read: record ``t`` is
    ``TensorRecord(names[t], dtypes[t], shapes[t], "coo", nnz[t], SegmentBuffers(roles, t))``, its buffers range
    ``t`` of each role's shared array (a selection's :class:`Segmented` outputs, or the v2 reader's
    :class:`Ranges` of a payload's data). What a compress with no stage after top-k makes and what the v2 reader
    gives for a table it has read before; the writer, the reader and the decoder read its columns, and reading a
    record makes them all (:meth:`records`, once). :attr:`gpu_codec.Payload.tensors` is always the list.

    >>> roles = {"indices": Segmented((np.array([1, 0, 2], np.uint32),), [0, 1, 3]),
    ...          "values": Segmented((np.array([.5, 1., 2.], np.float32),), [0, 1, 3])}
    >>> t = RecordTable(["a", "b"], ["float32", "float32"], [(4,), (2, 2)], [1, 2], roles)
    >>> len(t), t.numels(), t[1].name, t[1].buffers["indices"].tolist(), t.records() is t.records()
    (2, [4, 4], 'b', [0, 2], True)
    """

    __slots__ = ("_made", "dtypes", "names", "nnz", "roles", "shapes")
    encoding = "coo"

    def __init__(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple], nnz: list[int], roles):
        self.names, self.dtypes, self.shapes, self.roles = names, dtypes, shapes, roles
        self.nnz = nnz if type(nnz) is list else list(nnz)  # (compared with lists of counts)
        self._made: list[TensorRecord] | None = None

    def records(self) -> list[TensorRecord]:
        """Every record, made on the first call (the same list after it)."""
        if self._made is None:
            bufs = map(SegmentBuffers, repeat(self.roles), range(len(self.names)))
            self._made = list(map(TensorRecord, self.names, self.dtypes, self.shapes, repeat("coo"), self.nnz, bufs))
        return self._made

    def numels(self) -> list[int]:
        """Each record's element count."""
        return list(map(math.prod, self.shapes))

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):  # type: ignore[override]
        return self.records()[i]

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self.records())


def record_columns(records: Sequence[TensorRecord]) -> RecordTable | None:
    """``records`` where they are a :class:`RecordTable` (its columns to read), else None (a list of records)."""
    return records if type(records) is RecordTable else None


_COLUMN_OF = {"name": "names", "dtype": "dtypes", "shape": "shapes", "nnz": "nnz"}


def record_column(records: Sequence[TensorRecord], field: str, first: int = 0, end: int | None = None) -> list:
    """Field ``field`` (``name``, ``dtype``, ``shape`` or ``nnz``) of records ``[first, end)``: a
    :class:`RecordTable`'s column (no record made), or one C pass over a list's records.

    >>> recs = [TensorRecord("a", "float32", (4,), "coo", 1, {}), TensorRecord("b", "float16", (2,), "coo", 2, {})]
    >>> record_column(recs, "nnz"), record_column(recs, "name", 1)
    ([1, 2], ['b'])
    """
    if type(records) is RecordTable:
        return list(getattr(records, _COLUMN_OF[field])[first:end])
    return list(map(operator.attrgetter(field), records[first:end]))


CODED = ("sparse", "dense_q")  # the encodings of a pipeline with a value or an index stage
# a bytes stage's record's codec dict: in a shared frame, and holding its own frame (its compressed size too)
WRAPPED_SHARED_KEYS = frozenset({"inner", "ic", "raw"})
WRAPPED_KEYS = WRAPPED_SHARED_KEYS | {"zbytes"}

# Layout rules: encoding -> f(record) -> ordered {role: (allowed buffer dtypes, required element count)}. A rule
# may also have a ``many`` attribute: ``many(cols)`` (:class:`Columns`) is the rule of every record of ``cols`` at
# once, ``{role: (allowed buffer dtypes, element counts: an int64 array, one a record)}``, or None where any record
# might fail the rule or the records' roles differ (the caller then applies the rule record by record, which raises
# what it raises).
LayoutRule = Callable[[TensorRecord], dict[str, tuple[tuple[str, ...], int]]]


class Columns(NamedTuple):
    """Records as columns, what a layout rule's ``many`` reads: each record's dtype name, element count and nnz
    (int64 arrays) and codec dict.

    >>> cols = Columns(["float32", "float64"], np.array([10, 4]), np.array([2, 4]), [{}, {}])
    >>> len(cols.dtypes), cols.nnz.tolist()
    (2, [2, 4])
    """

    dtypes: list[str]
    numels: np.ndarray
    nnz: np.ndarray
    codecs: list[dict]
    chunks: list | None = None  # each record's ``chunk`` (None: every one None)

    @classmethod
    def of(cls, records: Sequence[TensorRecord], codecs: list | None = None) -> Columns:
        """The columns of ``records`` (with ``codecs`` for their codec dicts: a wrapper's inner ones, say)."""
        numels = np.array([r.numel for r in records], np.int64)
        nnz = np.array([r.nnz for r in records], np.int64)
        return cls([r.dtype for r in records], numels, nnz, [r.codec for r in records] if codecs is None else codecs)


def _coo_layout(rec: TensorRecord) -> dict[str, tuple[tuple[str, ...], int]]:
    vd = ("float64",) if rec.dtype == "float64" else ("float32",)
    return {"indices": (("uint32", "uint64"), rec.nnz), "values": (vd, rec.nnz)}


def _dense_layout(rec: TensorRecord) -> dict[str, tuple[tuple[str, ...], int]]:
    if rec.nnz != rec.numel:  # every element is stored: Payload.nnz would misreport anything else
        raise PayloadLayoutError(
            f"tensor {rec.name!r}: a dense tensor must have nnz = numel = {rec.numel}, got {rec.nnz}"
        )
    vd = ("float64",) if rec.dtype == "float64" else ("float32",)
    return {"values": (vd, rec.numel)}


# The container's own encodings. The codec encodings (sparse, dense_q, zstd, nvcomp) are declared by the codecs
# (:func:`gpu_codec.codecs.wire_layouts`) and handed to :func:`unpack` by the caller: this package keeps no registry.
BASE_LAYOUTS: dict[str, LayoutRule] = {"coo": _coo_layout, "dense": _dense_layout}


def canonical_dtype(allowed: tuple[str, ...], rec: TensorRecord) -> str:
    """The one dtype a buffer has where its dtype is not stored (index width follows the element count)."""
    if len(allowed) == 1:
        return allowed[0]
    return dtype_name(index_dtype(rec.numel))


def same_keys(dicts: list, keys: set[str]) -> bool:
    """Whether ``dicts`` is a non-empty list of dicts whose keys are each exactly ``keys`` (a few C calls over the
    list, for the checks of a whole table at once).

    >>> same_keys([{"a": 1}, {"a": 2}], {"a"}), same_keys([{"a": 1}, {"a": 2, "b": 3}], {"a"}), same_keys([], set())
    (True, False, False)
    """
    return (
        bool(dicts) and set(map(type, dicts)) == {dict} and all(map(operator.eq, repeat(keys), map(dict.keys, dicts)))
    )


def same_str(values: list, want: Any) -> bool:
    """Whether every item of ``values`` is the str ``want``.

    >>> same_str(["f16", "f16"], "f16"), same_str(["f16", "bf16"], "f16"), same_str(["f16"], 1)
    (True, False, False)
    """
    return type(want) is str and set(map(type, values)) == {str} and values.count(want) == len(values)


def canonical_dtypes(allowed: tuple[str, ...], numels: list[int]) -> list[str]:
    """:func:`canonical_dtype` of a buffer of each of many records (their element counts ``numels``).

    >>> canonical_dtypes(("uint32", "uint64"), [10, 1 << 33]), canonical_dtypes(("float16",), [10, 1 << 33])
    (['uint32', 'uint64'], ['float16', 'float16'])
    """
    if len(allowed) == 1:
        return [allowed[0]] * len(numels)
    return [dtype_name(index_dtype(m)) for m in numels]


def laid_out(records: list, bufs: list, layout: dict, numels: np.ndarray) -> list[list] | None:
    """The check of each record's buffers (``bufs``, a dict each) against its layout (a rule's ``many``): each
    role's buffers, a record each, in the layout's order; None where any record's are not its layout's (its roles,
    in order, each of the count and dtype the layout says: a stored dtype name, or the array's own).

    >>> r = TensorRecord("a", "float32", (4,), "coo", 2, {})
    >>> lay = {"indices": (("uint32", "uint64"), np.array([2])), "values": (("float32",), np.array([2]))}
    >>> [len(c) for c in laid_out([r], [{"indices": np.zeros(2, np.uint32), "values": np.ones(2, np.float32)}],
    ...                           lay, np.array([4]))]
    [1, 1]
    >>> laid_out([r], [{"values": np.ones(2, np.float32), "indices": np.zeros(2, np.uint32)}], lay, np.array([4]))
    """
    roles = list(layout)
    if set(map(type, bufs)) != {dict} or not all(map(operator.eq, repeat(roles), map(list, bufs))):
        return None
    columns = []
    for role, (allowed, counts) in layout.items():
        arrays = [b[role] for b in bufs]
        dts = canonical_dtypes(allowed, numels.tolist())
        if list(map(buffer_dtype_name, arrays, records, repeat(role))) != dts:
            return None
        if [int(a.size) for a in arrays] != counts.tolist():
            return None
        if [a.dtype.itemsize for a in arrays] != [BUFFER_DTYPES[d].itemsize for d in dts]:
            return None
        columns.append(arrays)
    return columns


def role_nbytes(layout: dict[str, tuple[tuple[str, ...], np.ndarray]], numels: np.ndarray) -> list[np.ndarray]:
    """Each role's bytes, a record each, under the layout a rule's ``many`` gave (each buffer of its
    :func:`canonical_dtype`): int64 arrays, in the layout's order.

    >>> [x.tolist() for x in role_nbytes({"indices": (("uint32", "uint64"), np.array([3, 3])),
    ...                                   "values": (("float16",), np.array([3, 3]))}, np.array([10, 1 << 33]))]
    [[12, 24], [6, 6]]
    """
    return [
        counts * (BUFFER_DTYPES[allowed[0]].itemsize if len(allowed) == 1 else index_itemsizes(numels))
        for allowed, counts in layout.values()
    ]  # (an index's width follows the element count)


def layout_nbytes(layout: dict[str, tuple[tuple[str, ...], np.ndarray]], numels: np.ndarray) -> np.ndarray:
    """Each record's bytes under the layout a rule's ``many`` gave (:func:`role_nbytes`, summed): an int64 array.

    >>> layout_nbytes({"indices": (("uint32", "uint64"), np.array([3, 3])), "values": (("float16",), np.array([3, 3]))},
    ...               np.array([10, 1 << 33])).tolist()
    [18, 30]
    """
    return sum(role_nbytes(layout, numels), np.zeros(len(numels), np.int64))


def buffer_dtype_name(a: Any, rec: TensorRecord, role: str) -> str:
    if role in rec.buffer_dtypes:
        return rec.buffer_dtypes[role]
    return dtype_name(a.dtype)


def req(cond: bool, exc: type, msg: str) -> None:
    if not cond:
        raise exc(msg)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _reject_constant(name: str) -> Any:
    raise PayloadHeaderError(f"header JSON holds the non-standard constant {name}")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise PayloadHeaderError(f"header JSON holds an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise PayloadHeaderError(f"header JSON holds the number {text[:40]}, which is not a finite float")
    return x


JSON_BLOCK = 1 << 18  # bytes of JSON text json_shape reads at a time (its temporaries: about 10 bytes a byte)
_QUOTE, _OPEN, _CLOSE, _COMMA = 34, (91, 123), (93, 125), 44  # '"', '[' '{', ']' '}', ','


def json_shape(raw: bytes | str) -> tuple[int, int]:
    """(an upper bound on the values of the JSON text ``raw``, its deepest nesting of brackets and braces), counted
    without parsing it, a block of bytes at a time with a few NumPy passes each: no object a value, whatever the
    text. Values: one plus its commas and opening brackets and braces outside strings (a container holds at most
    one element more than the commas between its elements; an empty one counts twice). The escapes ``\\\\`` and
    ``\\"`` are dropped first, so every quote left opens or closes a string (an unclosed one runs to the end);
    UTF-8 puts no ASCII byte inside a character.

    >>> json_shape('{"a": [1, 2, {}], "b,[{": "x\\"]"}'), json_shape("7"), json_shape('[[[]], "[[[["]')
    ((7, 3), (1, 0), (5, 3))
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    values, inside, depth, deepest = 1, 0, 0, 0
    for s in range(0, text.size, JSON_BLOCK):
        x = text[s : s + JSON_BLOCK]
        quotes = np.cumsum(x == _QUOTE, dtype=np.uint8)  # (mod 256: its parity is what tells inside from out)
        out = ((quotes + np.uint8(inside)) & 1) == 0
        opens = ((x == _OPEN[0]) | (x == _OPEN[1])) & out
        values += int(np.count_nonzero(opens)) + int(np.count_nonzero((x == _COMMA) & out))
        step = opens.astype(np.int32) - (((x == _CLOSE[0]) | (x == _CLOSE[1])) & out)
        if step.size:
            level = np.cumsum(step, out=step)
            deepest = max(deepest, depth + int(level.max()))
            depth += int(level[-1])
            inside = (inside + int(quotes[-1])) & 1
    return values, deepest


def loads_json(raw: bytes, what: str = "header", max_values: int | None = None, max_depth: int | None = None) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity constants, no number that overflows a float, no integer of more
    than 40 digits; with ``max_values`` / ``max_depth``, no more values than that and no deeper nesting of
    brackets and braces (:func:`json_shape`, checked before anything is parsed). Anything else is a
    :class:`~gpu_codec.errors.PayloadHeaderError` (:class:`~gpu_codec.errors.PayloadLimitError` for a count or a
    nesting past its bound)."""
    try:
        if max_values is not None or max_depth is not None:
            values, deepest = json_shape(raw)
            if max_values is not None and values > max_values:
                raise PayloadLimitError(
                    f"{what} counts more than {max_values} JSON values (one plus its commas, brackets and braces "
                    "outside strings)"
                )
            if max_depth is not None and deepest > max_depth:
                raise PayloadLimitError(f"{what} nests brackets and braces {deepest} deep, more than {max_depth}")
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int, parse_float=_parse_float)
    except (PayloadHeaderError, PayloadLimitError):
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise PayloadHeaderError(f"{what} is not valid JSON: {e}") from None


def as_uint8(buf: Any) -> np.ndarray:
    """A host buffer's bytes as a flat uint8 array, without a copy where it is contiguous.

    >>> as_uint8(np.ones(2, np.float16)).tolist(), as_uint8(b"ab").tolist()
    ([0, 60, 0, 60], [97, 98])
    """
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, np.uint8)
    return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)


def check_name(name: Any) -> None:
    """A tensor name a reader takes: a non-empty string (its length and encoding: the caller's limits)."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"tensor names must be non-empty strings, got {name!r}")


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def check_shape(shape: Any, where: str) -> int:
    """Validate a shape (at most 8 non-negative integers, the element count and every dimension within
    :data:`MAX_TENSOR_ELEMENTS`, a zero dimension included) and return its element count."""
    if not (isinstance(shape, (list, tuple)) and len(shape) <= MAX_NDIM and all(is_int(s) and s >= 0 for s in shape)):
        raise PayloadLimitError(
            f"{where}: shape must be a list of at most {MAX_NDIM} non-negative integers, got {shape!r}"
        )
    bound = 1  # the product of the non-zero dimensions, checked on every prefix: a zero cannot hide a huge one
    for s in shape:
        bound *= max(s, 1)
        if bound > MAX_TENSOR_ELEMENTS:  # (each message built only where it is raised: this runs per tensor)
            raise PayloadLimitError(
                f"{where}: shape {list(shape)} exceeds the limit of {MAX_TENSOR_ELEMENTS} elements "
                "(zero dimensions aside)"
            )
    return math.prod(shape)


def zstd_frame(raw: bytes, level: int) -> bytes:
    """One zstd frame of ``raw`` that declares its content size, without a checksum (what every writer here
    makes: the payload's CRC covers it)."""
    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True).compress(raw)


def compress_bound(raw: Any) -> Any:
    """An upper bound on a zstd frame of ``raw`` bytes (ZSTD_compressBound plus the frame header); of each of an
    int64 array of raw sizes.

    >>> compress_bound(0), compress_bound(1 << 20), compress_bound(np.array([0, 1 << 20])).tolist()
    (96, 1052704, [96, 1052704])
    """
    small = np.maximum((128 << 10) - raw, 0) if isinstance(raw, np.ndarray) else max(0, (128 << 10) - raw)
    return raw + (raw >> 8) + (small >> 11) + 32


def frame_count(raw: int, chunk: int) -> int:
    """How many zstd frames hold ``raw`` bytes cut into chunks of ``chunk`` bytes: one per chunk, and one (empty)
    frame for no bytes at all.

    >>> frame_count(0, 65536), frame_count(65536, 65536), frame_count(65537, 65536)
    (1, 1, 2)
    """
    return max(1, -(-raw // chunk))


def frame_raw_size(raw: int, chunk: int, i: int) -> int:
    """The content size of frame ``i`` of :func:`frame_count`: ``chunk``, or what is left for the last frame."""
    return min(chunk, raw - i * chunk)


def frames_bound(raw: int, chunk: int) -> int:
    """An upper bound on the frames of ``raw`` bytes in chunks of ``chunk`` bytes: each frame's
    :func:`compress_bound`.

    >>> frames_bound(100, 65536) == compress_bound(100), frames_bound(65537, 65536)
    (True, 65952)
    """
    n = frame_count(raw, chunk)
    return (n - 1) * compress_bound(chunk) + compress_bound(frame_raw_size(raw, chunk, n - 1))


def check_chunk(chunk: Any, what: str) -> int:
    """A chunk size: a power of two from 2^MIN_CHUNK_LOG2 to 2^MAX_CHUNK_LOG2 (PayloadHeaderError otherwise)."""
    ok = is_int(chunk) and chunk > 0 and chunk & (chunk - 1) == 0
    if not ok or not MIN_CHUNK_LOG2 <= chunk.bit_length() - 1 <= MAX_CHUNK_LOG2:
        raise PayloadHeaderError(
            f"{what}: chunk size {chunk!r} is not a power of two from 2^{MIN_CHUNK_LOG2} to 2^{MAX_CHUNK_LOG2}"
        )
    return chunk


def check_frame(data: bytes | memoryview, raw: int, what: str) -> int:
    """Check a zstd frame's header without decompressing: it declares exactly ``raw`` bytes of content (or none)
    and a window within :data:`MAX_WINDOW`. Returns the declared size (``zstandard.CONTENTSIZE_UNKNOWN`` if
    none)."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise PayloadLayoutError(f"{what}: compressed buffer is not a zstd frame ({e})") from None
    cs = params.content_size
    if cs != zstandard.CONTENTSIZE_UNKNOWN and cs != raw:
        exc = PayloadLimitError if cs > raw else PayloadLayoutError
        raise exc(f"{what}: zstd frame declares {cs} bytes, {raw} expected")
    if params.window_size > MAX_WINDOW:
        raise WindowLimitError(f"{what}: zstd window of {params.window_size} bytes exceeds {MAX_WINDOW}")
    return cs


class WindowLimitError(PayloadLimitError):
    """A zstd frame's window past :data:`MAX_WINDOW` (a :class:`~gpu_codec.errors.PayloadLimitError` wherever the
    frame lies; told apart where another frame error is reported as the header's)."""


def bounded_decompress(data: bytes, raw: int, what: str) -> bytes:
    """Decompress one zstd frame of exactly ``raw`` bytes, never allocating more than that. ``data`` must be
    exactly one complete frame: a truncated frame, junk or a second frame after it is a PayloadLayoutError, for
    an empty frame too (whose decompression alone would stop at its first block)."""
    check_frame(data, raw, what)
    check_one_frame(data, what)
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompress(
            data, max_output_size=max(raw, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise PayloadLayoutError(f"{what}: zstd frame does not decompress to {raw} bytes ({e})") from None
    if len(out) != raw:
        raise PayloadLayoutError(f"{what}: zstd frame decompressed to {len(out)} bytes, expected {raw}")
    return out


_ZSTD_MAGIC = 0xFD2FB528


def zstd_frame_size(data: Any, what: str) -> int:
    """The exact length of the zstd frame at the start of ``data``, from its header and block headers (RFC 8878
    section 3.1.1), without decompressing anything. A reserved bit, a reserved block type or a truncated frame is
    a PayloadLayoutError (a truncated frame's has ``needs``: the bytes the headers read so far show the frame
    needs at least)."""
    mv = memoryview(data).cast("B")
    n = len(mv)

    def need(end: int) -> None:
        if end > n:
            e = PayloadLayoutError(f"{what}: zstd frame is truncated ({n} bytes; at least {end} needed)")
            e.needs = end
            raise e

    need(5)
    if int.from_bytes(mv[0:4], "little") != _ZSTD_MAGIC:
        raise PayloadLayoutError(f"{what}: compressed buffer is not a zstd frame")
    fhd = mv[4]
    if fhd & 0x08:
        raise PayloadLayoutError(f"{what}: zstd frame header sets a reserved bit")
    single = bool(fhd & 0x20)
    fcs = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
    while True:
        need(pos + 3)
        bh = int.from_bytes(mv[pos : pos + 3], "little")
        btype, size = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise PayloadLayoutError(f"{what}: zstd block of reserved type")
        pos += 3 + (1 if btype == 1 else size)
        need(pos)
        if bh & 1:
            break
    end = pos + (4 if fhd & 0x04 else 0)  # the content checksum
    need(end)
    return end


def check_one_frame(data: Any, what: str) -> None:
    """``data`` is exactly one zstd frame, by its frame and block headers: nothing missing, nothing after it."""
    n = len(memoryview(data).cast("B"))
    size = zstd_frame_size(data, what)
    if size != n:
        raise PayloadLayoutError(f"{what}: {n - size} bytes after the zstd frame")


def split_frames(data: Any, raw: int, chunk: int, what: str) -> list[tuple[int, int]]:
    """The byte range of each zstd frame of a chunked ``nvcomp`` buffer (wire format v3), from the frame and block
    headers alone: exactly :func:`frame_count` frames back to back, filling ``data`` with nothing after the last,
    frame ``i`` declaring a content size of exactly :func:`frame_raw_size` bytes (the chunk size; the last frame,
    what is left). Nothing is decompressed; a frame that breaks a rule is a PayloadLayoutError (a
    PayloadLimitError if it declares more).
    """
    mv = memoryview(data).cast("B")
    n, count = len(mv), frame_count(raw, chunk)
    out, pos = [], 0
    for i in range(count):
        if pos == n:
            raise PayloadLayoutError(
                f"{what}: {i} zstd frames, where {raw} raw bytes in chunks of {chunk} make {count}"
            )
        frame, at = mv[pos:], f"{what}, frame {i}"
        if check_frame(frame, frame_raw_size(raw, chunk, i), at) == zstandard.CONTENTSIZE_UNKNOWN:
            raise PayloadLayoutError(f"{at}: the zstd frame does not declare its content size")
        end = pos + zstd_frame_size(frame, at)
        out.append((pos, end))
        pos = end
    if pos != n:
        raise PayloadLayoutError(f"{what}: {n - pos} bytes after its {count} zstd frames")
    return out


def decompress_frames(data: Any, raw: int, chunk: int, what: str) -> bytearray:
    """The ``raw`` bytes of a chunked ``nvcomp`` buffer (checked by :func:`split_frames`, each frame by
    :func:`bounded_decompress`), allocating ``raw`` bytes and one frame's content."""
    mv = memoryview(data).cast("B")
    out, off = bytearray(raw), 0
    for i, (a, b) in enumerate(split_frames(mv, raw, chunk, what)):
        part = bounded_decompress(mv[a:b], frame_raw_size(raw, chunk, i), f"{what}, frame {i}")
        out[off : off + len(part)] = part
        off += len(part)
    return out


class _Cursor:
    """One decompression context reading a frame's content front to back."""

    def __init__(self, data: Any, what: str, raw: int):
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        self.reader = dctx.stream_reader(data, read_size=1 << 16, read_across_frames=False)
        self.pos, self.what, self.raw = 0, what, raw

    def take(self, n: int) -> bytes:
        parts, got = [], 0
        try:
            while got < n:
                b = self.reader.read(min(FrameStream.PIECE, n - got))
                if not b:
                    break
                parts.append(b)
                got += len(b)
        except zstandard.ZstdError as e:
            raise self._error(str(e)) from None
        if got != n:
            raise self._error(f"it ended {n - got} bytes early")
        self.pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def at_end(self) -> bool:
        """Whether the frame holds nothing more (its end, where zstd checks the content checksum it may have)."""
        try:
            return not self.reader.read(1)
        except zstandard.ZstdError as e:
            raise self._error(str(e)) from None

    def _error(self, why: str) -> PayloadLayoutError:
        """The error of a frame that does not decompress to its declared size, and why."""
        return PayloadLayoutError(f"{self.what}: zstd frame does not decompress to {self.raw} bytes ({why})")

    def skip(self, n: int) -> None:
        while n > 0:
            k = min(FrameStream.SKIP, n)
            self.take(k)
            n -= k


class FrameStream:
    """The content of one zstd frame, read a range at a time and never held whole (bounded like
    :func:`bounded_decompress`: the frame must declare exactly ``raw`` bytes, fill ``data`` with nothing after it,
    use a window of at most MAX_WINDOW and decompress to exactly ``raw`` bytes).

    Construction reads the frame once, front to back, to check it and to keep its bytes from ``keep_from`` on
    (``tail``). :meth:`read` then decompresses up to the range asked for with one of a few forward cursors (the
    one furthest along that has not passed the range), so buffers read in step, such as a sparse tensor's
    indices and values, each cost one pass over the frame in all. The cursors are shared state (a zstd reader is
    not safe to share between threads): reads from several threads take turns.
    """

    PIECE = 1 << 20  # the most one read asks zstd for at once
    SKIP = 1 << 16  # what is decompressed and dropped at once, passing over bytes not asked for
    CURSORS = 4

    def __init__(self, data: Any, raw: int, keep_from: int, what: str):
        self.data, self.raw, self.what = data, raw, what
        check_frame(data, raw, what)
        check_one_frame(data, what)
        c = _Cursor(data, what, raw)
        c.skip(keep_from)
        self.tail = c.take(raw - keep_from)
        if not c.at_end():
            raise c._error("it holds more")
        self._cursors: list[_Cursor] = []
        self._turn = threading.Lock()

    def close(self) -> None:
        """Drop the decompression contexts (a later :meth:`read` opens new ones)."""
        with self._turn:
            self._cursors = []

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the content."""
        with self._turn:
            behind = [c for c in self._cursors if c.pos <= start]
            if behind:
                c = max(behind, key=lambda c: c.pos)
            else:
                if len(self._cursors) >= self.CURSORS:
                    self._cursors.remove(min(self._cursors, key=lambda c: c.pos))
                c = _Cursor(self.data, self.what, self.raw)
                self._cursors.append(c)
            try:
                c.skip(start - c.pos)
                return c.take(end - start)
            except BaseException:
                self._cursors.remove(c)  # (its place in the frame is unknown: the next read opens another)
                raise


class ChunkedFrameStream:
    """The content of a chunked ``nvcomp`` buffer (wire format v3), read a range at a time like a
    :class:`FrameStream`: one FrameStream per frame, each checked once when this is built (``tail`` collects their
    bytes from ``keep_from`` on); the frames last read keep their decompression contexts, the others drop them."""

    OPEN = 2

    def __init__(self, data: Any, raw: int, chunk: int, keep_from: int, what: str):
        mv = memoryview(data).cast("B")
        self.chunk = chunk
        self.frames: list[FrameStream] = []
        tails = []
        for i, (a, b) in enumerate(split_frames(mv, raw, chunk, what)):
            size = frame_raw_size(raw, chunk, i)
            keep = min(size, max(0, keep_from - i * chunk))
            s = FrameStream(mv[a:b], size, keep, f"{what}, frame {i}")
            tails.append(s.tail)
            self.frames.append(s)
        self.tail = tails[0] if len(tails) == 1 else b"".join(tails)
        self._open: list[FrameStream] = []
        self._turn = threading.Lock()

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the content (reads from several threads take turns)."""
        with self._turn:
            return self._read(start, end)

    def _read(self, start: int, end: int) -> bytes:
        parts = []
        while start < end:
            i = start // self.chunk
            s = self.frames[i]
            if s in self._open:
                self._open.remove(s)
            self._open.append(s)
            if len(self._open) > self.OPEN:
                self._open.pop(0).close()
            stop = min(end, (i + 1) * self.chunk)
            parts.append(s.read(start - i * self.chunk, stop - i * self.chunk))
            start = stop
        return parts[0] if len(parts) == 1 else b"".join(parts)


def open_stream(data: Any, raw: int, chunk: int | None, keep_from: int, what: str) -> FrameStream | ChunkedFrameStream:
    """A :class:`FrameStream` over one frame (``chunk`` None) or a :class:`ChunkedFrameStream`."""
    if chunk is None:
        return FrameStream(data, raw, keep_from, what)
    return ChunkedFrameStream(data, raw, chunk, keep_from, what)


class StreamedBuffer:
    """A 1-D buffer of ``count`` items of ``dtype`` at byte ``offset`` of a source of byte ranges (a
    :class:`FrameStream`, a :class:`ChunkedFrameStream` or a :class:`FrameSlice`'s source): slicing it
    decompresses just that range (a NumPy array, read only)."""

    def __init__(self, stream: Any, offset: int, dtype: np.dtype, count: int):
        self.stream, self.offset, self.dtype, self.count = stream, offset, np.dtype(dtype), count

    @property
    def size(self) -> int:
        return self.count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b, step = s.indices(self.count)
        if step != 1:
            raise IndexError("a streamed buffer is read in contiguous ranges")
        b = max(a, b)
        it = self.dtype.itemsize
        return np.frombuffer(self.stream.read(self.offset + a * it, self.offset + b * it), self.dtype)
