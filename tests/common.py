"""Shared test helpers: an independent brute-force reference, backend switching, payload surgery."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends import _gpu_probe

HAS_GPU = _gpu_probe()[0]


def has_emulator() -> bool:
    try:
        import gpu_codec.backends.emulated  # noqa: F401
    except Exception:
        return False
    return True


BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "emulated", id="emulated", marks=pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
    ),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


@contextlib.contextmanager
def use_backend(name: str):
    old = os.environ.get("GPU_CODEC_BACKEND")
    os.environ["GPU_CODEC_BACKEND"] = name
    gpu_codec.reset_backend()
    try:
        yield gpu_codec.get_backend()
    finally:
        if old is None:
            os.environ.pop("GPU_CODEC_BACKEND", None)
        else:
            os.environ["GPU_CODEC_BACKEND"] = old
        gpu_codec.reset_backend()


# ---------------------------------------------------------------- reference (independent of the implementation)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32)


def ref_delta(new: np.ndarray, base: np.ndarray | None, dtype: str) -> np.ndarray:
    if dtype == "float64":
        return new - (base if base is not None else 0.0)
    z = np.zeros(new.shape, np.float32)
    return to_f32(new, dtype) - (to_f32(base, dtype) if base is not None else z)


def ref_score(crit: str, new, base, d, dtype) -> np.ndarray:
    if dtype == "float64":
        w, w0 = new, (base if base is not None else np.zeros_like(new))
    else:
        w, w0 = to_f32(new, dtype), (to_f32(base, dtype) if base is not None else np.zeros(new.shape, np.float32))
    s = {
        "magnitude": lambda: np.abs(d),
        "largest_final_magnitude": lambda: np.abs(w),
        "smallest_final_magnitude": lambda: -np.abs(w),
        "largest_magnitude_change": lambda: np.abs(d),
        "smallest_magnitude_change": lambda: -np.abs(d),
        "largest_increase_in_magnitude": lambda: np.abs(w) - np.abs(w0),
        "smallest_increase_in_magnitude": lambda: np.abs(w0) - np.abs(w),
    }[crit]()
    with np.errstate(over="ignore"):
        return np.asarray(s).astype(np.float32)


def reference_topk(
    update: dict,
    base: dict | None,
    fraction: float,
    scope: str = "global",
    crit: str = "magnitude",
    dtypes: dict | None = None,
):
    """Per tensor (indices, values) by a stable argsort over all scores: the definition, not an algorithm."""
    names = list(update)
    dtypes = dtypes or {n: np.asarray(update[n]).dtype.name for n in names}
    deltas, scores = {}, {}
    for n in names:
        nw = np.asarray(update[n]).reshape(-1)
        bs = np.asarray(base[n]).reshape(-1) if base is not None else None
        deltas[n] = ref_delta(nw, bs, dtypes[n])
        scores[n] = ref_score(crit, nw, bs, deltas[n], dtypes[n])
    out = {}
    groups = [names] if scope == "global" else [[n] for n in names]
    for g in groups:
        allsc = np.concatenate([scores[n] for n in g]) if g else np.zeros(0, np.float32)
        k = gpu_codec.kept_count(fraction, allsc.size)
        order = np.argsort(-allsc.astype(np.float64), kind="stable")[:k]
        chosen = np.zeros(allsc.size, bool)
        chosen[order] = True
        a = 0
        for n in g:
            sz = scores[n].size
            idx = np.flatnonzero(chosen[a : a + sz])
            out[n] = (idx, deltas[n][idx])
            a += sz
    return out


def dense_from(ref: dict, shapes: dict, dtypes: dict) -> dict:
    res = {}
    for n, (idx, vals) in ref.items():
        vd = np.float64 if dtypes[n] == "float64" else np.float32
        z = np.zeros(int(np.prod(shapes[n])), vd)
        z[idx] = vals
        res[n] = z.reshape(shapes[n])
    return res


def as_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


# ---------------------------------------------------------------- payload surgery


def split_payload(blob: bytes) -> tuple[dict, bytes]:
    _, _, hlen = struct.unpack_from("<8sII", blob, 0)
    header = json.loads(blob[16 : 16 + hlen])
    return header, blob[16 + hlen : -4]


def build_payload(header: dict, data: bytes, *, version: int = 1, fix_crc: bool = True) -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-(16 + len(hb))) % 8)
    body = struct.pack("<8sII", b"GPUCODEC", version, len(hb)) + hb + data
    crc = zlib.crc32(body) & 0xFFFFFFFF if fix_crc else 0
    return body + struct.pack("<I", crc)


def load_benchmark(filename: str):
    """Import ``benchmarks/<filename>`` (not a package) once, as module ``gpu_codec_bench_<stem>``."""
    import importlib.util
    import pathlib
    import sys

    name = "gpu_codec_bench_" + filename.removesuffix(".py")
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / filename
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
