"""An independent reader of the gpu_codec wire format, version 1, written from docs/FORMAT.md alone.

It uses NumPy, zlib and zstandard and imports nothing from gpu_codec, so comparing its output with
``gpu_codec.decompress`` checks the document against the code. Section numbers (§) refer to docs/FORMAT.md.

``read(blob)`` returns the dense deltas (float32, float64 for float64 tensors); ``read(blob, base)`` returns
``base + delta`` in the base's dtype (bfloat16 as uint16 bit patterns). A payload that breaks a rule of §11
raises :class:`SpecError`, whose ``kind`` names the error class gpu_codec's reader raises for the same fault.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

MAGIC = b"GPUCODEC"
PREFIX = struct.Struct("<8sII")
MAX_HEADER = 16 << 20
MAX_TENSORS = 100_000
MAX_NDIM = 8
MAX_NAME = 1024
MAX_NUMEL = 1 << 40
MAX_WINDOW = 1 << 27
LN2 = 0.6931471805599453
F32_MAX = float(np.finfo(np.float32).max)

TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64")
BUFFER_DTYPES = {
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
ENCODINGS = ("coo", "dense", "sparse", "dense_q", "zstd", "nvcomp")
CODED = ("sparse", "dense_q", "zstd", "nvcomp")
WRAPPERS = ("zstd", "nvcomp")
INNER = ("coo", "dense", "sparse", "dense_q")
VALUE_FIELDS = {"f32": (), "f16": (), "bf16": (), "int8": ("block",), "ternary": ("mu",)}
INDEX_FIELDS = {"raw": (), "rice": ("k", "bits")}

# §9: id -> (stage, {field: default})
CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "topk": ("sparsify", {"fraction": 0.01, "scope": "global", "score": "magnitude"}),
    "quantize": ("values", {"dtype": "float16"}),
    "int8": ("values", {"block_size": 256}),
    "ternary": ("values", {}),
    "rice": ("indices", {}),
    "zstd": ("bytes", {"level": 3}),
    "nvcomp": ("bytes", {"algorithm": "zstd"}),
}
STAGES = ("sparsify", "values", "indices", "bytes")
SCORES = (
    "magnitude",
    "largest_final_magnitude",
    "smallest_final_magnitude",
    "largest_magnitude_change",
    "smallest_magnitude_change",
    "largest_increase_in_magnitude",
    "smallest_increase_in_magnitude",
    "custom",
)
QUANTIZE_TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


class SpecError(ValueError):
    """A payload that breaks the spec. ``kind``: header, version, checksum, layout, dtype, limit or index."""

    def __init__(self, kind: str, msg: str):
        super().__init__(f"[{kind}] {msg}")
        self.kind = kind


def need(cond: bool, kind: str, msg: str) -> None:
    if not cond:
        raise SpecError(kind, msg)


def is_int(x: Any) -> bool:
    return type(x) is int  # a JSON integer (json gives int only for literals without fraction or exponent)


def is_num(x: Any) -> bool:
    return type(x) in (int, float)


def align8(n: int) -> int:
    return (n + 7) // 8 * 8


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rice_k(nnz: int, numel: int) -> int:
    """§8.2."""
    if nnz == 0 or numel <= nnz:
        return 0
    x = ((numel - nnz) / nnz) * LN2
    if x < 2.0:
        return 0
    return min(40, math.floor(math.log2(x)))


def zstd_bound(raw: int) -> int:
    """§6.2."""
    return raw + (raw >> 8) + ((131072 - raw) >> 11 if raw < 131072 else 0) + 32


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    nnz: int
    codec: dict
    buffers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def vdtype(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"


# ---------------------------------------------------------------------------------------------- §6, §7, §8 layouts

Layout = list[tuple[str, tuple[str, ...], int]]  # (role, allowed dtypes, element count), in order


def value_layout(t: Tensor, n: int) -> Layout:
    v = t.codec["v"]
    if v == "f32":
        return [("values", (t.vdtype,), n)]
    if v == "f16":
        return [("values", ("float16",), n)]
    if v == "bf16":
        return [("values", ("bfloat16",), n)]
    if v == "int8":
        b = t.codec.get("block")
        need(is_int(b) and 1 <= b <= 1 << 20, "header", f"{t.name}: bad int8 block {b!r}")
        return [("values", ("int8",), n), ("scales", ("float32",), ceil_div(n, b))]
    mu = t.codec.get("mu")
    need(
        is_num(mu) and 0 <= mu <= F32_MAX and float(np.float32(mu)) == float(mu),
        "header",
        f"{t.name}: ternary mu {mu!r} is not a finite non-negative binary32 value",
    )
    return [("signs", ("uint8",), ceil_div(n, 8))]


def index_layout(t: Tensor) -> Layout:
    if t.codec["i"] == "raw":
        return [("indices", ("uint32", "uint64"), t.nnz)]
    k, bits = t.codec.get("k"), t.codec.get("bits")
    need(is_int(k) and k == rice_k(t.nnz, t.numel), "header", f"{t.name}: Rice k {k!r} is not rice_k(nnz, numel)")
    lo, hi = t.nnz * (k + 1), t.nnz * (k + 1) + ((t.numel - t.nnz) >> k)
    need(is_int(bits) and lo <= bits <= hi, "header", f"{t.name}: Rice bits {bits!r} outside [{lo}, {hi}]")
    return [("indices", ("uint8",), ceil_div(bits, 8))]


def check_fields(t: Tensor, allowed: set[str]) -> None:
    extra = set(t.codec) - allowed
    need(not extra, "header", f"{t.name}: unexpected codec fields {sorted(extra)}")


def check_form(t: Tensor, key: str, table: dict) -> tuple[str, ...]:
    tag = t.codec.get(key)
    need(isinstance(tag, str) and tag in table, "header", f"{t.name}: unknown form {key}={tag!r}")
    return table[tag]


def inner_tensor(t: Tensor) -> Tensor:
    inner, ic = t.codec.get("inner"), t.codec.get("ic", {})
    need(isinstance(inner, str) and inner in INNER, "header", f"{t.name}: bad inner encoding {inner!r}")
    need(isinstance(ic, dict) and not (inner in ("coo", "dense") and ic), "header", f"{t.name}: bad ic {ic!r}")
    return Tensor(t.name, t.dtype, t.shape, inner, t.nnz, dict(ic))


def canonical(t: Tensor, allowed: tuple[str, ...]) -> str:
    """§8.3: the dtype of a buffer inside a compressed frame."""
    if len(allowed) == 1:
        return allowed[0]
    return "uint32" if t.numel <= 1 << 32 else "uint64"


def raw_size(t: Tensor) -> int:
    return sum(count * BUFFER_DTYPES[canonical(t, allowed)].itemsize for _, allowed, count in layout(t))


def layout(t: Tensor) -> Layout:
    enc, vd = t.encoding, t.vdtype
    if enc == "coo":
        return [("indices", ("uint32", "uint64"), t.nnz), ("values", (vd,), t.nnz)]
    if enc == "dense":
        return [("values", (vd,), t.numel)]
    if enc == "sparse":
        vf = check_form(t, "v", VALUE_FIELDS)
        inf = check_form(t, "i", INDEX_FIELDS)
        check_fields(t, {"v", "i", *vf, *inf})
        return index_layout(t) + value_layout(t, t.nnz)
    if enc == "dense_q":
        vf = check_form(t, "v", VALUE_FIELDS)
        check_fields(t, {"v", *vf})
        need(t.nnz == t.numel, "layout", f"{t.name}: dense_q needs nnz = numel")
        return value_layout(t, t.numel)
    check_fields(t, {"inner", "ic", "raw", "zbytes"} | ({"algo"} if enc == "nvcomp" else set()))
    if enc == "nvcomp":
        need(t.codec.get("algo") == "zstd", "header", f"{t.name}: nvcomp algo must be 'zstd'")
    expect = raw_size(inner_tensor(t))
    raw, zb = t.codec.get("raw"), t.codec.get("zbytes")
    need(is_int(raw) and raw == expect, "layout", f"{t.name}: raw {raw!r} is not the inner size {expect}")
    need(is_int(zb) and 0 < zb <= zstd_bound(raw), "layout", f"{t.name}: zbytes {zb!r} out of range")
    return [("compressed", ("uint8",), zb)]


# ---------------------------------------------------------------------------------------------- §2, §3, §5 container


def parse(blob: bytes) -> tuple[dict, list[Tensor]]:
    """Check the container, header and buffer layout; return the header and the tensors with raw buffers."""
    blob = bytes(blob)
    n = len(blob)
    need(n >= 20, "header", "shorter than 20 bytes")
    magic, version, hlen = PREFIX.unpack_from(blob, 0)
    need(magic == MAGIC, "header", "bad magic")
    need(version == 1, "version", f"version {version}")
    need(hlen <= MAX_HEADER, "header", "header too long")
    need(16 + hlen + 4 <= n, "header", "header runs past the payload")
    (crc,) = struct.unpack_from("<I", blob, n - 4)
    need(crc == zlib.crc32(blob[: n - 4]) & 0xFFFFFFFF, "checksum", "CRC-32 mismatch")

    def no_constants(name: str) -> Any:
        raise SpecError("header", f"JSON constant {name}")

    try:
        header = json.loads(blob[16 : 16 + hlen].decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SpecError("header", f"header is not JSON: {e}") from None
    need(isinstance(header, dict), "header", "header is not an object")
    need(header.get("format") == "gpu_codec", "header", "format")
    need(is_int(header.get("version")) and header["version"] == 1, "header", "version field")
    dl = header.get("data_length")
    need(is_int(dl) and dl >= 0, "header", "data_length")
    need(hlen % 8 == 0, "header", "header not padded to 8 bytes")
    need(16 + hlen + dl + 4 == n, "layout", "total length")
    data = blob[16 + hlen : 16 + hlen + dl]
    entries = header.get("tensors")
    need(isinstance(entries, list), "header", "tensors")
    need(len(entries) <= MAX_TENSORS, "limit", "too many tensors")
    need(isinstance(header.get("pipeline", []), list), "header", "pipeline")
    need(isinstance(header.get("metadata", {}), dict), "header", "metadata")

    tensors, names, end = [], set(), 0
    for e in entries:
        need(isinstance(e, dict), "header", "tensor entry is not an object")
        name = e.get("name")
        need(isinstance(name, str) and 0 < len(name) <= MAX_NAME, "header", f"name {name!r}")
        need(e.get("dtype") in TENSOR_DTYPES, "dtype", f"{name}: dtype {e.get('dtype')!r}")
        shape = e.get("shape")
        need(
            isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(s) and s >= 0 for s in shape),
            "limit",
            f"{name}: shape {shape!r}",
        )
        need(math.prod(shape) <= MAX_NUMEL, "limit", f"{name}: too many elements")
        need(e.get("encoding") in ENCODINGS, "header", f"{name}: encoding {e.get('encoding')!r}")
        nnz = e.get("nnz")
        need(is_int(nnz) and 0 <= nnz <= math.prod(shape), "layout", f"{name}: nnz {nnz!r}")
        codec = e.get("codec", {})
        need(isinstance(codec, dict), "header", f"{name}: codec")
        bufs = e.get("buffers")
        need(isinstance(bufs, list), "header", f"{name}: buffers")
        need(name not in names, "header", f"{name}: duplicate name")
        names.add(name)
        t = Tensor(name, e["dtype"], tuple(shape), e["encoding"], nnz, codec)
        lay = layout(t)
        roles = [b.get("role") if isinstance(b, dict) else None for b in bufs]
        need(roles == [r for r, _, _ in lay], "layout", f"{name}: roles {roles}")
        for b, (role, allowed, count) in zip(bufs, lay):
            bd = b.get("dtype")
            need(isinstance(bd, str) and bd in BUFFER_DTYPES, "dtype", f"{name}: buffer dtype {bd!r}")
            need(bd in allowed, "dtype", f"{name}: {role} may not be {bd}")
            off, nb = b.get("offset"), b.get("nbytes")
            need(is_int(off) and is_int(nb) and off >= 0 and nb >= 0, "layout", f"{name}: offset/nbytes")
            need(off == align8(end), "layout", f"{name}: {role} at {off}, expected {align8(end)}")
            item = BUFFER_DTYPES[bd].itemsize
            need(nb == count * item, "layout", f"{name}: {role} holds {nb} bytes, expected {count * item}")
            need(off + nb <= len(data), "layout", f"{name}: {role} runs past the data section")
            need(not any(data[end:off]), "layout", f"{name}: non-zero padding before {role}")
            t.buffers[role] = np.frombuffer(data, BUFFER_DTYPES[bd], count, off)
            end = off + nb
        tensors.append(t)
    need(end == len(data), "layout", "data section longer than its buffers")
    return header, tensors


# ---------------------------------------------------------------------------------------------- §9 pipeline


def fields_ok(cid: str, f: dict[str, Any]) -> bool:
    """§9: each field of the right type and range."""
    if cid == "topk":
        return (
            is_num(f["fraction"])
            and 0 < f["fraction"] <= 1
            and f["scope"] in ("global", "per_tensor")
            and f["score"] in SCORES
        )
    if cid == "quantize":
        return isinstance(f["dtype"], str) and f["dtype"] in QUANTIZE_TAGS
    if cid == "int8":
        return is_int(f["block_size"]) and 1 <= f["block_size"] <= 1 << 20
    if cid == "zstd":
        return is_int(f["level"]) and 1 <= f["level"] <= 22
    if cid == "nvcomp":
        return f["algorithm"] == "zstd"
    return True


def build_pipeline(config: list) -> dict[str, tuple[str, dict]]:
    """stage -> (id, fields with defaults filled in)."""
    out: dict[str, tuple[str, dict]] = {}
    last = -1
    for c in config:
        need(
            isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"] in CODECS,
            "header",
            f"pipeline entry {c!r}",
        )
        stage, defaults = CODECS[c["id"]]
        extra = set(c) - {"id", *defaults}
        need(not extra, "header", f"pipeline {c['id']}: unknown fields {sorted(extra)}")
        f = {**defaults, **{k: v for k, v in c.items() if k != "id"}}
        need(fields_ok(c["id"], f), "header", f"pipeline {c!r}: field out of range")
        s = STAGES.index(stage)
        need(s > last, "header", "pipeline stages out of order")
        last = s
        out[stage] = (c["id"], f)
    return out


def check_agreement(pipe: dict[str, tuple[str, dict]], t: Tensor) -> None:
    coded = "values" in pipe or "indices" in pipe
    bytes_id = pipe["bytes"][0] if "bytes" in pipe else None
    enc = t.encoding
    if enc in WRAPPERS:
        need(bytes_id == enc, "layout", f"{t.name}: {enc} tensor without a {enc} stage")
        enc = t.codec["inner"]
    else:
        need(bytes_id is None, "layout", f"{t.name}: unwrapped tensor in a pipeline with a bytes stage")
    dense = enc in ("dense", "dense_q")
    want = ("dense_q" if dense else "sparse") if coded else ("dense" if dense else "coo")
    need(enc == want, "layout", f"{t.name}: encoding {enc}, pipeline produces {want}")


def check_forms(pipe: dict[str, tuple[str, dict]], t: Tensor) -> None:
    vid, vf = pipe.get("values", (None, {}))
    vtag = {"quantize": QUANTIZE_TAGS.get(vf.get("dtype")), "int8": "int8", "ternary": "ternary"}.get(vid, "f32")
    itag = "rice" if "indices" in pipe else "raw"
    need(t.codec.get("v") == vtag, "layout", f"{t.name}: v {t.codec.get('v')!r}, pipeline says {vtag}")
    if t.encoding == "sparse":
        need(t.codec.get("i") == itag, "layout", f"{t.name}: i {t.codec.get('i')!r}, pipeline says {itag}")
    if vid == "int8":
        need(t.codec.get("block") == vf["block_size"], "layout", f"{t.name}: block differs from block_size")


# ---------------------------------------------------------------------------------------------- §7, §8 decoding


def unwrap(t: Tensor) -> Tensor:
    """§8.3: the inner tensor, its buffers cut from the decompressed frame."""
    inner = inner_tensor(t)
    raw = t.codec["raw"]
    frame = t.buffers["compressed"].tobytes()
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise SpecError("layout", f"{t.name}: not a zstd frame ({e})") from None
    cs = params.content_size
    if cs != zstandard.CONTENTSIZE_UNKNOWN:
        need(cs <= raw, "limit", f"{t.name}: frame declares {cs} > {raw} bytes")
        need(cs == raw, "layout", f"{t.name}: frame declares {cs} != {raw} bytes")
    need(params.window_size <= MAX_WINDOW, "limit", f"{t.name}: window {params.window_size}")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompress(
            frame, max_output_size=max(raw, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise SpecError("layout", f"{t.name}: bad zstd frame ({e})") from None
    need(len(out) == raw, "layout", f"{t.name}: frame holds {len(out)} bytes, expected {raw}")
    off = 0
    for role, allowed, count in layout(inner):
        dt = BUFFER_DTYPES[canonical(inner, allowed)]
        inner.buffers[role] = np.frombuffer(out, dt, count, off)
        off += count * dt.itemsize
    return inner


def rice_decode(stream: np.ndarray, bits: int, k: int, nnz: int, numel: int, name: str) -> np.ndarray:
    """§8.2, bit by bit as the document states it."""
    b = np.unpackbits(stream, bitorder="little")  # stream bit j = bit (j & 7) of byte (j >> 3)
    need(not b[bits:].any(), "layout", f"{name}: non-zero Rice padding bits")
    if nnz == 0:
        need(bits == 0, "layout", f"{name}: an empty Rice stream has 0 bits")
        return np.zeros(0, np.int64)
    unary = b[nnz * k : bits]
    ones = np.flatnonzero(unary)
    need(ones.size == nnz and ones[-1] == unary.size - 1, "layout", f"{name}: Rice unary section is malformed")
    q = np.diff(ones, prepend=-1) - 1  # zeros before each one
    r = np.zeros(nnz, np.int64)
    if k:
        r = (b[: nnz * k].reshape(nnz, k).astype(np.int64) << np.arange(k, dtype=np.int64)).sum(axis=1)
    g = (q.astype(np.int64) << k) + r
    idx = np.cumsum(g + 1) - 1
    need(int(idx[-1]) < numel, "index", f"{name}: Rice index {int(idx[-1])} >= numel {numel}")
    return idx


def decode_values(t: Tensor, n: int) -> np.ndarray:
    """§7: n values of the tensor's value dtype."""
    v = t.codec["v"]
    with np.errstate(all="ignore"):
        if v == "f32":
            return t.buffers["values"]
        if v == "f16":
            x = t.buffers["values"].astype(np.float32)
        elif v == "bf16":
            x = (t.buffers["values"].astype(np.uint32) << np.uint32(16)).view(np.float32)
        elif v == "int8":
            b = t.codec["block"]
            x = t.buffers["values"].astype(np.float32) * np.repeat(t.buffers["scales"], b)[:n]
        else:
            neg = np.unpackbits(t.buffers["signs"], bitorder="little")[:n].astype(bool)
            mu = np.float32(t.codec["mu"])
            x = np.where(neg, -mu, mu).astype(np.float32)
    return x.astype(t.vdtype)


