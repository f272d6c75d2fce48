"""Decoder fuzzing support, shared by the property tests (tests/test_fuzz.py, tests/test_fuzz_table.py) and the
fuzz driver (benchmarks/fuzz_decoder.py): seed corpora of valid payloads of every pipeline (version 1, whose JSON
header :func:`mutate` edits; versions 2 and 3, whose binary tensor table :func:`mutate_table` edits field by
field, knowing varints, counts, lengths, codes, pipeline stages and tensor entries), mutations that keep the
checksum valid (so the reader's own checks are what is exercised), and the oracles.

The oracle: decoding a payload either succeeds with finite values of the declared shapes, or raises a
:class:`~gpu_codec.errors.PayloadError`. Anything else (another exception, a crash, a non-finite value) is a bug.

>>> seeds = seed_corpus()
>>> sorted(seeds)[:2]
['bf16', 'dense']
>>> check(seeds["fp16_rice"])
'decoded'
>>> check(mutate(seeds["fp16_rice"], [("header", 3, "junk")]))  # doctest: +ELLIPSIS
'Payload...Error'
"""

from __future__ import annotations

import copy
import json
import pathlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpu_codec
from gpu_codec.errors import InvalidInputError, PayloadError, PayloadHeaderError

from . import build_payload, split_payload

# small updates keep one decode in the millisecond range
PIPELINES: dict[str, dict[str, Any]] = {
    "raw": dict(fraction=0.05),
    "raw_per_tensor": dict(fraction=0.1, scope="per_tensor", metadata={"round": 1}),
    "fp16_rice": dict(fraction=0.05, pipeline=[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}]),
    "fp16_rice_zstd": dict(
        fraction=0.05, pipeline=[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd"}]
    ),
    "bf16": dict(fraction=0.05, pipeline=[{"id": "quantize", "dtype": "bfloat16"}]),
    "int8_rice_zstd": dict(
        fraction=0.1, pipeline=[{"id": "int8", "block_size": 16}, {"id": "rice"}, {"id": "zstd", "level": 1}]
    ),
    "int8_dense_zstd": dict(fraction=None, pipeline=[{"id": "int8", "block_size": 32}, {"id": "zstd"}]),
    "fp16_dense": dict(fraction=None, pipeline=[{"id": "quantize", "dtype": "float16"}]),
    "ternary": dict(fraction=0.05, pipeline=[{"id": "ternary"}]),
    "ternary_rice": dict(fraction=0.05, pipeline=[{"id": "ternary"}, {"id": "rice"}]),
    "dense": dict(fraction=None),
    "zstd": dict(fraction=0.05, pipeline=[{"id": "zstd", "level": 1}]),
}

MAX_OUTPUT_BYTES = 64 << 20  # the cap the oracle decodes under: a mutation cannot ask for more


def seed_update(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv": rng.standard_normal((6, 3, 3, 3)).astype(np.float32),
        "fc": rng.standard_t(3, (20, 16)).astype(np.float32),
        "bias": rng.standard_normal(12),  # float64
        "half": rng.standard_normal(40).astype(np.float16),
        "scalar": np.asarray(np.float32(0.5)),
    }


def seed_base(seed: int = 0) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in seed_update(seed).items()}


