"""Wire formats v2 and v3: a compact binary tensor table instead of a JSON header (see docs/FORMAT.md, "Version 2"
and "Version 3"). Version 3 is version 2 with the ``nvcomp`` tensors cut into chunks of at most 16 MiB, one zstd
frame each (nvCOMP compresses at most 16 MiB per chunk); the writer uses it only for a payload that needs it.

Names are front-coded against the previous name, shapes and counts are varints, dtypes, encodings, value and
index forms are one-byte codes, the pipeline is stored once (built-in stages as codes, others as JSON), the
encoding of most tensors once (a tensor that differs carries its own), per-tensor codec fields as varints or
raw float32 bits, buffer offsets are implied by the layout, and the bytes stage may run over every tensor as
one frame. The table itself is zstd-compressed where that is smaller.

The codecs' configs and forms are stored as the codecs declare them (:mod:`gpu_codec.format.schema`); the
declarations come with the layout rules (:func:`gpu_codec.codecs.wire_layouts`):

>>> import numpy as np
>>> from gpu_codec.codecs import wire_layouts
>>> from gpu_codec.format import TensorRecord, pack, unpack
>>> rec = TensorRecord("w", "float32", (4,), "coo", 1,
...                    {"indices": np.array([2], np.uint32), "values": np.array([0.5], np.float32)})
>>> topk = {"id": "topk", "fraction": 0.25, "scope": "global", "score": "magnitude"}
>>> blob = pack([rec], pipeline=[topk], layouts=wire_layouts())
>>> len(blob), blob[8], header_size([rec], [topk], None, wire_layouts())
(40, 2, 28)
>>> header, (back,) = unpack(blob, wire_layouts())
>>> header["version"], header["pipeline"][0]["fraction"], back.buffers["indices"].tolist()
(2, 0.25, [2])
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
import struct
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from itertools import repeat
from operator import attrgetter, itemgetter, sub
from typing import Any, NamedTuple

import numpy as np
import zstandard

from ..constants import U32_INDEX_NUMEL
from ..dtypes import dtype_name
from ..errors import (
    InvalidInputError,
    PayloadChecksumError,
    PayloadError,
    PayloadHeaderError,
    PayloadLayoutError,
    PayloadLimitError,
    PayloadTruncatedError,
)
from .common import (
    BASE_LAYOUTS,
    BUFFER_DTYPES,
    CODED,
    MAGIC,
    MAX_CHUNK_LOG2,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    MAX_NAME,
    MAX_NAMES_BYTES,
    MAX_NDIM,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSORS,
    MIN_CHUNK_LOG2,
    WRAPPED_KEYS,
    Columns,
    FrameSlice,
    LayoutRule,
    Ranges,
    RecordTable,
    SegmentBuffers,
    Segmented,
    SegmentPart,
    SharedFrame,
    TensorRecord,
    WindowLimitError,
    as_uint8,
    bounded_decompress,
    buffer_dtype_name,
    canonical_dtype,
    canonical_dtypes,
    check_frame,
    check_one_frame,
    check_shape,
    compress_bound,
    dumps_json,
    frames_bound,
    is_int,
    json_shape,
    laid_out,
    layout_nbytes,
    loads_json,
    record_column,
    record_columns,
    req,
    same_keys,
    same_str,
    split_frames,
    zstd_frame,
    zstd_frame_size,
)
from .fingerprint import check_hex
from .schema import FormSpec, Unrepresentable, WireTables, form_bytes, read_form, tables_of, uvarint, uvarints

VERSION = 2
CHUNKED = 3  # the version whose nvcomp tensors are a zstd frame per chunk
_PREFIX = struct.Struct("<8sIB")  # magic, version, flags
_CRC = struct.Struct("<I")
MIN_SIZE = _PREFIX.size + 1 + _CRC.size

# flags (the prefix's last byte)
FLAG_METADATA = 0x01
FLAG_TABLE_ZSTD = 0x02
FLAG_FINGERPRINT = 0x10  # the table holds the fingerprint of the base the payload was made against
FLAG_RESERVED = 0xE0
FINGERPRINT_BYTES = 8
DATA_SHIFT = 2  # bits 2-3: the data mode
DATA_RECORDS, DATA_ZSTD, DATA_PLAIN = 0, 1, 2
DATA_MODES = ("records", "zstd", "plain")
SHARED_FRAME_MAX = 1 << 20  # the largest raw size the writer puts in one shared frame (or stores plainly)

# one-byte codes, fixed forever (a new value is appended, never reordered)
DTYPE_CODES = ("float32", "float16", "bfloat16", "float64")
ENCODING_CODES = ("coo", "dense", "sparse", "dense_q", "zstd", "nvcomp")
INNER_ENCODINGS = ENCODING_CODES[:4]
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPE_CODES)}
_TENSOR_DTYPE = {"float64": "float64"}  # the dtype of a coo/dense record's values (float32 for every other dtype)
WRAPPERS = ("zstd", "nvcomp")
STAGE_JSON = 0  # a pipeline stage stored as JSON (every code above it is a codec's own: gpu_codec.codecs)

MAX_STAGES = 16
MAX_NAME_BYTES = 4 * MAX_NAME


class _Names(list):
    """A table's names read so far (UTF-8, in order: what later names are coded against), and their bytes."""

    spent = 0


_TABLE_LEVEL_SMALL, _TABLE_LEVEL_LARGE, _TABLE_SMALL = 19, 3, 256 << 10

# (encoding, inner encoding | None, value form tag | None, its params, index form tag | None, its params); params
# are (name, value) pairs of the fields a form stores once (int8's block)
Form = tuple
_NO_FORM: Form = ("coo", None, None, (), None, ())


class _Reader:
    """Sequential reads of a byte string, every one bounds-checked (PayloadHeaderError past the end)."""

    def __init__(self, buf: bytes | memoryview, pos: int, end: int, what: str):
        self.buf, self.pos, self.end, self.what = buf, pos, end, what

    def _need(self, n: int, field: str) -> None:
        if self.pos + n > self.end:
            raise PayloadHeaderError(f"{self.what} ends inside {field}")

    def u8(self, field: str) -> int:
        pos = self.pos
        if pos >= self.end:
            self._need(1, field)
        self.pos = pos + 1
        return self.buf[pos]

    def take(self, n: int, field: str) -> bytes:
        self._need(n, field)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def varint(self, field: str, hi: int, exc: type = PayloadHeaderError) -> int:
        """A canonical varint (at most 10 bytes, below 2^64, no redundant trailing zero group) in [0, hi]."""
        pos = self.pos
        if pos < self.end and self.buf[pos] < 0x80:  # one byte: most fields of a table (a call per byte costs)
            n = self.buf[pos]
            self.pos = pos + 1
            if n > hi:
                raise exc(f"{self.what}: {field} {n} exceeds its limit {hi}")
            return n
        n, shift, start = 0, 0, self.pos
        while True:
            b = self.u8(field)
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift >= 70:
                raise PayloadHeaderError(f"{self.what}: varint {field} runs past 10 bytes")
        if n >= 1 << 64 or (b == 0 and self.pos - start > 1):
            raise PayloadHeaderError(f"{self.what}: varint {field} is not canonical or exceeds 64 bits")
        if n > hi:
            raise exc(f"{self.what}: {field} {n} exceeds its limit {hi}")
        return n

    def code(self, field: str, table: tuple) -> str:
        c = self.u8(field)
        if c >= len(table):
            raise PayloadHeaderError(f"{self.what}: unknown {field} code {c}")
        return table[c]


# ------------------------------------------------------------------------------------------ pipeline stages


def _stage_bytes(cfg: Any, tables: WireTables) -> bytes:
    """A pipeline stage: its codec's compact code and fields where the codec declares them and the config fits
    them (:class:`~gpu_codec.format.schema.StageSpec`), JSON otherwise."""
    spec = tables.stage_of.get(cfg.get("id")) if type(cfg) is dict else None
    if spec is not None:
        try:
            return spec.encode(cfg)
        except Unrepresentable:
            pass
    if not isinstance(cfg, dict) or not isinstance(cfg.get("id"), str):
        raise Unrepresentable(f"pipeline stage {cfg!r} is not a codec config")
    try:
        j = dumps_json(cfg)
    except (TypeError, ValueError) as e:
        raise Unrepresentable(str(e)) from None
    if _past_json_bounds(j):  # (what a reader refuses; version 1 holds it)
        raise Unrepresentable(f"pipeline stage {cfg.get('id')!r} is past the JSON bounds of a v2 table")
    return bytes([STAGE_JSON]) + uvarint(len(j)) + j


def _past_json_bounds(j: bytes) -> bool:
    """Whether JSON text a v2 table would hold (metadata, a stage's config) is past what its reader takes."""
    values, deepest = json_shape(j)
    return values > MAX_JSON_VALUES or deepest > MAX_JSON_DEPTH


def _read_stage(r: _Reader, tables: WireTables) -> dict:
    code = r.u8("stage code")
    if code == STAGE_JSON:
        n = r.varint("stage config length", r.end - r.pos)
        cfg = loads_json(r.take(n, "stage config"), "a pipeline stage config", MAX_JSON_VALUES, MAX_JSON_DEPTH)
        req(
            isinstance(cfg, dict) and isinstance(cfg.get("id"), str),
            PayloadHeaderError,
            f"{r.what}: a JSON pipeline stage must be an object with a string 'id'",
        )
        return cfg
    spec = tables.stages.get(code)
    req(spec is not None, PayloadHeaderError, f"{r.what}: unknown pipeline stage code {code}")
    return spec.decode(r)


# ------------------------------------------------------------------------------------------ forms


def _form_bytes(form: Form, tables: WireTables) -> bytes:
    enc, inner, v, vparams, i, iparams = form
    out = bytearray([ENCODING_CODES.index(enc)])
    base = enc
    if enc in WRAPPERS:
        out.append(ENCODING_CODES.index(inner))
        base = inner
    if base in CODED:
        out += form_bytes(tables.value_forms[v], dict(vparams))
    if base == "sparse":
        out += form_bytes(tables.index_forms[i], dict(iparams))
    return bytes(out)


def _read_form(r: _Reader, tables: WireTables) -> tuple:
    """(encoding, inner, value form spec, its params, index form spec, its params)."""
    enc = r.code("encoding", ENCODING_CODES)
    inner, v, vparams, i, iparams = None, None, (), None, ()
    base = enc
    if enc in WRAPPERS:
        inner = r.code("inner encoding", ENCODING_CODES)
        if inner not in INNER_ENCODINGS:
            raise PayloadHeaderError(f"{r.what}: a {enc} record cannot wrap {inner!r}")
        base = inner
    if base in CODED:
        v, vparams = read_form(r, tables.value_codes, tables.value_forms, "value")
    if base == "sparse":
        i, iparams = read_form(r, tables.index_codes, tables.index_forms, "index")
    return (enc, inner, v, vparams, i, iparams)


def _keys(d: Any, allowed: set[str], required: set[str]) -> dict:
    if not isinstance(d, dict) or not required <= set(d) <= allowed:
        raise Unrepresentable(f"codec fields {d!r}")
    return d


def _part_form(spec: FormSpec | None, c: dict, nnz: int, numel: int, out: bytearray) -> tuple:
    """The params of one form of a codec dict, its per-tensor fields appended to ``out``; Unrepresentable where a
    value does not fit its declared field."""
    if spec is None:
        raise Unrepresentable(f"a form without a declaration in the table: {c!r}")
    params = tuple((f.name, c.get(f.name)) for f in spec.params)
    for f in spec.params:
        f.encode(c.get(f.name))  # (checks it)
    if spec.derived:
        if spec.derive is None:
            raise Unrepresentable(f"form {spec.tag!r}: derived fields without a rule")
        want = spec.derive(nnz, numel)
        if any(c.get(k) != want[k] or type(c.get(k)) is not type(want[k]) for k in spec.derived):
            raise Unrepresentable(f"form {spec.tag!r}: fields {list(spec.derived)} are not what nnz and numel give")
    for f in spec.fields:
        b = f.encode(c.get(f.name))
        if f.empty is not None and not nnz:
            if b != f.encode(f.empty):
                raise Unrepresentable(f"form {spec.tag!r}: {f.name} of an empty tensor")
        else:
            out += b
    return params


