"""A pipeline of codecs: top-k, then a value codec, an index codec and a lossless stage, each optional.

Its config (a list of codec configs) travels in the payload header, so a receiver rebuilds the decoder from
the payload alone; every tensor record also says how it is encoded, and the two must agree.

>>> import numpy as np, gpu_codec
>>> pipe = gpu_codec.Pipeline([{"id": "quantize", "dtype": "float16"}, gpu_codec.RiceIndices(), gpu_codec.Zstd()])
>>> pipe.get_config()
[{'id': 'quantize', 'dtype': 'float16'}, {'id': 'rice'}, {'id': 'zstd', 'level': 3}]
>>> pipe.is_lossy(), gpu_codec.Pipeline.from_config(pipe.get_config()) == pipe
(True, True)
>>> u = {"w": np.arange(100, dtype=np.float32)}
>>> blob = gpu_codec.compress(u, fraction=0.02, pipeline=pipe).to_bytes()
>>> gpu_codec.Payload.from_bytes(blob).pipeline[0]
{'id': 'topk', 'fraction': 0.02, 'scope': 'global', 'score': 'magnitude'}
>>> np.flatnonzero(gpu_codec.decompress(blob)["w"]).tolist()
[98, 99]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from ..backends.base import Backend, gathered, later
from ..constants import TOGETHER_BATCH, TOGETHER_MOST
from ..dtypes import index_dtype, value_dtype
from ..errors import (
    CodecConfigError,
    InvalidInputError,
    PayloadError,
    PayloadHeaderError,
    PayloadLayoutError,
    UnknownCodecError,
)
from ..format import BUFFER_DTYPES, TensorRecord
from ..format.common import (
    CODED,
    WRAPPED_KEYS,
    WRAPPED_SHARED_KEYS,
    Columns,
    FrameSlice,
    StreamedBuffer,
    bounded_decompress,
    canonical_dtypes,
    laid_out,
    open_stream,
    role_nbytes,
    same_keys,
    same_str,
)
from ..xp.rice import MANY_BITS, rice_decode_many
from .base import STAGES, Codec, ValueOverflow
from .quantize import Quantize
from .registry import get_codec, index_forms, value_forms, wire_layouts
from .rice import RawIndices, RiceIndices
from .wire import inner_record, is_int, raw_layout, where
from .zstd import encode_wrapped


class Pipeline:
    """An ordered list of codecs (objects or config dicts): at most one of each stage, in the order
    sparsify (``topk``), values (``quantize``, ``int8``, ``ternary``), indices (``rice``), bytes (``zstd``,
    ``nvcomp``)."""

    def __init__(self, stages: Iterable[Codec | Mapping[str, Any]] = ()):
        if isinstance(stages, (str, bytes, Mapping)) or not isinstance(stages, Iterable):
            raise CodecConfigError(f"a pipeline takes a list of codecs or codec configs, got {type(stages).__name__}")
        built: list[Codec] = []
        for s in stages:
            if isinstance(s, Codec):
                built.append(s)
            elif isinstance(s, Mapping):
                built.append(get_codec(s))
            else:
                raise CodecConfigError(f"a pipeline stage must be a codec or a config dict, got {type(s).__name__}")
        order = [STAGES.index(c.stage) for c in built]
        if any(a >= b for a, b in pairwise(order)):
            raise CodecConfigError(
                "pipeline stages must come in the order "
                + " -> ".join(STAGES)
                + ", at most one of each; got "
                + " -> ".join(c.codec_id for c in built)
            )
        self.stages: tuple[Codec, ...] = tuple(built)
        by = {c.stage: c for c in built}
        self.topk = by.get("sparsify")
        self.values = by.get("values")
        self.indices = by.get("indices")
        self.bytes = by.get("bytes")

    def get_config(self) -> list[dict[str, Any]]:
        """The list of codec configs (JSON), as stored in a payload header."""
        return [s.get_config() for s in self.stages]

    @classmethod
    def from_config(cls, config: Iterable[Mapping[str, Any]]) -> Pipeline:
        return cls(config)

    def is_lossy(self) -> bool:
        """True if any stage is lossy (OpenFL's ``TransformationPipeline.is_lossy``)."""
        return any(not s.lossless for s in self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self):
        return iter(self.stages)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and other.stages == self.stages

    def __hash__(self) -> int:
        return hash(self.stages)

    def __repr__(self) -> str:
        return f"Pipeline([{', '.join(map(repr, self.stages))}])"

    # --- engine hooks -------------------------------------------------------------------------------------------

    def after_topk(self) -> list[dict[str, Any]]:
        """Configs of the stages after top-k (the engine writes the top-k config itself)."""
        return [s.get_config() for s in self.stages if s.stage != "sparsify"]

    def _coded(self) -> bool:
        return self.values is not None or self.indices is not None

    @property
    def _value_tag(self) -> str:
        """The value form this pipeline's records carry (``f32`` without a value stage)."""
        return self.values.tag if self.values is not None else "f32"

    @property
    def _index_tag(self) -> str:
        """The index form of its sparse records (``raw`` without an index stage)."""
        return self.indices.tag if self.indices is not None else "raw"

    def plain(self) -> bool:
        """No stage after top-k: its records are ``coo`` / ``dense`` buffers as the selection wrote them."""
        return not self._coded() and self.bytes is None

    def encode(self, records: list[TensorRecord], backend: Backend, residual: list[Any] | None) -> list[TensorRecord]:
        """Turn the engine's ``coo`` (or ``dense``) records into this pipeline's encodings, on the backend.

        ``residual`` (lists over tensors, or None) receives ``value - decoded`` at every kept entry.
        """
        if not records:
            return records
        dense = records[0].encoding == "dense"
        if dense and self.indices is not None:
            raise InvalidInputError(
                f"the {self.indices.codec_id!r} index stage needs a sparse (top-k) update; "
                "fraction=None encodes every tensor densely, with no indices"
            )
        host_bytes = self.bytes is not None and self.bytes.on_host
        host: list[dict] = []
        # the stages' host reads (ternary's mu, Rice's bit counts) and, for a bytes stage on the host, the coded
        # buffers themselves: one copy for all, where the block ends (backends.base.gathered), which is the call's
        # wait; a bytes stage on the device (nvCOMP) runs after it and ends with its own copy to the host
        try:
            with gathered(backend):
                if self._coded():
                    vals = [r.buffers["values"] for r in records]
                    idxs = [None if dense else r.buffers["indices"] for r in records]
                    res = residual if residual is not None else [None] * len(records)
                    vc = self.values if self.values is not None else Quantize("float32")
                    vparts = vc.encode_values(vals, idxs, res, backend)
                    if dense:
                        iparts = [({}, {}, {})] * len(records)
                    else:
                        ic = self.indices if self.indices is not None else RawIndices()
                        iparts = ic.encode_indices(idxs, [r.numel for r in records], backend)
                if host_bytes:
                    if self._coded():
                        bufs_of = [{**ib, **vb} for (_, vb, _), (_, ib, _) in zip(vparts, iparts)]
                    else:
                        bufs_of = [r.buffers for r in records]
                    roles = [list(b) for b in bufs_of]
                    arrays = [b[role] for b, rs in zip(bufs_of, roles) for role in rs]

                    def keep(copies: list) -> None:
                        it = iter(copies)
                        host.extend({role: next(it) for role in rs} for rs in roles)

                    later(backend, arrays, keep)
        except ValueOverflow as e:  # (raised where the host reads came back: no record made, no residual kept)
            raise InvalidInputError(
                f"tensor {records[e.position].name!r}: {e.what} (kept values past float32's range); send them with "
                "no value codec"
            ) from None
        if self._coded():
            out = []
            for r, (vf, vb, vd), (inf, ib, idt) in zip(records, vparts, iparts):
                codec = {"v": vc.tag, **vf}
                if not dense:
                    codec.update({"i": self._index_tag, **inf})
                out.append(
                    TensorRecord(
                        r.name,
                        r.dtype,
                        r.shape,
                        "dense_q" if dense else "sparse",
                        r.nnz,
                        {**ib, **vb},
                        codec,
                        {**idt, **vd},
                    )
                )
            records = out
        if self.bytes is not None:
            records = encode_wrapped(self.bytes, records, backend, wire_layouts(), host if host_bytes else None)
        return records

    def _expect(self, rec: TensorRecord) -> None:
        enc = rec.encoding
        if self.bytes is not None:
            if enc != self.bytes.encoding:
                raise PayloadLayoutError(
                    f"{where(rec)} is encoded {enc!r}, but the payload's pipeline ends with {self.bytes.codec_id!r}"
                )
            enc = rec.codec.get("inner")
        elif enc not in ("coo", "dense", *CODED):
            raise PayloadLayoutError(
                f"{where(rec)} is encoded {enc!r}, but the payload's pipeline has no {enc!r} stage"
            )
        dense = enc in ("dense", "dense_q")
        if dense and self.indices is not None:
            raise PayloadLayoutError(
                f"{where(rec)} is encoded {enc!r} (dense), but the payload's pipeline has the index stage "
                f"{self.indices.codec_id!r}, which only sparse tensors use"
            )
        want = ("dense_q" if dense else "sparse") if self._coded() else ("dense" if dense else "coo")
        if enc != want:
            raise PayloadLayoutError(f"{where(rec)} is encoded {enc!r}; the payload's pipeline produces {want!r}")

    def _together(self) -> bool:
        """Whether records of this pipeline may be decoded a window at once (:func:`_decoded_many`): sparse records
        (alone or in zstd records) whose values are stored one by one (f32, f16, bf16) and whose indices are raw
        or Rice coded."""
        vt, it = self._value_tag, self._index_tag
        return (
            (self.bytes is None or self.bytes.encoding == "zstd")
            and self._coded()
            and vt in ("f32", "f16", "bf16")
            and it in ("raw", "rice")
        )

    def _check_forms(self, rec: TensorRecord) -> None:
        vt, it = self._value_tag, self._index_tag
        if rec.codec.get("v") != vt or (rec.encoding == "sparse" and rec.codec.get("i") != it):
            raise PayloadLayoutError(
                f"{where(rec)} holds values {rec.codec.get('v')!r} / indices "
                f"{rec.codec.get('i')!r}; the payload's pipeline says {vt!r} / {it!r}"
            )
        if (
            self.values is not None
            and "block" in rec.codec
            and rec.codec["block"] != getattr(self.values, "block_size", None)
        ):
            raise PayloadLayoutError(f"{where(rec)}: int8 block {rec.codec['block']} differs from the pipeline's")

    def decode(self, records: list[TensorRecord], backend: Backend) -> list[TensorRecord]:
        """Turn this pipeline's encodings back into ``coo``/``dense`` records with backend buffers.

        Every record must be what this pipeline writes (a ``coo`` record in a payload whose pipeline has an
        index stage is a :class:`~gpu_codec.errors.PayloadLayoutError`, as is any other mismatch).
        """
        out = []
        for d in self.decode_stream(records, backend):
            idx = None if d.indices is None else d.indices(0, d.nnz)
            vals = d.values(0, d.nnz)
            bufs = {"values": vals} if idx is None else {"indices": idx, "values": vals}
            out.append(TensorRecord(d.name, d.dtype, d.shape, "dense" if idx is None else "coo", d.nnz, bufs))
        return out

    def decode_stream(self, records: list[TensorRecord], backend: Backend) -> Iterator[Decoded]:
        """Decode one record at a time (the engine scatters each before the next is decoded, so the temporaries
        of only one tensor are alive at once). A dense tensor's values are decoded a slice at a time. With a Rice
        index stage, the Rice streams of a window of small records read from bytes are decoded at once
        (:func:`~gpu_codec.xp.rice.rice_decode_many`; where one fails a check, each is decoded alone, which raises
        its error), a window's records checked and unwrapped before the first is yielded; an error of a record
        is raised after the records before it are yielded, as one record at a time would."""
        layouts = wire_layouts()
        rice = isinstance(self.indices, RiceIndices)
        together = self._together()
        pos = 0
        while pos < len(records):
            ahead = RICE_WINDOW if rice else 1
            if together:  # (small records: a window's frames and entries decoded at once)
                got = _decoded_many(self, records, pos, layouts, backend)
                if got:
                    yield from got
                    pos += len(got)
                    continue
                if got is None:  # (the next record is not a small one: it alone, then the windows again)
                    ahead = 1
            window: list = []  # the next records, as decoded (checked and unwrapped)
            failed = None
            entries = 0
            for rec in records[pos : pos + ahead]:
                try:
                    self._expect(rec)
                    if self.bytes is not None:
                        rec = _unwrap(rec, layouts)
                    if rec.encoding in CODED:
                        self._check_forms(rec)
                except PayloadError as e:
                    failed = _named(e, rec)
                    break
                window.append(rec)
                entries += rec.nnz
                if entries > RICE_MANY:
                    break
            pos += len(window)
            pre = _rice_many(window) if rice else {}
            for rec in window:
                try:
                    d = _decoded(rec, backend, pre.get(id(rec)))
                except PayloadError as e:
                    raise _named(e, rec) from None
                yield d
            if failed is not None:
                raise failed


RICE_WINDOW = 256  # records a Rice payload's decode looks ahead at once, at most
RICE_MOST, RICE_MANY = TOGETHER_MOST, TOGETHER_BATCH  # (a record decoded with others, at most; a window, at most)


def _named(e: PayloadError, rec: TensorRecord) -> PayloadError:
    """``e`` with its message starting with where ``rec`` is, as every decode error does."""
    msg = str(e)
    return type(e)(msg if msg.startswith(where(rec)) else f"{where(rec)}: {msg}")


def _rice_many(window: list[TensorRecord]) -> dict[int, np.ndarray]:
    """The indices of the window's small Rice records read from bytes (at most RICE_MANY entries and MANY_BITS
    stream bits), decoded at once (by id of record); none where any fails a check (each is then decoded alone,
    which raises its error) or fewer than two are."""
    recs, entries, nbits = [], 0, 0
    for r in window:
        c = r.codec
        if (
            r.encoding == "sparse"
            and c.get("i") == "rice"
            and is_int(r.nnz)
            and 0 < r.nnz <= RICE_MOST
            and is_int(c.get("k"))
            and is_int(c.get("bits"))
            and host_resident(r)
        ):  # (anything else, a record made by hand among them, is decoded alone, which checks it)
            entries, nbits = entries + r.nnz, nbits + c["bits"]
            if entries > RICE_MANY or nbits > MANY_BITS:
                break
            recs.append(r)
    if len(recs) < 2:
        return {}
    streams = [np.asarray(_whole(r.buffers["indices"])) for r in recs]
    codec = [r.codec for r in recs]
    got = rice_decode_many(
        streams, [c["bits"] for c in codec], [c["k"] for c in codec], [r.nnz for r in recs], [r.numel for r in recs]
    )
    return {} if got is None else {id(r): i for r, i in zip(recs, got)}


def _decoded_many(pipe: Pipeline, records: list, pos: int, layouts: Any, backend: Backend) -> list[Decoded] | None:
    """The records from ``pos`` on, as many as make a window (at most RICE_WINDOW records of at most RICE_MOST
    entries each, RICE_MANY entries in all), decoded at once on the host, each as :func:`_decoded` decodes a
    record read from bytes: their frames read once (one range of a shared frame, or each record's frame; records
    without a bytes stage: their own buffers), their layouts by the rule's ``many``, their values decoded by one
    call, their Rice streams by
    :func:`~gpu_codec.xp.rice.rice_decode_many`. None where fewer than two records make the window; empty where
    any check of the one-by-one decode might fail (that decode then runs, and raises the error that names the
    record)."""
    window, entries = [], 0
    for rec in records[pos : pos + RICE_WINDOW]:
        n = rec.nnz
        if type(n) is not int or not 0 <= n <= RICE_MOST or entries + n > RICE_MANY:
            break
        window.append(rec)
        entries += n
    if len(window) < 2:
        return None
    try:
        return _decode_window(pipe, window, layouts, backend)
    except (PayloadError, TypeError, ValueError, KeyError, OverflowError):
        return []


def _decode_window(pipe: Pipeline, window: list, layouts: Any, backend: Backend) -> list[Decoded]:
    """:func:`_decoded_many` of a window of records (raises, or returns [], where the window is not one it
    decodes)."""
    codecs = [r.codec for r in window]
    wrapped = pipe.bytes is not None
    if wrapped and not (same_keys(codecs, WRAPPED_SHARED_KEYS) or same_keys(codecs, WRAPPED_KEYS)):
        return []
    for r in window:  # (encodings and forms the pipeline makes)
        pipe._expect(r)
    ics = [c["ic"] for c in codecs] if wrapped else codecs
    if set(map(type, ics)) != {dict} or (wrapped and not same_str([c.get("inner") for c in codecs], "sparse")):
        return []
    vt, it = pipe._value_tag, pipe._index_tag
    if not (same_str([c.get("v") for c in ics], vt) and same_str([c.get("i") for c in ics], it)):
        return []
    dts = [r.dtype for r in window]
    vds = set(map(value_dtype, dts))
    if len(vds) != 1:
        return []
    cols = Columns.of(window, ics)
    num, nz = cols.numels, cols.nnz
    nnz, numels = nz.tolist(), num.tolist()
    lay = layouts["sparse"].many(cols)
    if lay is None or list(lay) != ["indices", "values"]:
        return []
    (iallowed, _), (vallowed, vcounts) = lay["indices"], lay["values"]
    idts, vdt = canonical_dtypes(iallowed, numels), BUFFER_DTYPES[vallowed[0]]
    got = _window_parts(window, codecs, lay, num, idts, vdt) if wrapped else _own_parts(window, lay, num, idts, vdt)
    if got is None:
        return []
    ibufs, bits = got
    if bits.size != int(vcounts.sum()):
        return []
    cpu = backend.host
    with _quiet():
        vals = cpu.as_values(value_forms()[vt].decode(window[0], {"values": bits}, bits.size, cpu), np.dtype(vds.pop()))
    if it == "rice":
        got = rice_decode_many(ibufs, [c["bits"] for c in ics], [c["k"] for c in ics], nnz, numels)
        if got is None:
            return []
        idx = [x.astype(index_dtype(m), copy=False) for x, m in zip(got, numels)]
    else:
        idx = [x.astype(index_dtype(m), copy=False) for x, m in zip(ibufs, numels)]
    cuts = np.cumsum(nz).tolist()
    out = []
    for r, i, a, b in zip(window, idx, [0, *cuts[:-1]], cuts):
        v = vals[a:b]
        head = (r.name, r.dtype, tuple(r.shape), r.nnz)
        out.append(Decoded(*head, _slicer(v, backend), _slicer(i, backend), host=(i, v)))
    return out


def _window_parts(window: list, codecs: list, lay: dict, num: np.ndarray, idts: list, vdt: np.dtype) -> tuple | None:
    """Zstd records: (each record's index buffer, every record's value buffer joined), cut from their raw bytes
    (:func:`_window_bytes`) by the layout; None where their raw sizes are not the layout's or their frames are not
    read here."""
    raws = [c["raw"] for c in codecs]
    ibytes, vbytes = role_nbytes(lay, num)
    if set(map(type, raws)) != {int} or raws != (ibytes + vbytes).tolist():
        return None
    data = _window_bytes(window, raws)
    if data is None:
        return None
    buf = np.frombuffer(data, np.uint8)
    starts = np.cumsum(raws) - np.array(raws, np.int64)
    vstart = (starts + ibytes).tolist()
    vend = (starts + ibytes + vbytes).tolist()
    ibufs = [buf[a:b].view(BUFFER_DTYPES[d]) for a, b, d in zip(starts.tolist(), vstart, idts)]
    return ibufs, np.concatenate([buf[a:b] for a, b in zip(vstart, vend)]).view(vdt)


def _own_parts(window: list, lay: dict, num: np.ndarray, idts: list, vdt: np.dtype) -> tuple | None:
    """Records with their own buffers (no bytes stage): (each record's index buffer, every record's value buffer
    joined); None where a record's buffers are not host arrays of its layout's roles, dtypes and sizes
    (:func:`~gpu_codec.format.common.laid_out`)."""
    columns = laid_out(window, [r.buffers for r in window], lay, num)
    if columns is None:
        return None
    ibufs, vbufs = columns
    if set(map(type, ibufs)) | set(map(type, vbufs)) != {np.ndarray} or len({a.dtype for a in vbufs}) != 1:
        return None  # (values of one dtype: fp16 bits as float16 or uint16, joined as they are)
    return [a.view(BUFFER_DTYPES[d]) for a, d in zip(ibufs, idts)], np.concatenate(vbufs).view(vdt)


def _window_bytes(window: list, raws: list[int]) -> Any:
    """The window's records' raw bytes, back to back: one range of the shared frame that holds them all in order,
    or each record's own frame decompressed (checked as a frame stream checks it); None where they are neither."""
    frames = [r.frame for r in window]
    if frames.count(None) == len(frames):
        comp = [r.buffers.get("compressed") for r in window]
        if not same_keys([dict(r.buffers) for r in window], {"compressed"}) or any(r.chunk is not None for r in window):
            return None
        if set(map(type, comp)) != {np.ndarray} or {a.dtype for a in comp} != {np.dtype(np.uint8)}:
            return None
        frames = [memoryview(np.ascontiguousarray(a)) for a in comp]
        return b"".join(bounded_decompress(f, raw, where(r)) for f, raw, r in zip(frames, raws, window))
    if set(map(type, frames)) != {FrameSlice} or len({id(f.frame) for f in frames}) != 1:
        return None
    offsets = [f.offset for f in frames]
    if [f.nbytes for f in frames] != raws or any(a + n != b for a, n, b in zip(offsets, raws, offsets[1:])):
        return None
    return frames[0].frame.read(offsets[0], offsets[-1] + raws[-1], where(window[0]))


@dataclass
class Decoded:
    """One tensor's entries, decoded on demand: ``values(a, b)`` are entries ``[a, b)`` as fp32 (fp64 for fp64
    tensors) backend arrays, ``indices(a, b)`` their flat positions (``None`` for a dense tensor, where entry
    ``l`` is element ``l``). ``a`` must be a multiple of ``step``. ``host``: a plain COO record's indices and
    values as read from bytes (host arrays), which a decode may join on the host before one copy to the device.
    ``host_values``: where a dense record was read from bytes for a device decode, its values decoded whole on the
    host (fp32, fp64 for fp64 tensors), for a decode that joins a run of small tensors' values there before one
    copy."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nnz: int
    values: Callable[[int, int], Any]
    indices: Callable[[int, int], Any] | None
    step: int = 1
    host: tuple[np.ndarray, np.ndarray] | None = None
    host_values: Callable[[], np.ndarray] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _unwrap(rec: TensorRecord, layouts: Any) -> TensorRecord:
    """The inner record of a ``zstd``/``nvcomp`` record, its buffers left in the frame: each is a
    :class:`~gpu_codec.format.common.StreamedBuffer` that decompresses the range a slice asks for (the frame is
    checked whole first, in one pass that keeps nothing), so no more than a chunk of its entries is ever held."""
    inner = inner_record(rec)
    raw = int(rec.codec["raw"])
    if rec.frame is not None:  # a share of the frame of every tensor (wire format v2)
        source: Any = rec.frame.source(where(rec))
    else:
        frame = memoryview(np.ascontiguousarray(rec.buffers["compressed"]))  # no copy of the compressed bytes
        source = open_stream(frame, raw, rec.chunk, raw, where(rec))
    off = 0
    for role, dt, count in raw_layout(inner, layouts):
        inner.buffers[role] = StreamedBuffer(source, off, BUFFER_DTYPES[dt], count)
        inner.buffer_dtypes[role] = dt
        off += count * BUFFER_DTYPES[dt].itemsize
    return inner


def _slicer(a_full: Any, backend: Backend, dtype: Any = None) -> Callable[[int, int], Any]:
    def part(a: int, b: int) -> Any:
        x = backend.asarray(a_full[a:b])
        return x if dtype is None else x.astype(dtype, copy=False)

    return part


def _quiet():
    # a hostile payload's values may be inf or NaN, or overflow when widened: the scatter refuses them, with an
    # error of ours, so NumPy's floating-point warnings on the way are noise
    return np.errstate(over="ignore", invalid="ignore")


def _decoded(rec: TensorRecord, backend: Backend, indices: np.ndarray | None = None) -> Decoded:
    """The record's :class:`Decoded`; ``indices``: its indices decoded already, on the host (a Rice record's, by
    :func:`_rice_many`)."""
    vd = np.dtype(value_dtype(rec.dtype))
    head = (rec.name, rec.dtype, tuple(rec.shape), rec.nnz)
    # a record read from bytes (host buffers: NumPy's own arrays, not a subclass standing for a device's) for a
    # device: its entries are decoded where they lie, on the host
    from_bytes = backend.on_device and host_resident(rec)
    if rec.encoding == "coo":
        vals, idx = rec.buffers["values"], rec.buffers["indices"]
        host = (idx, vals) if type(idx) is np.ndarray and type(vals) is np.ndarray else None
        return Decoded(*head, _slicer(vals, backend), _slicer(idx, backend), host=host)
    if rec.encoding == "dense":
        whole = (lambda: np.asarray(_whole(rec.buffers["values"]))) if from_bytes else None
        return Decoded(*head, _slicer(rec.buffers["values"], backend), None, host_values=whole)
    vform = value_forms()[rec.codec["v"]]
    iform = index_forms()[rec.codec["i"]] if rec.encoding == "sparse" else None
    iroles = set(iform.layout(rec, rec.nnz)) if iform is not None else set()
    host = {role: x for role, x in rec.buffers.items() if role not in iroles}

    def values(a: int, b: int) -> Any:  # a slice of entries at a time, sparse or dense
        bufs = {role: backend.asarray(x) for role, x in vform.slice(rec, host, a, b).items()}
        with _quiet():
            return backend.as_values(vform.decode(rec, bufs, b - a, backend), vd)

    if iform is None:

        def host_values() -> np.ndarray:
            cpu = backend.host
            with _quiet():
                return cpu.as_values(vform.decode(rec, vform.slice(rec, host, 0, rec.nnz), rec.nnz, cpu), vd)

        return Decoded(*head, values, None, vform.step(rec), host_values=host_values if from_bytes else None)
    if from_bytes:
        # a sparse record read from bytes: its entries decoded where they lie, on the host (the twins' bytes, with
        # no host wait and no launch a tensor), so a device decode joins them with the others' and copies them once
        cpu = backend.host
        if indices is None:
            indices = iform.decode(rec, {r: _whole(rec.buffers[r]) for r in iroles}, rec.nnz, cpu)
        idx = indices.astype(index_dtype(rec.numel), copy=False)
        with _quiet():
            vals = cpu.as_values(vform.decode(rec, vform.slice(rec, host, 0, rec.nnz), rec.nnz, cpu), vd)
        return Decoded(*head, _slicer(vals, backend), _slicer(idx, backend), host=(idx, vals))
    if indices is None and rec.codec.get("i") == "raw":  # (read a slice at a time where they lie, a frame's too)
        return Decoded(*head, values, _slicer(rec.buffers["indices"], backend, index_dtype(rec.numel)), vform.step(rec))
    if indices is not None:
        idx = backend.asarray(indices).astype(index_dtype(rec.numel), copy=False)
    else:
        ibufs = {role: backend.asarray(_whole(rec.buffers[role])) for role in iroles}
        idx = iform.decode(rec, ibufs, rec.nnz, backend).astype(index_dtype(rec.numel), copy=False)
        del ibufs
    return Decoded(*head, values, _slicer(idx, backend), vform.step(rec))


def host_resident(rec: TensorRecord) -> bool:
    """Whether every buffer of a record lies in host memory as read from bytes: NumPy's own arrays (not a subclass
    standing for a device's) or a frame's streams."""
    return all(type(x) is np.ndarray or isinstance(x, StreamedBuffer) for x in rec.buffers.values())


def _whole(a: Any) -> Any:
    return a[0 : len(a)] if isinstance(a, StreamedBuffer) else a


def as_pipeline(pipeline: Any) -> Pipeline:
    """None, a :class:`Pipeline`, or a list of codecs / configs, as a Pipeline (errors as InvalidInputError)."""
    if pipeline is None:
        return Pipeline(())
    if isinstance(pipeline, Pipeline):
        return pipeline
    try:
        return Pipeline(pipeline)
    except (UnknownCodecError, CodecConfigError) as e:
        raise type(e)(f"pipeline: {e}") from None


def decoder_for(pipeline_config: Any) -> Pipeline:
    """The pipeline a payload's header names (PayloadHeaderError if it cannot be rebuilt)."""
    try:
        return Pipeline.from_config(pipeline_config)
    except (UnknownCodecError, CodecConfigError) as e:
        raise PayloadHeaderError(f"the payload's pipeline cannot be rebuilt: {e}") from None


def decode_records(pipeline_config: Any, records: list[TensorRecord], backend: Backend) -> list[TensorRecord]:
    """Every record decoded (and checked) per the header's pipeline, all at once (the engine streams instead,
    with :meth:`Pipeline.decode_stream`)."""
    return decoder_for(pipeline_config).decode(records, backend)
