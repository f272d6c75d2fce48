"""The codec encodings on the wire and their layout rules, built from the forms the codecs declare.

``sparse``
    A top-k tensor whose ``codec`` dict says how its parts are stored: ``"i"`` the index form (``raw``:
    ``indices`` uint32/uint64; ``rice``: ``indices`` as uint8 bytes, with ``"k"`` and ``"bits"``), ``"v"`` the
    value form (``f32``, ``f16``, ``bf16``: ``values``; ``int8``: ``values`` int8 + ``scales`` float32, with
    ``"block"``; ``ternary``: ``signs`` uint8, with ``"mu"``). Index buffers come first.
``dense_q``
    Every element of a tensor (``compress(..., fraction=None)``) in one of the value forms.
``zstd``, ``nvcomp``
    One ``compressed`` uint8 buffer holding the tensor's buffers of encoding ``"inner"`` (codec ``"ic"``)
    concatenated without padding; ``"raw"`` is their exact size, ``"zbytes"`` the compressed size. The buffer is
    one zstd frame, or (an ``nvcomp`` record whose ``chunk`` is set, wire format v3) one frame per ``chunk`` raw
    bytes, back to back.

Every rule computes exact buffer sizes from nnz, numel and the codec fields, and rejects fields that are
missing, mistyped, out of range or inconsistent (a Rice bit count outside what nnz and numel allow, a raw size
that is not what the inner encoding implies), so nothing is read from a buffer that the header got wrong.
:func:`build_layouts` turns the registered forms into the rules that :func:`gpu_codec.format.unpack` takes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import PayloadHeaderError, PayloadLayoutError
from ..format import BASE_LAYOUTS, BUFFER_DTYPES, LayoutRule, TensorRecord
from ..format.common import (
    CODED,
    WRAPPED_KEYS,
    Columns,
    canonical_dtype,
    check_chunk,
    compress_bound,
    frames_bound,
    layout_nbytes,
    role_nbytes,
    same_keys,
    same_str,
)
from .base import BytesCodec, Form, Layout

INNER = ("coo", "dense", *CODED)  # what a bytes stage may wrap


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def where(rec: TensorRecord) -> str:
    return f"tensor {rec.name!r}"


def n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def value_dtype_name(rec: TensorRecord) -> str:
    return "float64" if rec.dtype == "float64" else "float32"


def _form(table: Mapping[str, Form], tag: Any, what: str, rec: TensorRecord) -> Form:
    if not isinstance(tag, str) or tag not in table:
        raise PayloadHeaderError(f"{where(rec)}: unknown {what} form {tag!r} (known: {', '.join(sorted(table))})")
    return table[tag]


def _only(rec: TensorRecord, allowed: set[str]) -> None:
    extra = sorted(set(rec.codec) - allowed)
    if extra:
        raise PayloadHeaderError(f"{where(rec)}: unexpected codec field(s) {extra} for encoding {rec.encoding!r}")


def inner_encoding(rec: TensorRecord) -> str:
    """The encoding of a record's entries: a ``zstd``/``nvcomp`` record's inner one, any other record's own."""
    return rec.codec.get("inner", rec.encoding) if rec.encoding in ("zstd", "nvcomp") else rec.encoding


def inner_record(rec: TensorRecord) -> TensorRecord:
    """The record a ``zstd``/``nvcomp`` record wraps, without buffers."""
    inner, ic = rec.codec.get("inner"), rec.codec.get("ic", {})
    if inner not in INNER:
        raise PayloadHeaderError(f"{where(rec)}: inner encoding {inner!r} must be one of {list(INNER)}")
    if not isinstance(ic, dict) or (inner in ("coo", "dense") and ic):
        raise PayloadHeaderError(f"{where(rec)}: inner codec fields {ic!r} do not fit inner encoding {inner!r}")
    return TensorRecord(rec.name, rec.dtype, rec.shape, inner, rec.nnz, {}, dict(ic))


def raw_layout(rec: TensorRecord, layouts: Mapping[str, LayoutRule]) -> list[tuple[str, str, int]]:
    """(role, dtype, element count) of each inner buffer, in order: the blob's exact layout."""
    layout = layouts[rec.encoding](rec)
    return [(role, canonical_dtype(allowed, rec), count) for role, (allowed, count) in layout.items()]


def raw_nbytes(rec: TensorRecord, layouts: Mapping[str, LayoutRule]) -> int:
    return sum(count * BUFFER_DTYPES[dt].itemsize for _, dt, count in raw_layout(rec, layouts))