def seed_corpus(golden_dir: str | pathlib.Path | None = None) -> dict[str, bytes]:
    """Valid payloads of every pipeline (and the version-1 golden payloads, where a directory of them is given),
    in the version-1 container, whose JSON header the structure-aware mutations edit. (:func:`seed_corpus_v2`
    and :func:`mutate_table` do the same for versions 2 and 3.)"""
    u = seed_update()
    out = {name: gpu_codec.compress(u, **kw).to_bytes(version=1) for name, kw in PIPELINES.items()}
    if golden_dir is not None:
        for p in sorted(pathlib.Path(golden_dir).glob("*_v1.bin")):
            out[f"golden/{p.stem}"] = p.read_bytes()
    return out


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def mutate(blob: bytes, ops: Sequence[tuple]) -> bytes:
    """Apply mutations, then recompute the checksum. Each op is a tuple:

    ``("header", i, value)`` sets the i-th node (mod the count) of the header JSON tree to ``value``;
    ``("delete", i)`` removes it from its parent; ``("flip", pos, bit)``, ``("byte", pos, value)``,
    ``("insert", pos, bytes)``, ``("cut", pos, n)`` act on the data section; ``("body_flip", pos, bit)`` and
    ``("body_byte", pos, value)`` on every byte before the checksum (prefix and header text included);
    ``("truncate", n)`` keeps the first n bytes (mod the length) and no checksum fix.
    """
    try:
        header, data = split_payload(blob)
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError):
        header, data = None, None
    if not isinstance(header, dict):
        header, data = None, None
    body = None
    for op in ops:
        kind = op[0]
        if kind in ("header", "delete") and header is not None:
            paths = _paths(header)[1:]
            if not paths:
                continue
            path = paths[op[1] % len(paths)]
            node = header
            for key in path[:-1]:
                node = node[key]
            if kind == "header":  # (a copy: a value set twice, or into itself, would make the header circular)
                node[path[-1]] = copy.deepcopy(op[2])
            else:
                del node[path[-1]]
        elif kind in ("flip", "byte", "insert", "cut") and data is not None:
            d = bytearray(data)
            if not d and kind != "insert":
                continue
            pos = op[1] % max(1, len(d))
            if kind == "flip":
                d[pos] ^= 1 << (op[2] % 8)
            elif kind == "byte":
                d[pos] = op[2] % 256
            elif kind == "insert":
                d[pos:pos] = op[2]
            else:
                del d[pos : pos + max(1, op[2])]
            data = bytes(d)
        elif kind in ("body_flip", "body_byte"):
            if body is None:
                body = bytearray(_built(header, data, blob)[:-4])
            if not body:
                continue
            pos = op[1] % len(body)
            if kind == "body_flip":
                body[pos] ^= 1 << (op[2] % 8)
            else:
                body[pos] = op[2] % 256
        elif kind == "truncate":
            full = _with_crc(bytes(body)) if body is not None else _built(header, data, blob)
            return full[: op[1] % max(1, len(full))]
    if body is not None:
        return _with_crc(bytes(body))
    return _built(header, data, blob)


def _built(header: dict | None, data: bytes | None, blob: bytes) -> bytes:
    """The payload of a mutated header and data; ``blob`` unmutated where there is no header, or where it holds a
    value JSON cannot write."""
    if header is None:
        return blob
    try:
        return build_payload(header, data)
    except (TypeError, ValueError):
        return blob


def check(blob: bytes, base: dict | None = None, *, max_output_bytes: int = MAX_OUTPUT_BYTES) -> str:
    """The oracle: the outcome's name (``"decoded"``, the PayloadError subclass, or ``"base_mismatch"`` when a
    base is given and the payload names other tensors, shapes or dtypes: InvalidInputError); AssertionError if a
    decode succeeded with a non-finite value or a wrong shape; any other exception propagates (a bug)."""
    try:
        out = gpu_codec.decompress(blob, base=base, max_output_bytes=max_output_bytes)
    except PayloadError as e:
        return type(e).__name__
    except InvalidInputError as e:  # a payload whose tensors are not the server's model
        if base is None or "base" not in str(e):
            raise
        return "base_mismatch"
    header = json.loads(blob[16 : 16 + struct.unpack_from("<I", blob, 12)[0]])
    shapes = {t["name"]: tuple(t["shape"]) for t in header["tensors"]}
    assert set(out) == set(shapes), "decoded names differ from the header's"
    for name, v in out.items():
        a = np.asarray(v)
        assert a.shape == shapes[name], f"{name}: decoded shape {a.shape}, header says {shapes[name]}"
        assert np.isfinite(a.astype(np.float64)).all(), f"{name}: decoded a non-finite value"
    return "decoded"


# ------------------------------------------------------------------------------------------ v2/v3 binary table


@dataclass(frozen=True)
class Field:
    """One field of a v2/v3 tensor table: bytes ``[start, end)`` of the (decompressed) table, how it is stored
    (``varint``, ``code``, ``u8`` or ``bytes``), the reader's name for it, and its bound (varints; for a code, the
    number of codes)."""

    start: int
    end: int
    how: str
    name: str
    bound: int | None = None

    @property
    def role(self) -> str:
        """What the field does to the rest of the table: ``count`` (how many entries follow), ``length`` (how many
        bytes follow), ``stage`` (a pipeline stage code), ``code``, ``value`` or ``bytes``."""
        n = self.name
        if n in ("stage count", "tensor count", "name reference"):
            return "count"
        if n.endswith(" length") or n in ("compressed size", "Rice bit count"):
            return "length"
        if n == "stage code":
            return "stage"
        if self.how in ("code", "u8"):
            return "code"
        return "value" if self.how == "varint" else "bytes"


@dataclass
class Table:
    """A v2/v3 payload taken apart: prefix fields, the table (decompressed) with its fields, the data section."""

    version: int
    flags: int
    table: bytes
    data: bytes
    fields: list[Field]


