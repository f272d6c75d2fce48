"""Every kernel launch of kernels/*.cu, in one place, driven by a *runner*.

A runner (:class:`~gpu_codec.backends.base.Runner`) has ``xp`` (the array module its memory lives in),
``launch(name, grid, block, args)``, ``ptr(array)`` and ``to_host(array)``. The GPU backend's runner is CuPy
(:mod:`gpu_codec.backends.cupy`); the emulated backend's runner executes the same CUDA sources on the CPU
(:mod:`gpu_codec.backends.emulated`). Both go through :class:`KernelOps` below, so the emulated backend exercises
exactly what the GPU backend launches.

The only device-to-host copies here are small: one error word after scoring and after a scatter, the per-tensor
kept counts, ternary mu and Rice bit counts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..constants import (
    BLOCK,
    CHUNK,
    DT_F32,
    DT_F64,
    NO_SEG_THRESHOLD,
    Q_BF16,
    Q_F16,
    RICE_SCAN_THREADS,
    SCAN_THREADS,
    U64_MAX,
    index_dtype,
)
from .base import Runner, dense_values, flat_tables, scatter_args, split_values

__all__ = ["CHUNK", "KernelBackendBase", "KernelOps", "TensorTables", "initial_state", "scatter_args"]


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


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.uint64)


def _split(flat: Any, counts: list[int]) -> list[Any]:
    out, a = [], 0
    for c in counts:
        out.append(flat[a : a + c])
        a += c
    return out


class KernelOps:
    """Every op of the :class:`~gpu_codec.backends.base.Backend` protocol that runs kernels, composed from them."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.xp = runner.xp

    def _up(self, host: np.ndarray):
        return self.xp.asarray(host)

    def _ptrs(self, arrays, *, skip_empty: bool = False) -> Any:
        """A device table of the arrays' addresses (0 for None, and for empty arrays with ``skip_empty``)."""
        return self._up(
            np.asarray(
                [self.runner.ptr(a) if a is not None and not (skip_empty and a.size == 0) else 0 for a in arrays],
                dtype=np.uint64,
            )
        )

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
        has64 = any(int(d) == DT_F64 for d in dtypes)
        has32 = any(int(d) != DT_F64 for d in dtypes)
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
            values.append((vals64 if int(dtypes[t]) == DT_F64 else vals32)[a : a + c])
            a += c
        if a != K:
            raise AssertionError(f"kernels kept {a} entries, expected {K}")
        return indices, values, None

    def dense_delta(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit):
        """Dense mode in one pass over the inputs (see :meth:`gpu_codec.backends.base.Backend.dense_delta`)."""
        xp, run = self.xp, self.runner
        numels = [int(a.size) for a in new]
        tb = TensorTables(numels, [0] * len(new), 1)
        off, n32, n64 = flat_tables(numels, dtypes, DT_F64)
        vals32, vals64 = xp.empty(n32, np.float32), xp.empty(n64, np.float64)
        err = self._up(np.full(1, U64_MAX, dtype=np.uint64))
        if tb.nchunks:
            run.launch(
                "dense_delta",
                tb.nchunks,
                BLOCK,
                (
                    np.int32(len(new)),
                    self._up(tb.chunk_start),
                    self._up(tb.elem_off),
                    self._up(tb.numel),
                    self._up(np.asarray(dtypes, dtype=np.int32)),
                    self._ptrs(new),
                    self._ptrs(base),
                    self._ptrs(res),
                    self._ptrs(ext_scores),
                    self._up(np.asarray(ext_dtypes, dtype=np.int32)),
                    np.int32(crit),
                    vals32,
                    vals64,
                    err,
                ),
            )
            bad = int(run.to_host(err)[0])
            if bad != U64_MAX:
                return None, bad
        for r in res_out:
            if r is not None:
                r.fill(0)  # every entry is kept and sent exactly: d - decoded(d) = +0.0
        return split_values(vals32, vals64, numels, dtypes, off, DT_F64), None

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

    def dense_apply(self, outs, out_dtypes, bases, values, mode):
        """Dense records into fresh outputs, reading bases and values in place; the lowest bad entry or None."""
        counts = [int(o.size) for o in outs]
        total = sum(counts)
        if total == 0:
            return None
        vals = dense_values(values, out_dtypes, DT_F64)
        err = self._up(np.full(1, U64_MAX, dtype=np.uint64))
        self.runner.launch(
            "dense_apply",
            math.ceil(total / BLOCK),
            BLOCK,
            (
                np.int32(len(outs)),
                np.uint64(total),
                self._up(_offsets(counts)),
                self._up(np.asarray(out_dtypes, np.int32)),
                self._ptrs(outs, skip_empty=True),
                self._ptrs(bases, skip_empty=True),
                self._ptrs(vals, skip_empty=True),
                np.int32(mode),
                err,
            ),
        )
        bad = int(self.runner.to_host(err)[0])
        return None if bad == U64_MAX else bad

    def _entry_tables(self, values, indices, res):
        counts = [int(v.size) for v in values]
        return (
            counts,
            np.int32(len(values)),
            self._up(_offsets(counts)),
            self._up(np.asarray([DT_F64 if v.dtype == np.float64 else DT_F32 for v in values], np.int32)),
            self._ptrs(values, skip_empty=True),
            self._up(np.asarray([0 if i is None else np.dtype(i.dtype).itemsize for i in indices], np.int32)),
            self._ptrs(indices, skip_empty=True),
            self._ptrs(res, skip_empty=True),
        )

    def cast16(self, values, dtype: str, indices, res) -> list[Any]:
        mode = Q_F16 if dtype == "float16" else Q_BF16
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        total = sum(counts)
        out = self.xp.empty(max(total, 1), dtype=np.uint16)
        if total:
            self.runner.launch(
                "quantize_cast",
                -(-total // BLOCK),
                BLOCK,
                (nt, np.uint64(total), ent, vdt, vp, iw, ip, rp, np.int32(mode), out),
            )
        return _split(out, counts)

    def int8(self, values, block, indices, res) -> tuple[list[Any], list[Any]]:
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        nblk = [-(-c // block) for c in counts]
        out = self.xp.empty(max(sum(counts), 1), dtype=np.int8)
        scales = self.xp.empty(max(sum(nblk), 1), dtype=np.float32)
        if sum(nblk):
            self.runner.launch(
                "quantize_int8",
                sum(nblk),
                BLOCK,
                (nt, self._up(_offsets(nblk)), ent, np.int32(block), vdt, vp, iw, ip, rp, out, scales),
            )
        return _split(out, counts), _split(scales, nblk)

    def ternary(self, values, indices, res) -> tuple[list[Any], np.ndarray]:
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        tb = TensorTables(counts, [0] * len(counts), 1)
        nwords = [-(-c // 32) for c in counts]
        word_off = _offsets(nwords)
        words = self.xp.zeros(max(sum(nwords), 1), dtype=np.uint32)
        partial = self.xp.zeros(max(tb.nchunks, 1), dtype=np.float64)
        mu = self.xp.zeros(max(len(counts), 1), dtype=np.float32)
        cs = self._up(tb.chunk_start)
        if tb.nchunks:
            self.runner.launch(
                "ternary_partial", tb.nchunks, BLOCK, (nt, cs, ent, vdt, vp, self._up(word_off), partial, words)
            )
        if counts:
            self.runner.launch("ternary_mu", len(counts), BLOCK, (nt, cs, ent, partial, mu))
        if any(r is not None for r in res) and sum(counts):
            self.runner.launch(
                "ternary_fixup",
                -(-sum(counts) // BLOCK),
                BLOCK,
                (nt, np.uint64(sum(counts)), ent, vdt, vp, iw, ip, rp, mu),
            )
        signs = [
            words[int(word_off[t]) : int(word_off[t + 1])].view(np.uint8)[: -(-c // 8)] for t, c in enumerate(counts)
        ]
        return signs, self.runner.to_host(mu)[: len(counts)].astype(np.float32)

    def rice(self, indices, ks) -> tuple[list[Any], list[int]]:
        xp, run = self.xp, self.runner
        counts = [int(i.size) for i in indices]
        wide = any(i.dtype == np.uint64 for i in indices)
        idx = [i.astype(np.uint64) if wide and i.dtype != np.uint64 else i for i in indices]
        tb = TensorTables(counts, [0] * len(counts), 1)
        nt, ent, d_ks = np.int32(len(counts)), self._up(_offsets(counts)), self._up(np.asarray(ks, np.int32))
        cs, ip = self._up(tb.chunk_start), self._ptrs(idx, skip_empty=True)
        sfx = "u64" if wide else "u32"
        bits = [0] * len(counts)
        chunk_base = xp.zeros(max(tb.nchunks, 1), dtype=np.uint64)
        if tb.nchunks:
            chunk_q = xp.zeros(tb.nchunks, dtype=np.uint64)
            tbits = xp.zeros(len(counts), dtype=np.uint64)
            run.launch("rice_count_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_q))
            run.launch(
                "rice_scan", 1, RICE_SCAN_THREADS, (nt, np.int64(tb.nchunks), cs, ent, d_ks, chunk_q, chunk_base, tbits)
            )
            bits = [int(b) for b in run.to_host(tbits)]
        nwords = [-(-b // 32) for b in bits]
        word_off = _offsets(nwords)
        words = xp.zeros(max(sum(nwords), 1), dtype=np.uint32)
        if tb.nchunks:
            run.launch(
                "rice_write_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_base, self._up(word_off), words)
            )
        streams = [
            words[int(word_off[t]) : int(word_off[t + 1])].view(np.uint8)[: -(-b // 8)] for t, b in enumerate(bits)
        ]
        return streams, bits


class KernelBackendBase:
    """The ops of a kernel backend (GPU or emulated): each one a :class:`KernelOps` launch sequence."""

    name: str
    on_device: bool

    def __init__(self, runner: Runner):
        self.runner = runner
        self.xp = runner.xp
        self.ops = KernelOps(runner)

    def to_host(self, a: Any) -> np.ndarray:
        return self.runner.to_host(a)

    def topk_select(self, *args):
        return self.ops.topk_select(*args)

    def scatter(self, *args):
        return self.ops.scatter(*args)

    def dense_apply(self, outs, out_dtypes, bases, values, mode):
        return self.ops.dense_apply(outs, out_dtypes, bases, values, mode)

    def dense_delta(self, *args):
        return self.ops.dense_delta(*args)

    def cast16(self, values, dtype, indices, res):
        return self.ops.cast16(values, dtype, indices, res)

    def int8(self, values, block, indices, res):
        return self.ops.int8(values, block, indices, res)

    def ternary(self, values, indices, res):
        return self.ops.ternary(values, indices, res)

    def rice(self, indices, ks):
        return self.ops.rice(indices, ks)