def gather(records: list[TensorRecord], backend: Any, layouts: Mapping[str, LayoutRule]) -> tuple[Any, list[int]]:
    """Every record's buffers concatenated in layout order into one uint8 array in the backend's memory, and
    each record's byte count."""
    parts, sizes = [], []
    for rec in records:
        n = 0
        for role, _, count in raw_layout(rec, layouts):
            a = backend.asarray(rec.buffers[role])
            if int(a.size) != count:
                raise AssertionError(f"{where(rec)}: buffer {role!r} has {int(a.size)} entries, layout says {count}")
            parts.append(a.reshape(-1).view(np.uint8))
            n += int(a.nbytes)
        sizes.append(n)
    flat = backend.xp.concatenate(parts) if parts else backend.xp.zeros(0, np.uint8)
    return flat, sizes


def host_raw(rec: TensorRecord, host: Mapping[str, np.ndarray], layouts: Mapping[str, LayoutRule]) -> bytes:
    """A record's buffers concatenated in layout order, from their host copies ``host`` (by role; each at least
    its layout's bytes long: a copy may run past them, as a Rice stream placed before its bit count was read)."""
    sizes = [(role, count * BUFFER_DTYPES[dt].itemsize) for role, dt, count in raw_layout(rec, layouts)]
    return _joined(rec, host, sizes)


def _joined(rec: TensorRecord, host: Mapping[str, np.ndarray], sizes: Iterable[tuple[str, int]]) -> bytes:
    """The first ``n`` bytes of each buffer ``role`` of ``host``, for each ``(role, n)`` of ``sizes``, joined."""
    out = []
    for role, n in sizes:
        b = host[role]
        if b.nbytes < n:
            raise AssertionError(f"{where(rec)}: buffer {role!r} has {b.nbytes} bytes, layout says {n}")
        out.append(
            b if b.nbytes == n and b.flags.c_contiguous else np.ascontiguousarray(b).reshape(-1).view(np.uint8)[:n]
        )
    return b"".join(out)  # (NumPy arrays are bytes-like: joined without a copy of each)


def host_raws(
    records: list[TensorRecord], host: list[Mapping[str, np.ndarray]], layouts: Mapping[str, LayoutRule]
) -> list[bytes]:
    """:func:`host_raw` of every record: their layouts by the rule's ``many`` at once where the records share an
    encoding whose rule has one, else record by record."""
    encs = {r.encoding for r in records}
    many = getattr(layouts.get(next(iter(encs))), "many", None) if len(encs) == 1 else None
    cols = Columns.of(records) if many is not None else None
    lay = many(cols) if many is not None else None
    if lay is None:
        return [host_raw(rec, h, layouts) for rec, h in zip(records, host)]
    nbytes = [x.tolist() for x in role_nbytes(lay, cols.numels)]  # each role's bytes, a record each
    return [_joined(rec, h, zip(lay, sizes)) for rec, h, sizes in zip(records, host, zip(*nbytes))]