def _coded_form(enc: str, c: dict, rec: TensorRecord, nnz: int, tables: WireTables) -> tuple[tuple, bytes]:
    """(value form, params, index form, params) and the per-tensor field bytes of a sparse/dense_q codec dict."""
    fields = bytearray()
    v = c.get("v")
    vs = tables.value_forms.get(v) if isinstance(v, str) else None
    vparams = _part_form(vs, c, nnz, rec.numel, fields)
    allowed = {"v"} | vs.keys()
    i, iparams = None, ()
    if enc == "sparse":
        i = c.get("i")
        ispec = tables.index_forms.get(i) if isinstance(i, str) else None
        iparams = _part_form(ispec, c, nnz, rec.numel, fields)
        allowed |= {"i"} | ispec.keys()
    _keys(c, allowed, allowed)
    return (v, vparams, i, iparams), bytes(fields)


def _record_form(rec: TensorRecord, tables: WireTables) -> tuple[Form, bytes]:
    enc, c = rec.encoding, rec.codec
    if enc in ("coo", "dense"):
        _keys(c, set(), set())
        return (enc, None, None, (), None, ()), b""
    if enc in CODED:
        (v, vp, i, ip), fields = _coded_form(enc, c, rec, rec.nnz, tables)
        return (enc, None, v, vp, i, ip), fields
    if enc in WRAPPERS:
        allowed = {"inner", "raw", "zbytes", "ic"} | ({"algo"} if enc == "nvcomp" else set())
        _keys(c, allowed, {"inner", "raw"} | ({"algo"} if enc == "nvcomp" else set()))
        if enc == "nvcomp" and c["algo"] != "zstd":
            raise Unrepresentable("nvcomp algorithm")
        inner, ic = c["inner"], c.get("ic", {})
        if inner in ("coo", "dense"):
            _keys(ic, set(), set())
            return (enc, inner, None, (), None, ()), b""
        if inner in CODED and isinstance(ic, dict) and ic:
            (v, vp, i, ip), fields = _coded_form(inner, ic, rec, rec.nnz, tables)
            return (enc, inner, v, vp, i, ip), fields
    raise Unrepresentable(f"encoding {enc!r}")


# ------------------------------------------------------------------------------------------ writer


def _layout_of(rec: TensorRecord, layouts: Mapping[str, LayoutRule]) -> list[tuple[str, str, int]]:
    rule = layouts.get(rec.encoding)
    if rule is None:
        raise Unrepresentable(f"encoding {rec.encoding!r} has no layout rule here")
    try:
        layout = rule(rec)
    except (PayloadError, KeyError, TypeError, ValueError) as e:
        raise Unrepresentable(str(e)) from None
    return [(role, canonical_dtype(allowed, rec), count) for role, (allowed, count) in layout.items()]


def _inner_of(rec: TensorRecord) -> TensorRecord:
    return TensorRecord(rec.name, rec.dtype, rec.shape, rec.codec["inner"], rec.nnz, {}, dict(rec.codec.get("ic", {})))


_FIELDS_OF = attrgetter("encoding", "shape", "dtype", "nnz", "codec", "buffers", "buffer_dtypes", "frame", "chunk")
_DTYPE_NAMES = frozenset(DTYPE_CODES)
_SIZE = attrgetter("size")
_IC, _INNER, _RAW, _ZBYTES, _COMPRESSED = map(itemgetter, ("ic", "inner", "raw", "zbytes", "compressed"))


def _coded_many(tensors: list[TensorRecord], tables: WireTables) -> tuple[list, list, list, list] | None:
    """What :func:`plan`'s loop makes of a table of coded records of one form: ``sparse`` or ``dense_q`` records
    with their buffers, or ``zstd`` records that wrap them and each hold their own frame (a bytes stage's output,
    not a shared frame's slices). Returns (forms, fields, zbytes, the buffers written, in order), every check of the
    loop made over the whole table (the layout rules' ``many``, :func:`_coded_forms`,
    :func:`~gpu_codec.format.common.laid_out`); None where any might fail (the loop then runs, and raises what it
    raises). The same output with fewer calls: tests/test_format_fast.py writes the same records through both."""
    n = len(tensors)
    enc = tensors[0].encoding if n and record_columns(tensors) is None else None  # (a table's are plain coo)
    if enc not in ("zstd", *CODED):
        return None
    many = getattr(tables.get(enc), "many", None)
    if many is None:
        return None
    try:
        encs, shapes, dts, nnz, codecs, bufs, bdts, frames, chunks = zip(*map(_FIELDS_OF, tensors))
        if not same_str(list(encs), enc) or set(map(type, shapes)) != {tuple} or max(map(len, shapes)) > MAX_NDIM:
            return None
        dims = [d for s in shapes for d in s]
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > MAX_TENSOR_ELEMENTS):
            return None
        if not set(dts) <= _DTYPE_NAMES or set(map(type, nnz)) != {int}:
            return None
        if frames.count(None) != n or chunks.count(None) != n or set(map(type, bdts)) != {dict}:
            return None
        wrapped = enc == "zstd"
        if wrapped:
            if not same_keys(list(codecs), WRAPPED_KEYS):
                return None
            inner = codecs[0]["inner"]
            ics = list(map(_IC, codecs))
            if inner not in CODED or not same_str(list(map(_INNER, codecs)), inner):
                return None
        else:
            inner, ics = enc, list(codecs)
        if set(map(type, ics)) != {dict}:
            return None
        numels = list(map(math.prod, shapes))
        num, nz = np.array(numels, np.int64), np.array(nnz, np.int64)
        if (nz < 0).any() or (nz > num).any() or (inner == "dense_q" and not np.array_equal(nz, num)):
            return None
        coded = _coded_forms(inner, ics, list(nnz), numels, tables)
        cols = Columns(list(dts), num, nz, list(codecs), list(chunks))
        inner_many = getattr(tables.get(inner), "many", None) if wrapped else many
        inner_lay = inner_many(cols._replace(codecs=ics)) if inner_many is not None else None
        if coded is None or inner_lay is None:
            return None
        if wrapped:
            lay = many(cols)
            if lay is None or list(lay) != ["compressed"]:
                return None
            raw, zb = list(map(_RAW, codecs)), list(map(_ZBYTES, codecs))
            if set(map(type, raw)) != {int}:
                return None
            if not np.array_equal(np.array(raw, np.int64), layout_nbytes(inner_lay, num)):
                return None
        else:
            lay, zb = inner_lay, [c.get("zbytes") for c in codecs]
        columns = laid_out(list(tensors), list(bufs), lay, num)
        if columns is None:
            return None
        written = [a for row in zip(*columns) for a in row]
    except (TypeError, ValueError, OverflowError, Unrepresentable):
        return None
    form, fields = coded
    return [(enc, inner if wrapped else None, *form)] * n, fields, zb, [] if wrapped else written


def _coded_forms(enc: str, ics: list, nnz: list[int], numels: list[int], tables: WireTables) -> tuple | None:
    """:func:`_coded_form` of many codec dicts at once, where they name the same forms with the same params:
    ((v, vparams, i, iparams), each one's field bytes); None where they do not, or where a record's dict holds
    other keys than its forms' (then :func:`_coded_form` runs record by record). Raises
    :class:`Unrepresentable` where a value does not fit its field (the caller turns it into None)."""
    c0 = ics[0]
    parts = ("v", "i") if enc == "sparse" else ("v",)
    specs = []
    for key, forms in zip(parts, (tables.value_forms, tables.index_forms)):
        tag = c0.get(key)
        spec = forms.get(tag) if type(tag) is str else None
        if spec is None:
            return None
        specs.append(spec)
    if not same_keys(ics, set(parts).union(*(spec.keys() for spec in specs))):
        return None
    tags = [c0[key] for key in parts]
    if not all(same_str(list(map(itemgetter(key), ics)), tag) for key, tag in zip(parts, tags)):
        return None
    out: list[tuple] = []
    columns: list[list[bytes]] = []  # the bytes of each stored field, a record each
    for spec in specs:
        params = tuple((f.name, c0[f.name]) for f in spec.params)
        for f, (name, value) in zip(spec.params, params):
            f.encode(value)
            got = list(map(itemgetter(name), ics))
            if set(map(type, got)) != {type(value)} or got.count(value) != len(got):
                return None
        if spec.derived:
            if spec.derive is None:
                return None
            wants = list(map(spec.derive, nnz, numels))
            for k in spec.derived:
                got, want = list(map(itemgetter(k), ics)), list(map(itemgetter(k), wants))
                if got != want or list(map(type, got)) != list(map(type, want)):
                    return None
        for f in spec.fields:
            col = f.encode_many(list(map(itemgetter(f.name), ics)))
            if f.empty is not None and 0 in nnz:
                empty = f.encode(f.empty)
                for j in [j for j, m in enumerate(nnz) if not m]:
                    if col[j] != empty:
                        return None
                    col[j] = b""
            columns.append(col)
        out.append(params)
    if not columns:
        fields = [b""] * len(ics)
    else:
        fields = columns[0] if len(columns) == 1 else list(map(b"".join, zip(*columns)))
    return (tags[0], out[0], tags[1] if enc == "sparse" else None, out[1] if enc == "sparse" else ()), fields


_FRAMES_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("frames_unchecked", default=False)


@contextlib.contextmanager
def frames_unchecked() -> Iterator[None]:
    """The writer leaves ``nvcomp`` records' frames unchecked inside the block: for tools that build payloads whose
    frames lie, to test that readers refuse them (:mod:`gpu_codec.testing.nvcomp`)."""
    token = _FRAMES_UNCHECKED.set(True)
    try:
        yield
    finally:
        _FRAMES_UNCHECKED.reset(token)


def _check_frames(rec: TensorRecord, comp: list[Any], version: int) -> None:
    """An ``nvcomp`` record's frames against its ``raw`` size and ``chunk``, as the reader checks them (headers
    only), where its buffer is on the host: a record changed since it was made (a payload read, edited and written
    again) is refused here, not written for the reader to refuse. A device buffer is the codec's own, made to
    match (reading it here would copy it to the host)."""
    buf = comp[0] if len(comp) == 1 else None
    if type(buf) is not np.ndarray or _FRAMES_UNCHECKED.get():
        return
    raw, what = rec.codec["raw"], f"tensor {rec.name!r}"
    try:
        if version == CHUNKED and multi_frame(rec):
            split_frames(buf, raw, rec.chunk, what)
        else:
            check_frame(buf, raw, what)
            check_one_frame(buf, what)
    except PayloadError as e:
        raise InvalidInputError(f"{e}: the record does not match its frames") from None


def _check_buffers(rec: TensorRecord, layout: list[tuple[str, str, int]]) -> list[Any]:
    if list(rec.buffers) != [role for role, _, _ in layout]:
        raise Unrepresentable(f"tensor {rec.name!r}: buffers {list(rec.buffers)} are not in layout order")
    out = []
    for role, dt, count in layout:
        a = rec.buffers[role]
        if (
            buffer_dtype_name(a, rec, role) != dt
            or int(a.size) != count
            or a.dtype.itemsize != BUFFER_DTYPES[dt].itemsize
        ):
            raise Unrepresentable(f"tensor {rec.name!r}: buffer {role!r} is not {count} x {dt}")
        out.append(a)
    return out


def zstd_level(pipeline: list) -> int:
    """The level of the pipeline's zstd stage (3, zstd's default, without one)."""
    for s in pipeline:
        if isinstance(s, dict) and s.get("id") == "zstd" and is_int(s.get("level")) and 1 <= s["level"] <= 22:
            return s["level"]
    return 3


def _raw_of(rec: TensorRecord) -> bytes:
    """A zstd record's content: its share of a shared frame, the bytes its encoder kept (``rec.raw``, for the same
    ``compressed`` buffer), or its frame decompressed."""
    if rec.frame is not None:
        return rec.frame.read(f"tensor {rec.name!r}")
    comp = rec.buffers.get("compressed")
    if comp is None:
        raise Unrepresentable(f"tensor {rec.name!r}: a wrapped record without its frame")
    kept = rec.raw
    if kept is not None and kept[0] is comp and len(kept[1]) == rec.codec["raw"]:
        return kept[1]
    return bounded_decompress(np.asarray(comp).tobytes(), rec.codec["raw"], f"tensor {rec.name!r}")


_PLAIN_FORMS: dict[str, Form] = {enc: (enc, None, None, (), None, ()) for enc in BASE_LAYOUTS}
_PLAIN_ROLES = {"coo": ["indices", "values"], "dense": ["values"]}


