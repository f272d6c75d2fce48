"""The NumPy backend's exact top-k: the same selection as the kernels, composed for speed on a CPU.

A sample (runs of RUN consecutive elements at every stride-th element of the tensors laid end to end) brackets the
threshold from below (``lo``). One pass over cache-sized blocks, spread over the thread pool, computes each block's
delta and keys while the block sits in cache (on the fp32 |delta| path in place, in the delta's buffer; of packed small
tensors, into a key buffer beside it) and keeps only the candidates: the entries whose key is above ``lo`` (a 16-bit
index in their sub-block, and their deltas, gathered again from the block's inputs, or of packed tensors from the
block's delta, while they are in cache), and a count of those equal to ``lo``. The blocks are as large as fits in a
share of the update's bytes, or two threads' worth where that is more (BUFFER_SHARE, BUFFER_FLOOR: all threads
together), so that few NumPy calls are made per element: with threads, every call is a turn at the interpreter lock, and
a turn that has to wait for another thread costs far more than the call (the waiting thread sleeps until the kernel
wakes it). Exact selection (``np.partition``) then runs on the candidates; if the threshold turns out to be ``lo``
itself, the blocks holding the needed entries equal to ``lo`` are computed again. If the bracket misses (fewer than k
entries at or above ``lo``), it is lowered (further down the sample, at last the lowest key) and the pass runs again, so
the result is always exact. Ties at the threshold are taken lowest flat index first, tensor order first for global
scope, exactly as ``chunk_write`` does on the device; results are combined in block order, so they do not depend on the
thread count.

Small tensors are packed end to end into a task, so that the calls a block makes serve every tensor in it. In
per-tensor scope a tensor of at most SMALL_SELECT elements needs no scan: |delta| tensors are selected table by table
(tables of many tensors end to end, each one's calls made over the whole table but a bracket, a comparison and a
partition of the candidates a tensor), any other alone by a partition of its keys; tables whose tensors average fewer
than PACKED_PARALLEL elements are run in turn by one thread.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise, repeat

import numpy as np

from gpu_codec.constants import U32_INDEX_NUMEL, index_dtype

from .elementwise import DT_F32, DT_F64, array_sizes, decoded, delta, nonfinite, score_key, scores_f32
from .parallel import parallel_map, thread_count

SAMPLE = 1 << 16  # sampled keys: about one element in SAMPLE_STRIDE, at least SAMPLE_MIN, at most SAMPLE
SAMPLE_MIN = 1 << 12
SAMPLE_STRIDE = 128
RUN = 8  # the sample takes runs of RUN consecutive elements (one 32-byte sector of fp32), as the kernels do
BLOCK = 1 << 18  # most elements per block: its buffers stay in a core's L2 (a larger block means fewer calls)
MIN_BLOCK = 1 << 13
ALIGN = 1 << 12  # a block's elements are a multiple of ALIGN (16 KiB of fp32: whole pages and cache lines)
BUFFER_SHARE = 0.02  # the block buffers of all threads together: at most this share of the update's bytes ...
PARALLEL_BLOCK = 1 << 17  # a call uses no more threads than leave each a block this large (smaller ones cost
# more in turns at the interpreter lock than a second core gives back)
BLOCK_BYTES = 5  # buffer bytes per block element: the delta (its key, in place) and the comparison (a packed
# part's blocks, of as many elements, hold their keys in a buffer of their own: 9 bytes, so up to 9/5 of the share)
BUFFER_FLOOR = 2 * PARALLEL_BLOCK * BLOCK_BYTES  # ... or as much as gives two threads a PARALLEL_BLOCK each, where the
# share is less and the update has two tasks' worth of fp32 (1.25 MiB: an update of 2^21 to 2^24 fp32 elements; at
# 2^23 on 2 cores such blocks on both threads took 0.75x the time of the share's one thread, for a peak of 6.3 % of
# the update's bytes instead of 5.3 %; a smaller update is one task, which one thread scans)
SCORE_BLOCK = 1 << 16  # most elements per block where the score is not |delta| (its temporaries are per block)
SUB = 1 << 16  # candidates keep a uint16 index within a sub-block of SUB elements, and a count per sub-block
TASK = 1 << 21  # elements per pool task, rounded up to whole blocks: each task's joins and its share of the final
# copy cost turns at the interpreter lock, so fewer, larger tasks are faster (measured at 2^24 on 2 cores: 2^21 took
# 9 % less time than 2^20, 2^19 13 % more); a task holds about 12 bytes a candidate in flight at its peak
MIN_TASK = 1 << 20  # ... but a call is split into at least TASK_SPLIT tasks where that leaves them MIN_TASK or more
TASK_SPLIT = 8  # (in-flight candidates stay a small share of a smaller update: at 2^22 2^21 took 6 % of its bytes)
TIE_SHARE = 8  # strict candidates where the keys equal to the bracket would be over an eighth of k
SMALL_TABLE = 1 << 18  # small tensors selected together (per-tensor scope): at most this many elements a table (its
# delta, key and comparison buffers, 9 bytes an element, and temporaries of a few bytes an element)
SMALL_SELECT = SMALL_TABLE  # in per-tensor scope, a tensor of at most this many elements is selected without the
# scan's tasks (on a model's many small tensors their sample, brackets, tasks and joins cost far more than a table's
# calls: at 100 tensors of 2^23 elements in all, 2^18 took a third less time than 2^16; other than |delta| scores,
# the temporaries of one tensor alone, about 13 bytes an element)
SMALL_STRIDE = 16  # a small tensor's bracket is read from every SMALL_STRIDE-th key (at 1,000 and 100 tensors of 2^23
# elements in all, 16 took 6 % and 12 % less time than 8)
PACKED_PARALLEL = 1 << 15  # small tables (per-tensor scope) whose tensors average fewer elements than this are one
# turn of the pool, run in order by one thread: their calls a tensor make two threads' turns at the interpreter lock
# cost more than the second core gives back (2^23 elements in 1,000 tensors, 8.4k on average, on 2 cores, AMD EPYC,
# AVX2: 0.71-0.74x the time of tables spread over both threads). The scan's packed tasks, with a call a tensor piece
# but a few calls a whole block, are faster spread over the threads (one turn took 1.02x the time at 1,000 tensors,
# 1.15x at 400)
HIST_BINS = 1 << 10  # a part's histogram of its keys' top 16 bits, counted from lo's up (the last bin takes every
# higher key): the final threshold is found in one bin's keys instead of by a partition of every candidate
_NONNEG = (0, 1, 3)  # criteria whose fp32 score is never negative: its raw bits already sort like the key
_INF_BITS = np.uint32(0x7F800000)
_ABS = np.uint32(0x7FFFFFFF)
_ZERO32 = np.float32(0.0)


def _keys(t, new, base, res, dt, crit, ext, ext_dt):
    """(delta, sortable key array, bad) for one tensor (or a view of one)."""
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
    """One topk_select call's inputs, and the block buffers its tasks share."""

    new: list
    base: list
    res: list
    res_out: list
    dtypes: list
    ext: list
    ext_dt: list
    crit: int
    block: int = BLOCK
    workers: int = 1
    strict: bool = False  # candidates are the keys above lo (not at or above), and those at lo only counted
    _free: list = field(default_factory=list)
    _free_keys: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _early: list | None = None  # writes_residual_early of each tensor, found once a call
    misses: int = 0  # scans run again after a bracket missed (one a segment and lowered bracket)

    def fast(self, t: int) -> bool:
        """The key is |delta|'s fp32 bits: no score array, and non-finite deltas are exactly the keys >= inf."""
        return self.crit in (0, 3) and self.dtypes[t] != DT_F64

    def writes_residual_early(self, t: int) -> bool:
        """The residual can be written during the scan: it does not share memory with the residual read."""
        if self._early is None:
            self._early = [
                w is not None and (r is None or not np.may_share_memory(r, w)) for r, w in zip(self.res, self.res_out)
            ]
        return self._early[t]

    def early(self, p: _Part) -> bool:
        """The scan of part ``p`` writes its residuals (every tensor of a packed part can take it early)."""
        return all(self.writes_residual_early(t) for t in p.ts) if p.ts is not None else self.writes_residual_early(p.t)

    def late(self, p: _Part) -> bool:
        """Part ``p``'s residuals are written after the selection (they share memory with the residuals read)."""
        ts = p.ts if p.ts is not None else (p.t,)
        return any(self.res_out[t] is not None for t in ts) and not self.early(p)

    def packed_block(self) -> int:
        """Elements per block of a packed part: a block, whose keys take a buffer of their own beside the delta's
        (:meth:`packed_views`; the candidates' deltas are gathered from the delta, not from the inputs), so 9 bytes an
        element where the other paths take BLOCK_BYTES. Half a block in the delta's buffer took 1.24x the time at
        100 tensors of 2^23 elements in all, 1.05x at 1,000 (two threads: twice the blocks, and each block's calls
        are turns at the interpreter lock). At the smallest blocks (MIN_BLOCK: an update of less than about 3 MiB)
        it is still half a block, the keys in the delta's buffer's other half, as a buffer of their own would weigh
        much in so small an update's peak."""
        return self.block if self.keys_apart() else self.block // 2

    def keys_apart(self) -> bool:
        """Whether a packed part's keys take a buffer of their own (:meth:`packed_block`)."""
        return self.block > MIN_BLOCK

    def step(self, t: int) -> int:
        """Elements per block of tensor t: scores other than |delta| need temporaries of their own per block."""
        return self.block if self.fast(t) else min(self.block, SCORE_BLOCK)

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """A block's delta and comparison buffers: at most one set per running task, reused by the next."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.block, np.float32), np.empty(self.block, np.bool_)

    def give_back(self, bufs: tuple[np.ndarray, np.ndarray]) -> None:
        with self._lock:
            self._free.append(bufs)

    @contextlib.contextmanager
    def packed_views(self, dbuf: np.ndarray, n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(delta, keys) views of a packed block for a task of ``n`` elements, the delta's of :meth:`packed_block`
        elements in ``dbuf``: the keys in a buffer of their own (uint32, at most a block's elements, held while
        inside: at most one per running task, as :meth:`buffers`), or where not :meth:`keys_apart`, in ``dbuf``'s
        second half."""
        step = self.packed_block()
        if not self.keys_apart():
            yield dbuf[:step], dbuf[step : 2 * step].view(np.uint32)
            return
        n = min(n, self.block)
        with self._lock:
            keys = self._free_keys.pop() if self._free_keys and self._free_keys[-1].size >= n else None
        if keys is None:
            keys = np.empty(n, np.uint32)
        try:
            yield dbuf[:step], keys[:step]
        finally:
            with self._lock:
                self._free_keys.append(keys)

    def release(self) -> None:
        """Free the block buffers (between the phases of a call: they are not needed while joining)."""
        with self._lock:
            self._free.clear()
            self._free_keys.clear()

    def values(self, t: int, s: int, e: int, ci: np.ndarray) -> np.ndarray:
        """The deltas at positions ``ci`` of elements [s, e), gathered again from a block's inputs."""

        def at(x):
            return x[s:e] if x is not None else None

        return _gathered(ci, at(self.new[t]), at(self.base[t]), at(self.res[t]), self.dtypes[t])


