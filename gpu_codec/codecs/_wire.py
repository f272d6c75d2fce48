"""Wire encodings added by the codecs and their layout rules (see :func:`gpu_codec.format.register_layout`).

``sparse``
    A top-k tensor whose ``codec`` dict says how its parts are stored: ``"i"`` the index form (``raw``:
    ``indices`` uint32/uint64; ``rice``: ``indices`` as uint8 bytes, with ``"k"`` and ``"bits"``), ``"v"`` the
    value form (``f32``, ``f16``, ``bf16``: ``values``; ``int8``: ``values`` int8 + ``scales`` float32, with
    ``"block"``; ``ternary``: ``signs`` uint8, with ``"mu"``). Index buffers come first.
``dense_q``
    Every element of a tensor (``compress(..., fraction=None)``) in one of the value forms.
``zstd``, ``nvcomp``
    One ``compressed`` uint8 buffer holding the tensor's buffers of encoding ``"inner"`` (codec ``"ic"``)
    concatenated without padding; ``"raw"`` is their exact size, ``"zbytes"`` the compressed size.

Every rule computes exact buffer sizes from nnz, numel and the codec fields, and rejects fields that are
missing, mistyped, out of range or inconsistent (a Rice bit count outside what nnz and numel allow, a raw size
that is not what the inner encoding implies), so nothing is read from a buffer that the header got wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import index_dtype
from ..errors import PayloadHeaderError, PayloadLayoutError
from ..format import BUFFER_DTYPES, LAYOUTS, TensorRecord, register_layout

Layout = dict[str, tuple[tuple[str, ...], int]]
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Form:
    """One way of storing a tensor's values (or indices): its codec-dict fields, layout and decoder."""

    tag: str
    fields: tuple[str, ...]
    layout: Callable[[TensorRecord, int], Layout]
    decode: Callable[..., Any]


VALUE_FORMS: dict[str, Form] = {}
INDEX_FORMS: dict[str, Form] = {}
WRAPPERS = ("zstd", "nvcomp")
ENCODINGS = ("sparse", "dense_q", *WRAPPERS)
_INNER = ("coo", "dense", "sparse", "dense_q")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def where(rec: TensorRecord) -> str:
    return f"tensor {rec.name!r}"


def _form(table: dict[str, Form], tag: Any, what: str, rec: TensorRecord) -> Form:
    if not isinstance(tag, str) or tag not in table:
        raise PayloadHeaderError(f"{where(rec)}: unknown {what} form {tag!r} (known: {', '.join(sorted(table))})")
    return table[tag]


def _only(rec: TensorRecord, allowed: set[str]) -> None:
    extra = sorted(set(rec.codec) - allowed)
    if extra:
        raise PayloadHeaderError(f"{where(rec)}: unexpected codec field(s) {extra} for encoding {rec.encoding!r}")


def _sparse_layout(rec: TensorRecord) -> Layout:
    vf = _form(VALUE_FORMS, rec.codec.get("v"), "value", rec)
    inf = _form(INDEX_FORMS, rec.codec.get("i"), "index", rec)
    _only(rec, {"v", "i", *vf.fields, *inf.fields})
    return {**inf.layout(rec, rec.nnz), **vf.layout(rec, rec.nnz)}


def _dense_q_layout(rec: TensorRecord) -> Layout:
    vf = _form(VALUE_FORMS, rec.codec.get("v"), "value", rec)
    _only(rec, {"v", *vf.fields})
    if rec.nnz != rec.numel:
        raise PayloadLayoutError(f"{where(rec)}: a dense tensor must have nnz = numel = {rec.numel}, got {rec.nnz}")
    return vf.layout(rec, rec.numel)


def canonical_dtype(allowed: tuple[str, ...], rec: TensorRecord) -> str:
    """The one dtype a buffer has inside a compressed blob (index width follows the element count)."""
    if len(allowed) == 1:
        return allowed[0]
    return index_dtype(rec.numel).name


