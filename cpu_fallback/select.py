"""The NumPy backend's exact top-k: the same selection as the kernels, composed for speed on a CPU.

A strided sample brackets the threshold from below (``lo``). One pass over cache-sized blocks, spread over the
thread pool, computes each block's delta and keys while they sit in cache and keeps only the candidates: the
entries whose key is above ``lo`` (local index and delta), and a count of those equal to ``lo``. Each input byte
crosses from memory once and nothing of full size is allocated. Exact selection (``np.partition``) then runs on
the candidates; if the threshold turns out to be ``lo`` itself, the blocks holding the needed entries equal to
``lo`` are computed again. If the bracket misses (fewer than k entries at or above ``lo``), the pass runs again
with the lowest key as ``lo``, so the result is always exact. Ties at the threshold are taken lowest flat index
first, tensor order first for global scope, exactly as ``chunk_write`` does on the device; results are combined
in block order, so they do not depend on the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpu_codec.constants import index_dtype

from .elementwise import DT_F32, DT_F64, decoded, delta, nonfinite, score_key, scores_f32
from .parallel import parallel_map, thread_count

SAMPLE = 1 << 16  # sampled keys: one every SAMPLE_STRIDE elements, at least SAMPLE_MIN, at most SAMPLE
SAMPLE_MIN = 1 << 12
SAMPLE_STRIDE = 128
BLOCK = 1 << 16  # elements per block (at most 2^16: candidates keep a uint16 index in their block); stays in L2
MIN_BLOCK = 1 << 12
MIN_TASK = 1 << 20  # fewer elements than this per task are not worth a thread (measured: 2^18 was 3x slower at 1M)
TASK = 1 << 20  # most elements per pool task (a task's candidates are joined once)
_NONNEG = (0, 1, 3)  # criteria whose fp32 score is never negative: its raw bits already sort like the key
_INF_BITS = np.uint32(0x7F800000)
_ABS = np.uint32(0x7FFFFFFF)
_ZERO32 = np.float32(0.0)


def _keys(t, new, base, res, dt, crit, ext, ext_dt):
    """(delta, sortable key array, bad) for one tensor (or a strided view of one)."""
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


@dataclass
class _Call:
    """One topk_select call's inputs."""

    new: list
    base: list
    res: list
    res_out: list
    dtypes: list
    ext: list
    ext_dt: list
    crit: int

    def fast(self, t: int) -> bool:
        """The key is |delta|'s fp32 bits: no score array, and non-finite deltas are exactly the keys >= inf."""
        return self.crit in (0, 3) and self.dtypes[t] != DT_F64

    def writes_residual_early(self, t: int) -> bool:
        """The residual can be written during the scan: it does not share memory with the residual read."""
        r, w = self.res[t], self.res_out[t]
        return w is not None and (r is None or not np.may_share_memory(r, w))


@dataclass
class _Part:
    """A task's candidates: entries of tensor ``t`` in ``[a, b)`` with key above ``lo``, in index order."""

    t: int
    a: int
    b: int
    idx: np.ndarray | None = None  # uint16, relative to the block (6 bytes a candidate with its fp32 delta)
    counts: np.ndarray | None = None  # candidates per block
    d: np.ndarray | None = None  # deltas
    key: np.ndarray | None = None  # keys (None on the fast path: derived from d)
    neq: int = 0  # entries with key == lo
    bad: bool = False
    block: int = 0

    def keys(self) -> np.ndarray:
        return self.key if self.key is not None else np.bitwise_and(self.d.view(np.uint32), _ABS)

    def rel(self) -> np.ndarray:
        """uint32 index of each candidate relative to a."""
        starts = np.arange(self.counts.size, dtype=np.uint32) * np.uint32(self.block)
        return self.idx.astype(np.uint32) + np.repeat(starts, self.counts)