def _plain_buffers(rec: TensorRecord, enc: str) -> tuple[list[Any], int] | None:
    """The buffers of a ``coo`` or ``dense`` record without codec fields and their bytes, where :func:`plan`'s
    checks of it (:func:`_record_form`, :func:`_layout_of` with the container's own rule, :func:`_check_buffers`)
    all pass; None where any might not (:func:`plan` then runs them, and raises what they raise). The same checks
    with fewer calls: tests/test_format_fast.py writes the same records through both."""
    try:
        shape, dtype, nnz, codec, bufs = rec.shape, rec.dtype, rec.nnz, rec.codec, rec.buffers
        if (
            type(shape) is not tuple
            or len(shape) > MAX_NDIM
            or type(dtype) is not str
            or dtype not in _DTYPE_CODE
            or type(nnz) is not int
            or type(codec) is not dict
            or codec
            or type(bufs) not in (dict, SegmentBuffers)
            or list(bufs) != _PLAIN_ROLES[enc]
        ):
            return None
        get = bufs.part if type(bufs) is SegmentBuffers else bufs.__getitem__  # (a range: no slice made)
        numel = 1
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_TENSOR_ELEMENTS:
                return None
            numel *= d
        values = get("values")
        vd = _TENSOR_DTYPE.get(dtype, "float32")
        if enc == "coo":
            indices = get("indices")
            idx = "uint32" if numel <= U32_INDEX_NUMEL else "uint64"
            if indices.size != nnz or not _dtype_is(indices, idx, "indices", rec.buffer_dtypes):
                return None
            out, size = [indices, values], nnz * BUFFER_DTYPES[idx].itemsize
        elif nnz == numel:
            out, size = [values], 0
        else:
            return None
        if values.size != nnz or not _dtype_is(values, vd, "values", rec.buffer_dtypes):
            return None
        return out, size + nnz * BUFFER_DTYPES[vd].itemsize
    except Exception:  # whatever the checks raise, plan's own run of them raises too
        return None


_PLAIN_COO = ["indices", "values"]
_PLAIN_OF = attrgetter("encoding", "shape", "dtype", "nnz", "codec", "buffers", "buffer_dtypes")


class _Interleaved(NamedTuple):
    """The buffers of records ``[0, n)`` of one shared indices array and one shared values array, of one element
    size, written as each record's indices then its values: the data of :func:`plan`'s loop, laid out with a few
    calls over the whole table. The records' entries are ranges ``[offsets[r], offsets[r + 1])`` of both arrays
    (a selection's :class:`~gpu_codec.format.common.Segmented` outputs), or, where ``ranges`` is given, each
    array's own ranges (``(index starts, index stops, value starts, value stops)``, host lists: a payload read from
    bytes, :class:`~gpu_codec.format.common.Ranges`)."""

    indices: Any
    values: Any
    offsets: np.ndarray | None  # int64, n + 1 (None with ranges)
    ranges: tuple[list[int], list[int], list[int], list[int]] | None = None

    @property
    def nbytes(self) -> int:
        size = self.indices.dtype.itemsize
        if self.ranges is not None:
            return size * (sum(self.ranges[1]) - sum(self.ranges[0]) + sum(self.ranges[3]) - sum(self.ranges[2]))
        return 2 * int(self.offsets[-1] - self.offsets[0]) * size

    def host(self, to_host: Any = None) -> bytes:
        """The bytes, interleaved on the host (``to_host``: the device-to-host copy of each shared range, one each)."""
        return b"".join(self.pieces(to_host))

    def pieces(self, to_host: Any = None) -> list[memoryview]:
        """Each record's indices then its values, as views of the two arrays' memory on the host (no copy until they
        are joined, by :meth:`host` or by the writer's one join of the whole payload)."""
        size = self.indices.dtype.itemsize
        if self.ranges is not None:  # (host arrays read from bytes: each range cut from its array's memory)
            idx, val = self.indices, self.values
            at = [(np.asarray(r, np.int64) * size).tolist() for r in self.ranges]
            cuts = list(map(slice, at[0], at[1])), list(map(slice, at[2], at[3]))
        else:
            a, b = int(self.offsets[0]), int(self.offsets[-1])
            idx, val = self.indices[a:b], self.values[a:b]
            if to_host is not None:
                idx, val = to_host(idx), to_host(val)
            at = ((self.offsets - a) * size).tolist()
            cuts = (list(map(slice, at[:-1], at[1:])),) * 2  # (a slice of each memory a record)
        ib = memoryview(np.ascontiguousarray(idx)).cast("B")
        vb = memoryview(np.ascontiguousarray(val)).cast("B")
        return [x for pair in zip(map(ib.__getitem__, cuts[0]), map(vb.__getitem__, cuts[1])) for x in pair]


def _one_source(seg: Segmented) -> Any:
    """The one source array every tensor of ``seg`` is a range of; None where they use more than one."""
    which = seg.which
    if which is None:
        return seg.sources[0]
    first = which[0] if len(which) else 0
    return seg.sources[first] if which.count(first) == len(which) else None


def _plain_many(tensors: list[TensorRecord]) -> tuple[list[Any], int] | None:
    """What :func:`plan`'s loop makes of a table of plain ``coo`` records whose buffers are records ``0..n-1`` of a
    selection's shared outputs (:class:`~gpu_codec.format.common.SegmentBuffers` of one indices and one values
    array), or of the reader's ranges of a payload's data (:class:`~gpu_codec.format.common.Ranges`: a payload read
    from bytes, written again): (the buffers written, in order: one :class:`_Interleaved` part where the two
    arrays' elements are of one size, a range of each array a buffer otherwise, ranges of the reader's only
    interleaved; their bytes), every check of :func:`_plain_buffers` made over the whole table. None where any
    might fail, and for records whose buffers are not such ranges (the loop then runs, and raises what it raises).
    The same bytes with fewer calls and parts: tests/test_format_fast.py writes the same records through both."""
    n = len(tensors)
    table = record_columns(tensors)  # (a table: its columns, no record made)
    if n < 2 or (table is None and type(tensors[0].buffers) is not SegmentBuffers):
        return None
    try:
        if table is not None:
            shapes, dts, nnz, roles = table.shapes, table.dtypes, table.nnz, table.roles
        else:
            encs, shapes, dts, nnz, codecs, bufs, stored = zip(*map(_PLAIN_OF, tensors))
            if set(map(type, bufs)) != {SegmentBuffers} or len({id(b.roles) for b in bufs}) != 1:
                return None
            if not same_str(list(encs), "coo") or [b.t for b in bufs] != list(range(n)):
                return None
            if set(map(type, codecs)) != {dict} or any(codecs) or set(map(type, stored)) != {dict} or any(stored):
                return None
            roles = bufs[0].roles
        if set(map(type, shapes)) != {tuple} or max(map(len, shapes)) > MAX_NDIM:
            return None
        dims = [d for s in shapes for d in s]
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > MAX_TENSOR_ELEMENTS):
            return None
        if set(map(type, dts)) != {str} or not set(dts) <= _DTYPE_NAMES or set(map(type, nnz)) != {int}:
            return None
        if list(roles) != _PLAIN_COO:
            return None
        iseg, vseg = roles["indices"], roles["values"]
        if type(iseg) is not type(vseg) or type(iseg) not in (Segmented, Ranges) or len(iseg) != n or len(vseg) != n:
            return None
        if type(iseg) is Ranges:  # (a payload read from bytes: each role's records are ranges of its array)
            nnz = list(nnz)
            if list(map(sub, iseg.stops, iseg.starts)) != nnz or list(map(sub, vseg.stops, vseg.starts)) != nnz:
                return None
            off = None
        else:
            off = np.asarray(iseg.offsets, np.int64)
            if not np.array_equal(off, np.asarray(vseg.offsets, np.int64)) or not np.array_equal(np.diff(off), nnz):
                return None
        # one source array a role: every record's indices of one width, every record's values of one dtype
        wide = np.fromiter(map(math.prod, shapes), np.int64, n) > U32_INDEX_NUMEL
        f64 = dts.count("float64")
        isrc, vsrc = _one_source(iseg), _one_source(vseg)
        if isrc is None or vsrc is None or wide.any() != wide.all() or f64 not in (0, n):
            return None
        if not _dtype_is(isrc, "uint64" if wide[0] else "uint32", "indices", {}):
            return None
        if not _dtype_is(vsrc, "float64" if f64 else "float32", "values", {}):
            return None
        isz, vsz = isrc.dtype.itemsize, vsrc.dtype.itemsize
        if off is None:  # (ranges of host arrays: interleaved where the two element sizes agree, else the loop)
            if isz != vsz or type(isrc) is not np.ndarray or type(vsrc) is not np.ndarray:
                return None
            if nnz and (min(nnz) < 0 or min(iseg.starts) < 0 or min(vseg.starts) < 0):
                return None
            if nnz and (max(iseg.stops) > isrc.size or max(vseg.stops) > vsrc.size):
                return None
            ranges = (iseg.starts, iseg.stops, vseg.starts, vseg.stops)
            return [_Interleaved(isrc, vsrc, None, ranges)], sum(nnz) * (isz + vsz)
        if isz == vsz:
            parts = [_Interleaved(isrc, vsrc, off)]
        else:
            lo, hi = off[:-1].tolist(), off[1:].tolist()
            ip, vp = map(SegmentPart, repeat(isrc), lo, hi), map(SegmentPart, repeat(vsrc), lo, hi)
            parts = [x for pair in zip(ip, vp) for x in pair]
        return parts, int(off[-1] - off[0]) * (isz + vsz)
    except Exception:  # whatever the checks raise, plan's own run of them raises too
        return None


def _dtype_is(a: Any, dt: str, role: str, stored: dict[str, str]) -> bool:
    """Whether :func:`_check_buffers` takes ``a``'s dtype for ``dt``."""
    if not stored and a.dtype is BUFFER_DTYPES[dt]:  # (NumPy's own dtypes are single objects)
        return True
    name = stored[role] if role in stored else dtype_name(a.dtype)
    return name == dt and a.dtype.itemsize == BUFFER_DTYPES[dt].itemsize


class _Plan:
    """What :func:`pack` writes: the header (prefix and table) and the data parts, sized without any copy."""

    def __init__(self, head: bytes, parts: list[Any], data_len: int):
        self.head, self.parts, self.data_len = head, parts, data_len

    @property
    def size(self) -> int:
        return len(self.head) + self.data_len + _CRC.size


def _cached(cache: dict | None, slot: str, key: Any, fn, keep: Any = None):
    """``fn()``, remembered in ``cache[slot]`` while ``key`` stays the same (``keep`` holds the objects whose ids
    are in the key, so no id is reused while the entry lives)."""
    if cache is None:
        return fn()
    hit = cache.get(slot)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = fn()
    cache[slot] = (key, out, keep)
    return out


def _wrapped_data(records, level: int, cache: dict | None, force: int | None) -> tuple[int, list, list[int | None]]:
    """Choose how the bytes stage's output is laid out: per record, one shared frame or plain. Returns
    (data mode, data parts, per-record zbytes for the table)."""
    ident = tuple(id(r.frame) if r.frame is not None else id(r.buffers.get("compressed")) for r in records)
    refs = [r.frame if r.frame is not None else r.buffers.get("compressed") for r in records]

    def compute():
        # a shared frame is read whole by the receiver: offered for small payloads only, where the per-frame
        # overhead matters and reading it whole costs little (a large one keeps the per-tensor, streamed frames,
        # and its records' contents are not read: plan checked each one's raw size)
        small = sum(r.codec["raw"] for r in records) <= SHARED_FRAME_MAX
        raws = [_raw_of(r) if small or r.frame is not None else None for r in records]
        frames = [  # (a record's own frame as it lies: a copy would stay in the cache beside the payload's)
            zstd_frame(raw, level) if r.frame is not None else as_uint8(r.buffers["compressed"])
            for r, raw in zip(records, raws)
        ]
        if not small:
            return None, None, frames
        joint_raw = b"".join(raws)
        return joint_raw, zstd_frame(joint_raw, level), frames

    joint_raw, joint, frames = _cached(cache, "wrapped", (ident, level), compute, refs)
    per = sum(len(f) + len(uvarint(len(f))) for f in frames)
    options = [(per, DATA_RECORDS)]
    if joint is not None:
        options += [(len(joint_raw), DATA_PLAIN), (len(joint), DATA_ZSTD)]
    _, mode = min(options) if force is None else (0, force)
    if mode != DATA_RECORDS and joint_raw is None:  # (forced on a large payload)
        joint_raw = b"".join(map(_raw_of, records))
    if mode == DATA_PLAIN:
        return mode, [joint_raw], [None] * len(records)
    if mode == DATA_ZSTD:
        return mode, [joint if joint is not None else zstd_frame(joint_raw, level)], [None] * len(records)
    return mode, frames, [len(f) for f in frames]