def inner_record(rec: TensorRecord) -> TensorRecord:
    inner, ic = rec.codec.get("inner"), rec.codec.get("ic", {})
    if inner not in _INNER:
        raise PayloadHeaderError(f"{where(rec)}: inner encoding {inner!r} must be one of {list(_INNER)}")
    if not isinstance(ic, dict) or (inner in ("coo", "dense") and ic):
        raise PayloadHeaderError(f"{where(rec)}: inner codec fields {ic!r} do not fit inner encoding {inner!r}")
    return TensorRecord(rec.name, rec.dtype, rec.shape, inner, rec.nnz, {}, dict(ic))


def raw_layout(rec: TensorRecord) -> list[tuple[str, str, int]]:
    """(role, dtype, element count) of each inner buffer, in order: the blob's exact layout."""
    layout = LAYOUTS[rec.encoding](rec)
    return [(role, canonical_dtype(allowed, rec), count) for role, (allowed, count) in layout.items()]


def raw_nbytes(rec: TensorRecord) -> int:
    return sum(count * BUFFER_DTYPES[dt].itemsize for _, dt, count in raw_layout(rec))


def compress_bound(raw: int) -> int:
    """An upper bound on a zstd frame of ``raw`` bytes (ZSTD_compressBound plus the frame header)."""
    return raw + (raw >> 8) + ((128 << 10) - raw >> 11 if raw < (128 << 10) else 0) + 32


def _wrapped_layout(rec: TensorRecord) -> Layout:
    fields = {"inner", "ic", "raw", "zbytes"} | ({"algo"} if rec.encoding == "nvcomp" else set())
    _only(rec, fields)
    if rec.encoding == "nvcomp" and rec.codec.get("algo") != "zstd":
        raise PayloadHeaderError(
            f"{where(rec)}: nvcomp algorithm {rec.codec.get('algo')!r} is not supported (this reader decodes 'zstd')"
        )
    inner = inner_record(rec)
    expect = raw_nbytes(inner)
    raw, zb = rec.codec.get("raw"), rec.codec.get("zbytes")
    if not is_int(raw) or raw != expect:
        raise PayloadLayoutError(
            f"{where(rec)}: declared raw size {raw!r} is not the {expect} bytes that encoding "
            f"{inner.encoding!r} implies for nnz {rec.nnz} of {rec.numel}"
        )
    if not is_int(zb) or not 0 < zb <= compress_bound(raw):
        raise PayloadLayoutError(
            f"{where(rec)}: compressed size {zb!r} is outside (0, {compress_bound(raw)}] for {raw} raw bytes"
        )
    return {"compressed": (("uint8",), zb)}


def split_raw(rec: TensorRecord, raw: bytes) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for role, dt, count in raw_layout(rec):
        out[role] = np.frombuffer(raw, dtype=BUFFER_DTYPES[dt], count=count, offset=off)
        rec.buffer_dtypes[role] = dt
        off += count * BUFFER_DTYPES[dt].itemsize
    return out


def value_dtype_name(rec: TensorRecord) -> str:
    return "float64" if rec.dtype == "float64" else "float32"


def n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def check_block(rec: TensorRecord) -> int:
    b = rec.codec.get("block")
    if not is_int(b) or not 1 <= b <= (1 << 20):
        raise PayloadHeaderError(f"{where(rec)}: int8 block size {b!r} must be an integer in [1, 2^20]")
    return b


def check_mu(rec: TensorRecord) -> float:
    mu = rec.codec.get("mu")
    if (
        isinstance(mu, bool)
        or not isinstance(mu, (int, float))
        or not 0 <= mu <= _F32_MAX
        or float(np.float32(mu)) != float(mu)
    ):
        raise PayloadHeaderError(f"{where(rec)}: ternary mu {mu!r} must be a finite, non-negative float32 value")
    return float(mu)


register_layout("sparse", _sparse_layout)
register_layout("dense_q", _dense_q_layout)
for _w in WRAPPERS:
    register_layout(_w, _wrapped_layout)