def _gathered(ci: np.ndarray, new: np.ndarray, base, res, dt: int) -> np.ndarray:
    """The deltas at positions ``ci`` of a block's inputs (views; ``None`` where absent), element-wise, so the same
    bits as the whole block's delta."""
    if dt != DT_F32:
        return delta(new.take(ci), *(x.take(ci) if x is not None else None for x in (base, res)), dt)
    v = new.take(ci)
    if base is not None:
        np.subtract(v, base.take(ci), out=v)
    if res is not None:
        np.add(v, res.take(ci), out=v)
    return v


def block_size(nbytes: int, threads: int) -> int:
    """Elements per block: the largest multiple of ALIGN whose buffers, one set per thread, stay within
    BUFFER_SHARE of the update's ``nbytes``, or BUFFER_FLOOR where that is more and ``nbytes`` holds two tasks of
    fp32 (between MIN_BLOCK and BLOCK).

    >>> block_size(4 << 24, 2), block_size(4 << 23, 2), block_size(4 << 20, 2), block_size(4 * 150_000_000, 16)
    (131072, 131072, 8192, 147456)
    """
    budget = BUFFER_SHARE * nbytes
    if nbytes >= 2 * MIN_TASK * 4:
        budget = max(budget, BUFFER_FLOOR)
    fit = int(budget / (BLOCK_BYTES * max(1, threads)))
    return max(MIN_BLOCK, min(BLOCK, fit // ALIGN * ALIGN))


def plan(nbytes: int, threads: int) -> tuple[int, int]:
    """(threads, elements per block) for an update of ``nbytes``: as many of ``threads`` as still leave each a
    block of PARALLEL_BLOCK elements (at least one), and the block size for that many.

    >>> plan(4 << 24, 2), plan(4 << 21, 16), plan(4 << 20, 16), plan(4 << 26, 16)
    ((2, 131072), (2, 131072), (1, 16384), (8, 131072))
    """
    workers = max(1, threads)
    while workers > 1 and block_size(nbytes, workers) < PARALLEL_BLOCK:
        workers -= 1
    return workers, block_size(nbytes, workers)


@dataclass
class _Part:
    """A task's candidates: entries of tensor ``t`` in ``[a, b)`` with key above ``lo``, in index order."""

    t: int
    a: int
    b: int
    idx: np.ndarray | None = None  # uint16, relative to the sub-block (6 bytes a candidate with its fp32 delta)
    counts: np.ndarray | None = None  # candidates per sub-block of SUB elements
    d: np.ndarray | None = None  # deltas
    key: np.ndarray | None = None  # keys (None on the fast path: derived from d)
    neq: int = 0  # entries with key == lo
    bad: bool = False
    hist: np.ndarray | None = None  # the candidates per bin of their keys' top 16 bits (_hist)
    ts: tuple | None = None  # a packed part: whole small tensors, end to end ([a, b) counts along them)
    cum: list | None = None  # ... each one's start in the part, and the part's end
    bad_t: int | None = None  # the first tensor with a non-finite delta or score

    def first_bad(self) -> int:
        """The lowest tensor position with a non-finite delta or score (``bad`` is set)."""
        return self.t if self.bad_t is None else self.bad_t

    def keys(self) -> np.ndarray:
        """The candidates' keys."""
        return np.bitwise_and(self.d.view(np.uint32), _ABS) if self.key is None else self.key

    def rel(self) -> np.ndarray:
        """uint32 index of each candidate relative to a."""
        return _rel(self.idx, self.counts)


def _rel(idx: np.ndarray, counts: np.ndarray, out: np.ndarray | None = None, start: int = 0) -> np.ndarray:
    """Indices relative to a part's start, plus ``start``, from uint16 ``idx`` within sub-blocks of SUB elements and
    the number of entries in each sub-block (``counts``, in order): uint32, or into ``out`` (uint32 or uint64)."""
    out = np.empty(idx.size, np.uint32) if out is None else out
    ty = out.dtype.type
    out[...] = idx
    out += np.repeat(np.arange(counts.size, dtype=out.dtype) * ty(SUB) + ty(start), counts)
    return out


def _block_keys(c: _Call, t: int, s: int, e: int, dbuf: np.ndarray, write_res: bool):
    """Keys of elements [s, e) of tensor t, and whether a delta or score there is non-finite (None on the fast
    path, where the keys themselves tell). On the fast path the keys are |delta|'s bits, made in place in
    ``dbuf``; the residual (the delta) is written first where asked."""
    new, base, res, dt = c.new[t][s:e], c.base[t], c.res[t], c.dtypes[t]
    base = base[s:e] if base is not None else None
    res = res[s:e] if res is not None else None
    if c.fast(t):
        d = dbuf[: e - s]
        if dt == DT_F32:
            np.subtract(new, base if base is not None else _ZERO32, out=d)
            if res is not None:
                np.add(d, res, out=d)
        else:
            d[...] = delta(new, base, res, dt)
        if write_res:
            c.res_out[t][s:e] = d
        k = d.view(np.uint32)
        np.bitwise_and(k, _ABS, out=k)  # |delta|: a NaN stays above inf, so it is a candidate and is seen
        return k, None
    d = delta(new, base, res, dt)
    if write_res:
        c.res_out[t][s:e] = d
    ext = c.ext[t][s:e] if c.ext[t] is not None else None
    sc = scores_f32(c.crit, new, base, d, dt, ext, c.ext_dt[t])
    bad = nonfinite(d) or nonfinite(sc)
    k = np.ascontiguousarray(sc).view(np.uint32) if c.crit in _NONNEG else score_key(sc)
    return k, bad


def _scan(c: _Call, part: _Part, lo: np.uint32, write_res: bool) -> _Part:
    """Candidates (key > lo) of one task, the count of keys == lo, and whether a delta or score is non-finite."""
    t, a, b = part.t, part.a, part.b
    fast = c.fast(t)
    pos, starts, ds, ks = [], [], [], []
    dbuf, mask = bufs = c.buffers()
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite deltas are reported, not warned about
            f32 = fast and c.dtypes[t] == DT_F32
            if part.ts is not None:
                with c.packed_views(dbuf, b - a) as (d, k):
                    neq = _scan_packed(c, part, lo, write_res, d, k, mask, pos, starts, ds)
                bad = False
            elif f32:
                neq = _scan_f32(c, t, a, b, lo, write_res, dbuf, mask, pos, starts, ds)
                bad = False
            else:
                bad, neq = _scan_blocks(c, t, a, b, lo, write_res, dbuf, mask, pos, starts, ds, ks)
    finally:
        c.give_back(bufs)
    # positions relative to a, ascending: uint32, and joined before they are shifted (one call a task, not one a
    # block); the scan's transient memory is about 12 bytes a candidate at its peak
    sizes = [x.size for x in pos]
    rel = np.concatenate(pos, dtype=np.uint32, casting="unsafe") if len(pos) > 1 else pos[0].astype(np.uint32)
    pos.clear()
    rel += np.repeat(np.array(starts, np.uint32), sizes)
    d = _join(ds)
    key = _join(ks) if ks else np.bitwise_and(d.view(np.uint32), _ABS)
    bad_t = None
    if fast:  # lo <= inf: every non-finite delta is at or above lo
        bad = key.size > 0 and bool(key.max() >= _INF_BITS)
        if bad and part.ts is not None:
            first = int(rel[int(np.argmax(key >= _INF_BITS))])
            bad_t = part.ts[bisect.bisect_right(part.cum, first) - 1]
    eq = np.flatnonzero(key == lo)  # rare (none where strict): dropping them beats copying the rest through a mask
    if eq.size:
        rel, d, key = np.delete(rel, eq), np.delete(d, eq), np.delete(key, eq)
    # the sub-blocks' ends in rel's dtype (int64 ones would cast all of rel)
    ends = np.searchsorted(rel, np.arange(1, -(-(b - a) // SUB) + 1, dtype=np.uint32) * np.uint32(SUB))
    counts = np.empty_like(ends)
    counts[0] = ends[0]
    np.subtract(ends[1:], ends[:-1], out=counts[1:])
    np.bitwise_and(rel, np.uint32(SUB - 1), out=rel)  # the index within its sub-block
    idx, rel = rel.astype(np.uint16), None
    hist = _hist(key, lo, in_place=fast)  # on the fast path the keys are not kept: binned in their own memory
    return _Part(
        t, a, b, idx, counts, d, None if fast else key, int(eq.size) + neq, bad, hist, part.ts, part.cum, bad_t
    )


def _hist(key: np.ndarray, lo: np.uint32, in_place: bool = False) -> np.ndarray:
    """How many of ``key`` (every one above lo) fall in each bin of HIST_BINS: bin j holds the keys whose top 16
    bits are lo's plus j, the last bin every higher key too. ``in_place`` bins them in ``key``'s own memory.

    >>> _hist(np.array([0x10005, 0x1FFFF, 0x20000, 0xFFFFFFFF], np.uint32), np.uint32(0x10000))[:3].tolist()
    [2, 1, 0]
    """
    hb = np.right_shift(key, np.uint32(16), out=key if in_place else None)
    hb -= lo >> np.uint32(16)
    np.minimum(hb, np.uint32(HIST_BINS - 1), out=hb)
    return np.bincount(hb, minlength=HIST_BINS).astype(np.int32)  # held until _finish: 4 KB a part


def _threshold(parts: list[_Part], lo: np.uint32, k: int) -> tuple[np.uint32, list[int], list[int]]:
    """(thr, above, equal) for parts holding at least k candidates (every key above lo): thr is the k-th largest
    key; above and equal say, part by part, how many of its keys are above thr and equal to it. The parts'
    histograms give the bin that holds thr; only the keys of that bin are gathered and partitioned, and the counts
    come from the bins above it and the bin's own keys.

    >>> keys = np.array([5, 0x20001, 0x20001, 0x30000, 0x7, 0x20009], np.uint32)
    >>> parts = [_Part(0, 0, 3, key=keys[:3], hist=_hist(keys[:3], np.uint32(1))),
    ...          _Part(0, 3, 6, key=keys[3:], hist=_hist(keys[3:], np.uint32(1)))]
    >>> for k in (1, 2, 3, 5):
    ...     thr, above, equal = _threshold(parts, np.uint32(1), k)
    ...     print(hex(thr), above, equal)
    0x30000 [0, 0] [0, 1]
    0x20009 [0, 1] [0, 1]
    0x20001 [0, 2] [2, 0]
    0x7 [2, 2] [0, 1]
    """
    hists = [p.hist for p in parts]
    top = np.cumsum(np.add.reduce(hists)[::-1])  # keys at or above each bin, from the top
    j = int(np.searchsorted(top, k))
    b = HIST_BINS - 1 - j  # the bin that holds the k-th largest
    first = ((int(lo) >> 16) + b) << 16  # that bin's lowest key; the top bin has no upper end
    last = first + (1 << 16) if j and first + (1 << 16) <= 0xFFFFFFFF else None
    inbin = []
    for p in parts:
        kp = p.keys()
        m = kp >= np.uint32(first)
        if last is not None:
            m &= kp < np.uint32(last)
        inbin.append(kp[m])
        del kp, m
    kb = np.concatenate(inbin)
    r = k - (int(top[j - 1]) if j else 0)  # the k-th largest is the r-th largest in the bin
    thr = _kth_in_bin(kb, kb.size - r)
    above = [int(h[b + 1 :].sum()) + int(np.count_nonzero(x > thr)) for h, x in zip(hists, inbin)]
    return thr, above, [int(np.count_nonzero(x == thr)) for x in inbin]


def _scan_blocks(
    c: _Call, t: int, a: int, b: int, lo: np.uint32, write_res: bool, dbuf, mask, pos, starts, ds, ks
) -> bool:
    """The scan of elements [a, b) of any tensor and criterion, block by block: appends each block's candidate
    positions (in the block), its start (relative to a), the candidates' deltas and (but on the |delta| path) their
    keys; returns whether any is non-finite, and how many keys equal lo where only those above are candidates."""
    fast, block, bad, neq = c.fast(t), c.step(t), False, 0
    cmp = np.greater if c.strict else np.greater_equal
    for s in range(a, b, block):
        e = min(b, s + block)
        k, bad_b = _block_keys(c, t, s, e, dbuf, write_res)
        m = mask[: e - s]
        cmp(k, lo, out=m)
        ci = m.nonzero()[0]
        if c.strict:
            neq += int(np.count_nonzero(np.equal(k, lo, out=m)))
        ds.append(c.values(t, s, e, ci))
        if not fast:
            bad = bad or bad_b
            ks.append(k.take(ci))
        pos.append(ci)
        starts.append(s - a)
    return bad, neq


def _scan_f32(c: _Call, t: int, a: int, b: int, lo: np.uint32, write_res: bool, dbuf, mask, pos, starts, ds) -> int:
    """The |delta| scan of an fp32 tensor's elements [a, b): ``_block_keys`` and the comparison, with as few NumPy
    calls and as little Python between them per block as the result allows (each call is a turn at the interpreter
    lock, and a turn another thread waits for costs far more than the call); appends each block's candidate
    positions, its start and the candidates' deltas (gathered from the block's inputs while in cache: 9-12 % faster
    on one thread, 3-6 % on two, than one gather from memory at the task's end, measured at 2^24 and 2^26 on an AMD
    EPYC with AVX-512). The keys are made in place in the delta's buffer: a buffer of their own, the deltas then
    gathered from the block's delta in one call, took 0.93-0.95x the time at 2^23 and 2^24 on an AMD EPYC (AVX2),
    but 9 bytes a block element, a peak of 6.1 % of a 2^24 update's bytes, over the 5 % bound."""
    new, base, res = c.new[t], c.base[t], c.res[t]
    out = c.res_out[t] if write_res else None
    block = c.block
    sub, add, band, ge = np.subtract, np.add, np.bitwise_and, np.greater if c.strict else np.greater_equal
    keep_pos, keep_start, keep_d = pos.append, starts.append, ds.append
    strict, neq = c.strict, 0
    for s in range(a, b, block):
        e = min(b, s + block)
        d, m = (dbuf, mask) if e - s == block else (dbuf[: e - s], mask[: e - s])
        nv = new[s:e]
        bv = base[s:e] if base is not None else None
        rv = res[s:e] if res is not None else None
        sub(nv, bv if bv is not None else _ZERO32, out=d)
        if rv is not None:
            add(d, rv, out=d)
        if out is not None:
            out[s:e] = d
        k = d.view(np.uint32)
        band(k, _ABS, out=k)
        ge(k, lo, out=m)
        ci = m.nonzero()[0]
        if strict:
            neq += int(np.count_nonzero(np.equal(k, lo, out=m)))
        keep_d(_gathered(ci, nv, bv, rv, DT_F32))
        keep_pos(ci)
        keep_start(s - a)
    return neq


def _fill(c: _Call, part: _Part, s: int, e: int, d: np.ndarray, write_res: bool) -> None:
    """The fp32 deltas of a packed part's elements [s, e) into ``d`` (one piece of each tensor the range meets,
    a whole tensor without slicing its inputs), each tensor's residual written first where asked."""
    cum, ts = part.cum, part.ts
    j = bisect.bisect_right(cum, s) - 1
    new, base, res, dts, sub, add = c.new, c.base, c.res, c.dtypes, np.subtract, np.add
    outs = c.res_out if write_res else None
    o = 0
    while s < e:
        t, t0, t1 = ts[j], cum[j], cum[j + 1]
        j += 1
        stop = t1 if t1 < e else e
        if stop <= s:  # (an empty tensor)
            continue
        a, b = s - t0, stop - t0
        nv, bv, rv = new[t], base[t], res[t]
        if b - a != nv.size:  # a piece of the tensor
            nv = nv[a:b]
            bv = bv[a:b] if bv is not None else None
            rv = rv[a:b] if rv is not None else None
        out = d[o : o + b - a]
        if dts[t] == DT_F32:
            sub(nv, bv if bv is not None else _ZERO32, out=out)
            if rv is not None:
                add(out, rv, out=out)
        else:
            out[...] = delta(nv, bv, rv, dts[t])
        if outs is not None and outs[t] is not None:
            outs[t][a:b] = out
        o += b - a
        s = stop


def _scan_packed(c: _Call, part: _Part, lo: np.uint32, write_res: bool, d, k, mask, pos, starts, ds) -> int:
    """The |delta| scan of a packed part (small fp32, fp16 or bf16 tensors end to end), in blocks of ``d``'s
    elements (:meth:`_Call.packed_views`): per block, one piece a tensor fills the delta (:func:`_fill`), then keys
    (into ``k``), comparison and the candidates' deltas take one call each for the whole block, whatever the number
    of tensors in it."""
    step = d.size
    m = mask[:step]
    band, ge = np.bitwise_and, np.greater if c.strict else np.greater_equal
    neq = 0
    for s in range(0, part.b, step):
        e = min(part.b, s + step)
        dv, kv, mv = (d, k, m) if e - s == step else (d[: e - s], k[: e - s], m[: e - s])
        _fill(c, part, s, e, dv, write_res)
        band(dv.view(np.uint32), _ABS, out=kv)
        ge(kv, lo, out=mv)
        ci = mv.nonzero()[0]
        if c.strict:
            neq += int(np.count_nonzero(np.equal(kv, lo, out=mv)))
        ds.append(dv.take(ci))
        pos.append(ci)
        starts.append(s)
    return neq


def _join(xs: list) -> np.ndarray:
    """The arrays of a list joined, the list emptied (its arrays are freed as soon as they are copied)."""
    out = np.concatenate(xs) if len(xs) > 1 else xs[0]
    xs.clear()
    return out


def _equal(c: _Call, part: _Part, lo: np.uint32, need: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``need`` entries of a task whose key equals lo: (uint32 index relative to a, delta)."""
    t, a, b = part.t, part.a, part.b
    idx, ds = [], []
    dbuf, _ = bufs = c.buffers()
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            if part.ts is not None:
                with c.packed_views(dbuf, b - a) as (d, k):
                    step = d.size
                    for s in range(0, b, step):
                        if need <= 0:
                            break
                        e = min(b, s + step)
                        _fill(c, part, s, e, d[: e - s], False)
                        keys = np.bitwise_and(d[: e - s].view(np.uint32), _ABS, out=k[: e - s])
                        ci = np.flatnonzero(keys == lo)[:need]
                        need -= ci.size
                        ds.append(d[: e - s].take(ci))
                        idx.append((ci + s).astype(np.uint32))
                return np.concatenate(idx), np.concatenate(ds)
            for s in range(a, b, c.step(t)):
                if need <= 0:
                    break
                e = min(b, s + c.step(t))
                k, _ = _block_keys(c, t, s, e, dbuf, False)
                ci = np.flatnonzero(k == lo)[:need]
                need -= ci.size
                ds.append(c.values(t, s, e, ci))
                idx.append((ci + (s - a)).astype(np.uint32))
    finally:
        c.give_back(bufs)
    return np.concatenate(idx), np.concatenate(ds)


def _write_residual(c: _Call, part: _Part) -> None:
    """residual = delta over a task's range, block by block (used where the residual read is overwritten)."""
    dbuf, _ = bufs = c.buffers()
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            if part.ts is not None:
                step = c.packed_block()
                for s in range(0, part.b, step):
                    e = min(part.b, s + step)
                    _fill(c, part, s, e, dbuf[: e - s], True)
                return
            step = c.step(part.t)
            for s in range(part.a, part.b, step):
                _block_keys(c, part.t, s, min(part.b, s + step), dbuf, True)
    finally:
        c.give_back(bufs)


def _tasks(c: _Call, seg: list[int]) -> list[_Part]:
    """The pool's tasks: ranges of each tensor, in whole blocks, of TASK elements, or fewer (down to MIN_TASK)
    where the segment has fewer than TASK_SPLIT times TASK elements."""
    total = sum(c.new[t].size for t in seg)
    span = max(MIN_TASK, min(TASK, total // TASK_SPLIT))
    span = -(-span // c.block) * c.block
    parts, pack, cum = [], [], [0]

    def flush() -> None:
        if cum[-1]:
            parts.append(_Part(pack[0], 0, cum[-1], ts=tuple(pack), cum=list(cum)))
        pack.clear()
        del cum[1:]

    for t in seg:
        m = c.new[t].size
        if m < span and c.fast(t):  # small tensors end to end: a task's blocks span many of them
            pack.append(t)
            cum.append(cum[-1] + m)
            if cum[-1] >= span:
                flush()
            continue
        flush()
        parts += [_Part(t, a, min(m, a + span)) for a in range(0, m, span)]
    flush()
    return parts


def _runs(x, stride: int, start: int):
    """The runs of RUN consecutive elements of flat ``x`` that start at ``start`` and every ``stride``-th element
    after it and end inside ``x`` (a view, rows x RUN; ``start``: the tensor's phase, :func:`_phases`)."""
    if x is None:
        return None
    rows = max(0, (x.size - start - RUN) // stride + 1)
    return np.ndarray((rows, RUN), x.dtype, x, start * x.itemsize, (stride * x.itemsize, x.itemsize))


def _phases(sizes: np.ndarray, stride: int) -> tuple[list[int], list[int]]:
    """(start, runs) of each tensor of a segment, ``sizes`` its tensors' sizes: the sampled runs start at every
    ``stride``-th element of the tensors laid end to end, so each tensor's share of the sample is its share of the
    elements, within one run either way (systematic sampling). A run from each tensor's own start would weigh a
    tensor smaller than the stride up to stride / RUN times as much as the others: on ResNet-50 (320 tensors, half
    of them BatchNorm's of 64 to 2,048 elements, which move more) that sample put the first bracket above the k-th
    largest key, and every compress scanned twice (1.7x the time).

    >>> _phases(np.array([10, 3, 40, 0, 9]), 16)  # runs of 8 at 0 | - | 16, 32 | - | - laid end to end
    ([0, 6, 3, 11, 11], [1, 0, 2, 0, 0])
    """
    ends = np.cumsum(sizes)
    start = (-(ends - sizes)) % stride
    rows = np.maximum(0, (sizes - start - RUN) // stride + 1)
    return start.tolist(), rows.tolist()


def _stride(n: int) -> int:
    """Elements from one sampled run to the next in a segment of n: about n / SAMPLE_STRIDE sampled, between
    SAMPLE_MIN and SAMPLE."""
    ms = min(SAMPLE, max(SAMPLE_MIN, n // SAMPLE_STRIDE))
    return max(RUN, n // -(-ms // RUN))


def _sample(c: _Call, seg: list[int], n: int) -> np.ndarray:
    """Keys of a sample of the segment: runs of RUN elements at every ``stride``-th element of its tensors laid end
    to end (:func:`_phases`). The runs of |delta| tensors of one dtype are gathered into one array first (a view
    per tensor and array, made by one ``map`` over the tensor table), so their keys take a few calls whatever the
    tensor count; the tensors are grouped by (dtype, has base, has residual) with one pass of ``zip`` over the
    table, and one group (the common case) takes no Python a tensor at all."""
    stride = _stride(n)
    keys = []
    fast = c.crit in (0, 3)
    dts, news, bases, res = c.dtypes, c.new, c.base, c.res
    ns = [news[t] for t in seg]
    starts, rows = _phases(array_sizes(ns), stride)
    batch: dict[tuple, list[int]] = {}  # (dtype, has base, has residual) -> positions in seg of |delta| tensors
    rest = []  # positions of the others (scores, fp64), each sampled alone
    if fast:
        sd = [dts[t] for t in seg]
        hb = [bases[t] is not None for t in seg]
        hr = [res[t] is not None for t in seg]
        groups = set(zip(sd, hb, hr))
        if len(groups) == 1 and DT_F64 not in sd:  # (one group: every tensor with rows)
            batch[groups.pop()] = [i for i, r in enumerate(rows) if r] if 0 in rows else list(range(len(seg)))
        else:
            for i, g in enumerate(zip(sd, hb, hr)):
                if not rows[i]:
                    continue
                if g[0] == DT_F64:
                    rest.append(i)
                else:
                    batch.setdefault(g, []).append(i)
    else:
        rest = [i for i, r in enumerate(rows) if r]
    with np.errstate(over="ignore", invalid="ignore"):
        for i in rest:
            t = seg[i]
            nw, bs, rs, ex = (_runs(x, stride, starts[i]) for x in (news[t], bases[t], res[t], c.ext[t]))
            keys.append(_keys(t, nw, bs, rs, dts[t], c.crit, ex, c.ext_dt[t])[1].ravel())
        for (dt, has_base, has_res), at in batch.items():
            if not at:
                continue
            ts = [seg[i] for i in at]
            r, o = [rows[i] for i in at], [starts[i] for i in at]
            nw, bs, rs = (
                _runs_of([xs[t] for t in ts], r, o, stride) if on else None
                for xs, on in ((news, True), (bases, has_base), (res, has_res))
            )
            keys.append(_keys(-1, nw, bs, rs, dt, c.crit, None, 0)[1])
    return np.concatenate(keys) if keys else np.zeros(0, np.uint32)


def _runs_of(xs: list[np.ndarray], rows: list[int], starts: list[int], stride: int) -> np.ndarray:
    """The runs of :func:`_runs` of each array of ``xs`` (one dtype; ``rows`` of them from ``starts``, every one at
    least one: a view of its array, made by one constructor call, the calls made by ``map``), in one array."""
    dt = xs[0].dtype
    size = dt.itemsize
    shapes = zip(rows, repeat(RUN))
    views = map(np.ndarray, shapes, repeat(dt), xs, [o * size for o in starts], repeat((stride * size, size)))
    return np.concatenate(list(views)).reshape(-1)


def _order_stats(x: np.ndarray, ranks: list[int]) -> list[np.uint32]:
    """The values at ``ranks`` (0-based, ascending) of uint32 ``x`` in sorted order, as ``np.partition`` gives
    them: a histogram of the top 16 bits finds each one's bin, and only that bin's values are partitioned (for 2^16
    keys and five ranks 0.17 ms, where one partition of the whole took 0.41 ms).

    >>> x = np.array([7, 0x50000, 3, 0x50001, 0x10000, 9], np.uint32)
    >>> [int(v) for v in _order_stats(x, [0, 2, 3, 5])] == np.sort(x)[[0, 2, 3, 5]].tolist()
    True
    >>> x = np.arange(0x70000, 0x90000, 7, dtype=np.uint32)  # bins 7 to 8 (offset from the lowest): the histogram
    >>> [int(v) for v in _order_stats(x, [0, 9000, 18724])] == np.sort(x)[[0, 9000, 18724]].tolist()
    True
    """
    hi = np.right_shift(x, np.uint32(16))
    first = int(hi.min())
    bins = int(hi.max()) - first + 1
    if bins > x.size // 4:  # a histogram as wide as the values (a small sample): one partition costs less memory
        part = np.partition(x, ranks)
        return [part[q] for q in ranks]
    hi -= np.uint32(first)
    upto = np.cumsum(np.bincount(hi, minlength=bins))  # values in each bin and every lower one
    out = []
    for q in ranks:
        b = int(np.searchsorted(upto, q, side="right"))
        q -= int(upto[b - 1]) if b else 0
        out.append(_kth_in_bin(x[hi == b], q))
    return out


def _kth_in_bin(v: np.ndarray, q: int) -> np.uint32:
    """The q-th smallest (0-based) of uint32 ``v``: a partition, or where the values are many and share their top 16
    bits, a histogram of the low 16 bits (a partition of many equal values, as a tie-heavy update gives, is
    slow: 40k keys of 9 distinct values took 5 ms).

    >>> v = np.repeat(np.array([0x70005, 0x70001, 0x7FFFF], np.uint32), 3000)
    >>> [hex(_kth_in_bin(v, q)) for q in (0, 2999, 3000, 8999)]
    ['0x70001', '0x70001', '0x70005', '0x7ffff']
    """
    if v.size <= 4096 or int(v.min()) >> 16 != int(v.max()) >> 16:  # (the top bin of _threshold spans many)
        v.partition(q)
        return v[q]
    low = np.bitwise_and(v, np.uint32(0xFFFF))
    upto = np.cumsum(np.bincount(low, minlength=1 << 16))
    return np.uint32((int(v[0]) & ~0xFFFF) | int(np.searchsorted(upto, q, side="right")))


def _brackets(sample: np.ndarray, n: int, k: int, crit: int) -> list[np.uint32]:
    """The brackets tried in turn, each a key at or below the k-th largest with high probability: the sample's
    estimate, then (after a miss) each step reaching four times as far below it, and at last 0 (every key). They
    are all found at once (:func:`_order_stats`), so the sample is freed before the scan.

    >>> [int(x) for x in _brackets(np.arange(100_000, dtype=np.uint32), 10**7, 10**5, 0)]
    [98841, 98366, 96464, 88856, 58426, 0]
    """
    ms = sample.size
    r = k * ms / n
    picks = []
    while True:
        w = len(picks)
        pick = int(r + (4 << (2 * w)) * math.sqrt(r) + (32 << (2 * w)))
        if pick >= ms - 1:
            break
        picks.append(pick)
    out = []
    if picks:
        kth = [ms - 1 - p for p in picks]
        for lo in _order_stats(sample, kth):
            lo = int(lo)
            if crit in (0, 3):
                lo = min(lo, int(_INF_BITS))  # so every non-finite delta is a candidate and is seen
            if out and lo >= out[-1]:
                break
            out.append(lo)
    return [np.uint32(x) for x in out if x > 0] + [np.uint32(0)]


def _finish(
    c: _Call,
    seg: list[int],
    parts: list[_Part],
    lo: np.uint32,
    k: int,
    indices: list,
    values: list,
    packed: list,
    shared: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """The k largest keys among the parts' entries, written to ``indices`` and ``values`` tensor by tensor; each
    packed part's tensors, where each one's entries start and end in the part's, and the part's indices and values
    are appended to ``packed`` (the tensors' own arrays are views of these).

    ``shared`` (the segment is every tensor, in order, each with uint32 indices and fp32 values): every entry is
    written into one index array and one value array, part after part, and ``(indices, values, offsets)`` is
    returned, tensor t's entries being ``[offsets[t], offsets[t + 1])`` of each; ``indices`` and ``values`` are
    left as they are (no array made a tensor).

    The parts' counts come from :func:`_threshold`; each part is then copied into its own slice of the output and its
    candidates freed, so the candidates and the output are never held twice. This runs on the calling thread: it touches
    about 1.2 k entries, and on the pool its many small calls cost more in turns at the interpreter lock than a
    second core gave back (measured at 2^24 and 2^26 on 2 cores).
    """
    g = sum(p.idx.size for p in parts)
    thr, extras, ties = None, [None] * len(parts), None
    if g >= k:  # the threshold is above lo: every entry at it is a candidate
        thr, above, equal = _threshold(parts, lo, k)
        take, counts, ties = k - sum(above), [], []
        for n_above, n_equal in zip(above, equal):  # ties at the threshold: lowest index first, in part order
            ties.append(min(n_equal, take))
            take -= ties[-1]
            counts.append(n_above + ties[-1])
    else:  # the threshold is lo: every candidate, then the first entries equal to lo
        need, counts = k - g, []
        for i, p in enumerate(parts):
            if need and p.neq:
                extras[i] = _equal(c, p, lo, min(need, p.neq))
                need -= extras[i][0].size
            counts.append(p.idx.size + (extras[i][0].size if extras[i] is not None else 0))
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    out = (np.empty(offsets[-1], np.uint32), np.empty(offsets[-1], np.float32)) if shared else None
    per_tensor = np.zeros(len(seg), np.int64) if shared else None  # (shared) each tensor's entries
    first = seg[0] if seg else 0
    mine: dict[int, list[int]] = {}
    for i, p in enumerate(parts):
        if p.ts is None:
            mine.setdefault(p.t, []).append(i)
            continue
        # a packed part: its selection at once, indices made relative to their tensors in one call, then a view of
        # it per tensor (or, shared, its tensors' entry counts)
        if out is None:
            rel, val = np.empty(counts[i], np.uint32), np.empty(counts[i], np.float32)
        else:
            rel, val = out[0][offsets[i] : offsets[i + 1]], out[1][offsets[i] : offsets[i + 1]]
        _write_part(p, thr, ties[i] if ties is not None else None, extras[i], rel, val, 0)
        cum = np.asarray(p.cum, np.uint32)
        cuts = np.searchsorted(rel, cum)
        rel -= np.repeat(cum[:-1], np.diff(cuts))
        if per_tensor is not None:  # (a packed part's tensors are consecutive)
            per_tensor[p.ts[0] - first : p.ts[-1] - first + 1] = np.diff(cuts)
        cuts = cuts.tolist()
        if out is None:
            for t, a, b in zip(p.ts, cuts, cuts[1:]):
                indices[t], values[t] = rel[a:b], val[a:b]
        packed.append((p.ts, cuts[:-1], cuts[1:], rel, val))
    for t in seg:
        own = mine.get(t)
        if own is None and (out is not None or indices[t] is not None):  # (a packed tensor's, or one with no part)
            continue
        own = own or []
        start = offsets[own[0]] if own else 0
        size = sum(counts[i] for i in own)
        if out is None:
            idx = np.empty(size, index_dtype(c.new[t].size))
            val = np.empty(idx.size, np.float64 if c.dtypes[t] == DT_F64 else np.float32)
        else:
            idx, val = out[0][start : start + size], out[1][start : start + size]
            per_tensor[t - first] = size
        for i in own:
            o = offsets[i] - start
            _write_part(
                parts[i],
                thr,
                ties[i] if ties is not None else None,
                extras[i],
                idx[o : o + counts[i]],
                val[o : o + counts[i]],
                parts[i].a,
            )
        if out is None:
            indices[t], values[t] = idx, val
    if out is None:
        return None
    return out[0], out[1], np.concatenate([[0], np.cumsum(per_tensor)]).tolist()


def _write_part(p: _Part, thr, tie: int | None, extra, idx: np.ndarray, val: np.ndarray, start: int) -> None:
    """A part's kept entries, in index order, into ``idx`` (relative to the part, plus ``start``) and ``val``: those
    above ``thr`` and the first ``tie`` equal to it (``tie`` None: every candidate, and the ``extra`` entries equal
    to lo where the threshold is lo). The part's candidates are freed."""
    if tie is not None:  # two gathers, straight into the output (faster than masks)
        kp = p.keys()
        sel = kp > thr
        if tie:
            sel[np.flatnonzero(kp == thr)[:tie]] = True
        j, sel, kp = sel.nonzero()[0], None, None
        np.take(p.d, j, out=val, mode="clip")  # j is in range: no checked copy
        per_sub = np.searchsorted(j, np.cumsum(p.counts))  # where each sub-block's kept entries end,
        per_sub[1:] -= per_sub[:-1]  # then how many each holds
        kept, j = p.idx.take(j, mode="clip"), None  # j freed before _rel's temporaries (the peak)
        _rel(kept, per_sub, out=idx, start=start)
    elif extra is not None:
        pi = np.concatenate([p.rel(), extra[0]])
        order = np.argsort(pi, kind="stable")
        pi, pd = pi[order], np.concatenate([p.d, extra[1]])[order]
        idx[...] = pi
        idx += idx.dtype.type(start)
        val[...] = pd
    else:
        _rel(p.idx, p.counts, out=idx, start=start)
        val[...] = p.d
    p.idx = p.d = p.key = None


def _sparse_segment(c: _Call, seg: list[int], n: int, k: int) -> tuple[list[_Part], np.uint32]:
    """Scan a segment's tasks; returns the parts and lo. A bracket that misses (fewer than k entries at or above
    it) is lowered and the scan runs again, down to the lowest key, where every entry is a candidate."""
    sample = _sample(c, seg, n)
    ladder = _brackets(sample, n, k, c.crit)
    # a bracket many keys equal (exact zeros, few distinct values): candidates only above it, those at it counted
    strict = [lo < _INF_BITS and int(np.count_nonzero(sample == lo)) * n * TIE_SHARE > sample.size * k for lo in ladder]
    del sample  # not held during the scan
    tasks = _tasks(c, seg)
    for step, lo in enumerate(ladder):
        c.strict = strict[step]
        parts = parallel_map(  # a rescan does not write the residual again
            lambda p, lo=lo, early=step == 0: _scan(c, p, lo, early and c.early(p)), tasks, c.workers
        )
        c.release()
        if any(p.bad for p in parts) or lo == 0 or sum(p.idx.size + p.neq for p in parts) >= k:
            c.misses += step
            return parts, lo
    raise AssertionError("the last bracket is 0, where every entry is a candidate")


def _select_small(c: _Call, t: int, k: int) -> tuple:
    """Exact top-k of a small tensor alone (per-tensor scope): (indices, values, the whole delta, whether a delta or
    score is non-finite). Ties at the threshold: lowest index first (:func:`_top_of`).

    >>> c = _Call([np.array([3, -5, 1, 5, 0], np.float32)], [None], [None], [None], [DT_F32], [None], [0], 0)
    >>> idx, vals, _, bad = _select_small(c, 0, 2)
    >>> idx.tolist(), vals.tolist(), bool(bad)
    ([1, 3], [-5.0, 5.0], False)
    """
    d, key, bad = _keys(t, c.new[t], c.base[t], c.res[t], c.dtypes[t], c.crit, c.ext[t], c.ext_dt[t])
    if bad:
        return None, None, d, True
    idx = _top_of(key, k, _bracketed(key, k)).astype(index_dtype(key.size))
    return idx, d[idx], d, False


def _top_of(key: np.ndarray, k: int, cand: np.ndarray | None = None) -> np.ndarray:
    """The ascending positions of the k largest of ``key``, ties at the threshold lowest position first; ``cand``:
    the positions of the keys at or above a bracket below the k-th largest (at least k of them), where known,
    among which the threshold is found (else among every key).

    >>> key = np.repeat(np.arange(40, dtype=np.uint32), 100)  # ties: 100 of each value, in runs
    >>> idx = _top_of(key, 150)  # every 39, then the first 50 of the 38s
    >>> bool((idx == np.r_[3800:3850, 3900:4000]).all()), bool((_top_of(key, 150, np.arange(3700, 4000)) == idx).all())
    (True, True)
    """
    kc = key if cand is None else key.take(cand)
    q = kc.size - k
    thr = np.partition(kc, q)[q]
    m = kc > thr
    need = k - int(np.count_nonzero(m))
    if need:
        m[np.flatnonzero(kc == thr)[:need]] = True
    return np.flatnonzero(m) if cand is None else cand[m]


def _table_buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A table's delta, key and comparison buffers (:func:`_select_small_tables`)."""
    return np.empty(SMALL_TABLE, np.float32), np.empty(SMALL_TABLE, np.uint32), np.empty(SMALL_TABLE, np.bool_)


def _select_small_tables(c: _Call, group: list[tuple[int, int]], bufs, indices, values, packed, bad) -> None:
    """Exact top-k of each of many small |delta| tensors alone (per-tensor scope), ``group``: (tensor, k) pairs
    whose deltas fit ``bufs`` (:func:`_table_buffers`) end to end. What :func:`_select_small` does tensor by tensor,
    with calls over the whole table: the deltas (residuals written) and keys, the candidates (the keys at or above
    each tensor's bracket: its sample's pick, the sample every SMALL_STRIDE-th key), and the kept entries among
    them (ties lowest index first). Only the bracket, its comparison and the threshold among the candidates are
    calls a tensor (:func:`_top_of` of every key of a tensor whose bracket does not help or misses). Writes
    ``indices`` and ``values``, the tensors and their entries to ``packed`` (as :func:`_finish` does), or the first
    tensor with a non-finite delta to ``bad``."""
    ts = tuple(t for t, _ in group)
    kt = np.array([k for _, k in group], np.int64)
    sizes = np.array([c.new[t].size for t in ts], np.int64)
    cum = np.zeros(len(ts) + 1, np.int64)
    np.cumsum(sizes, out=cum[1:])
    n = int(cum[-1])
    d, key = bufs[0][:n], bufs[1][:n]
    _fill(c, _Part(ts[0], 0, n, ts=ts, cum=cum.tolist()), 0, n, d, True)
    np.bitwise_and(d.view(np.uint32), _ABS, out=key)
    if n and key.max() >= _INF_BITS:
        bad.append(ts[int(np.searchsorted(cum, np.argmax(key >= _INF_BITS), side="right")) - 1])
        return
    # each tensor's bracket: its sample's pick-th largest key, three standard deviations above the k-th's expected
    # rank (a miss costs one tensor's partition); the keys at or above it
    scut = -(-cum // SMALL_STRIDE)
    ms = np.diff(scut)
    r = kt * ms / sizes
    pick = ms - 1 - (r + 3 * np.sqrt(r) + 2).astype(np.int64)  # (ascending)
    usable = pick >= ms - ms // 4  # (else most keys are candidates: every key is partitioned)
    sample, mask, cl, sl = key[::SMALL_STRIDE], bufs[2][:n], cum.tolist(), scut.tolist()
    ge = np.greater_equal
    for j, (q, use) in enumerate(zip(pick.tolist(), usable.tolist())):
        lo = 0
        if use:  # (the methods: np.partition's wrapper costs about as much as a small partition)
            lo = sample[sl[j] : sl[j + 1]].copy()
            lo.partition(q)
            lo = lo[q]
        ge(key[cl[j] : cl[j + 1]], lo, out=mask[cl[j] : cl[j + 1]])
    cand = np.flatnonzero(mask)
    ccut = np.searchsorted(cand, cum)
    cc = np.diff(ccut)
    ok = usable & (cc >= kt)
    kc = key.take(cand)
    thr = np.full(len(ts), 0xFFFFFFFF, np.uint32)  # above every key: nothing kept among the candidates
    cut, kl = ccut.tolist(), kt.tolist()
    for j in np.flatnonzero(ok).tolist():  # the threshold among each tensor's candidates
        x = kc[cut[j] : cut[j + 1]].copy()
        q = x.size - kl[j]
        x.partition(q)
        thr[j] = x[q]
    thr_c = np.repeat(thr, cc)
    keep = kc > thr_c
    eq = kc == thr_c
    kc = thr_c = None
    # ties at each threshold: the first (lowest index) of them, as many as each tensor still needs
    above_n = np.zeros(cand.size + 1, np.int64)
    np.cumsum(keep, out=above_n[1:])
    need = kt - (above_n[ccut[1:]] - above_n[ccut[:-1]])
    eq_n = np.zeros(cand.size + 1, np.int64)
    np.cumsum(eq, out=eq_n[1:])
    rank = eq_n[1:] - np.repeat(eq_n[ccut[:-1]], cc)  # 1-based among the tensor's ties
    keep |= eq & (rank <= np.repeat(need, cc))
    sel = cand[keep]
    kcut = np.searchsorted(sel, cum)
    val = d.take(sel)
    rel = (sel - np.repeat(cum[:-1], np.diff(kcut))).astype(np.uint32)
    lows, highs = kcut[:-1].tolist(), kcut[1:].tolist()
    done = []
    for j, t in enumerate(ts):
        if ok[j]:
            indices[t], values[t] = rel[lows[j] : highs[j]], val[lows[j] : highs[j]]
            done.append(j)
        else:  # a bracket that cannot help or misses: every key of the tensor
            a, b = int(cum[j]), int(cum[j + 1])
            idx = _top_of(key[a:b], int(kt[j]), _bracketed(key[a:b], int(kt[j])))
            indices[t], values[t] = idx.astype(index_dtype(b - a)), d[a:b].take(idx)
    packed.append(([ts[j] for j in done], [lows[j] for j in done], [highs[j] for j in done], rel, val))


def _bracketed(key: np.ndarray, k: int) -> np.ndarray | None:
    """The ascending positions of the keys at or above a bracket below the k-th largest of ``key`` (at least k of
    them), the bracket read from every SMALL_STRIDE-th key as :func:`_brackets` reads the sample; None where the
    bracket would take most keys anyway or misses (then every key is partitioned).

    >>> key = np.random.default_rng(0).permutation(20_000).astype(np.uint32)
    >>> cand = _bracketed(key, 100)
    >>> bool(100 <= cand.size < 2_000 and (key[cand] >= 19_900).sum() == 100), _bracketed(key, 5_000) is None
    (True, True)
    """
    sample = key[::SMALL_STRIDE]
    ms = sample.size
    r = k * ms / key.size
    pick = int(r + 4 * math.sqrt(r) + 32)
    if pick >= ms // 4:
        return None
    lo = np.partition(sample, ms - 1 - pick)[ms - 1 - pick]
    cand = np.flatnonzero(key >= lo)
    return cand if cand.size >= k else None


def _select_segments(
    c: _Call, segments, ks, indices: list, values: list, sparse: list, bad: list, full: dict, packed: list
) -> None:
    """The selection of each segment (:func:`topk_select`): small tensors alone at once (small |delta| tensors
    table by table, their entries into ``packed``), the rest scanned into ``sparse``; the tensors with a
    non-finite value into ``bad``, whole deltas for the residuals into ``full``. The caller sets the
    floating-point error state."""
    new, base, res, res_out, dtypes, crit = c.new, c.base, c.res, c.res_out, c.dtypes, c.crit
    ext_scores, ext_dtypes = c.ext, c.ext_dt
    tables, size = [[]], 0  # (per-tensor scope) small |delta| tensors, selected table by table on the pool
    for seg, k in zip(segments, ks):
        n = sum(new[t].size for t in seg) if len(seg) != 1 else new[seg[0]].size
        if 0 < k < n and len(seg) == 1 and n <= SMALL_SELECT and len(segments) > 1:
            t = seg[0]
            if c.fast(t) and n <= SMALL_TABLE and (res_out[t] is None or c.writes_residual_early(t)):
                if size + n > SMALL_TABLE:
                    tables.append([])
                    size = 0
                tables[-1].append((t, k))
                size += n
                continue
            indices[t], values[t], d, b = _select_small(c, t, k)
            if b:
                bad.append(t)
            elif res_out[t] is not None:  # the residual: the delta, then (below) the kept entries fixed
                if c.writes_residual_early(t):
                    res_out[t][...] = d
                else:  # it is the residual read: written only once every tensor is known to be finite
                    full[t] = d
            continue
        if 0 < k < n:
            parts, lo = _sparse_segment(c, seg, n, k)
            bad += [p.first_bad() for p in parts if p.bad]
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
    tables = [g for g in tables if g]
    if tables:
        free = [_table_buffers()]
        lock = threading.Lock()

        def table(group: list[tuple[int, int]]) -> None:
            with lock:
                bufs = free.pop() if free else None
            if bufs is None:
                bufs = _table_buffers()
            try:
                with np.errstate(over="ignore", invalid="ignore"):
                    _select_small_tables(c, group, bufs, indices, values, packed, bad)
            finally:
                with lock:
                    free.append(bufs)

        sizes = [sum(c.new[t].size for t, _ in g) for g in tables]
        parallel_map(table, tables, c.workers, [n < PACKED_PARALLEL * len(g) for n, g in zip(sizes, tables)])


def _u32_f32(new: list, dtypes: list) -> bool:
    """Whether every tensor's kept entries are uint32 indices and fp32 values (none fp64, none past 2^32)."""
    return DT_F64 not in dtypes and int(array_sizes(new).max()) <= U32_INDEX_NUMEL


def topk_select(
    new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode, stats=None, shared=False
):
    """Exact top-k of every segment of a tensor list.

    Arguments are lists over tensors (flat NumPy arrays, ``None`` where absent) plus ``segments`` (lists of
    tensor positions sharing one threshold) and ``ks`` (k per segment). Returns ``(indices, values, bad)``:
    per-tensor ascending indices (uint32 or uint64), per-tensor kept deltas (fp32, fp64 for fp64 tensors), and
    the lowest tensor position with a non-finite delta or score (None if all are finite). ``res_out[t]``, where
    given, receives the error-feedback residual: the delta where not kept, delta - decoded(delta) where kept.
    Where ``res_out[t]`` shares memory with ``res[t]`` (the engine's in-place state) nothing is written to it
    when a value is non-finite. The result does not depend on ``GPU_CODEC_THREADS``. ``stats`` (a dict, where
    given): its ``"misses"`` grows by the scans run again after a bracket missed (:func:`_sparse_segment`).
    ``shared``: where one segment holds every tensor (global scope) of at most 2^32 elements each and none is
    fp64, indices and values are each ``(array, offsets)``: one uint32 and one fp32 array that the selection
    writes every tensor's entries into, tensor t's being ``[offsets[t], offsets[t + 1])`` (no array made a tensor;
    the CPU backend hands them on as the kernels' shared outputs).
    """
    c = _Call(new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit)
    c.workers, c.block = plan(sum(x.nbytes for x in new), thread_count())
    nt = len(new)
    indices, values = [None] * nt, [None] * nt
    sparse, bad, full = [], [], {}
    packed: list = []
    with np.errstate(over="ignore", invalid="ignore"):  # (non-finite deltas are reported, not warned about)
        _select_segments(c, segments, ks, indices, values, sparse, bad, full, packed)
    if stats is not None:
        stats["misses"] = stats.get("misses", 0) + c.misses
    if bad:
        return None, None, min(bad)
    one = shared and nt > 1 and len(segments) == 1 and len(sparse) == 1 and _u32_f32(new, dtypes)
    joined = None
    for seg, parts, lo, k in sparse:
        joined = _finish(c, seg, parts, lo, k, indices, values, packed, one) or joined
        late = [p for p in parts if c.late(p)]
        c.release()
        if late:  # after _finish: it may read the residual again
            parallel_map(lambda p: _write_residual(c, p), late, c.workers)
            c.release()
    result = (indices, values, None) if joined is None else ((joined[0], joined[2]), (joined[1], joined[2]), None)
    if all(r is None for r in res_out):
        return result
    if joined is not None:  # (every tensor's entries in one index and one value array: tensor t's, a range of each)
        all_idx, all_val, offsets = joined
        indices = [all_idx[a:b] for a, b in pairwise(offsets)]
        values = [all_val[a:b] for a, b in pairwise(offsets)]
    done = set()
    for ts, lows, highs, rel, val in packed:  # the kept entries' residuals of a packed part's tensors: one rounding
        fix, rel = val - decoded(val, qmode), rel.astype(np.intp)  # (intp: no index cast per tensor)
        for t, a, b in zip(ts, lows, highs):
            if res_out[t] is not None:
                res_out[t][rel[a:b]] = fix[a:b]
        done.update(ts)
    for t in range(nt):
        r = res_out[t]
        if r is None or t in done:
            continue
        if t in full:
            r[:] = full[t]
        v = values[t]
        r[indices[t]] = v - decoded(v, qmode)
    return result