def table_fields(blob: bytes) -> Table | None:
    """A valid v2/v3 payload's table and where each of its fields lies (None for a v1 payload or one that does
    not parse): gpu_codec's own reader reads it, with a reader that records every field it reads."""
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import v2

    if len(blob) < v2.MIN_SIZE or blob[8] not in (2, 3):
        return None
    fields: list[Field] = []
    seen: list[Any] = []

    class Recorder(v2._Reader):
        depth = 0

        def __init__(self, *a):
            super().__init__(*a)
            seen.append(self)

        def _log(self, how, call, field, bound=None):
            start, self.depth = self.pos, self.depth + 1
            try:
                return call()
            finally:
                self.depth -= 1
                if not self.depth:
                    fields.append(Field(start, self.pos, how, field, bound))

        def u8(self, field):
            return self._log("u8", lambda: v2._Reader.u8(self, field), field)

        def take(self, n, field):
            return self._log("bytes", lambda: v2._Reader.take(self, n, field), field)

        def varint(self, field, hi, exc=PayloadHeaderError):
            return self._log("varint", lambda: v2._Reader.varint(self, field, hi, exc), field, hi)

        def code(self, field, table):
            return self._log("code", lambda: v2._Reader.code(self, field, table), field, len(table))

    mv = memoryview(blob)
    try:
        end, *_ = v2._read_table(mv, blob[8], blob[12], len(blob) - 4, wire_layouts(), Recorder)
    except PayloadError:
        return None
    return Table(blob[8], blob[12], bytes(seen[0].buf), bytes(mv[end:-4]), fields)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _varint_junk(rng, f: Field, old: int) -> bytes:
    """A replacement for a varint field: its bounds and their neighbours, small shifts (a count or length one off
    moves every later field), non-canonical and overlong encodings, 2^64."""
    hi = f.bound if f.bound is not None else 1 << 40
    k = rng.randrange(9)
    if k == 0:
        return _uvarint(rng.choice([0, 1, hi, hi + 1, 2**63, 2**64 - 1]))
    if k in (1, 2):
        return _uvarint(max(0, old + rng.choice([-2, -1, 1, 2])))
    if k == 3:
        return _uvarint(old)[:-1] + bytes([_uvarint(old)[-1] | 0x80, 0])  # the same value, one byte too long
    if k == 4:
        return b"\xff" * 10 + b"\x01"  # more than 10 bytes
    if k == 5:
        return _uvarint(1 << 64)
    if k == 6:
        return b"\x80"  # a continuation with nothing after it
    return _uvarint(rng.randrange(hi + 2))


def _read_uvarint(b: bytes) -> int:
    n = 0
    for i, x in enumerate(b):
        n |= (x & 0x7F) << (7 * i)
    return n


def mutate_table(blob: bytes, rng, n: int = 1) -> bytes:
    """``n`` structure-aware mutations of a v2/v3 payload's table (``blob`` unchanged if it has none): a field
    replaced by what its kind invites (a varint by its bounds, off-by-one counts and lengths, non-canonical or
    overlong encodings; a code past its table or a flipped bit; a pipeline stage code by another stage; a name,
    mu or fingerprint byte by junk), a field deleted, repeated or swapped with another, a whole tensor entry's
    bytes repeated or dropped; or the prefix (flags, table length), or the data (cut, grown, a byte flipped). The
    table is stored again (compressed if it was), the table length set to match (or not) and the checksum
    recomputed, so the reader's checks past the checksum are what is exercised."""
    t = table_fields(blob)
    if t is None or not t.fields:
        return blob
    table, flags, data = bytearray(t.table), t.flags, bytearray(t.data)
    fields = sorted(t.fields, key=lambda f: f.start)
    edits: list[tuple[int, int, bytes]] = []  # (start, end, replacement) of the original table
    tlen_delta = 0
    for _ in range(n):
        f = rng.choice(fields)
        old = bytes(t.table[f.start : f.end])
        k = rng.randrange(12)
        if k < 5:  # replace by what the field's kind invites
            if f.how == "varint":
                new = _varint_junk(rng, f, _read_uvarint(old))
            elif f.role == "stage":
                new = bytes([rng.randrange(10)])
            elif f.how in ("code", "u8"):
                bound = f.bound or 256
                pick = rng.choice([bound - 1, bound, 255, old[0] ^ (1 << rng.randrange(8)), rng.randrange(256)])
                new = bytes([pick % 256])
            else:
                b = bytearray(old or b"\0")
                b[rng.randrange(len(b))] = rng.choice([0, 0x7F, 0x80, 0xFF, 0xC0, rng.randrange(256)])
                new = bytes(b)
            edits.append((f.start, f.end, new))
        elif k == 5:
            edits.append((f.start, f.end, b""))  # deleted
        elif k == 6:
            edits.append((f.start, f.end, old + old))  # repeated
        elif k == 7:
            g = rng.choice(fields)
            if g.start >= f.end:
                edits.append((f.start, f.end, bytes(t.table[g.start : g.end])))
                edits.append((g.start, g.end, old))
        elif k == 8:  # a span of whole fields, e.g. a tensor entry, repeated or dropped
            i = fields.index(f)
            j = min(len(fields), i + rng.randrange(1, 12))
            span = bytes(t.table[f.start : fields[j - 1].end])
            edits.append((f.start, fields[j - 1].end, rng.choice([b"", span + span])))
        elif k == 9:
            flags ^= 1 << rng.randrange(8)
        elif k == 10:
            tlen_delta = rng.choice([-1, 1])
        elif data:
            pos = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[pos:]
            else:
                data[pos:pos] = bytes([rng.randrange(256)])
    edits = _disjoint(edits)
    for start, end, new in sorted(edits, reverse=True):
        table[start:end] = new
    return _join_v2(t.version, flags, bytes(table), bytes(data), t.flags & 0x02, tlen_delta)