def decode_entries(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, values of the value dtype) of an unwrapped tensor."""
    if t.encoding == "coo":
        return t.buffers["indices"].astype(np.uint64), t.buffers["values"]
    if t.encoding == "dense":
        return np.arange(t.numel, dtype=np.uint64), t.buffers["values"]
    if t.encoding == "dense_q":
        return np.arange(t.numel, dtype=np.uint64), decode_values(t, t.numel)
    if t.codec["i"] == "raw":
        idx = t.buffers["indices"].astype(np.uint64)
    else:
        c = t.codec
        idx = rice_decode(t.buffers["indices"], c["bits"], c["k"], t.nnz, t.numel, t.name).astype(np.uint64)
    return idx, decode_values(t, t.nnz)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)


def reconstruct(t: Tensor, idx: np.ndarray, x: np.ndarray, base: np.ndarray | None) -> np.ndarray:
    """§10."""
    if base is None:
        out = np.zeros(t.numel, t.vdtype)
        out[idx.astype(np.int64)] = x
        return out.reshape(t.shape)
    out = np.array(base, copy=True).reshape(-1)
    i = idx.astype(np.int64)
    with np.errstate(all="ignore"):
        if t.dtype in ("float64", "float32"):
            out[i] = out[i] + x  # binary64 / binary32 add
        elif t.dtype == "float16":
            out[i] = (out[i].astype(np.float32) + x).astype(np.float16)
        else:
            out[i] = f32_to_bf16_bits((out[i].astype(np.uint32) << np.uint32(16)).view(np.float32) + x)
    return out.reshape(t.shape)


def read(
    blob: bytes, base: dict[str, np.ndarray] | None = None, *, max_elements: int = 1 << 31
) -> dict[str, np.ndarray]:
    """Decode a payload to dense arrays (§10), or raise :class:`SpecError` (§11)."""
    header, tensors = parse(blob)
    if base is None:
        total = sum(t.numel for t in tensors)
        need(total <= max_elements, "limit", f"{total} dense elements > max_elements")
    else:
        assert sorted(base) == sorted(t.name for t in tensors), "base must name the payload's tensors"
    pipe = None
    if any(t.encoding in CODED for t in tensors):
        pipe = build_pipeline(header.get("pipeline", []))
    entries = []
    for t in tensors:
        if t.encoding in CODED:
            check_agreement(pipe, t)
            if t.encoding in WRAPPERS:
                t = unwrap(t)
            if t.encoding in ("sparse", "dense_q"):
                check_forms(pipe, t)
        idx, x = decode_entries(t)
        entries.append((t, idx, x))
    for t, idx, x in entries:  # §11 row 23: every entry is checked before anything is returned
        with np.errstate(all="ignore"):
            need(bool(np.isfinite(x).all()), "index", f"{t.name}: a value is not finite")
        need(not idx.size or int(idx.max()) < t.numel, "index", f"{t.name}: an index >= numel")
        need(bool((idx[1:] > idx[:-1]).all()), "index", f"{t.name}: indices not strictly increasing")
    return {t.name: reconstruct(t, idx, x, None if base is None else base[t.name]) for t, idx, x in entries}


__all__ = ["SpecError", "parse", "read", "rice_k"]