class _Blocks:
    """Delta and keys of one block at a time, in buffers reused across the blocks of a task."""

    def __init__(self, c: _Call, t: int, size: int, lo: np.uint32):
        self.c, self.t, self.lo = c, t, lo
        self.fast = c.fast(t)
        if self.fast:
            self.dbuf = np.empty(size, np.float32)
            self.below = np.empty(size, np.bool_)
            self.above = np.empty(size, np.bool_)
            self.lof = np.array([lo], np.uint32).view(np.float32)[0]  # lo <= inf: a number

    def delta_keys(self, s: int, e: int, write_res: bool) -> tuple[np.ndarray, np.ndarray | None, bool | None]:
        """(delta, keys, bad) of elements [s, e); on the fast path keys and bad are None (|delta| is the key)."""
        c, t = self.c, self.t
        new, base, res, dt = c.new[t][s:e], c.base[t], c.res[t], c.dtypes[t]
        base = base[s:e] if base is not None else None
        res = res[s:e] if res is not None else None
        if self.fast:
            d = self.dbuf[: e - s]
            if dt == DT_F32:
                np.subtract(new, base if base is not None else _ZERO32, out=d)
                if res is not None:
                    np.add(d, res, out=d)
            else:
                d[...] = delta(new, base, res, dt)
            if write_res:
                c.res_out[t][s:e] = d
            return d, None, None
        d = delta(new, base, res, dt)
        if write_res:
            c.res_out[t][s:e] = d
        ext = c.ext[t][s:e] if c.ext[t] is not None else None
        sc = scores_f32(c.crit, new, base, d, dt, ext, c.ext_dt[t])
        bad = nonfinite(d) or nonfinite(sc)
        k = np.ascontiguousarray(sc).view(np.uint32) if c.crit in _NONNEG else score_key(sc)
        return d, k, bad

    def at_least(self, d: np.ndarray, k: np.ndarray | None) -> np.ndarray:
        """Positions with key >= lo. Fast path: not (-lo < d < lo), on fp32 compares; NaN is a candidate."""
        if not self.fast:
            return (k >= self.lo).nonzero()[0]
        m, a = self.below[: d.size], self.above[: d.size]
        np.less(d, self.lof, out=m)
        np.greater(d, -self.lof, out=a)
        np.logical_and(m, a, out=m)
        np.logical_not(m, out=m)
        return m.nonzero()[0]


def _scan(c: _Call, part: _Part, lo: np.uint32, write_res: bool) -> _Part:
    """Candidates (key > lo) of one task, the count of keys == lo, and whether a delta or score is non-finite."""
    t, a, b = part.t, part.a, part.b
    blk = _Blocks(c, t, min(part.block, b - a), lo)
    idx, ds, ks, cnt = [], [], [], []
    bad = False
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite deltas are reported, not warned about
        for s in range(a, b, part.block):
            d, k, bad_b = blk.delta_keys(s, min(b, s + part.block), write_res)
            ci = blk.at_least(d, k)
            idx.append(ci.astype(np.uint16))
            cnt.append(ci.size)
            ds.append(d[ci])
            if not blk.fast:
                bad = bad or bad_b
                ks.append(k[ci])
    join = np.concatenate if len(idx) > 1 else (lambda xs: xs[0])
    ci, d = join(idx), join(ds)
    key = join(ks) if ks else np.bitwise_and(d.view(np.uint32), _ABS)
    if blk.fast:  # lo <= inf: every non-finite delta is at or above lo
        bad = key.size > 0 and bool(key.max() >= _INF_BITS)
    gt = key > lo
    counts = np.bincount(np.repeat(np.arange(len(cnt)), cnt)[gt], minlength=len(cnt))
    kept = ci[gt]
    return _Part(t, a, b, kept, counts, d[gt], None if blk.fast else key[gt], gt.size - kept.size, bad, part.block)


