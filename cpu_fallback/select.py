"""The NumPy backend's exact top-k: the same selection as the kernels, composed for speed on a CPU.

A strided sample brackets the threshold; one comparison pass keeps the superset above the low bracket; exact
selection (``np.partition``) runs on that small superset only. If the bracket misses (fewer than k candidates),
the whole tensor list becomes the superset, so the result is always exact. Ties at the threshold are taken
lowest flat index first, tensor order first for global scope, exactly as ``chunk_write`` does on the device.
"""

from __future__ import annotations

import math

import numpy as np

from gpu_codec.constants import index_dtype

from .elementwise import DT_F64, decoded, delta, nonfinite, score_key, scores_f32

SAMPLE = 1 << 16
_NONNEG = (0, 1, 3)  # criteria whose fp32 score is never negative: its raw bits already sort like the key
_INF_BITS = np.uint32(0x7F800000)


def _keys(t, new, base, res, dt, crit, ext, ext_dt):
    """(delta, sortable key array, first bad tensor or None) for one tensor."""
    d = delta(new, base, res, dt)
    if crit in (0, 3) and dt != DT_F64:
        raw = np.abs(d).view(np.uint32)
        bad = raw.size > 0 and raw.max() >= _INF_BITS
        return d, raw, bad
    s = scores_f32(crit, new, base, d, dt, ext, ext_dt)
    bad = nonfinite(d) or nonfinite(s)
    if crit in _NONNEG:
        return d, np.ascontiguousarray(s).view(np.uint32), bad
    return d, score_key(s), bad


def _select_segment(keys: list[np.ndarray], k: int) -> list[np.ndarray]:
    """Flat indices (int64, ascending) of the k largest keys over the concatenation of ``keys``."""
    sizes = [kk.size for kk in keys]
    n = sum(sizes)
    if k <= 0:
        return [np.zeros(0, np.int64) for _ in keys]
    if k >= n:
        return [np.arange(s, dtype=np.int64) for s in sizes]
    stride = max(1, n // SAMPLE)
    sample = np.concatenate([kk[::stride] for kk in keys])
    ms = sample.size
    r = k * ms / n
    pick = min(ms - 1, int(r + 4.0 * math.sqrt(r) + 32))
    lo = np.partition(sample, ms - 1 - pick)[ms - 1 - pick]
    cand = [np.flatnonzero(kk >= lo) for kk in keys]
    if sum(c.size for c in cand) < k:  # the bracket missed: exact selection over everything
        cand = [np.arange(s, dtype=np.int64) for s in sizes]
    ck = np.concatenate([kk[c] for kk, c in zip(keys, cand)])
    C = ck.size
    T = np.partition(ck, C - k)[C - k]
    sel = ck > T
    take = k - int(np.count_nonzero(sel))
    if take:
        sel[np.flatnonzero(ck == T)[:take]] = True
    out, a = [], 0
    for c in cand:
        out.append(c[sel[a : a + c.size]])
        a += c.size
    return out


def topk_select(new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode):
    """Exact top-k of every segment of a tensor list.

    Arguments are lists over tensors (flat NumPy arrays, ``None`` where absent) plus ``segments`` (lists of
    tensor positions sharing one threshold) and ``ks`` (k per segment). Returns ``(indices, values, bad)``:
    per-tensor ascending indices (uint32 or uint64), per-tensor kept deltas (fp32, fp64 for fp64 tensors), and
    the lowest tensor position with a non-finite delta or score (None if all are finite). ``res_out[t]``, where
    given, receives the error-feedback residual: the delta where not kept, delta - decoded(delta) where kept.
    """
    nt = len(new)
    deltas, keys = [None] * nt, [None] * nt
    for t in range(nt):
        d, kk, bad = _keys(t, new[t], base[t], res[t], dtypes[t], crit, ext_scores[t], ext_dtypes[t])
        if bad:
            return None, None, t
        deltas[t], keys[t] = d, kk
    indices, values = [None] * nt, [None] * nt
    for seg, k in zip(segments, ks):
        picked = _select_segment([keys[t] for t in seg], k)
        for t, idx in zip(seg, picked):
            d = deltas[t]
            indices[t] = idx.astype(index_dtype(d.size))
            values[t] = d[idx]
            if res_out[t] is not None:
                r = res_out[t]
                r[:] = d
                r[idx] = d[idx] - decoded(d[idx], qmode)
    return indices, values, None
