"""NumPy twins of the fused selection kernels of kernels/topk.cu: same names, same arguments, same bytes.

As in :mod:`cpu_fallback.kernels`, a table of device addresses (``new_ptrs``, ``early_ptrs``, ...) is passed as
the list of arrays it points to (``None`` for a null address), and outputs are written into the arrays passed in.
The NumPy backend itself selects with :mod:`cpu_fallback.select`; these twins are what the emulated and GPU
backends' fused path is checked against.
"""

from __future__ import annotations

import numpy as np

from .elementwise import DT_F64, decoded, delta, score_key, tensor_delta_scores
from .kernels import CHUNK


def _keys(t, idx, new_ptrs, base_ptrs, res_ptrs, score_ptrs, score_dtypes, dtypes, crit):
    """(delta, key, bad) of tensor t at positions ``idx`` (all of it for None)."""
    _, d, s, bad = tensor_delta_scores(t, new_ptrs, base_ptrs, res_ptrs, dtypes, crit, score_ptrs, score_dtypes, idx)
    return d, score_key(s), bad


def sample_positions(t, n, count, stride, run):
    """The elements that the ``count`` sample slots of tensor ``t`` (``n`` elements) read: slot r lies in window
    w = r // run (the elements [w * stride, (w + 1) * stride)), at a run-aligned offset that a hash of (t, w)
    picks among the window's whole runs (kernels/topk.cu, sample_position).

    >>> sample_positions(1, 64, 16, 32, 8).tolist()
    [16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55]
    """
    run, stride = int(run), int(stride)
    r = np.arange(int(count), dtype=np.int64)
    w = r // run
    start = w * stride
    runs = np.minimum(int(n) - start, stride) // run
    h = (w.astype(np.uint32) ^ np.uint32((int(t) * 0x632BE5AB) & 0xFFFFFFFF)) * np.uint32(0x9E3779B1)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    off = np.where(runs > 1, (h.astype(np.int64) % np.maximum(runs, 1)) * run, 0)
    return start + off + r % run


def sample_keys(
    nt,
    total,
    samp_off,
    numel,
    stride,
    run,
    dtypes,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    score_ptrs,
    score_dtypes,
    crit,
    keys,
):
    for t in range(int(nt)):
        a, b = int(samp_off[t]), int(samp_off[t + 1])
        if b <= a:
            continue
        pos = sample_positions(t, int(numel[t]), b - a, int(stride[t]), run)
        keys[a:b] = _keys(t, pos, new_ptrs, base_ptrs, res_ptrs, score_ptrs, score_dtypes, dtypes, crit)[1]


def _chunks(chunk_start, t):
    return int(chunk_start[t]), int(chunk_start[t + 1])


def fused_scan(
    nt,
    chunk_start,
    numel,
    dtypes,
    seg_of,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    score_ptrs,
    score_dtypes,
    crit,
    early_ptrs,
    lo,
    own_k,
    pool_cap,
    cand_base,
    cand_cnt,
    cand_idx,
    cand_key,
    eq_cnt,
    status,
):
    """Chunks take their places in the pool in chunk order here; the kernel places them in the order its blocks
    finish. Later kernels reach a chunk's candidates through cand_base and cand_cnt only, so the placement never
    reaches the results (the step-by-step comparison in gpu_codec.testing.kernel_cases compares candidates per
    chunk)."""
    nt = int(nt)
    cap = int(pool_cap)
    for t in range(nt):
        n = int(numel[t])
        if n == 0:
            continue
        s = int(seg_of[t])
        d, key, bad = _keys(t, None, new_ptrs, base_ptrs, res_ptrs, score_ptrs, score_dtypes, dtypes, crit)
        if bad:
            status[0] = min(int(status[0]), t)
        if early_ptrs[t] is not None:
            early_ptrs[t][:] = d
        sel = key.astype(np.uint64) > np.uint64(int(lo[s]))
        eq = key.astype(np.uint64) == np.uint64(int(lo[s]))
        c0, c1 = _chunks(chunk_start, t)
        for c in range(c0, c1):
            e0 = (c - c0) * CHUNK
            local = np.flatnonzero(sel[e0 : min(n, e0 + CHUNK)])
            e = int(np.count_nonzero(eq[e0 : min(n, e0 + CHUNK)]))
            k = int(own_k[s])
            if k and local.size > k:  # the chunk's own k best only (all where it holds fewer), ties lowest index first
                kc = key[e0 + local]
                T = np.partition(kc, kc.size - k)[kc.size - k]
                kept = kc > T
                kept[np.flatnonzero(kc == T)[: k - int(np.count_nonzero(kept))]] = True
                local = local[kept]
            eq_cnt[c] = e
            m = local.size
            at = int(status[1])
            fits = at + m <= cap
            cand_base[c] = at if fits and m else 0
            cand_cnt[c] = m if fits else 0
            if fits and m:
                cand_idx[at : at + m] = local.astype(np.uint16)
                cand_key[at : at + m] = key[e0 + local]
            status[1] += np.uint64(m)
            status[2 + 2 * s] += np.uint64(m)
            status[3 + 2 * s] += np.uint64(e)


