"""Wrappers that run the kernels of kernels/*.cu through a *runner*.

A runner has ``xp`` (the array module its memory lives in), ``launch(name, grid, block, args)``, ``ptr(array)``
and ``to_host(array)``. The GPU backend's runner is CuPy (:mod:`gpu_codec._cupy_runtime`); the emulated
backend's runner executes the same CUDA sources on the CPU (:mod:`gpu_codec._emulator`). Both go through the
code below, so the emulated backend exercises exactly what the GPU backend launches.

The only device-to-host copies here are small: one error word after scoring and the per-tensor kept counts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .cpu_fallback.select import index_dtype

BLOCK = 256
ITEMS = 16
CHUNK = BLOCK * ITEMS
SCAN_THREADS = 1024
U64_MAX = 0xFFFFFFFFFFFFFFFF
NO_SEG_THRESHOLD = 0xFFFFFFFF  # threshold of a segment with k = 0: above every finite key


class TensorTables:
    """Host-side tables that describe a tensor list to the kernels (chunk map, offsets, segments)."""

    def __init__(self, numels: list[int], seg_of: list[int], nseg: int):
        self.nt = len(numels)
        self.numel = np.asarray(numels, dtype=np.int64)
        nch = (self.numel + CHUNK - 1) // CHUNK
        self.chunk_start = np.concatenate([[0], np.cumsum(nch)]).astype(np.int64)
        self.nchunks = int(self.chunk_start[-1])
        self.elem_off = np.concatenate([[0], np.cumsum(self.numel)])[:-1].astype(np.int64)
        self.total = int(self.numel.sum())
        self.seg_of = np.asarray(seg_of, dtype=np.int32)
        first = [0] * nseg
        for t in range(self.nt - 1, -1, -1):
            first[int(seg_of[t])] = int(self.chunk_start[t])
        self.seg_first_chunk = np.asarray(first, dtype=np.int64)
        self.nseg = nseg


def initial_state(ks: list[int]) -> np.ndarray:
    """Radix-select state, 2 x u64 per segment: [prefix, k remaining]; k = 0 gets an unreachable threshold."""
    st = np.zeros(2 * len(ks), dtype=np.uint64)
    for s, k in enumerate(ks):
        st[2 * s] = 0 if k else NO_SEG_THRESHOLD
        st[2 * s + 1] = k
    return st


def scatter_args(xp: Any, indices: list, values: list):
    """Concatenate per-tensor entries as the scatter kernels take them: (total, ent_start (host u64), indices
    (u32, or u64 if any tensor needs it), vals32, vals64); ``None`` when there is no entry."""
    counts = [int(i.size) for i in indices]
    total = sum(counts)
    if total == 0:
        return None
    ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
    wide = any(i.dtype == np.uint64 for i in indices)
    idx = xp.concatenate([i.astype(np.uint64 if wide else np.uint32, copy=False) for i in indices])
    if all(v.dtype != np.float64 for v in values):
        vals32, vals64 = xp.concatenate([v.astype(np.float32, copy=False) for v in values]), xp.zeros(1, np.float64)
    elif all(v.dtype == np.float64 for v in values):
        vals32, vals64 = xp.zeros(1, np.float32), xp.concatenate(values)
    else:
        vals32 = xp.concatenate([v if v.dtype == np.float32 else xp.zeros(v.size, np.float32) for v in values])
        vals64 = xp.concatenate([v if v.dtype == np.float64 else xp.zeros(v.size, np.float64) for v in values])
    return total, ent_start, idx, vals32, vals64


class KernelOps:
    """Top-k selection and scatter, composed from the kernels."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.xp = runner.xp

    def _up(self, host: np.ndarray):
        return self.xp.asarray(host)

    def _ptrs(self, arrays) -> Any:
        return self._up(np.asarray([self.runner.ptr(a) if a is not None else 0 for a in arrays], dtype=np.uint64))

    def topk_select(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode):
        """Same contract as :func:`gpu_codec.cpu_fallback.select.topk_select`, on the runner's memory."""
        xp, run = self.xp, self.runner
        nt = len(new)
        seg_of = [0] * nt
        for s, seg in enumerate(segments):
            for t in seg:
                seg_of[t] = s
        # chunk_scan ranks ties over a segment's chunks in launch order: a segment must be a run of tensors
        flat = [t for seg in segments for t in seg]
        if flat != list(range(nt)) or any(
            list(seg) != list(range(seg[0], seg[0] + len(seg))) for seg in segments if seg
        ):
            raise ValueError(f"segments must be consecutive runs covering tensors 0..{nt - 1} in order")
        tb = TensorTables([int(a.size) for a in new], seg_of, len(segments))
        d_chunk_start, d_elem_off, d_numel = self._up(tb.chunk_start), self._up(tb.elem_off), self._up(tb.numel)
        d_seg_of = self._up(tb.seg_of)
        d_dtypes = self._up(np.asarray(dtypes, dtype=np.int32))
        p_new, p_base, p_res = self._ptrs(new), self._ptrs(base), self._ptrs(res)
        p_ext = self._ptrs(ext_scores)
        d_ext_dt = self._up(np.asarray(ext_dtypes, dtype=np.int32))
        keys = xp.empty(max(tb.total, 1), dtype=np.uint32)
        err = self._up(np.full(1, U64_MAX, dtype=np.uint64))
        nt32, grid = np.int32(nt), tb.nchunks
        if grid:
            run.launch(
                "score_keys",
                grid,
                BLOCK,
                (
                    nt32,
                    d_chunk_start,
                    d_elem_off,
                    d_numel,
                    d_dtypes,
                    p_new,
                    p_base,
                    p_res,
                    p_ext,
                    d_ext_dt,
                    np.int32(crit),
                    keys,
                    err,
                ),
            )
            bad = int(run.to_host(err)[0])
            if bad != U64_MAX:
                return None, None, bad
        # every entry kept (dense mode, fraction 1): threshold 0 is below every finite key, no radix pass needed
        full = all(k == sum(int(tb.numel[t]) for t in seg) for seg, k in zip(segments, ks))
        state = self._up(np.zeros(2 * len(ks), np.uint64) if full else initial_state(ks))
        hist = xp.zeros(256 * max(tb.nseg, 1), dtype=np.uint64)
        if grid and not full:
            for shift in (24, 16, 8, 0):
                run.launch(
                    "radix_hist",
                    grid,
                    BLOCK,
                    (nt32, d_chunk_start, d_elem_off, d_numel, d_seg_of, keys, state, np.int32(shift), hist),
                )
                run.launch("radix_pick", (tb.nseg + 255) // 256, 256, (np.int32(tb.nseg), np.int32(shift), hist, state))
        cnt = xp.zeros(max(2 * grid, 1), dtype=np.uint32)
        eq_base = xp.zeros(max(grid, 1), dtype=np.uint64)
        out_base = xp.zeros(grid + 1, dtype=np.uint64)
        counts = xp.zeros(max(nt, 1), dtype=np.uint64)
        K = int(sum(ks))
        wide = any(index_dtype(int(n)) == np.uint64 for n in tb.numel)
        idx = xp.empty(max(K, 1), dtype=np.uint64 if wide else np.uint32)
        has64 = any(int(d) == 3 for d in dtypes)
        has32 = any(int(d) != 3 for d in dtypes)
        vals32 = xp.empty(max(K, 1) if has32 else 1, dtype=np.float32)
        vals64 = xp.empty(max(K, 1) if has64 else 1, dtype=np.float64)
        if grid:
            run.launch(
                "chunk_count", grid, BLOCK, (nt32, d_chunk_start, d_elem_off, d_numel, d_seg_of, keys, state, cnt)
            )
            run.launch(
                "chunk_scan",
                1,
                SCAN_THREADS,
                (
                    nt32,
                    np.int64(grid),
                    d_chunk_start,
                    d_seg_of,
                    self._up(tb.seg_first_chunk),
                    state,
                    cnt,
                    eq_base,
                    out_base,
                    counts,
                ),
            )
            run.launch(
                "chunk_write_u64" if wide else "chunk_write_u32",
                grid,
                BLOCK,
                (
                    nt32,
                    d_chunk_start,
                    d_elem_off,
                    d_numel,
                    d_dtypes,
                    d_seg_of,
                    p_new,
                    p_base,
                    p_res,
                    self._ptrs(res_out),
                    np.int32(qmode),
                    keys,
                    state,
                    eq_base,
                    out_base,
                    idx,
                    vals32,
                    vals64,
                ),
            )
        host_counts = run.to_host(counts)[:nt].astype(np.int64) if grid else np.zeros(nt, np.int64)
        indices, values = [], []
        a = 0
        for t in range(nt):
            c = int(host_counts[t])
            it = idx[a : a + c]
            want = index_dtype(int(tb.numel[t]))
            indices.append(it if it.dtype == want else it.astype(want))
            values.append((vals64 if int(dtypes[t]) == 3 else vals32)[a : a + c])
            a += c
        if a != K:
            raise AssertionError(f"kernels kept {a} entries, expected {K}")
        return indices, values, None

    def scatter(self, outs, out_dtypes, numels, indices, values, mode):
        """Write kept entries into dense outputs; returns the lowest bad entry position or None.

        ``outs`` are flat arrays already zero-filled (mode 0) or holding a copy of the base (mode 1).
        """
        xp, run = self.xp, self.runner
        nt = len(outs)
        packed = scatter_args(xp, indices, values)
        if packed is None:
            return None
        total, ent_start, idx, vals32, vals64 = packed
        wide = idx.dtype == np.uint64
        err = self._up(np.full(1, U64_MAX, dtype=np.uint64))
        grid = math.ceil(total / BLOCK)
        run.launch(
            "scatter_u64" if wide else "scatter_u32",
            grid,
            BLOCK,
            (
                np.int32(nt),
                np.uint64(total),
                self._up(ent_start),
                self._up(np.asarray(numels, np.int64)),
                self._up(np.asarray(out_dtypes, np.int32)),
                self._ptrs(outs),
                idx,
                vals32,
                vals64,
                np.int32(mode),
                err,
            ),
        )
        bad = int(run.to_host(err)[0])
        return None if bad == U64_MAX else bad
