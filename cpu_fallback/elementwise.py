"""Element-wise NumPy twins of the device helpers in kernels/common.cuh and kernels/topk.cu.

Each function gives, bit for bit, what its CUDA counterpart computes: IEEE round-to-nearest-even conversions,
the fp32 (or fp64) delta, the score criteria and the order-preserving score key.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from gpu_codec.constants import CRIT_EXTERNAL, DT_BF16, DT_F16, DT_F32, DT_F64, QMODE_EXACT, QMODE_F16

_SIZE = attrgetter("size")


def array_sizes(arrays: list) -> np.ndarray:
    """Each array's element count, int64, read in one C loop over the list.

    >>> array_sizes([np.zeros(3), np.zeros((2, 2))]).tolist()
    [3, 4]
    """
    return np.fromiter(map(_SIZE, arrays), np.int64, len(arrays))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) to float32, exactly.

    >>> bf16_bits_to_f32(np.array([0x3F80, 0xC000], dtype=np.uint16)).tolist()
    [1.0, -2.0]
    """
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, round to nearest even (finite inputs).

    >>> f32_to_bf16_bits(np.array([1.0, 1.00390625, 1.01171875], dtype=np.float32)).tolist()  # ties to even
    [16256, 16256, 16258]
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    return ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 to float16, round to nearest even, overflow to inf (as the device does)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16)


def f64_to_f32(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32)


# every float16 bit pattern's float32 value, by NumPy's own cast: a lookup in it reads a block faster than the cast,
# a scalar loop where NumPy has no vector fp16 conversion for the CPU (same bits: tests/test_cpu_fallback_blocked.py)
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def load_f32(arr: np.ndarray, dt: int) -> np.ndarray:
    """A tensor's elements widened (or, for fp64, narrowed) to float32, as ``load_f32`` in common.cuh.

    >>> bits = np.array([0x3C00, 0x8001, 0x7C00, 0x7E01], np.uint16)  # 1, -2^-24, inf, a NaN: as NumPy casts them
    >>> cast = bits.view(np.float16).astype(np.float32)
    >>> load_f32(bits, DT_F16).view(np.uint32).tolist() == cast.view(np.uint32).tolist()
    True
    """
    if dt == DT_F32:
        return arr
    if dt == DT_F16:
        if arr.ndim == 0:
            return arr.view(np.float16).astype(np.float32)
        return _F16_TO_F32.take(arr.view(np.uint16))
    if dt == DT_BF16:
        return bf16_bits_to_f32(arr)
    return f64_to_f32(arr)


def store_from_f32(v: np.ndarray, dt: int) -> np.ndarray:
    """float32 values rounded to the storage of logical dtype ``dt`` (``store_f32`` in common.cuh)."""
    if dt == DT_F32:
        return v.astype(np.float32, copy=False)
    if dt == DT_F16:
        return f32_to_f16(v)
    if dt == DT_BF16:
        return f32_to_bf16_bits(v)
    return v.astype(np.float64)


def delta(new: np.ndarray, base: np.ndarray | None, res: np.ndarray | None, dt: int) -> np.ndarray:
    """(new - base) + residual in fp32 (fp64 for fp64 tensors); a missing base reads as zeros."""
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite deltas are reported by the caller
        if dt == DT_F64:
            d = new - (base if base is not None else 0.0)
        else:
            d = load_f32(new, dt) - (load_f32(base, dt) if base is not None else np.float32(0.0))
        d = np.asarray(d)
        if res is not None:
            d = d + res
    return d


def criterion(crit: int, w: np.ndarray, w0: np.ndarray | None, d: np.ndarray) -> np.ndarray:
    """A score criterion in the delta's precision (kernels/topk.cu ``criterion_f32``/``criterion_f64``)."""
    if w0 is None:
        w0 = np.zeros((), dtype=d.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        return _criterion(crit, w, w0, d)


def _criterion(crit, w, w0, d):
    if crit == 1:
        return np.abs(w)
    if crit == 2:
        return -np.abs(w)
    if crit == 4:
        return -np.abs(d)
    if crit == 5:
        return np.abs(w) - np.abs(w0)
    if crit == 6:
        return np.abs(w0) - np.abs(w)
    return np.abs(d)


def scores_f32(
    crit: int,
    new: np.ndarray,
    base: np.ndarray | None,
    d: np.ndarray,
    dt: int,
    ext: np.ndarray | None = None,
    ext_dt: int = DT_F32,
) -> np.ndarray:
    """The fp32 score of every element, as ``score_keys`` computes it before taking the key."""
    if crit == CRIT_EXTERNAL:
        return load_f32(ext, ext_dt)
    if dt == DT_F64:
        return f64_to_f32(criterion(crit, new, base, d))
    w = load_f32(new, dt)
    w0 = load_f32(base, dt) if base is not None else None
    return criterion(crit, w, w0, d).astype(np.float32, copy=False)


def score_key(s: np.ndarray) -> np.ndarray:
    """Order-preserving uint32 image of float32 scores; -0.0 and +0.0 map alike.

    >>> k = score_key(np.array([-2.0, -0.0, 0.0, 1.5], dtype=np.float32))
    >>> bool(k[0] < k[1] == k[2] < k[3])
    True
    """
    u = np.ascontiguousarray(s, dtype=np.float32).view(np.uint32).copy()
    u[u == np.uint32(0x80000000)] = 0
    neg = (u & np.uint32(0x80000000)) != 0
    return np.where(neg, ~u, u | np.uint32(0x80000000))


def nonfinite_f32(x: np.ndarray) -> bool:
    return bool(
        np.any(
            (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        )
    )


def nonfinite(x: np.ndarray) -> bool:
    if x.dtype == np.float64:
        return not bool(np.isfinite(x).all())
    return nonfinite_f32(x)


def decoded(d: np.ndarray, qmode: int) -> np.ndarray:
    """What the receiver decodes for kept value ``d`` under residual rounding mode ``qmode``."""
    if qmode == QMODE_EXACT:
        return d
    if d.dtype == np.float64:
        return decoded(f64_to_f32(d), qmode).astype(np.float64)
    if qmode == QMODE_F16:
        return f32_to_f16(d).astype(np.float32)
    return bf16_bits_to_f32(f32_to_bf16_bits(d))


def tensor_delta_scores(t, new_ptrs, base_ptrs, res_ptrs, dtypes, crit, score_ptrs, score_dtypes, idx=None):
    """(dtype code, delta, fp32 scores, bad) of tensor ``t`` (at positions ``idx``; all of it for None): the
    per-tensor front of every selection twin (``score_keys``, ``dense_delta``, ``fused_scan``, ``sample_keys``,
    ``tie_write``)."""

    def at(a):
        return None if a is None else (a if idx is None else a[idx])

    dt = int(dtypes[t])
    d = delta(at(new_ptrs[t]), at(base_ptrs[t]), at(res_ptrs[t]), dt)
    with np.errstate(over="ignore", invalid="ignore"):
        s = scores_f32(int(crit), at(new_ptrs[t]), at(base_ptrs[t]), d, dt, at(score_ptrs[t]), int(score_dtypes[t]))
    return dt, d, s, nonfinite(d) or nonfinite(s)
