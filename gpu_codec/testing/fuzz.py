"""Decoder fuzzing support, shared by the property tests (tests/test_fuzz.py) and the fuzz driver
(benchmarks/fuzz_decoder.py): a seed corpus of valid payloads of every pipeline, mutations that keep the
checksum valid (so the reader's own checks are what is exercised), and the one oracle.

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

import json
import pathlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

import gpu_codec
from gpu_codec.errors import InvalidInputError, PayloadError

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
    in the version-1 container, whose JSON header the structure-aware mutations edit. (Version 2's binary table
    is fuzzed byte by byte in tests/test_format_v2.py.)"""
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
            if kind == "header":
                node[path[-1]] = op[2]
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
                body = bytearray(build_payload(header, data)[:-4] if header is not None else blob[:-4])
            if not body:
                continue
            pos = op[1] % len(body)
            if kind == "body_flip":
                body[pos] ^= 1 << (op[2] % 8)
            else:
                body[pos] = op[2] % 256
        elif kind == "truncate":
            if body is not None:
                full = _with_crc(bytes(body))
            elif header is not None:
                full = build_payload(header, data)
            else:
                full = blob
            return full[: op[1] % max(1, len(full))]
    if body is not None:
        return _with_crc(bytes(body))
    if header is None:
        return blob
    try:
        return build_payload(header, data)
    except (TypeError, ValueError):  # a value json cannot write: keep the blob unmutated
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


__all__ = ["MAX_OUTPUT_BYTES", "PIPELINES", "check", "mutate", "seed_base", "seed_corpus", "seed_update"]