def _disjoint(edits: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes]]:
    out: list[tuple[int, int, bytes]] = []
    for e in edits:
        if all(e[1] <= o[0] or o[1] <= e[0] or (e[0] == e[1] == o[0]) for o in out):
            out.append(e)
    return out


def _join_v2(version: int, flags: int, table: bytes, data: bytes, compress: int, tlen_delta: int = 0) -> bytes:
    import zstandard

    if compress:
        z = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(table)
        stored = _uvarint(max(0, len(z) + tlen_delta)) + _uvarint(len(table)) + z
    else:
        stored = _uvarint(max(0, len(table) + tlen_delta)) + table
    body = b"GPUCODEC" + struct.pack("<IB", version, flags) + stored + data
    return _with_crc(body)


def seed_corpus_v2(golden_dir: str | pathlib.Path | None = None) -> dict[str, bytes]:
    """Valid v2/v3 payloads of every pipeline, each zstd one in every data mode, with metadata and a base
    fingerprint on some, a compressed table on one (and the v2/v3 golden payloads where a directory is given)."""
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import v2

    u, base = seed_update(), seed_base()
    out = {}
    for i, (name, kw) in enumerate(PIPELINES.items()):
        p = gpu_codec.compress(u, base if i % 2 else None, fingerprint_base=bool(i % 2), **kw)
        out[name] = p.to_bytes()
        if p.tensors[0].encoding == "zstd":
            for mode in (v2.DATA_RECORDS, v2.DATA_ZSTD, v2.DATA_PLAIN):
                plan = v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=mode)
                out[f"{name}/{v2.DATA_MODES[mode]}"] = v2.write(plan)
    many = {f"blocks.{i}.mlp.fc{j}.weight": np.full(9, i + j + 1, np.float32) for i in range(40) for j in (1, 2)}
    out["compressed_table"] = gpu_codec.compress(many, fraction=0.05, metadata={"round": 3}).to_bytes()
    if golden_dir is not None:
        for p in sorted(pathlib.Path(golden_dir).glob("*_v[23].bin")):
            out[f"golden/{p.stem}"] = p.read_bytes()
    return out


def check_against(blob: bytes, reference: Any, base: dict | None = None) -> str:
    """:func:`check`, and where the payload decodes, ``reference(blob, base)`` (an independent reader) must give
    the same names and bits (AssertionError otherwise)."""
    try:
        out = gpu_codec.decompress(blob, base=base, max_output_bytes=MAX_OUTPUT_BYTES)
    except PayloadError as e:
        return type(e).__name__
    except InvalidInputError as e:
        if base is None or "base" not in str(e):
            raise
        return "base_mismatch"
    ref = reference(blob, base)
    assert list(ref) == list(out), f"decoded names differ: {list(out)[:5]} vs the reference's {list(ref)[:5]}"
    for name, v in out.items():
        a, r = np.asarray(v), np.asarray(ref[name])
        assert a.shape == r.shape and a.dtype == r.dtype and a.tobytes() == r.tobytes(), f"{name} decodes otherwise"
        assert np.isfinite(a.astype(np.float64)).all(), f"{name}: decoded a non-finite value"
    return "decoded"


__all__ = [
    "MAX_OUTPUT_BYTES",
    "PIPELINES",
    "Field",
    "Table",
    "check",
    "check_against",
    "mutate",
    "mutate_table",
    "seed_base",
    "seed_corpus",
    "seed_corpus_v2",
    "seed_update",
    "table_fields",
]