def fused_scan_f32(*args):
    """fused_scan's specialisation for fp32 tensors scored by the magnitude of their delta: the kernel reads wider
    (128-bit loads where aligned), its outputs are fused_scan's, so its twin is fused_scan's."""
    fused_scan(*args)


def fused_scan_h16(*args):
    """fused_scan's specialisation for fp16 and bf16 tensors scored by the magnitude of their delta: the kernel reads
    wider (64-bit loads of the inputs, 128-bit of the fp32 residual, where aligned), its outputs are fused_scan's,
    so its twin is fused_scan's."""
    fused_scan(*args)


def _cands(cand_base, cand_cnt, c):
    return int(cand_base[c]), int(cand_cnt[c])


def cand_select(nseg, seg_chunks, cand_base, cand_cnt, cand_key, state):
    for s in range(int(nseg)):
        k_rem = int(state[2 * s + 1])
        if k_rem == 0:
            continue
        parts = []
        for c in range(int(seg_chunks[s]), int(seg_chunks[s + 1])):
            base, m = _cands(cand_base, cand_cnt, c)
            parts.append(cand_key[base : base + m])
        keys = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        prefix = int(state[2 * s])
        for shift in (24, 16, 8, 0):
            k = keys if shift == 24 else keys[(keys >> np.uint32(shift + 8)) == np.uint32(prefix >> (shift + 8))]
            h = np.bincount((k >> np.uint32(shift)) & np.uint32(255), minlength=256)
            for b in range(255, -1, -1):
                if k_rem <= int(h[b]):
                    prefix |= b << shift
                    break
                k_rem -= int(h[b])
        state[2 * s] = prefix
        state[2 * s + 1] = k_rem


def cand_hist(nt, chunk_start, seg_of, cand_base, cand_cnt, cand_key, state, shift, hist):
    shift = int(shift)
    for t in range(int(nt)):
        s = int(seg_of[t])
        if int(state[2 * s + 1]) == 0:
            continue
        c0, c1 = _chunks(chunk_start, t)
        parts = [cand_key[b : b + m] for b, m in (_cands(cand_base, cand_cnt, c) for c in range(c0, c1))]
        k = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        if shift != 24:
            k = k[(k >> np.uint32(shift + 8)) == np.uint32(int(state[2 * s]) >> (shift + 8))]
        hist[256 * s : 256 * (s + 1)] += np.bincount((k >> np.uint32(shift)) & np.uint32(255), minlength=256).astype(
            np.uint64
        )


def cand_count(nt, chunk_start, seg_of, cand_base, cand_cnt, cand_key, state, lo, eq_cnt, cnt):
    for t in range(int(nt)):
        s = int(seg_of[t])
        at_lo = int(state[2 * s]) == int(lo[s])
        T = np.uint32(int(state[2 * s]) & 0xFFFFFFFF)
        c0, c1 = _chunks(chunk_start, t)
        for c in range(c0, c1):
            base, m = _cands(cand_base, cand_cnt, c)
            k = cand_key[base : base + m]
            cnt[2 * c] = np.count_nonzero(k > T)
            cnt[2 * c + 1] = eq_cnt[c] if at_lo else np.count_nonzero(k == T)