def _equal(c: _Call, part: _Part, lo: np.uint32, need: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``need`` entries of a task whose key equals lo: (uint32 index relative to a, delta)."""
    t, a, b = part.t, part.a, part.b
    blk = _Blocks(c, t, min(part.block, b - a), lo)
    idx, ds = [], []
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(a, b, part.block):
            if need <= 0:
                break
            d, k, _ = blk.delta_keys(s, min(b, s + part.block), False)
            if k is None:
                k = np.bitwise_and(d.view(np.uint32), _ABS)
            ci = np.flatnonzero(k == lo)[:need]
            need -= ci.size
            idx.append((ci + (s - a)).astype(np.uint32))
            ds.append(d[ci])
    return np.concatenate(idx), np.concatenate(ds)


def _write_residual(c: _Call, part: _Part) -> None:
    """residual = delta over a task's range, block by block (used where the residual read is overwritten)."""
    blk = _Blocks(c, part.t, min(part.block, part.b - part.a), np.uint32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(part.a, part.b, part.block):
            blk.delta_keys(s, min(part.b, s + part.block), True)


def _tasks(c: _Call, seg: list[int], n: int) -> list[_Part]:
    per = max(1, 4 * thread_count())
    block = min(BLOCK, max(MIN_BLOCK, 1 << max(0, n // 64 - 1).bit_length()))  # buffers stay small beside n
    span = min(TASK, max(MIN_TASK, block, -(-n // per)))
    span = -(-span // block) * block
    parts = []
    for t in seg:
        m = c.new[t].size
        parts += [_Part(t, a, min(m, a + span), block=block) for a in range(0, m, span)]
    return parts


def _bracket(c: _Call, seg: list[int], n: int, k: int) -> np.uint32:
    """A key at or below the k-th largest with high probability, from a strided sample."""
    stride = max(1, n // min(SAMPLE, max(SAMPLE_MIN, n // SAMPLE_STRIDE)))

    def view(x):
        return x[::stride] if x is not None else None

    keys = []
    with np.errstate(over="ignore", invalid="ignore"):
        for t in seg:
            args = (view(c.new[t]), view(c.base[t]), view(c.res[t]), c.dtypes[t], c.crit, view(c.ext[t]))
            keys.append(_keys(t, *args, c.ext_dt[t])[1])
    sample = np.concatenate(keys)
    del keys
    ms = sample.size
    r = k * ms / n
    pick = min(ms - 1, int(r + 4.0 * math.sqrt(r) + 32))
    sample.partition(ms - 1 - pick)
    lo = sample[ms - 1 - pick]
    if c.crit in (0, 3):
        lo = min(lo, _INF_BITS)  # so every non-finite delta is a candidate and is seen
    return np.uint32(lo)


def _finish(c: _Call, seg: list[int], parts: list[_Part], lo: np.uint32, k: int, indices: list, values: list) -> None:
    """The k largest keys among the parts' entries, written to ``indices`` and ``values`` tensor by tensor.

    Each part's candidates are freed once copied, so the candidates and the output are never held twice.
    """
    g = sum(p.idx.size for p in parts)
    thr, takes, extras, counts = None, [0] * len(parts), [None] * len(parts), []
    if g >= k:  # the threshold is above lo: every entry at it is a candidate
        keys = np.concatenate([p.keys() for p in parts]) if len(parts) > 1 else parts[0].keys().copy()
        keys.partition(g - k)
        thr = keys[g - k]
        take = k - int(np.count_nonzero(keys > thr))
        del keys
        for i, p in enumerate(parts):
            kp = p.keys()
            if take:
                takes[i] = min(take, int(np.count_nonzero(kp == thr)))
                take -= takes[i]
            counts.append(int(np.count_nonzero(kp > thr)) + takes[i])
    else:  # the threshold is lo: every candidate, then the first entries equal to lo
        need = k - g
        for i, p in enumerate(parts):
            if need and p.neq:
                extras[i] = _equal(c, p, lo, min(need, p.neq))
                need -= extras[i][0].size
            counts.append(p.idx.size + (extras[i][0].size if extras[i] is not None else 0))
    for t in seg:
        mine = [i for i, p in enumerate(parts) if p.t == t]
        idx = np.empty(sum(counts[i] for i in mine), index_dtype(c.new[t].size))
        val = np.empty(idx.size, np.float64 if c.dtypes[t] == DT_F64 else np.float32)
        o = 0
        for i in mine:
            p = parts[i]
            if thr is not None:
                kp = p.keys()
                sel = kp > thr
                if takes[i]:
                    sel[np.flatnonzero(kp == thr)[: takes[i]]] = True
                pi, pd = p.rel()[sel], p.d[sel]
            elif extras[i] is not None:
                pi = np.concatenate([p.rel(), extras[i][0]])
                order = np.argsort(pi, kind="stable")
                pi, pd = pi[order], np.concatenate([p.d, extras[i][1]])[order]
            else:
                pi, pd = p.rel(), p.d
            dst = idx[o : o + pi.size]
            dst[...] = pi
            dst += idx.dtype.type(p.a)
            val[o : o + pi.size] = pd
            o += pi.size
            p.idx = p.d = p.key = None
        indices[t], values[t] = idx, val


def _sparse_segment(c: _Call, seg: list[int], n: int, k: int) -> tuple[list[_Part], np.uint32]:
    """Scan a segment's tasks; returns the parts and lo."""
    lo = _bracket(c, seg, n, k)
    tasks = _tasks(c, seg, n)
    parts = parallel_map(lambda p: _scan(c, p, lo, c.writes_residual_early(p.t)), tasks)
    if not any(p.bad for p in parts) and sum(p.idx.size + p.neq for p in parts) < k:  # the bracket missed
        lo = np.uint32(0)
        parts = parallel_map(lambda p: _scan(c, p, lo, False), tasks)
    return parts, lo


def topk_select(new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode):
    """Exact top-k of every segment of a tensor list.

    Arguments are lists over tensors (flat NumPy arrays, ``None`` where absent) plus ``segments`` (lists of
    tensor positions sharing one threshold) and ``ks`` (k per segment). Returns ``(indices, values, bad)``:
    per-tensor ascending indices (uint32 or uint64), per-tensor kept deltas (fp32, fp64 for fp64 tensors), and
    the lowest tensor position with a non-finite delta or score (None if all are finite). ``res_out[t]``, where
    given, receives the error-feedback residual: the delta where not kept, delta - decoded(delta) where kept.
    Where ``res_out[t]`` shares memory with ``res[t]`` (the engine's in-place state) nothing is written to it
    when a value is non-finite. The result does not depend on ``GPU_CODEC_THREADS``.
    """
    c = _Call(new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit)
    nt = len(new)
    indices, values = [None] * nt, [None] * nt
    sparse, bad, full = [], [], {}
    for seg, k in zip(segments, ks):
        n = sum(new[t].size for t in seg)
        if 0 < k < n:
            parts, lo = _sparse_segment(c, seg, n, k)
            bad += [p.t for p in parts if p.bad]
            sparse.append((seg, parts, lo, k))
            continue
        for t in seg:  # nothing or everything kept: whole deltas, as small as the tensor or as the output
            d, _, b = _keys(t, new[t], base[t], res[t], dtypes[t], crit, ext_scores[t], ext_dtypes[t])
            if b:
                bad.append(t)
            full[t] = d
            if k <= 0:
                indices[t], values[t] = np.zeros(0, index_dtype(d.size)), d[:0].copy()
            else:
                indices[t], values[t] = np.arange(d.size, dtype=index_dtype(d.size)), np.ascontiguousarray(d)
    if bad:
        return None, None, min(bad)
    for seg, parts, lo, k in sparse:
        _finish(c, seg, parts, lo, k, indices, values)
        late = [p for p in parts if res_out[p.t] is not None and not c.writes_residual_early(p.t)]
        if late:  # after _finish: it may read the residual again
            parallel_map(lambda p: _write_residual(c, p), late)
    for t in range(nt):
        r = res_out[t]
        if r is None:
            continue
        if t in full:
            r[:] = full[t]
        v = values[t]
        r[indices[t]] = v - decoded(v, qmode)
    return indices, values, None
