"""An independent reader of the gpu_codec wire format, versions 1, 2 and 3, written from docs/FORMAT.md alone.

It uses NumPy, zlib and zstandard and imports nothing from gpu_codec, so comparing its output with
``gpu_codec.decompress`` checks the document against the code. Section numbers (§) refer to docs/FORMAT.md.

``read(blob)`` returns the dense deltas (float32, float64 for float64 tensors); ``read(blob, base)`` returns
``base + delta`` in the base's dtype (bfloat16 as uint16 bit patterns). A payload that breaks a rule of §11
raises :class:`SpecError`, whose ``kind`` names the error class gpu_codec's reader raises for the same fault.
Versions 2 and 3 ("Version 2", "Version 3" in the document) are parsed into the same tensor records as version 1
and decoded by the same code; ``base_fingerprint(base)`` computes the optional base fingerprint ("Base
fingerprint").
"""

from __future__ import annotations

import hashlib
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
    chunk: int | None = None  # version 3: an nvcomp tensor's frames hold this many raw bytes each
    content: bytes | None = None  # version 2, data modes zstd and plain: the wrapped tensor's raw bytes

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
        need(t.nnz == t.numel, "layout", f"{t.name}: dense needs nnz = numel")
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
    bound = zstd_bound(raw) if t.chunk is None else frames_bound(raw, t.chunk)
    need(is_int(zb) and 0 < zb <= bound, "layout", f"{t.name}: zbytes {zb!r} out of range")
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
        text = blob[16 : 16 + hlen].decode("utf-8")
        need(json_shape(text)[1] <= 66, "limit", "the header nests deeper than 66")
        header = json.loads(text, parse_constant=no_constants)
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
    if "base_fingerprint" in header:
        fp = header["base_fingerprint"]
        ok = isinstance(fp, str) and len(fp) == 16 and all(c in "0123456789abcdef" for c in fp)
        need(ok, "header", f"base_fingerprint {fp!r}")

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
    """§8.3: the inner tensor, its buffers cut from the decompressed frame (or, version 2's shared data modes,
    from its share of the data section; version 3's chunked nvcomp tensors, from its frames)."""
    inner = inner_tensor(t)
    raw = t.codec["raw"]
    if t.content is not None:
        return split_inner(inner, t.content)
    if t.chunk is not None:
        return split_inner(inner, read_frames(t.buffers["compressed"].tobytes(), raw, t.chunk, t.name))
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
    need(frame_end(frame, 0, t.name) == len(frame), "layout", f"{t.name}: bytes after the zstd frame")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompress(
            frame, max_output_size=max(raw, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise SpecError("layout", f"{t.name}: bad zstd frame ({e})") from None
    need(len(out) == raw, "layout", f"{t.name}: frame holds {len(out)} bytes, expected {raw}")
    return split_inner(inner, out)


def split_inner(inner: Tensor, out: bytes) -> Tensor:
    """§8.3: the inner buffers, back to back in their canonical dtypes, cut from the raw bytes."""
    off = 0
    for role, allowed, count in layout(inner):
        dt = BUFFER_DTYPES[canonical(inner, allowed)]
        inner.buffers[role] = np.frombuffer(out, dt, count, off)
        off += count * dt.itemsize
    return inner


def frame_end(b: bytes, pos: int, name: str) -> int:
    """RFC 8878 §3.1.1: where the zstd frame at ``pos`` ends, from its header and block headers."""
    need(pos + 5 <= len(b) and b[pos : pos + 4] == b"\x28\xb5\x2f\xfd", "layout", f"{name}: not a zstd frame")
    fhd = b[pos + 4]
    need(not fhd & 0x08, "layout", f"{name}: reserved bit of the frame header")
    single = fhd >> 5 & 1
    fcs = (single, 2, 4, 8)[fhd >> 6]
    at = pos + 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3] + fcs
    while True:
        need(at + 3 <= len(b), "layout", f"{name}: truncated zstd frame")
        bh = int.from_bytes(b[at : at + 3], "little")
        btype = bh >> 1 & 3
        need(btype != 3, "layout", f"{name}: reserved block type")
        at += 3 + (1 if btype == 1 else bh >> 3)
        need(at <= len(b), "layout", f"{name}: truncated zstd frame")
        if bh & 1:
            break
    at += 4 if fhd & 0x04 else 0
    need(at <= len(b), "layout", f"{name}: truncated zstd frame")
    return at


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
    """Decode a payload of any version to dense arrays (§10), or raise :class:`SpecError` (§11 and the
    "What the reader rejects" sections of versions 2 and 3)."""
    header, tensors = parse_any(blob)
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


# ---------------------------------------------------------------------------------------------- versions 2 and 3

V2_PREFIX = struct.Struct("<8sIB")
DTYPE_CODES = ("float32", "float16", "bfloat16", "float64")
ENCODING_CODES = ("coo", "dense", "sparse", "dense_q", "zstd", "nvcomp")
VALUE_CODES = ("f32", "f16", "bf16", "int8", "ternary")
INDEX_CODES = ("raw", "rice")
DATA_MODES = ("records", "zstd", "plain")
SCOPES = ("global", "per_tensor")
QUANT_CODES = ("float32", "float16", "bfloat16")


def parse_any(blob: bytes) -> tuple[dict, list[Tensor]]:
    """The header and tensors of a payload of version 1, 2 or 3."""
    blob = bytes(blob)
    need(len(blob) >= 12 and blob[:8] == MAGIC, "header", "too short or bad magic")
    (version,) = struct.unpack_from("<I", blob, 8)
    need(version in (1, 2, 3), "version", f"version {version}")
    return parse(blob) if version == 1 else parse_v2(blob)


class Bytes:
    """Reads the fields of the table front to back; reading past the end is a header error."""

    def __init__(self, b: bytes, pos: int = 0, end: int | None = None):
        self.b, self.pos, self.end = b, pos, len(b) if end is None else end

    def take(self, n: int) -> bytes:
        need(self.pos + n <= self.end, "header", "the table ends inside a field")
        out = self.b[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def varint(self, hi: int, kind: str = "header") -> int:
        """Unsigned LEB128: at most 10 bytes, below 2^64, minimal; then at most ``hi``."""
        n = shift = 0
        start = self.pos
        while True:
            byte = self.u8()
            n |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
            need(self.pos - start < 10, "header", "varint longer than 10 bytes")
        need(n < 1 << 64, "header", "varint of 2^64 or more")
        need(not (byte == 0 and self.pos - start > 1), "header", "varint not minimal")
        need(n <= hi, kind, f"varint {n} above its bound {hi}")
        return n

    def code(self, table: tuple) -> str:
        c = self.u8()
        need(c < len(table), "header", f"unknown code {c}")
        return table[c]


def shortest_decimal(f: float) -> tuple[int, int]:
    """(m, e): the digits of the shortest decimal that reads back as ``f``, ``f = m x 10^-e``, m not a multiple
    of 10 (or e = 0)."""
    text = repr(f)
    mant, _, exp = text.partition("e")
    whole, _, frac = mant.partition(".")
    m, e = int(whole + frac), len(frac) - int(exp or 0)
    while e > 0 and m % 10 == 0:
        m, e = m // 10, e - 1
    if e < 0:
        m, e = m * 10**-e, 0
    return m, e


def read_stage(r: Bytes) -> dict:
    """Pipeline stage codes 0-7."""
    code = r.u8()
    if code == 0:
        n = r.varint(r.end - r.pos)
        cfg = strict_json(r.take(n), "a JSON stage")
        need(isinstance(cfg, dict) and isinstance(cfg.get("id"), str), "header", "a JSON stage without a string id")
        return cfg
    if code == 1:
        m, e = r.varint(10**17), r.varint(400)
        f = float(f"{m}e-{e}")
        need(0 < f <= 1 and shortest_decimal(f) == (m, e), "header", f"fraction {m}e-{e}")
        return {"id": "topk", "fraction": f, "scope": r.code(SCOPES), "score": r.code(SCORES)}
    if code == 2:
        return {"id": "quantize", "dtype": r.code(QUANT_CODES)}
    if code == 3:
        b = r.varint(1 << 20)
        need(b >= 1, "header", "int8 block size 0")
        return {"id": "int8", "block_size": b}
    if code in (4, 5):
        return {"id": "ternary" if code == 4 else "rice"}
    if code == 6:
        level = r.u8()
        need(1 <= level <= 22, "header", f"zstd level {level}")
        return {"id": "zstd", "level": level}
    if code == 7:
        return {"id": "nvcomp", "algorithm": r.code(("zstd",))}
    raise SpecError("header", f"stage code {code}")


def json_shape(text: str) -> tuple[int, int]:
    """(one plus the commas, '[' and '{' outside strings; the deepest nesting of brackets and braces), read a
    character at a time as FORMAT.md states the rule (a string runs to its closing quote, or to the end)."""
    values, depth, deepest, inside, escaped = 1, 0, 0, False, False
    for ch in text:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "[{":
            values, depth = values + 1, depth + 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
        elif ch == ",":
            values += 1
    return values, deepest


def strict_json(raw: bytes, what: str) -> Any:
    def no_constants(name: str) -> Any:
        raise SpecError("header", f"{what}: JSON constant {name}")

    def bounded_int(text: str) -> int:
        need(len(text.lstrip("-")) <= 40, "header", f"{what}: an integer of more than 40 digits")
        return int(text)

    def finite(text: str) -> float:
        x = float(text)
        need(math.isfinite(x), "header", f"{what}: number {text} overflows")
        return x

    try:
        text = raw.decode("utf-8")
        values, deepest = json_shape(text)
        need(values <= 1 << 18, "limit", f"{what}: over 2^18 values")
        need(deepest <= 65, "limit", f"{what}: nested {deepest} deep")
        return json.loads(text, parse_constant=no_constants, parse_int=bounded_int, parse_float=finite)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SpecError("header", f"{what} is not JSON: {e}") from None


def read_form(r: Bytes) -> tuple:
    """(encoding, inner, value form, int8 block, index form)."""
    enc = r.code(ENCODING_CODES)
    inner = v = block = i = None
    base = enc
    if enc in WRAPPERS:
        inner = r.code(ENCODING_CODES)
        need(inner in INNER, "header", "a wrapper wrapping a wrapper")
        base = inner
    if base in ("sparse", "dense_q"):
        v = r.code(VALUE_CODES) if r.b[r.pos : r.pos + 1] != b"\xff" else named_form(r)
        if v == "int8":
            block = r.varint(1 << 20)
            need(block >= 1, "header", "int8 block 0")
    if base == "sparse":
        i = r.code(INDEX_CODES) if r.b[r.pos : r.pos + 1] != b"\xff" else named_form(r)
    return enc, inner, v, block, i


def named_form(r: Bytes) -> str:
    """Form code 255: a form named by its tag, a codec's own; this reader knows the built-in forms only."""
    r.u8()
    tag = r.take(r.varint(64))
    raise SpecError("header", f"form {tag!r} is a codec's own, not a built-in form")


def frames_bound(raw: int, chunk: int) -> int:
    """Version 3."""
    count = max(1, ceil_div(raw, chunk))
    return (count - 1) * zstd_bound(chunk) + zstd_bound(raw - (count - 1) * chunk)


def read_entry(r: Bytes, earlier: list[bytes], default: tuple, mode: int, version: int) -> Tensor:
    """One tensor entry of the table, as the record a version 1 header entry would give."""
    d = r.varint(len(earlier))
    p = q = 0
    ref = b""
    if d:
        ref = earlier[-d]
        p = r.varint(len(ref))
        q = r.varint(len(ref) - p)
    m = r.varint(4096 - p - q)
    nb = ref[:p] + r.take(m) + ref[len(ref) - q :]
    earlier.append(nb)
    need(len(nb) > 0, "header", "empty name")
    try:
        name = nb.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("header", "a name that is not UTF-8") from None
    need(len(name) <= MAX_NAME, "header", "name too long")
    kind = r.u8()
    need(not kind & 0x80, "header", "bit 7 of the kind byte")
    dtype, ndim = DTYPE_CODES[kind & 3], kind >> 2 & 15
    need(ndim <= MAX_NDIM, "limit", f"{name}: {ndim} dimensions")
    enc, inner, v, block, i = read_form(r) if kind & 0x40 else default
    shape = tuple(r.varint(MAX_NUMEL, "limit") for _ in range(ndim))
    running = 1
    for s in shape:
        running *= max(s, 1)
        need(running <= MAX_NUMEL, "limit", f"{name}: shape {shape}")
    numel = math.prod(shape)
    base = inner if enc in WRAPPERS else enc
    nnz = r.varint(numel, "layout") if base in ("coo", "sparse") else numel
    codec: dict[str, Any] = {}
    if base in ("sparse", "dense_q"):
        codec["v"] = v
        if v == "int8":
            codec["block"] = block
        if v == "ternary":
            bits = r.take(4) if nnz else bytes(4)
            need(int.from_bytes(bits, "little") < 0x7F800000, "header", f"{name}: mu not finite and >= 0")
            codec["mu"] = float(np.frombuffer(bits, "<f4")[0])
        if base == "sparse":
            codec["i"] = i
            if i == "rice":
                codec["k"] = rice_k(nnz, numel)
                codec["bits"] = r.varint((1 << 64) - 1) if nnz else 0
    t = Tensor(name, dtype, shape, base, nnz, codec)
    if enc not in WRAPPERS:
        need(mode == 0, "layout", f"{name}: a shared data mode holds only zstd tensors")
        return t
    raw = raw_size(t)
    wc: dict[str, Any] = {"algo": "zstd"} if enc == "nvcomp" else {}
    wc.update(inner=base, raw=raw)
    chunk = None
    if mode == 0:
        if enc == "nvcomp" and version == 3:
            c = r.u8()
            need(16 <= c <= 24, "header", f"{name}: chunk code {c}")
            chunk = 1 << c
        bound = zstd_bound(raw) if chunk is None else frames_bound(raw, chunk)
        wc["zbytes"] = r.varint(bound, "layout")
    else:
        need(enc == "zstd", "layout", f"{name}: a shared data mode holds only zstd tensors")
    if codec:
        wc["ic"] = codec
    return Tensor(name, dtype, shape, enc, nnz, wc, chunk=chunk)


def canonical_layout(t: Tensor) -> list[tuple[str, str, int]]:
    """ "Buffers": (role, dtype, count), nothing stored about them."""
    return [(role, canonical(t, allowed), count) for role, allowed, count in layout(t)]


def one_frame(frame: bytes, size: int, name: str, *, required_size: bool) -> bytes:
    """A zstd frame that declares ``size`` (or nothing, unless ``required_size``), within the window limit, with
    nothing after it, that decompresses to exactly ``size`` bytes."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise SpecError("layout", f"{name}: not a zstd frame ({e})") from None
    cs = params.content_size
    if cs == zstandard.CONTENTSIZE_UNKNOWN:
        need(not required_size, "layout", f"{name}: the frame does not declare its size")
    else:
        need(cs <= size, "limit", f"{name}: frame declares {cs} > {size}")
        need(cs == size, "layout", f"{name}: frame declares {cs} != {size}")
    need(params.window_size <= MAX_WINDOW, "limit", f"{name}: window {params.window_size}")
    need(frame_end(frame, 0, name) == len(frame), "layout", f"{name}: bytes after the zstd frame")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompress(
            frame, max_output_size=max(size, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise SpecError("layout", f"{name}: bad zstd frame ({e})") from None
    need(len(out) == size, "layout", f"{name}: frame holds {len(out)} bytes, expected {size}")
    return out


def read_frames(b: bytes, raw: int, chunk: int, name: str) -> bytes:
    """Version 3 "Frames": exactly F frames back to back, frame i declaring and holding size_i bytes."""
    count, pos, out = max(1, ceil_div(raw, chunk)), 0, []
    for i in range(count):
        need(pos < len(b), "layout", f"{name}: fewer than {count} frames")
        size = min(chunk, raw - i * chunk)
        end = frame_end(b, pos, f"{name}, frame {i}")
        out.append(one_frame(b[pos:end], size, f"{name}, frame {i}", required_size=True))
        pos = end
    need(pos == len(b), "layout", f"{name}: bytes after its {count} frames")
    return b"".join(out)


def parse_v2(blob: bytes) -> tuple[dict, list[Tensor]]:
    """Versions 2 and 3: prefix, checksum, flags, the table, the data section."""
    n = len(blob)
    need(n >= 18, "header", "shorter than 18 bytes")
    _, version, flags = V2_PREFIX.unpack_from(blob, 0)
    (crc,) = struct.unpack_from("<I", blob, n - 4)
    need(crc == zlib.crc32(blob[: n - 4]) & 0xFFFFFFFF, "checksum", "CRC-32 mismatch")
    need(not flags & 0xE0, "header", f"reserved flag bits 0x{flags:02x}")
    mode = flags >> 2 & 3
    need(mode < 3, "header", "data mode 3")
    end = n - 4
    r = Bytes(blob, 13, end)
    tlen = r.varint(MAX_HEADER)
    if flags & 0x02:
        traw = r.varint(MAX_HEADER)
        table = one_frame(r.take(tlen), traw, "tensor table", required_size=False)
    else:
        table = r.take(tlen)
    data = blob[r.pos : end]
    t = Bytes(table)
    pipeline = [read_stage(t) for _ in range(t.varint(16))]
    metadata: Any = {}
    if flags & 0x01:
        metadata = strict_json(t.take(t.varint(t.end - t.pos)), "metadata")
        need(isinstance(metadata, dict), "header", "metadata is not an object")
    header: dict[str, Any] = {"version": version, "pipeline": pipeline, "metadata": metadata, "data": DATA_MODES[mode]}
    if flags & 0x10:
        header["base_fingerprint"] = t.take(8).hex()
    default = read_form(t)
    count = t.varint(MAX_TENSORS, "limit")
    tensors, names, earlier = [], set(), []
    for _ in range(count):
        x = read_entry(t, earlier, default, mode, version)
        need(x.name not in names, "header", f"{x.name}: duplicate name")
        names.add(x.name)
        tensors.append(x)
    need(t.pos == t.end, "header", "bytes after the last tensor entry")
    if mode == 0:
        lays = [canonical_layout(x) for x in tensors]
        total = sum(c * BUFFER_DTYPES[dt].itemsize for lay in lays for _, dt, c in lay)
        need(total == len(data), "layout", f"data section of {len(data)} bytes, the table implies {total}")
        off = 0
        for x, lay in zip(tensors, lays):
            for role, dt, c in lay:
                x.buffers[role] = np.frombuffer(data, BUFFER_DTYPES[dt], c, off)
                off += c * BUFFER_DTYPES[dt].itemsize
        return header, tensors
    need(bool(tensors), "layout", "a shared data mode without tensors")
    total = sum(x.codec["raw"] for x in tensors)
    if mode == 1:
        need(0 < len(data) <= zstd_bound(total), "layout", f"shared frame of {len(data)} bytes")
        content = one_frame(data, total, "shared frame", required_size=True)
    else:
        need(len(data) == total, "layout", f"plain data of {len(data)} bytes, the table implies {total}")
        content = data
    off = 0
    for x in tensors:
        x.content = content[off : off + x.codec["raw"]]
        off += x.codec["raw"]
    return header, tensors


def base_fingerprint(base: dict[str, np.ndarray], names: list[str]) -> str:
    """ "Base fingerprint": BLAKE2b-64 over each tensor's name length (u32), dtype code (u8), element count (u64),
    name, and the raw bits of its elements at (j * numel) // m, m = min(numel, 256)."""
    h = hashlib.blake2b(digest_size=8)
    for name in names:
        a = np.ascontiguousarray(base[name]).reshape(-1)
        dtype = "bfloat16" if a.dtype == np.uint16 else a.dtype.name
        nb = name.encode("utf-8")
        h.update(struct.pack("<IBQ", len(nb), DTYPE_CODES.index(dtype), a.size) + nb)
        m = min(a.size, 256)
        pos = [j * a.size // m for j in range(m)]
        h.update(a[pos].astype(a.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


__all__ = ["SpecError", "base_fingerprint", "parse", "parse_any", "parse_v2", "read", "rice_k"]