def _cand_write(
    nt,
    chunk_start,
    dtypes,
    seg_of,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    early_ptrs,
    cand_base,
    cand_cnt,
    cand_idx,
    cand_key,
    state,
    eq_base,
    out_base,
    out_idx,
    vals32,
    vals64,
):
    for t in range(int(nt)):
        s = int(seg_of[t])
        T, take = np.uint32(int(state[2 * s])), int(state[2 * s + 1])
        c0, c1 = _chunks(chunk_start, t)
        dt = int(dtypes[t])
        for c in range(c0, c1):
            base, m = _cands(cand_base, cand_cnt, c)
            k = cand_key[base : base + m]
            eq = k == T
            eq_rank = int(eq_base[c]) + np.cumsum(eq, dtype=np.int64) - eq
            sel = (k > T) | (eq & (eq_rank < take))
            i = (c - c0) * CHUNK + cand_idx[base : base + m][sel].astype(np.int64)
            o = int(out_base[c])
            out_idx[o : o + i.size] = i.astype(out_idx.dtype)
            if i.size == 0:
                continue
            if early_ptrs[t] is not None:  # the delta as fused_scan wrote it
                (vals64 if dt == DT_F64 else vals32)[o : o + i.size] = early_ptrs[t][i]
                continue
            d = delta(
                new_ptrs[t][i],
                None if base_ptrs[t] is None else base_ptrs[t][i],
                None if res_ptrs[t] is None else res_ptrs[t][i],
                dt,
            )
            (vals64 if dt == DT_F64 else vals32)[o : o + i.size] = d


def cand_write_u32(*args):
    _cand_write(*args)


def cand_write_u64(*args):
    _cand_write(*args)


def _tie_write(
    nt,
    chunk_start,
    numel,
    dtypes,
    seg_of,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    score_ptrs,
    score_dtypes,
    crit,
    lo,
    cnt,
    state,
    eq_base,
    out_base,
    out_idx,
    vals32,
    vals64,
):
    for t in range(int(nt)):
        s = int(seg_of[t])
        take = int(state[2 * s + 1])
        if int(state[2 * s]) != int(lo[s]):
            continue
        T = np.uint32(int(state[2 * s]))
        c0, c1 = _chunks(chunk_start, t)
        n = int(numel[t])
        for c in range(c0, c1):
            if int(eq_base[c]) >= take or int(cnt[2 * c + 1]) == 0:
                continue
            pos = np.arange((c - c0) * CHUNK, min(n, (c - c0 + 1) * CHUNK), dtype=np.int64)
            d, k, _ = _keys(t, pos, new_ptrs, base_ptrs, res_ptrs, score_ptrs, score_dtypes, dtypes, crit)
            eq = k == T
            eq_rank = int(eq_base[c]) + np.cumsum(eq, dtype=np.int64) - eq
            sel = (k > T) | (eq & (eq_rank < take))
            o, m = int(out_base[c]), int(np.count_nonzero(sel))
            out_idx[o : o + m] = pos[sel].astype(out_idx.dtype)
            (vals64 if int(dtypes[t]) == DT_F64 else vals32)[o : o + m] = d[sel]


def tie_write_u32(*args):
    _tie_write(*args)


def tie_write_u64(*args):
    _tie_write(*args)


def residual_delta(nt, chunk_start, numel, dtypes, new_ptrs, base_ptrs, res_ptrs, res_out_ptrs):
    for t in range(int(nt)):
        ro = res_out_ptrs[t]
        if ro is None or int(numel[t]) == 0:
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            ro[:] = delta(new_ptrs[t], base_ptrs[t], res_ptrs[t], int(dtypes[t]))


def _kept_fix(nt, total, ent_start, dtypes, res_out_ptrs, qmode, idx, vals32, vals64):
    for t in range(int(nt)):
        a, b = int(ent_start[t]), int(ent_start[t + 1])
        ro = res_out_ptrs[t]
        if ro is None or b <= a:
            continue
        v = (vals64 if int(dtypes[t]) == DT_F64 else vals32)[a:b]
        with np.errstate(over="ignore", invalid="ignore"):
            ro[idx[a:b].astype(np.int64)] = v - decoded(v, int(qmode))


def kept_fix_u32(*args):
    _kept_fix(*args)


def kept_fix_u64(*args):
    _kept_fix(*args)