def multi_frame(rec: TensorRecord) -> bool:
    """Whether a record is an ``nvcomp`` record of more than one frame (only version 3 holds it)."""
    raw = rec.codec.get("raw")
    return rec.encoding == "nvcomp" and rec.chunk is not None and is_int(raw) and raw > rec.chunk


def _chunk_log2(rec: TensorRecord, version: int) -> int | None:
    """The chunk size code a v3 nvcomp record carries (None for v2, which holds one frame per record)."""
    if version == VERSION:
        if multi_frame(rec):
            raise Unrepresentable(f"tensor {rec.name!r}: {rec.codec['raw']} raw bytes in frames of {rec.chunk}")
        return None
    c = rec.chunk
    if not is_int(c) or c <= 0 or c & (c - 1) or not MIN_CHUNK_LOG2 <= c.bit_length() - 1 <= MAX_CHUNK_LOG2:
        raise Unrepresentable(f"tensor {rec.name!r}: nvcomp chunk size {c!r}")
    return c.bit_length() - 1


def plan(
    tensors: list[TensorRecord],
    pipeline: list[dict],
    metadata: dict | None,
    layouts: Mapping[str, LayoutRule] | None = None,
    cache: dict | None = None,
    data_mode: int | None = None,
    version: int = VERSION,
    fingerprint: str | None = None,
) -> _Plan:
    """Lay out a v2 (or, ``version=3``, v3) payload; raises :class:`Unrepresentable` where the version cannot
    hold the records.

    ``data_mode`` forces how zstd records are laid out (``DATA_RECORDS``, ``DATA_ZSTD``, ``DATA_PLAIN``);
    by default the smallest is chosen."""
    layouts = tables_of(BASE_LAYOUTS if layouts is None else layouts)
    if len(tensors) > MAX_TENSORS:
        raise Unrepresentable("too many tensors")
    forms, fields, parts = [], [], []
    all_zstd = bool(tensors) and record_columns(tensors) is None and all(r.encoding == "zstd" for r in tensors)
    plain = {enc: layouts.get(enc) is rule for enc, rule in BASE_LAYOUTS.items()}
    plain_bytes, generic, zbytes = 0, [], []
    fast = _coded_many(tensors, layouts)
    if fast is not None:  # (coded records of one form, checked over the whole table)
        forms, fields, zbytes, written = fast
        parts += written
        generic += written
    elif plain.get("coo"):
        laid = _plain_many(tensors)
        if laid is not None:  # (plain coo records, checked over the whole table)
            fast = laid
            parts, plain_bytes = laid
            forms, fields, zbytes = [_PLAIN_FORMS["coo"]] * len(tensors), [b""] * len(tensors), [None] * len(tensors)
    for rec in tensors if fast is None else ():
        enc = rec.encoding
        if type(enc) is str and plain.get(enc):
            laid = _plain_buffers(rec, enc)
            if laid is not None:
                parts += laid[0]
                plain_bytes += laid[1]
                forms.append(_PLAIN_FORMS[enc])
                fields.append(b"")
                zbytes.append(None)
                continue
        if not isinstance(rec.shape, tuple) or len(rec.shape) > MAX_NDIM:
            raise Unrepresentable(f"tensor {rec.name!r}: shape")
        if rec.dtype not in DTYPE_CODES or not is_int(rec.nnz):
            raise Unrepresentable(f"tensor {rec.name!r}: dtype or nnz")
        form, f = _record_form(rec, layouts)
        base = form[1] if form[0] in WRAPPERS else form[0]
        if base in ("dense", "dense_q") and rec.nnz != rec.numel:
            raise Unrepresentable(f"tensor {rec.name!r}: a dense record with nnz != numel")
        if form[0] in WRAPPERS:
            if not is_int(rec.codec["raw"]):
                raise Unrepresentable("raw")
            if form[0] == "nvcomp":
                c = _chunk_log2(rec, version)
                f += bytes([c]) if c is not None else b""
            inner = _inner_of(rec)
            if sum(n * BUFFER_DTYPES[dt].itemsize for _, dt, n in _layout_of(inner, layouts)) != rec.codec["raw"]:
                raise Unrepresentable(f"tensor {rec.name!r}: raw size")
            if rec.frame is None:
                if "zbytes" not in rec.codec:
                    raise Unrepresentable("zbytes")
                comp = _check_buffers(rec, _layout_of(rec, layouts))
                if form[0] == "nvcomp":
                    _check_frames(rec, comp, version)
                if not all_zstd:
                    parts.extend(comp)
                    generic.extend(comp)
            elif not all_zstd:
                raise Unrepresentable(f"tensor {rec.name!r}: a shared-frame record among other encodings")
        else:
            comp = _check_buffers(rec, _layout_of(rec, layouts))
            parts.extend(comp)
            generic.extend(comp)
        forms.append(form)
        fields.append(f)
        zbytes.append(rec.codec.get("zbytes"))
    mode = DATA_RECORDS
    if all_zstd:
        mode, parts, zbytes = _wrapped_data(tensors, zstd_level(pipeline), cache, data_mode)
        plain_bytes, generic = 0, parts
    table = _table(tensors, pipeline, metadata, forms, fields, zbytes, mode, cache, layouts, fingerprint)
    flags = (FLAG_METADATA if metadata else 0) | (mode << DATA_SHIFT) | (FLAG_FINGERPRINT if fingerprint else 0)
    z = _cached(cache, "table", table, lambda: _table_frame(table, cache))
    if len(z) + len(uvarint(len(table))) < len(table):
        flags |= FLAG_TABLE_ZSTD
        stored = uvarint(len(z)) + uvarint(len(table)) + z
    else:
        stored = uvarint(len(table)) + table
    head = _PREFIX.pack(MAGIC, version, flags) + stored
    if len(table) > MAX_HEADER_BYTES:
        raise InvalidInputError(f"the tensor table is {len(table)} bytes, over the limit of {MAX_HEADER_BYTES}")
    data_len = plain_bytes + sum(len(p) if isinstance(p, bytes) else int(p.size) * p.dtype.itemsize for p in generic)
    return _Plan(head, parts, data_len)


def _compress_table(table: bytes) -> bytes:
    level = _TABLE_LEVEL_SMALL if len(table) <= _TABLE_SMALL else _TABLE_LEVEL_LARGE
    return zstd_frame(table, level)


def _table_frame(table: bytes, cache: dict | None) -> bytes:
    """The table's zstd frame: the one a payload read from bytes stored (``cache["read table"]``, set by
    :func:`gpu_codec.Payload.from_bytes` from :func:`table_frame`) where it holds this very table, else a new one. A
    payload read and written again keeps its own table bytes, with no compression at the table's high level."""
    read = cache.get("read table") if cache is not None else None
    if read is not None and read[0] == len(table):
        try:
            if bounded_decompress(read[1], len(table), "the tensor table") == table:
                return read[1]
        except PayloadError:
            pass
    return _compress_table(table)


def table_frame(blob: bytes | bytearray | memoryview) -> tuple[int, bytes] | None:
    """(raw size, the frame's bytes) of the zstd-compressed tensor table of a v2 or v3 payload that
    :func:`unpack` has accepted; None where its table is stored as it is."""
    mv = memoryview(blob).cast("B")
    _, _, flags = _PREFIX.unpack_from(mv, 0)
    r, tlen, raw = _table_lengths(mv, flags, len(mv) - _CRC.size)
    return None if raw is None else (raw, r.take(tlen, "the tensor table"))


def header_length(blob: bytes | bytearray | memoryview) -> int:
    """Bytes of the prefix and the stored tensor table of a v2 or v3 payload that :func:`unpack` has accepted, as
    they lie in ``blob`` (another writer's table may be coded otherwise than this one would code it)."""
    mv = memoryview(blob).cast("B")
    _, _, flags = _PREFIX.unpack_from(mv, 0)
    r, tlen, _ = _table_lengths(mv, flags, len(mv) - _CRC.size)
    return r.pos + tlen


def _table_lengths(mv: memoryview, flags: int, end: int) -> tuple[_Reader, int, int | None]:
    """The prefix's table lengths, read after its fixed fields: (a reader at the table, the table's stored length,
    its raw length where it is zstd-compressed, else None)."""
    r = _Reader(mv, _PREFIX.size, end, "payload prefix")
    tlen = r.varint("table length", MAX_HEADER_BYTES)
    raw = r.varint("table raw length", MAX_HEADER_BYTES) if flags & FLAG_TABLE_ZSTD else None
    return r, tlen, raw


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n - (x.bit_length() + 7) // 8


def _common_suffix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if not n:
        return 0
    x = int.from_bytes(a[len(a) - n :], "little") ^ int.from_bytes(b[len(b) - n :], "little")
    return n - (x.bit_length() + 7) // 8


_DIGITS = re.compile(rb"[0-9]+")


def _name_entries(names: tuple) -> tuple[bytes, ...]:
    """Each name coded against an earlier one: the previous name, or the last one with the same shape up to
    digits (``blocks.3.mlp.weight`` refers to ``blocks.2.mlp.weight``), whichever costs fewer bytes. Remembered
    for the latest few tuples of names, which an update repeats round after round."""
    try:
        return _remembered_entries(names)
    except TypeError:  # a name that cannot be hashed (which _entries_of refuses)
        return _entries_of(names)


@functools.lru_cache(maxsize=4)
def _remembered_entries(names: tuple) -> tuple[bytes, ...]:
    return _entries_of(names)


def _entries_of(names: tuple) -> tuple[bytes, ...]:
    encoded = _encoded_names(names)
    first, second, last = [], [], {}  # each name's references: indices of earlier names (-1: none)
    for i, skeleton in enumerate(_skeletons(encoded)):
        j = last.get(skeleton)
        last[skeleton] = i
        if j is None or j == i - 1:
            first.append(i - 1)
            second.append(-1)
        else:
            x, y = {1, i - j}  # (the set's order breaks ties)
            first.append(i - x)
            second.append(i - y)
    width = max(map(len, encoded), default=0)
    if len(encoded) >= _VECTOR_NAMES and len(encoded) * width <= _NAME_CELLS:
        return _entries_vector(encoded, first, second, width)
    return _entries_scalar(encoded, first, second)


def _encoded_names(names: tuple) -> list[bytes]:
    """The names in UTF-8; Unrepresentable at the first that is not a string of 1 to MAX_NAME characters
    encodable as UTF-8, or that repeats an earlier one."""
    if set(map(type, names)) <= {str} and len(set(names)) == len(names):
        lengths = list(map(len, names))
        if not names or (min(lengths) > 0 and max(lengths) <= MAX_NAME):
            try:
                joined = "\n".join(names).encode("utf-8")
            except UnicodeEncodeError:
                pass
            else:
                if joined.count(b"\n") == len(names) - 1:  # (no name holds a newline)
                    return joined.split(b"\n") if names else []
    encoded, seen = [], set()
    for name in names:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or name in seen:
            raise Unrepresentable(f"tensor name {name!r}")
        seen.add(name)
        try:
            encoded.append(name.encode("utf-8"))
        except UnicodeEncodeError:
            raise Unrepresentable(f"tensor name {name!r} is not encodable as UTF-8") from None
    return encoded


def _skeletons(encoded: list[bytes]) -> list[bytes]:
    """Each name with every run of digits replaced by one ``#``."""
    joined = b"\n".join(encoded)
    if joined.count(b"\n") != len(encoded) - 1:  # a name holds a newline: name by name
        return [_DIGITS.sub(b"#", nb) for nb in encoded]
    if b"#" in joined:
        return _DIGITS.sub(b"#", joined).split(b"\n")
    # no name holds a "#": every "#" is a digit's, and a run of them one run of digits
    s = joined.translate(_DIGITS_TO_HASH)
    while b"##" in s:
        s = s.replace(b"##", b"#")
    return s.split(b"\n")


_DIGITS_TO_HASH = bytes.maketrans(b"0123456789", b"#" * 10)


def _entries_scalar(encoded: list[bytes], first: list[int], second: list[int]) -> tuple[bytes, ...]:
    """Each name's entry: against each of its references in order (earlier names), the one that costs fewest
    bytes (the first of those that tie), or against none where that costs fewer."""
    out = []
    for i, nb in enumerate(encoded):
        best = uvarint(0) + uvarint(len(nb)) + nb
        for r in (first[i], second[i]):
            if r < 0:
                continue
            ref = encoded[r]
            p = _common_prefix(nb, ref)
            q = min(_common_suffix(nb, ref), len(ref) - p, len(nb) - p)
            e = uvarint(i - r) + uvarint(p) + uvarint(q) + uvarint(len(nb) - p - q) + nb[p : len(nb) - q]
            if len(e) < len(best):
                best = e
        out.append(best)
    return tuple(out)