def build_layouts(
    value_forms: Mapping[str, Form], index_forms: Mapping[str, Form], wrappers: Mapping[str, type[BytesCodec]]
) -> dict[str, LayoutRule]:
    """Layout rules of every encoding: the container's ``coo``/``dense``, ``sparse`` and ``dense_q`` over the
    given forms, and one wrapper encoding per bytes codec."""
    layouts: dict[str, LayoutRule] = dict(BASE_LAYOUTS)

    def sparse(rec: TensorRecord) -> Layout:
        vf = _form(value_forms, rec.codec.get("v"), "value", rec)
        inf = _form(index_forms, rec.codec.get("i"), "index", rec)
        _only(rec, {"v", "i", *vf.names, *inf.names})
        return {**inf.layout(rec, rec.nnz), **vf.layout(rec, rec.nnz)}

    def dense_q(rec: TensorRecord) -> Layout:
        vf = _form(value_forms, rec.codec.get("v"), "value", rec)
        _only(rec, {"v", *vf.names})
        if rec.nnz != rec.numel:
            raise PayloadLayoutError(f"{where(rec)}: a dense tensor must have nnz = numel = {rec.numel}, got {rec.nnz}")
        return vf.layout(rec, rec.numel)

    def wrapped(rec: TensorRecord) -> Layout:
        cls = wrappers[rec.encoding]
        _only(rec, {"inner", "ic", "raw", "zbytes", *cls.fields})
        cls.check_fields(rec)
        inner = inner_record(rec)
        expect = raw_nbytes(inner, layouts)
        raw, zb = rec.codec.get("raw"), rec.codec.get("zbytes")
        if not is_int(raw) or raw != expect:
            raise PayloadLayoutError(
                f"{where(rec)}: declared raw size {raw!r} is not the {expect} bytes that encoding "
                f"{inner.encoding!r} implies for nnz {rec.nnz} of {rec.numel}"
            )
        if rec.chunk is None:
            bound = compress_bound(raw)
        elif cls.chunk is None:
            raise PayloadHeaderError(f"{where(rec)}: a {rec.encoding!r} tensor is one zstd frame, not chunked")
        else:
            bound = frames_bound(raw, check_chunk(rec.chunk, where(rec)))
        if not is_int(zb) or not 0 < zb <= bound:
            raise PayloadLayoutError(
                f"{where(rec)}: compressed size {zb!r} is outside (0, {bound}] for {raw} raw bytes"
            )
        return {"compressed": (("uint8",), zb)}

    def forms_of(cols: Columns, parts: tuple[str, ...]) -> list[Form] | None:
        """The forms every codec dict of ``cols`` names (``parts``: "v", or "v" and "i"), where each dict holds
        exactly their keys; None where the dicts differ in forms or keys, or a form has no ``many``."""
        codecs = cols.codecs
        c0 = codecs[0] if codecs else None
        if type(c0) is not dict:
            return None
        forms = []
        for key, table in zip(parts, (value_forms, index_forms)):
            tag = c0.get(key)
            f = table.get(tag) if type(tag) is str else None
            if f is None or f.many is None:
                return None
            forms.append(f)
        if not same_keys(codecs, {*parts, *(name for f in forms for name in f.names)}):
            return None
        return forms if all(same_str(list(map(itemgetter(k), codecs)), c0[k]) for k in parts) else None

    def sparse_many(cols: Columns) -> dict | None:
        forms = forms_of(cols, ("v", "i"))
        if forms is None:
            return None
        vx, ix = forms[0].many(cols, cols.nnz), forms[1].many(cols, cols.nnz)
        if vx is None or ix is None or vx.keys() & ix.keys():
            return None
        return {**ix, **vx}

    def dense_q_many(cols: Columns) -> dict | None:
        forms = forms_of(cols, ("v",))
        if forms is None or not np.array_equal(cols.nnz, cols.numels):
            return None
        return forms[0].many(cols, cols.numels)

    def wrapped_many(enc: str):
        cls = wrappers[enc]

        def many(cols: Columns) -> dict | None:
            if cls.fields or (cols.chunks is not None and any(c is not None for c in cols.chunks)) or not cols.codecs:
                return None  # (a wrapper's own fields, or frames in chunks: record by record)
            codecs = cols.codecs
            if not same_keys(codecs, WRAPPED_KEYS):
                return None
            inner = codecs[0]["inner"]
            ics = list(map(itemgetter("ic"), codecs))
            if inner not in CODED or not same_str(list(map(itemgetter("inner"), codecs)), inner):
                return None
            if set(map(type, ics)) != {dict}:
                return None
            raw, zb = list(map(itemgetter("raw"), codecs)), list(map(itemgetter("zbytes"), codecs))
            if set(map(type, raw)) != {int} or set(map(type, zb)) != {int}:
                return None
            lay = layouts[inner].many(cols._replace(codecs=ics))
            if lay is None:
                return None
            try:
                raw_a, zb_a = np.array(raw, np.int64), np.array(zb, np.int64)
            except OverflowError:
                return None
            ok = np.array_equal(raw_a, layout_nbytes(lay, cols.numels))
            if not (ok and ((zb_a > 0) & (zb_a <= compress_bound(raw_a))).all()):
                return None
            return {"compressed": (("uint8",), zb_a)}

        return many

    sparse.many = sparse_many  # type: ignore[attr-defined]
    dense_q.many = dense_q_many  # type: ignore[attr-defined]
    layouts["sparse"] = sparse
    layouts["dense_q"] = dense_q
    for enc in wrappers:
        rule = functools.partial(wrapped)  # (a rule of its own a wrapper: its many knows the wrapper)
        rule.many = wrapped_many(enc)  # type: ignore[attr-defined]
        layouts[enc] = rule
    return layouts