_NAME_CELLS = 1 << 21  # the most bytes of names, padded to one width, compared at once (beyond: name by name)
_VECTOR_NAMES = 96  # the fewest names compared at once (below, NumPy's cost per call outweighs its gain)


def _entries_vector(encoded: list[bytes], first: list[int], second: list[int], width: int) -> tuple[bytes, ...]:
    """:func:`_entries_scalar`, its comparisons and sizes computed by NumPy over every name at once."""
    n = len(encoded)
    lens = np.array(list(map(len, encoded)), np.intp)
    # each name left-aligned in a row of the width, and reversed (its suffixes as prefixes), zero-padded
    flat = np.frombuffer(b"".join(encoded), np.uint8)
    row = np.repeat(np.arange(n), lens)
    col = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    rows = np.zeros((n, 2, width), np.uint8)
    rows[row, 0, col] = flat
    rows[row, 1, lens[row] - 1 - col] = flat
    sizes = [1 + _varint_sizes(lens) + lens]  # against no earlier name
    fields = []
    for refs in (first, second):
        ref = np.array(refs, np.intp)
        has = ref >= 0
        ref[~has] = 0
        differ = rows != rows[ref]
        same = np.where(differ.any(axis=2), differ.argmax(axis=2), width)  # (n, 2): prefix, suffix
        shorter = np.minimum(lens, lens[ref])
        p = np.minimum(same[:, 0], shorter)
        q = np.minimum(same[:, 1], shorter - p)
        d, m = np.arange(n) - ref, lens - p - q
        e = _varint_sizes(d) + _varint_sizes(p) + _varint_sizes(q) + _varint_sizes(m) + m
        sizes.append(np.where(has, e, np.iinfo(np.intp).max))
        fields.append((d, p, q, m))
    choice = np.argmin(np.stack(sizes), axis=0)  # the first of the smallest, as the scalar loop keeps it
    pick = [np.where(choice == 1, a, b).tolist() for a, b in zip(*fields)]
    out = []
    for nb, c, d, p, q, m in zip(encoded, choice.tolist(), *pick):
        if not c:
            out.append(b"\x00" + uvarint(len(nb)) + nb)
        elif d | p | q | m < 0x80:
            out.append(bytes((d, p, q, m)) + nb[p : len(nb) - q])
        else:
            out.append(uvarint(d) + uvarint(p) + uvarint(q) + uvarint(m) + nb[p : len(nb) - q])
    return tuple(out)


def _varint_sizes(x: np.ndarray) -> np.ndarray:
    """The length of :func:`uvarint` of each of ``x`` (non-negative, below 2^35)."""
    return 1 + (x >= 1 << 7) + (x >= 1 << 14) + (x >= 1 << 21) + (x >= 1 << 28)


def _table(tensors, pipeline, metadata, forms, fields, zbytes, mode, cache, tables, fingerprint=None) -> bytes:
    """The tensor table: ``forms`` and ``fields`` (each tensor's per-tensor field bytes) from :func:`_record_form`."""
    tables = tables_of(tables)
    if not isinstance(pipeline, list) or len(pipeline) > MAX_STAGES:
        raise Unrepresentable("pipeline")
    t = bytearray(uvarint(len(pipeline)))
    for cfg in pipeline:
        t += _stage_bytes(cfg, tables)
    if metadata:
        if not isinstance(metadata, dict):
            raise Unrepresentable("metadata")
        j = dumps_json(metadata)
        if _past_json_bounds(j):  # (what a reader refuses; version 1 holds it)
            raise Unrepresentable("metadata is past the JSON bounds of a v2 table")
        t += uvarint(len(j)) + j
    if fingerprint is not None:
        t += bytes.fromhex(check_hex(fingerprint))
    default = Counter(forms).most_common(1)[0][0] if forms else _NO_FORM
    t += _form_bytes(default, tables)
    t += uvarint(len(tensors))
    names = tuple(record_column(tensors, "name"))
    entries = _cached(cache, "names", names, lambda: _name_entries(names))
    rows = _rows_many(tensors, entries, forms, fields, default)
    if rows is not None:  # (every record of the default form, with no field of its own: the rows at once)
        t += rows
        tensors = ()
    counted: dict[Form, tuple[bool, bool]] = {}  # form -> (has an nnz, has a zbytes)
    for rec, entry, form, f, zb in zip(tensors, entries, forms, fields, zbytes):
        t += entry
        shape = rec.shape
        own = form is not default and form != default
        t.append(DTYPE_CODES.index(rec.dtype) | len(shape) << 2 | (0x40 if own else 0))
        if own:
            t += _form_bytes(form, tables)
        for d in shape:
            if type(d) is int and 0 <= d < 0x80:
                t.append(d)
            elif is_int(d) and 0 <= d <= MAX_TENSOR_ELEMENTS:
                t += uvarint(d)
            else:
                raise Unrepresentable("dimension")
        has = counted.get(form)
        if has is None:
            has = counted[form] = (_has_nnz(form), form[0] in WRAPPERS)
        if has[0]:
            nnz = rec.nnz
            if type(nnz) is int and 0 <= nnz < 0x80:
                t.append(nnz)
            else:
                t += uvarint(nnz)
        if f:
            t += f
        if has[1] and mode == DATA_RECORDS:
            if not is_int(zb) or zb < 1:
                raise Unrepresentable("zbytes")
            t += uvarint(zb)
    return bytes(t)


def _has_nnz(form: Form) -> bool:
    """Whether a table row of this form holds an nnz: a sparse form's (a wrapper's, its inner form's)."""
    return (form[1] if form[0] in WRAPPERS else form[0]) in ("coo", "sparse")


def _rows_many(tensors, entries, forms, fields, default: Form) -> bytes | None:
    """:func:`_table`'s rows of records that all take the ``default`` form, not wrapped, with no field of their own:
    each row its name's entry, then its head byte (dtype code, dimension count), dimensions and (a sparse form's)
    nnz as varints, the numbers of every row coded at once (:func:`~gpu_codec.format.schema.uvarints`). None where
    a row may not be so (the loop then writes them, and raises what it raises). The same bytes as the loop:
    tests/test_format_fast.py writes tables both ways."""
    n = len(tensors)
    if n < 2 or default[0] in WRAPPERS or forms.count(default) != n or any(fields):
        return None
    shapes, dts, nnz = (record_column(tensors, f) for f in ("shape", "dtype", "nnz"))
    if set(map(type, shapes)) != {tuple} or set(map(type, dts)) != {str} or not set(dts) <= _DTYPE_NAMES:
        return None
    ndim = np.fromiter(map(len, shapes), np.int64, n)
    if int(ndim.max()) > MAX_NDIM:
        return None
    dims = [d for s in shapes for d in s]
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > MAX_TENSOR_ELEMENTS):
        return None
    sparse = _has_nnz(default)
    if sparse and (set(map(type, nnz)) != {int} or min(nnz) < 0 or max(nnz) >= 1 << 64):
        return None
    per = 1 + ndim + sparse  # numbers a row: its head, its dimensions, its nnz
    first = np.cumsum(per) - per
    numbers = np.empty(int(per.sum()), np.uint64)
    numbers[first] = np.fromiter(map(_DTYPE_CODE.__getitem__, dts), np.int64, n) | ndim << 2
    if dims:
        numbers[np.repeat(first + 1 - (np.cumsum(ndim) - ndim), ndim) + np.arange(len(dims))] = dims
    if sparse:
        numbers[first + 1 + ndim] = nnz
    data, counts = uvarints(numbers)
    at = np.concatenate([[0], np.cumsum(counts)])
    starts, stops = at[first].tolist(), at[first + per].tolist()
    out: list = [None] * (2 * n)
    out[::2] = entries
    out[1::2] = [data[a:b] for a, b in zip(starts, stops)]
    return b"".join(out)


def _on_device(a: Any) -> bool:
    t = type(a)
    return type(a.source if t is SegmentPart else a.indices if t is _Interleaved else a).__module__.startswith("cupy")


def _host_parts(parts: list[Any]) -> list[Any]:
    """``parts`` with every device array's bytes on the host: one copy of each shared array that segment parts
    range over (the part of it they cover), and one of the other device arrays, concatenated on the device."""
    import cupy

    spans: dict[int, list] = {}  # id(source) -> [source, lo, hi]
    loose = []
    for a in parts:
        if type(a) is SegmentPart:
            if a.stop > a.start:
                s = spans.setdefault(id(a.source), [a.source, a.start, a.stop])
                s[1], s[2] = min(s[1], a.start), max(s[2], a.stop)
        elif type(a) is _Interleaved:
            continue
        elif _on_device(a) and len(a):
            loose.append(cupy.ascontiguousarray(cupy.asarray(a)).reshape(-1).view(cupy.uint8))
    host = {k: (cupy.asnumpy(src[lo:hi]), lo) for k, (src, lo, hi) in spans.items()}
    joined = cupy.asnumpy(cupy.concatenate(loose)) if loose else None
    out, pos = [], 0
    for a in parts:
        if type(a) is SegmentPart:
            if a.stop > a.start:
                h, lo = host[id(a.source)]
                out.append(h[a.start - lo : a.stop - lo])
        elif type(a) is _Interleaved:
            out.append(a.host(cupy.asnumpy if _on_device(a) else None))
        elif _on_device(a):
            if len(a):
                n = int(a.size) * a.dtype.itemsize
                out.append(joined[pos : pos + n])
                pos += n
        else:
            out.append(a)
    return out


def _gather(parts: list[Any], total: int) -> bytes:
    if any(_on_device(a) for a in parts):
        parts = _host_parts(parts)  # the device-to-host copies of a compress: one per shared array, at most
    out = bytearray(total)
    off = 0
    for a in parts:
        if type(a) is SegmentPart:
            a = np.asarray(a.source)[a.start : a.stop]
        elif type(a) is _Interleaved:
            a = a.host()
        b = a if isinstance(a, bytes) else as_uint8(a).tobytes()
        out[off : off + len(b)] = b
        off += len(b)
    return bytes(out)


def write(p: _Plan) -> bytes:
    parts = [p.head]
    for a in p.parts:
        if type(a) is np.ndarray or isinstance(a, bytes):
            parts.append(a)
        elif _on_device(a):
            body = p.head + _gather(p.parts, p.data_len)
            break
        elif type(a) is SegmentPart:
            parts.append(np.asarray(a.source)[a.start : a.stop])
        elif type(a) is _Interleaved:
            parts += a.pieces()  # (joined once, with the rest of the payload)
        else:
            parts.append(as_uint8(a))
    else:
        try:  # (the checksum over the parts as they lie, then one join with it: no second copy of the payload)
            crc = 0
            for a in parts:
                crc = zlib.crc32(a, crc)
            return b"".join([*parts, _CRC.pack(crc & 0xFFFFFFFF)])  # each array's memory, as _gather copies it
        except (BufferError, TypeError, ValueError):  # an array that is not contiguous, or a dtype without a buffer
            body = p.head + _gather(p.parts, p.data_len)
    return body + _CRC.pack(zlib.crc32(body) & 0xFFFFFFFF)


def pack(
    tensors: list[TensorRecord],
    *,
    pipeline: list[dict],
    metadata: dict | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
    version: int = VERSION,
    fingerprint: str | None = None,
) -> bytes:
    return write(plan(tensors, pipeline, metadata, layouts, version=version, fingerprint=fingerprint))


def header_size(
    tensors: list[TensorRecord],
    pipeline: list[dict],
    metadata: dict | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
) -> int:
    """Bytes of prefix and tensor table (everything but the data and the checksum) of the v2 payload."""
    return len(plan(tensors, pipeline, metadata, layouts).head)


# ------------------------------------------------------------------------------------------ reader


_ITEMSIZE = {dt: np.dtype(x).itemsize for dt, x in BUFFER_DTYPES.items()}


def _data_size(layouts_of: list | _SharedCoo) -> int:
    """Bytes of the buffers of every record's layout."""
    if type(layouts_of) is _SharedCoo:
        return 8 * sum(layouts_of.nnz)  # (4-byte indices and values)
    size = _ITEMSIZE
    return sum([n * size[dt] for lay in layouts_of for _, dt, n in lay])


_COO32 = (("indices", "uint32"), ("values", "float32"))  # a plain coo record's roles of 4-byte entries
SHARED_VIEWS_MIN = 16  # records a payload needs for shared ranges (fewer: two views a record cost less)


def _shared_views(records: list[TensorRecord], layouts_of: list, data: memoryview) -> bool:
    """:func:`_views` where every record is plain ``coo`` with uint32 indices and float32 values (the common
    payload): each role one array over the whole data and each record's buffers ranges of them
    (:class:`~gpu_codec.format.common.Ranges`), found with a few calls over the table, sliced only when read.
    False (nothing done) otherwise, and for fewer than SHARED_VIEWS_MIN records."""
    if len(records) < SHARED_VIEWS_MIN or len(data) % 4 or set(map(len, layouts_of)) != {2}:
        return False
    firsts, seconds = [lay[0] for lay in layouts_of], [lay[1] for lay in layouts_of]
    if {f[:2] for f in firsts} != {_COO32[0]} or {x[:2] for x in seconds} != {_COO32[1]}:
        return False
    nnz = [f[2] for f in firsts]
    if nnz != [x[2] for x in seconds]:
        return False
    roles: dict[str, Ranges] = {}
    _coo32_ranges(roles, nnz, data)
    for rec, bufs in zip(records, map(SegmentBuffers, repeat(roles), range(len(records)))):
        rec.buffers = bufs  # (its buffer_dtypes left empty: each array's own dtype names it, as stored)
    return True


def _coo32_ranges(roles: dict[str, Ranges], nnz: list[int], data: memoryview) -> None:
    """``roles`` given the two :class:`~gpu_codec.format.common.Ranges` over ``data`` of plain ``coo`` records of
    ``nnz`` entries each, back to back, each record's uint32 indices then its float32 values."""
    n = np.asarray(nnz, np.int64)
    ends = np.cumsum(2 * n)  # in 4-byte words
    mid = ends - n
    starts, mid, ends = (ends - 2 * n).tolist(), mid.tolist(), ends.tolist()
    words = len(data) // 4
    roles["indices"] = Ranges(np.frombuffer(data, BUFFER_DTYPES["uint32"], words, 0), starts, mid)
    roles["values"] = Ranges(np.frombuffer(data, BUFFER_DTYPES["float32"], words, 0), mid, ends)


class _SharedCoo(NamedTuple):
    """The layouts of a whole table read by :func:`_read_known` whose records are plain ``coo`` with uint32 indices
    and float32 values, SHARED_VIEWS_MIN or more: their nnz, the ``roles`` their buffers refer to, given their
    ranges by :func:`_views` (:func:`_coo32_ranges`) once the data is known, and the records themselves, as columns
    (:class:`~gpu_codec.format.common.RecordTable`: no object a record)."""

    roles: dict[str, Ranges]
    nnz: list[int]
    records: RecordTable


def _shared_coo(k: _Known, nnzs: list[int]) -> _SharedCoo:
    """The records of known table ``k`` with ``nnzs`` entries, their buffers ranges of the data (see
    :func:`_shared_views`): a table of columns, without a layout list or an object a record."""
    roles: dict[str, Ranges] = {}
    return _SharedCoo(roles, nnzs, RecordTable(k.names, k.dtypes, k.shapes, nnzs, roles))


def _views(records: list[TensorRecord], layouts_of: list | _SharedCoo, data: memoryview) -> None:
    """Each record's buffers, back to back in ``data`` (whose size the caller checked against the layouts)."""
    if type(layouts_of) is _SharedCoo:  # (records made by the table's reader: their ranges, over the data)
        _coo32_ranges(layouts_of.roles, layouts_of.nnz, data)
        return
    if _shared_views(records, layouts_of, data):
        return
    # views, aligned or not (v2 has no padding): NumPy reads unaligned arrays, and the decoder streams them a
    # slice at a time, so copying them whole here would cost as much memory as the buffers themselves
    # where a buffer starts at a multiple of its itemsize, it is a slice of the whole data read as its dtype (a
    # third of the cost of a view of its own)
    frombuffer, dtypes = np.frombuffer, BUFFER_DTYPES
    typed: dict[str, np.ndarray] = {}
    off = 0
    for rec, lay in zip(records, layouts_of):
        bufs, names = rec.buffers, rec.buffer_dtypes
        for role, dt, count in lay:
            npdt = dtypes[dt]
            size = npdt.itemsize
            if off % size:
                bufs[role] = frombuffer(data, npdt, count, off)  # (positional: keywords cost twice as much)
            else:
                whole = typed.get(dt)
                if whole is None:
                    whole = typed[dt] = frombuffer(data, npdt, len(data) // size, 0)
                bufs[role] = whole[off // size : off // size + count]
            names[role] = dt
            off += count * size


def _read_name(t: _Reader, earlier: list[bytes]) -> bytes:
    d = t.varint("name reference", len(earlier))
    p = q = 0
    ref = b""
    if d:
        ref = earlier[len(earlier) - d]
        p = t.varint("name prefix length", len(ref))
        q = t.varint("name suffix length", len(ref) - p)
    m = t.varint("name middle length", MAX_NAME_BYTES - p - q)
    if p + q + m <= 0:
        raise PayloadHeaderError(f"{t.what}: a tensor name is empty")
    return ref[:p] + t.take(m, "a tensor name") + ref[len(ref) - q :]


class _Leave(Exception):
    """A table entry the plain-record reader leaves to :func:`_read_tensor` (which reads it again, and raises
    whatever is wrong with it)."""


def _varint_tail(buf: bytes, pos: int, n: int) -> tuple[int, int]:
    """The rest of a varint whose first byte ``n`` (>= 0x80) is read: (value, position after it), or _Leave where
    :meth:`_Reader.varint` would refuse it (past 10 bytes, a redundant zero group; past the end: IndexError)."""
    n &= 0x7F
    shift = 7
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if not b:
                raise _Leave
            return n, pos
        if shift >= 70:
            raise _Leave


class _Known(NamedTuple):
    """A plain table read before, whole (:func:`_read_plain`): each entry's bytes before its nnz (all of a ``dense``
    entry's), and what they said."""

    enc: str
    heads: tuple[bytes, ...]
    names: tuple[str, ...]
    coded: tuple[bytes, ...]  # each name as the table codes it (the later entries' name references)
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    index_dtypes: tuple[str, ...]
    value_dtypes: tuple[str, ...]
    coo32: bool  # every entry plain coo with uint32 indices and float32 values
    ends: np.ndarray  # each head's end in the heads end to end
    joined: np.ndarray  # the heads end to end, as bytes (uint8)
    numel_array: np.ndarray
    widths: list  # [each nnz's bytes when last read] (the guess of :func:`_match`)


_KNOWN: tuple[_Known, ...] = ()  # the latest few (a federated update sends the same names and shapes every round)
_KNOWN_KEPT = 4
_KNOWN_MAX_BYTES = 1 << 20  # a table whose entries' heads take more is not remembered (what a sender can make a
# reader hold stays a few MiB: heads, names and coded names of at most _KNOWN_KEPT tables)


def _read_known(
    t: _Reader, left: int, enc: str, names: set, earlier: list, records: list, lays: list
) -> bool | _SharedCoo:
    """Read the ``left`` entries of a plain table, from its first, where they repeat a table read before but for
    their nnz: each entry's bytes before its nnz compared with the known one's at once, then its nnz read and
    checked against its element count. Equal bytes after equal entries say the same name, dtype and shape, which
    passed every check when first read. True where every entry matched, or a :class:`_SharedCoo` where they are
    plain ``coo`` of 4-byte entries (their layouts and their records, instead of ``lays`` and ``records``, which are
    left as they are); else False and nothing is read."""
    for k in _KNOWN:
        if k.enc == enc and len(k.heads) == left:
            got = _match(k, t.buf, t.pos)
            if got is not None:
                break
    else:
        return False
    pos, nnzs = got
    t.pos = pos
    names.update(k.names)
    earlier.spent += sum(map(len, k.coded))  # (within the bound: the table passed it when it was first read)
    earlier.extend(k.coded)
    if k.coo32 and left >= SHARED_VIEWS_MIN:  # (the whole table: its records are the shared one's columns)
        return _shared_coo(k, nnzs)
    if enc == "coo":
        lays.extend([[("indices", i, n), ("values", v, n)] for i, v, n in zip(k.index_dtypes, k.value_dtypes, nnzs)])
    else:
        lays.extend([[("values", v, n)] for v, n in zip(k.value_dtypes, nnzs)])
    records.extend(map(TensorRecord, k.names, k.dtypes, k.shapes, repeat(enc), nnzs, _dicts(left), _dicts(left)))
    return True


def _match(k: _Known, buf: bytes, pos: int) -> tuple[int, Any] | None:
    """(position after the entries, their nnz) where the entries from ``pos`` are ``k``'s but for their nnz, each
    nnz a canonical varint no larger than its tensor; else None. A ``coo`` table is first compared at once, each
    nnz taken to be as wide as when the table was last read (:func:`_match_widths`); where that fails, entry by
    entry, and the widths found are kept."""
    if k.enc == "coo" and k.heads and buf.startswith(k.heads[0], pos):
        got = _match_widths(k, buf, pos, k.widths[0])
        if got is not None:
            return got
    got = _match_entries(k, buf, pos)
    if got is not None and k.enc == "coo":
        k.widths[0] = _varint_widths(got[1])
    return got


def _varint_widths(values: list[int]) -> np.ndarray:
    """Bytes of each value's varint (values below 2^63)."""
    v = np.asarray(values, np.int64)
    w = np.ones(v.shape, np.int64)
    for bits in range(7, 63, 7):
        w += v >= 1 << bits
    return w


def _match_widths(k: _Known, buf: bytes, pos: int, widths: np.ndarray) -> tuple[int, list[int]] | None:
    """:func:`_match` of a ``coo`` table whose nnz varints are ``widths`` bytes each, by a few NumPy calls over
    the whole table: each head's bytes, where the widths put them, equal to the known ones; each varint's bytes
    continued but for its last, which is not a redundant zero group; each nnz no larger than its tensor. Then the
    entries read one by one would give the same (each head matches at its place, and each varint ends where its
    width says). None where any of this fails (which says nothing of the entries: they may be of other widths)."""
    n = len(widths)
    if n != len(k.heads) or not n or int(widths.max()) > 9:  # (9 varint bytes hold 63 bits)
        return None
    lasts = np.cumsum(widths) - 1  # each varint's last byte among the varints' bytes
    end = pos + int(k.ends[-1]) + int(lasts[-1]) + 1
    if end > len(buf):
        return None
    region = np.frombuffer(buf, np.uint8, end - pos, pos)
    firsts = lasts + 1 - widths
    vstart = k.ends + firsts  # each varint's first byte in the region
    one = int(lasts[-1]) + 1 == n  # (every nnz one byte: the common case)
    vpos = vstart if one else np.repeat(vstart - firsts, widths) + np.arange(int(lasts[-1]) + 1)
    heads = np.ones(region.size, bool)
    heads[vpos] = False
    if not np.array_equal(region[heads], k.joined):
        return None
    vb = region[vpos]
    cont = vb >= 0x80
    tail = vb[lasts]
    if cont[lasts].any() or int(cont.sum()) != vb.size - n or ((tail == 0) & (widths > 1)).any():
        return None
    if one:
        nnz = vb.astype(np.int64)
    else:
        shifts = 7 * (np.arange(vb.size) - np.repeat(firsts, widths))
        nnz = np.add.reduceat((vb & 0x7F).astype(np.int64) << shifts, firsts)
    if (nnz > k.numel_array).any():
        return None
    return end, nnz.tolist()


def _match_entries(k: _Known, buf: bytes, pos: int) -> tuple[int, Any] | None:
    """:func:`_match`, entry by entry."""
    starts = buf.startswith
    if k.enc != "coo":
        for head in k.heads:
            if not starts(head, pos):
                return None
            pos += len(head)
        return pos, k.numels
    nnzs = []
    try:
        for head, numel in zip(k.heads, k.numels):
            if not starts(head, pos):
                return None
            n, pos = _read_nnz(buf, pos + len(head), numel)
            nnzs.append(n)
    except (_Leave, IndexError):
        return None
    return pos, nnzs


def _read_nnz(buf: bytes, pos: int, numel: int) -> tuple[int, int]:
    """A plain ``coo`` entry's nnz at ``pos``: (nnz, position after it); _Leave where it is not a canonical varint
    no larger than the tensor's ``numel`` (IndexError past the end)."""
    n = buf[pos]
    pos += 1
    if n >= 0x80:
        n, pos = _varint_tail(buf, pos, n)
    if n > numel:
        raise _Leave
    return n, pos


def _dicts(n: int) -> Iterator[dict]:
    return (dict() for _ in range(n))


def _entry_head(buf: bytes, pos: int, end: int, earlier: list[bytes], names: set) -> tuple:
    """A table entry's name, kind byte and shape at ``pos``, every check of :func:`_read_tensor` made (and the
    duplicate-name check): (name bytes, name, kind, dims, numel, position after them); _Leave where any would
    refuse them or the entry has a form of its own (IndexError past the end, UnicodeDecodeError)."""
    d = buf[pos]
    pos += 1
    if d >= 0x80:
        d, pos = _varint_tail(buf, pos, d)
    if d:
        if d > len(earlier):
            raise _Leave
        ref = earlier[-d]
        p = buf[pos]
        pos += 1
        if p >= 0x80:
            p, pos = _varint_tail(buf, pos, p)
        q = buf[pos]
        pos += 1
        if q >= 0x80:
            q, pos = _varint_tail(buf, pos, q)
        m = buf[pos]
        pos += 1
        if m >= 0x80:
            m, pos = _varint_tail(buf, pos, m)
        if p > len(ref) or q > len(ref) - p or m > MAX_NAME_BYTES - p - q or pos + m > end:
            raise _Leave
        nb = ref[:p] + buf[pos : pos + m] + ref[len(ref) - q :]
    else:
        m = buf[pos]
        pos += 1
        if m >= 0x80:
            m, pos = _varint_tail(buf, pos, m)
        if m > MAX_NAME_BYTES or pos + m > end:
            raise _Leave
        nb = buf[pos : pos + m]
    pos += m
    name = nb.decode("utf-8")
    if not nb or len(name) > MAX_NAME or name in names:
        raise _Leave
    kind = buf[pos]
    pos += 1
    ndim = kind >> 2
    if kind & 0xC0 or ndim > MAX_NDIM:
        raise _Leave
    numel = bound = 1
    dims = []
    for _ in range(ndim):
        s = buf[pos]
        pos += 1
        if s >= 0x80:
            s, pos = _varint_tail(buf, pos, s)
        numel *= s
        bound *= s or 1
        if bound > MAX_TENSOR_ELEMENTS:
            raise _Leave
        dims.append(s)
    return nb, name, kind, dims, numel, pos


def _read_coded(
    t: _Reader, left: int, form: Form, earlier: list[bytes], names: set, records: list, lays: list, tables, mode: int
) -> bool:
    """Read up to ``left`` table entries of the table's default form where that is a coded one (``sparse`` or
    ``dense_q``, alone or in a ``zstd`` record) whose forms store only varint fields in each entry (Rice's bit
    count), appending what :func:`_read_tensor` would give: the entries' fields read in one pass, up to the first
    entry with a form of its own, then the checks of the layout rules made over all of them at once (their
    ``many``). Where a check over them would be refused, nothing is kept and ``t.pos`` stays where it was
    (:func:`_read_tensor` then reads the entries and raises what it raises). Returns whether to read here again
    after the next entry: not where the form is not one read here, nor after a refusal (every entry would be read
    again and again). The same records with fewer calls: tests/test_format_fast.py reads valid and corrupt tables
    through both."""
    enc, inner, v, vparams, i, iparams = form
    wrapped = enc in WRAPPERS
    base = inner if wrapped else enc
    if (wrapped and enc != "zstd") or base not in CODED or (not wrapped and mode != DATA_RECORDS):
        return False
    sparse = base == "sparse"
    parts = [("v", v.tag, vparams, v)]  # (the forms as the table declares them: FormSpec)
    if sparse:
        parts.append(("i", i.tag, iparams, i))
    stored = [f for _, _, _, spec in parts for f in spec.fields]
    if any(f.kind != "varint" for f in stored):
        return False
    zbytes = wrapped and mode == DATA_RECORDS
    buf, pos, end = t.buf, t.pos, t.end
    first, known, spent0 = pos, len(earlier), earlier.spent
    rows, got = [], set()  # (name, dtype, shape, nnz, numel, stored field values, zbytes) per entry
    try:
        for _ in range(left):
            start = pos
            try:
                nb, name, kind, dims, numel, pos = _entry_head(buf, pos, end, earlier, names)
                if earlier.spent + len(nb) > MAX_NAMES_BYTES:  # (_read_tensor reads it again, and refuses it)
                    raise _Leave
                nnz = numel
                if sparse:
                    nnz, pos = _read_nnz(buf, pos, numel)
                vals = []
                for f in stored:
                    if f.empty is not None and not nnz:
                        vals.append(f.empty)
                        continue
                    x = buf[pos]
                    pos += 1
                    if x >= 0x80:
                        x, pos = _varint_tail(buf, pos, x)
                    if not f.lo <= x <= f.hi:
                        raise _Leave
                    vals.append(x)
                zb = None
                if zbytes:
                    zb = buf[pos]
                    pos += 1
                    if zb >= 0x80:
                        zb, pos = _varint_tail(buf, pos, zb)
            except (_Leave, IndexError, UnicodeDecodeError):
                pos = start
                break
            names.add(name)
            got.add(name)
            earlier.spent += len(nb)
            earlier.append(nb)
            rows.append((name, DTYPE_CODES[kind & 3], tuple(dims), nnz, numel, vals, zb))
        if not rows:
            return True
        ok = _coded_rows(rows, enc, base, parts, tables, mode, records, lays)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:  # nothing kept: the entries are read again, one by one
        names.difference_update(got)
        del earlier[known:]
        earlier.spent = spent0
        t.pos = first
        return False
    t.pos = pos
    return True


def _coded_rows(rows: list, enc: str, base: str, parts: list, tables, mode: int, records, lays) -> bool:
    """:func:`_read_coded`'s entries made records, appended with their layouts, where the layout rules' ``many``
    takes every one of them (and each compressed size is within its bound); else False and nothing is appended."""
    names, dts, shapes, nnz, numels, vals, zbs = map(list, zip(*rows))
    num, nz = np.array(numels, np.int64), np.array(nnz, np.int64)
    columns: list[tuple[str, list]] = []  # each codec dict's keys, in _read_part's order, and their values
    at = 0
    for key, tag, params, spec in parts:
        columns.append((key, [tag] * len(rows)))
        columns.extend((name, [value] * len(rows)) for name, value in params)
        if spec.derived:
            wants = list(map(spec.derive, nnz, numels))
            columns.extend((k, list(map(itemgetter(k), wants))) for k in spec.derived)
        for f in spec.fields:
            columns.append((f.name, list(map(itemgetter(at), vals))))
            at += 1
    keys = [k for k, _ in columns]
    codecs = [dict(zip(keys, row)) for row in zip(*(col for _, col in columns))]
    cols = Columns(dts, num, nz, codecs)
    rule = tables.get(base)
    lay = getattr(rule, "many", lambda c: None)(cols)
    if lay is None:
        return False
    if enc in WRAPPERS:
        raw = layout_nbytes(lay, num)
        raws = raw.tolist()
        if mode == DATA_RECORDS:
            wcodecs = [{"inner": base, "raw": r, "zbytes": z, "ic": c} for r, z, c in zip(raws, zbs, codecs)]
            wlay = getattr(tables.get(enc), "many", lambda c: None)(cols._replace(codecs=wcodecs))
            if wlay is None or list(wlay) != ["compressed"]:
                return False
            lays.extend([[("compressed", "uint8", z)] for z in zbs])
        else:
            wcodecs = [{"inner": base, "raw": r, "ic": c} for r, c in zip(raws, codecs)]
            lays.extend([[("", "uint8", r)] for r in raws])
        records.extend(map(TensorRecord, names, dts, shapes, repeat(enc), nnz, _dicts(len(rows)), wcodecs))
        return True
    per = [
        list(zip(repeat(role), canonical_dtypes(allowed, numels), counts.tolist()))
        for role, (allowed, counts) in lay.items()
    ]
    lays.extend(map(list, zip(*per)) if len(per) > 1 else ([x] for x in per[0]))
    records.extend(map(TensorRecord, names, dts, shapes, repeat(base), nnz, _dicts(len(rows)), codecs))
    return True


def _read_plain(
    t: _Reader, left: int, enc: str, earlier: list[bytes], names: set, records: list, lays: list
) -> _SharedCoo | None:
    """Read up to ``left`` table entries of the table's default form where that is plain ``coo`` or ``dense``
    (the records of a payload without value, index or bytes stages), appending what :func:`_read_tensor` would
    give; stop before the first entry that has a form of its own or that any check of :func:`_read_tensor` (or
    the duplicate-name check) would refuse, leaving ``t.pos`` at its start. The same checks with fewer calls:
    tests/test_format_fast.py reads valid and corrupt tables through both. A whole table (read from its first
    entry to its last here) is remembered, and a table that repeats one of the latest few but for its nnz is read
    by :func:`_read_known` (which may give the whole table's layouts and records as a :class:`_SharedCoo`:
    returned, ``records`` and ``lays`` left empty)."""
    whole = not earlier
    if whole:
        known = _read_known(t, left, enc, names, earlier, records, lays)
        if known:
            return known if type(known) is _SharedCoo else None
    buf, pos, end = t.buf, t.pos, t.end
    coo = enc == "coo"
    heads = []
    for _ in range(left):
        start = pos
        try:
            nb, name, kind, dims, numel, pos = _entry_head(buf, pos, end, earlier, names)
            dtype = DTYPE_CODES[kind & 3]
            vd = _TENSOR_DTYPE.get(dtype, "float32")
            heads.append(buf[start:pos])
            if coo:
                nnz, pos = _read_nnz(buf, pos, numel)
                lay = [("indices", "uint32" if numel <= U32_INDEX_NUMEL else "uint64", nnz), ("values", vd, nnz)]
            else:
                nnz = numel
                lay = [("values", vd, numel)]
            spent = earlier.spent + len(nb)
            if spent > MAX_NAMES_BYTES:  # (_read_tensor reads it again, and refuses it)
                raise _Leave
        except (_Leave, IndexError, UnicodeDecodeError):
            t.pos = start
            return
        names.add(name)
        earlier.spent = spent
        earlier.append(nb)
        records.append(TensorRecord(name, dtype, tuple(dims), enc, nnz, {}, {}))
        lays.append(lay)
    t.pos = pos
    if whole and left:
        _remember(enc, heads, records, earlier, lays)


def _remember(enc: str, heads: list[bytes], records: list, earlier: list[bytes], lays: list) -> None:
    """Keep a whole plain table just read (:class:`_Known`), the latest few, where its heads take at most
    ``_KNOWN_MAX_BYTES``."""
    if sum(map(len, heads)) > _KNOWN_MAX_BYTES:
        return
    coo = enc == "coo"
    index_dtypes = tuple(lay[0][1] if coo else "" for lay in lays)
    value_dtypes = tuple(lay[-1][1] for lay in lays)
    numels = tuple(r.numel for r in records)
    known = _Known(
        enc,
        tuple(heads),
        tuple(r.name for r in records),
        tuple(earlier),
        tuple(r.dtype for r in records),
        tuple(r.shape for r in records),
        numels,
        index_dtypes,
        value_dtypes,
        coo and set(index_dtypes) == {"uint32"} and set(value_dtypes) == {"float32"},
        np.cumsum(list(map(len, heads)), dtype=np.int64),
        np.frombuffer(b"".join(heads), np.uint8),
        np.array(numels, np.int64),
        [_varint_widths([r.nnz for r in records])],
    )
    global _KNOWN
    _KNOWN = (known, *(k for k in _KNOWN if k.heads != known.heads or k.enc != enc))[:_KNOWN_KEPT]


def _read_tensor(t: _Reader, earlier: list[bytes], default: Form, layouts, mode: int, version: int):
    nb = _read_name(t, earlier)
    try:
        name = nb.decode("utf-8")
    except UnicodeDecodeError:
        raise PayloadHeaderError(f"{t.what}: tensor name {nb[:64]!r} is not UTF-8") from None
    if len(name) > MAX_NAME:
        raise PayloadHeaderError(f"{t.what}: tensor name of {len(name)} characters (max {MAX_NAME})")
    where = f"tensor {name!r}"
    kind = t.u8("tensor kind")
    if kind & 0x80:
        raise PayloadHeaderError(f"{where}: reserved bit 7 of the kind byte is set")
    dtype, ndim = DTYPE_CODES[kind & 3], (kind >> 2) & 15
    if ndim > MAX_NDIM:
        raise PayloadLimitError(f"{where}: {ndim} dimensions (at most {MAX_NDIM})")
    form = _read_form(t, layouts) if kind & 0x40 else default
    shape = tuple(t.varint("a dimension", MAX_TENSOR_ELEMENTS, PayloadLimitError) for _ in range(ndim))
    numel = check_shape(shape, where)
    enc, inner, v, vparams, i, iparams = form
    base = inner if enc in WRAPPERS else enc
    nnz = t.varint("nnz", numel, PayloadLayoutError) if base in ("coo", "sparse") else numel
    codec: dict[str, Any] = {}
    if base in CODED:
        _read_part(t, v, vparams, nnz, numel, "v", codec)
        if base == "sparse":
            _read_part(t, i, iparams, nnz, numel, "i", codec)
    rec = TensorRecord(name, dtype, shape, base, nnz, {}, codec)
    if enc in WRAPPERS:
        raw = sum(n * BUFFER_DTYPES[dt].itemsize for _, dt, n in _rule(rec, layouts, where))
        wc: dict[str, Any] = {"algo": "zstd"} if enc == "nvcomp" else {}
        wc.update(inner=base, raw=raw)
        chunk = None
        if enc == "nvcomp" and version == CHUNKED and mode == DATA_RECORDS:
            log2 = t.u8("nvcomp chunk size")
            if not (MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2):
                raise PayloadHeaderError(
                    f"{where}: nvcomp chunk size 2^{log2} is not from 2^{MIN_CHUNK_LOG2} to 2^{MAX_CHUNK_LOG2}"
                )
            chunk = 1 << log2
        if mode == DATA_RECORDS:
            bound = compress_bound(raw) if chunk is None else frames_bound(raw, chunk)
            wc["zbytes"] = t.varint("compressed size", bound, PayloadLayoutError)
        else:
            if enc != "zstd":
                raise PayloadLayoutError(f"{where}: a shared frame holds only zstd records, not {enc!r}")
        if codec:
            wc["ic"] = codec
        rec = TensorRecord(name, dtype, shape, enc, nnz, {}, wc, chunk=chunk)
        if mode != DATA_RECORDS:
            return rec, nb, [("", "uint8", raw)]
    elif mode != DATA_RECORDS:
        raise PayloadLayoutError(f"{where}: a shared frame holds only zstd records")
    return rec, nb, _rule(rec, layouts, where)


def _read_part(t: _Reader, spec: FormSpec, params: tuple, nnz: int, numel: int, key: str, codec: dict) -> None:
    """A form's codec-dict fields: its tag, its params, the fields derived from the counts, then the fields stored in
    the entry (those with an ``empty`` value are stored only where something is kept)."""
    codec[key] = spec.tag
    codec.update(params)
    if spec.derived:
        want = spec.derive(nnz, numel)
        codec.update((k, want[k]) for k in spec.derived)
    for f in spec.fields:
        codec[f.name] = f.empty if f.empty is not None and not nnz else f.decode(t)


def _rule(rec: TensorRecord, layouts, where: str) -> list[tuple[str, str, int]]:
    rule = layouts.get(rec.encoding)
    if rule is None:
        raise PayloadHeaderError(f"{where}: encoding {rec.encoding!r} is not known to this reader")
    try:
        layout = rule(rec)
    except PayloadError:
        raise
    except (KeyError, TypeError, ValueError) as ex:
        raise PayloadHeaderError(f"{where}: codec parameters do not fit encoding {rec.encoding!r}: {ex}") from None
    return [(role, canonical_dtype(allowed, rec), count) for role, (allowed, count) in layout.items()]


def _read_table(mv: memoryview, version: int, flags: int, end: int, layouts, reader: type = _Reader) -> tuple:
    """Parse the prefix's table length(s) and the table of a payload whose bytes before ``end`` hold the table
    and the data. Returns (end of the table, pipeline, metadata, fingerprint, records, their buffer layouts).
    ``reader`` reads the table (a subclass may record where each field lies: gpu_codec.testing.fuzz)."""
    r, tlen, traw = _table_lengths(mv, flags, end)
    table = r.take(tlen, "the tensor table")
    if traw is not None:
        try:
            table = bounded_decompress(table, traw, "the compressed tensor table")
        except WindowLimitError:  # (refused as every frame's is)
            raise
        except PayloadError as e:  # (a frame's own checks: here it is the header that is bad)
            raise PayloadHeaderError(f"the compressed tensor table does not decompress to {traw} bytes: {e}") from None
    mode = (flags >> DATA_SHIFT) & 3
    t = reader(table, 0, len(table), "tensor table")
    tables = tables_of(layouts)
    pipeline = [_read_stage(t, tables) for _ in range(t.varint("stage count", MAX_STAGES))]
    metadata: Any = {}
    if flags & FLAG_METADATA:
        mlen = t.varint("metadata length", t.end - t.pos)
        metadata = loads_json(t.take(mlen, "metadata"), "metadata", MAX_JSON_VALUES, MAX_JSON_DEPTH)
        if not isinstance(metadata, dict):
            raise PayloadHeaderError("metadata must be a JSON object")
    fingerprint = None
    if flags & FLAG_FINGERPRINT:
        fingerprint = t.take(FINGERPRINT_BYTES, "the base fingerprint").hex()
    default = _read_form(t, tables)
    count = t.varint("tensor count", MAX_TENSORS, PayloadLimitError)
    records, layouts_of, names, earlier = [], [], set(), _Names()
    enc = default[0]
    plain = reader is _Reader and mode == DATA_RECORDS and enc in BASE_LAYOUTS and tables.get(enc) is BASE_LAYOUTS[enc]
    coded = reader is _Reader and enc not in BASE_LAYOUTS
    while len(records) < count:
        if plain:
            shared = _read_plain(t, count - len(records), enc, earlier, names, records, layouts_of)
            if shared is not None:  # (the whole table: its layouts and its records in one object)
                layouts_of, records = shared, shared.records
            if len(records) == count:
                break
        if coded:  # (refused once: the rest of the table is read entry by entry)
            coded = _read_coded(t, count - len(records), default, earlier, names, records, layouts_of, tables, mode)
            if len(records) == count:
                break
        rec, nb, lay = _read_tensor(t, earlier, default, tables, mode, version)
        earlier.spent += len(nb)
        if earlier.spent > MAX_NAMES_BYTES:
            raise PayloadLimitError(
                f"{t.what}: the tensor names take more than {MAX_NAMES_BYTES} bytes (at tensor {len(records)})"
            )
        earlier.append(nb)
        if rec.name in names:
            raise PayloadHeaderError(f"tensor {rec.name!r} appears twice")
        names.add(rec.name)
        records.append(rec)
        layouts_of.append(lay)
    if t.pos != t.end:
        raise PayloadHeaderError(f"tensor table has {t.end - t.pos} bytes after its last tensor")
    return r.pos, pipeline, metadata, fingerprint, records, layouts_of


def _check_not_truncated(mv: memoryview, version: int, flags: int, layouts) -> None:
    """Where the checksum fails: a PayloadTruncatedError if the payload is shorter than its table says (the table
    itself cut off, or the data it implies missing), so a cut payload is reported as cut, not only as corrupt.
    Any other fault found on the way is left to the checksum error."""
    n = len(mv)
    what = f"payload is truncated: {n} bytes"
    try:
        r, tlen, _ = _table_lengths(mv, flags, n)
        if r.pos + tlen + _CRC.size > n:
            raise PayloadTruncatedError(
                f"{what}, its prefix declares a table of {tlen} bytes: with the checksum, at least "
                f"{r.pos + tlen + _CRC.size} bytes"
            )
        header_end, *_, layouts_of = _read_table(mv, version, flags, n, layouts)
    except PayloadTruncatedError:
        raise
    except PayloadError:
        return
    mode = (flags >> DATA_SHIFT) & 3
    if mode == DATA_ZSTD:
        try:
            size = zstd_frame_size(mv[header_end:], "shared zstd frame")
        except PayloadLayoutError as e:
            if hasattr(e, "needs"):
                raise PayloadTruncatedError(
                    f"{what}, its shared zstd frame is cut off: with the checksum, at least "
                    f"{header_end + e.needs + _CRC.size} bytes"
                ) from None
            return
        need = header_end + size + _CRC.size
        req(need <= n, PayloadTruncatedError, f"{what}, its shared zstd frame and checksum need {need}")
        return
    total = _data_size(layouts_of)
    need = header_end + total + _CRC.size
    req(need <= n, PayloadTruncatedError, f"{what}, its tensor table implies {need} ({total} bytes of data)")


def unpack(
    blob: bytes | bytearray | memoryview,
    layouts: Mapping[str, LayoutRule] | None = None,
    *,
    describe: bool = True,
    columns: bool = False,
) -> tuple[dict, list[TensorRecord] | RecordTable]:
    """Validate a v2 or v3 payload completely; return (header, records). See :func:`gpu_codec.format.unpack`."""
    layouts = BASE_LAYOUTS if layouts is None else layouts
    mv = memoryview(blob).cast("B")
    n = len(mv)
    req(n >= MIN_SIZE, PayloadTruncatedError, f"payload is {n} bytes, shorter than the smallest valid v2 payload")
    _, version, flags = _PREFIX.unpack_from(mv, 0)
    (stored,) = _CRC.unpack_from(mv, n - _CRC.size)
    computed = zlib.crc32(mv[: n - _CRC.size]) & 0xFFFFFFFF
    if stored != computed:
        if not flags & FLAG_RESERVED and (flags >> DATA_SHIFT) & 3 < len(DATA_MODES):
            _check_not_truncated(mv, version, flags, layouts)
        raise PayloadChecksumError(
            f"checksum mismatch: payload is corrupt (stored 0x{stored:08x}, computed 0x{computed:08x})"
        )
    req(not flags & FLAG_RESERVED, PayloadHeaderError, f"flags 0x{flags:02x} set reserved bits")
    mode = (flags >> DATA_SHIFT) & 3
    req(mode < len(DATA_MODES), PayloadHeaderError, f"unknown data mode {mode}")
    end = n - _CRC.size
    header_end, pipeline, metadata, fingerprint, records, layouts_of = _read_table(mv, version, flags, end, layouts)
    data_len = end - header_end
    total = _data_size(layouts_of)
    data = mv[header_end:end]
    if mode == DATA_RECORDS:
        req(
            total == data_len,
            PayloadTruncatedError if total > data_len else PayloadLayoutError,
            f"data section is {data_len} bytes, the tensor table implies {total}",
        )
        _views(records, layouts_of, data)
    else:
        req(bool(records), PayloadLayoutError, "a shared frame needs at least one tensor")
        if mode == DATA_ZSTD:
            req(
                0 < data_len <= compress_bound(total),
                PayloadLayoutError,
                f"shared zstd frame of {data_len} bytes is outside (0, {compress_bound(total)}] for {total} raw bytes",
            )
            check_frame(data, total, "shared zstd frame")
            cs = zstandard.get_frame_parameters(data).content_size
            req(cs == total, PayloadLayoutError, "the shared zstd frame must declare its content size")
            check_one_frame(data, "shared zstd frame")
        else:
            req(
                total == data_len,
                PayloadTruncatedError if total > data_len else PayloadLayoutError,
                f"data section is {data_len} bytes, the table implies {total}",
            )
        frame = SharedFrame(data, total, mode == DATA_ZSTD)
        off = 0
        for rec, lay in zip(records, layouts_of):
            size = lay[0][2]
            rec.frame = FrameSlice(frame, off, size)
            off += size
    header = {
        "format": "gpu_codec",
        "version": version,
        "pipeline": pipeline,
        "metadata": metadata,
        "data": DATA_MODES[mode],
        "header_nbytes": header_end,
        "data_length": data_len,
    }
    if describe:
        header["tensors"] = [
            {"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "encoding": r.encoding, "nnz": r.nnz}
            | ({"codec": r.codec} if r.codec else {})
            | ({"chunk": r.chunk} if r.chunk is not None else {})
            for r in records
        ]
    if fingerprint is not None:
        header["base_fingerprint"] = fingerprint
    if not columns and type(records) is RecordTable:
        records = records.records()
    return header, records


__all__ = ["CHUNKED", "VERSION", "header_size", "multi_frame", "pack", "plan", "unpack", "uvarint"]
