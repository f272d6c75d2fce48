"""Every kernel launch of kernels/*.cu, in one place, driven by a *runner*.

A runner (:class:`~gpu_codec.backends.base.Runner`) has ``xp`` (the array module its memory lives in),
``launch(name, grid, block, args)``, ``ptr(array)`` and ``to_host(array)``. The GPU backend's runner is CuPy
(:mod:`gpu_codec.backends.gpu`); the emulated backend's runner executes the same CUDA sources on the CPU
(:mod:`gpu_codec.backends.emulated`). Both go through :class:`KernelOps` below, so the emulated backend exercises
exactly what the GPU backend launches.

The only device-to-host copies here are small: one error word after scoring and after a scatter, the sampled keys
of the fused selection (at most SAMPLE_MAX per segment, none for a segment of OWN_CHUNKS chunks or fewer) and its
status words (two per segment), the per-tensor kept counts, ternary mu and Rice bit counts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from itertools import chain, repeat
from operator import is_, is_not
from statistics import NormalDist
from typing import Any

import numpy as np

from ..constants import (
    BLOCK,
    CHUNK,
    CHUNK_SCAN_PART,
    CHUNK_SCAN_THREADS,
    CRIT_LARGEST_CHANGE,
    CRIT_MAGNITUDE,
    DT_BF16,
    DT_F16,
    DT_F32,
    DT_F64,
    NO_SEG_THRESHOLD,
    Q_BF16,
    Q_F16,
    RICE_SCAN_THREADS,
    SCAN_THREADS,
    SCATTER_ADD,
    U64_MAX,
    index_dtype,
    max_bits,
)
from ..format.common import Segmented
from .base import DeviceViews, Runner, all_finite, dense_values, flat_tables, scatter_args, sizes_of, split_values

FUSED_ENV = "GPU_CODEC_FUSED_SELECT"
SAMPLE_RUN = 8  # consecutive elements per sampled run (one 32-byte sector of fp32; design_effect counts on 8)
SAMPLE_MAX = 1 << 16  # most sampled keys per segment
SAMPLE_DENSITY = 128  # about one sampled element in SAMPLE_DENSITY: 1/16 B/elem of reads per input
# segments of fewer elements than SAMPLE_SMALL are sampled twice as densely: their brackets, a few sampled keys
# wide, would cost more candidates than the sample's reads
SAMPLE_SMALL, SAMPLE_DENSITY_SMALL = 1 << 17, 64
SAMPLE_ALL = 1 << 12  # segments at most this large are sampled whole (exact bracket), but those of OWN_CHUNKS (none)
# a segment of at most this many chunks is selected by fused_scan's blocks, each chunk keeping its own k best: at
# most OWN_CHUNKS x k candidates (own_rule), where a bracket from a small segment's few sampled keys took 5-15 x k
OWN_CHUNKS = 4
# the chance that lo lands above the k-th key (a miss: the unfused passes run), shared by the sampled segments of
# a selection; the sampled keys above the k-th are counted as Poisson clusters of the runs' design effect
# (neighbours in a run of trained weights move together: up to SAMPLE_RUN times the variance of independent
# elements), estimated from the sample itself
BRACKET_MISS = 5e-3
# bracket sorts the sample's largest keys first, at least this many (and all of them where the pick lies past)
BRACKET_TOP_MIN = 1024
DESIGN_RANK = 64  # the design effect is measured at the sample's DESIGN_RANK-th key or lower (enough hits)
# the candidate pool holds the sample's estimate of a segment's candidates plus this many of its standard
# deviations and POOL_SLACK (device memory only: the traffic is what the candidates are)
POOL_SIGMAS = 6.0
POOL_SLACK = 256
NO_LO = 1 << 32  # lo of a segment with k = 0: above every key
# where a segment has more chunks than this, and the segments this many on average, the selection on the candidates
# takes a block per chunk (cand_hist) rather than one block per segment (cand_select, one SM each): the four
# histogram rounds cost a fixed 16 KiB of traffic per segment, at most a 64th of the inputs' bytes then
SELECT_BLOCK_CHUNKS = 64
# the criteria whose fp32 score is the magnitude of the delta (kernels/topk.cu, criterion_f32's default case),
# the ones fused_scan_f32 and fused_scan_h16 score by
MAGNITUDE_CRITERIA = (CRIT_MAGNITUDE, CRIT_LARGEST_CHANGE)

__all__ = ["CHUNK", "FUSED_ENV", "KernelBackendBase", "KernelOps", "TensorTables", "initial_state", "scatter_args"]


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
        # first chunk of each segment (seg_of is nondecreasing); an empty segment gets the next one's, so that the
        # table is nondecreasing and the chunk scan finds a chunk's segment by binary search
        first_tensor = np.searchsorted(self.seg_of, np.arange(nseg), side="left")
        self.seg_first_chunk = self.chunk_start[first_tensor].astype(np.int64)
        self.nseg = nseg


def initial_state(ks: list[int]) -> np.ndarray:
    """Radix-select state, 2 x u64 per segment: [prefix, k remaining]; k = 0 gets an unreachable threshold."""
    st = np.zeros(2 * len(ks), dtype=np.uint64)
    for s, k in enumerate(ks):
        st[2 * s] = 0 if k else NO_SEG_THRESHOLD
        st[2 * s + 1] = k
    return st


def _check_segments(segments, nt: int) -> None:
    # the chunk scan ranks ties over a segment's chunks in launch order: a segment must be a run of tensors (the
    # segments end to end being 0..nt-1 makes each one a run, in order)
    if list(chain.from_iterable(segments)) != list(range(nt)):
        raise ValueError(f"segments must be consecutive runs covering tensors 0..{nt - 1} in order")


def segment_of(segments) -> np.ndarray:
    """Each tensor's segment (segments are consecutive runs of tensors, in order: _check_segments)."""
    return np.repeat(np.arange(len(segments), dtype=np.int64), [len(seg) for seg in segments])


class SegmentTable:
    """Per segment of a selection, as arrays (segments are consecutive runs of tensors, in order): elements ``n``,
    kept count ``k``, ``chunks``, ``tensors``, ``first`` tensor; and per tensor ``numel`` and ``seg_of``."""

    def __init__(self, numels: list[int], segments, ks):
        self.numel = np.asarray(numels, np.int64).reshape(-1)
        self.tensors = np.fromiter((len(seg) for seg in segments), np.int64, len(segments))
        self.first = np.concatenate([[0], np.cumsum(self.tensors)])[:-1].astype(np.int64)
        self.seg_of = segment_of(segments)
        self.k = np.asarray([int(k) for k in ks], np.int64).reshape(-1)
        self.n = self._sum(self.numel)
        self.chunks = self._sum(-(-self.numel // CHUNK))
        self.own = own_rule(self.chunks, self.tensors) & (self.k > 0) & (self.k < self.n)

    def _sum(self, per_tensor: np.ndarray) -> np.ndarray:
        c = np.concatenate([[0], np.cumsum(per_tensor, dtype=np.int64)])
        return c[self.first + self.tensors] - c[self.first]


def own_rule(chunks: np.ndarray, tensors: np.ndarray) -> np.ndarray:
    """Which segments fused_scan's blocks select themselves (own_k), without a sample: those of at most
    OWN_CHUNKS chunks, each of which keeps its own k best (all of its elements where it holds fewer). The
    segment's k best are among them (a chunk leaves out only elements that k of its own beat), so the later
    kernels' exact selection on these at most OWN_CHUNKS x k candidates keeps the same entries, and no bracket can
    miss."""
    return (chunks > 0) & (chunks <= OWN_CHUNKS)


def sample_plan(st: SegmentTable) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor: (sample offsets, nt + 1 entries; sampling window). A segment of n elements is sampled in runs
    of SAMPLE_RUN consecutive elements, one run in every window of ``stride`` elements (whole when n <=
    SAMPLE_ALL or k is 0 or n); :func:`gpu_codec.cpu_fallback.fused.sample_positions` says where. A segment with
    nothing to bracket (k is 0 or n, or its chunks select it: :func:`own_rule`) takes no sample."""
    n, k = st.n, st.k
    fixed = ((k <= 0) | (k >= n) | st.own)[st.seg_of]
    windowed = (n > SAMPLE_ALL) & (k > 0) & (k < n)
    ms = np.minimum(
        SAMPLE_MAX, np.maximum(SAMPLE_RUN, n // np.where(n < SAMPLE_SMALL, SAMPLE_DENSITY_SMALL, SAMPLE_DENSITY))
    )
    stride = np.where(windowed, np.maximum(SAMPLE_RUN, SAMPLE_RUN * (n // ms)), SAMPLE_RUN)[st.seg_of]
    numel = st.numel
    counts = np.where(fixed, 0, numel // stride * SAMPLE_RUN + np.minimum(SAMPLE_RUN, numel % stride))
    return _offsets(counts), stride.astype(np.int64)


def design_effect(sample: np.ndarray, rank: int, x: Any = None) -> float:
    """How much more the count of sampled keys at or above the sample's ``rank``-th largest (``x``, where the
    caller knows it) varies than a count of independent elements would (1 to SAMPLE_RUN): the variance of the
    per-run counts over the binomial one."""
    runs = sample.size // SAMPLE_RUN
    if runs < 2:
        return float(SAMPLE_RUN)
    if x is None:
        x = np.partition(sample, sample.size - 1 - rank)[sample.size - 1 - rank]
    at = sample[: runs * SAMPLE_RUN] >= x
    if hasattr(np, "bitwise_count"):  # a run's eight flags are one 64-bit word: its hits are the word's set bits
        hits = np.bitwise_count(at.view(np.uint64))
    else:  # (NumPy before 2.0)
        hits = at.reshape(runs, SAMPLE_RUN).sum(axis=1)
    mean = float(hits.mean())
    if mean == 0 or mean == SAMPLE_RUN:
        return float(SAMPLE_RUN) if mean == 0 else 1.0
    return min(float(SAMPLE_RUN), max(1.0, float(hits.var()) / (mean * (1 - mean / SAMPLE_RUN))))


def poisson_upper(lam: float, alpha: float) -> int:
    """The least m with P(X > m) <= alpha for X ~ Poisson(lam) (a normal approximation past lam = 200).

    >>> poisson_upper(1.0, 1e-3), poisson_upper(100.0, 1e-3)
    (5, 132)
    """
    if lam > 200:
        return math.ceil(lam + NormalDist().inv_cdf(1 - alpha) * math.sqrt(lam))
    pmf = cdf = math.exp(-lam)
    m = 0
    while 1 - cdf > alpha:
        m += 1
        pmf *= lam / m
        cdf += pmf
    return m


def bracket(
    sample: np.ndarray, weight: np.ndarray, n: int, k: int, whole: bool, alpha: float = BRACKET_MISS
) -> tuple[int, int]:
    """(lo, pool): a key at or below the k-th largest of the segment with high probability (exact when sampled
    whole), and candidate slots enough for the keys above it with a far higher one. Sampled key i stands for
    ``weight[i]`` elements (its tensor's size over its sample: a small tensor's run weighs less)."""
    ms = sample.size
    if whole:
        lo = int(np.partition(sample, ms - k)[ms - k])
        return lo, int(np.count_nonzero(sample > lo))
    rank = max(int(k * ms / n), min(DESIGN_RANK, ms // SAMPLE_RUN))
    # the sampled keys in descending order (ties: the later first), sorted only as far as the pick can reach
    top = min(ms, max(BRACKET_TOP_MIN, 8 * (k * ms // n + 1), rank + 1))
    order = _descending(sample, top)
    d = design_effect(sample, rank, sample[order[rank]])
    while True:
        w = weight[order]
        est = np.cumsum(w)  # elements at or above each sampled key
        reach = np.flatnonzero(est >= k)
        if reach.size:
            wk = float(np.sum(w[: reach[0] + 1] ** 2) / est[reach[0]])  # the mean weight of a key above the k-th
            # sampled keys above the k-th: Poisson(k / wk) in clusters of d; lo is the one past their 1 - alpha quantile
            above_k = d * poisson_upper(k / wk / d, alpha)
            enough = np.flatnonzero(est >= (above_k + 1) * wk)
            if enough.size or order.size == ms:
                break
        elif order.size == ms:
            return 0, n
        order = _descending(sample, ms)  # the prefix fell short: sort them all
    pick = int(enough[0]) if enough.size else ms
    if pick >= ms - 1:
        return 0, n  # the sample cannot bracket so low: every element is a candidate
    lo = int(sample[order[pick]])
    above = sample > lo  # keys equal to lo are counted, not stored
    est_above, var_above = float(weight[above].sum()), d * float((weight[above] ** 2).sum())
    return lo, min(n, math.ceil(est_above + POOL_SIGMAS * math.sqrt(var_above)) + POOL_SLACK)


def _descending(sample: np.ndarray, top: int) -> np.ndarray:
    """Positions of the sample's keys in descending order, ties the later first (``argsort(stable)[::-1]``): all of
    them, or the first ``top`` of that order. Each key is made unique by its position (key x 2^32 + position), so
    the selection of the first ``top`` is a partition that many equal keys do not slow down (NumPy's partition of
    a sample of 99 % zeros took 17 times as long as of distinct keys).

    >>> s = np.array([3, 9, 1, 9, 5, 3], np.uint32)
    >>> _descending(s, 6).tolist(), _descending(s, 3).tolist(), _descending(s, 4).tolist()
    ([3, 1, 4, 5, 0, 2], [3, 1, 4], [3, 1, 4, 5])
    """
    ms = sample.size
    keyed = (sample.astype(np.uint64) << np.uint64(32)) | np.arange(ms, dtype=np.uint64)
    if top < ms:
        keyed = np.partition(keyed, ms - top)[ms - top :]
    keyed.sort()
    return (keyed[::-1] & np.uint64(0xFFFFFFFF)).astype(np.intp)


def candidate_plan(host_sample, samp_off, st: SegmentTable, segments):
    """(lo per segment, k per segment whose chunks fused_scan's blocks select themselves (:func:`own_rule`; else
    0), candidate pool slots) from the sampled keys, on the host: every segment at once but those bracketed by
    their sample."""
    nseg = len(segments)
    n, k, own = st.n, st.k, st.own
    samp_off = np.asarray(samp_off, np.int64)
    sampled = int(np.count_nonzero((st.tensors > 0) & (samp_off[st.first + st.tensors] > samp_off[st.first])))
    lo = np.zeros(max(nseg, 1), np.uint64)
    own_k = np.zeros(max(nseg, 1), np.uint64)
    lo[:nseg][k <= 0] = NO_LO
    full = (k > 0) & (k >= n)
    own_k[:nseg][own] = k[own]
    kt, numel = k[st.seg_of], st.numel  # each chunk of a segment its chunks select keeps its k, or all it holds
    chunk_keeps = np.minimum(kt, CHUNK) * (numel // CHUNK) + np.minimum(kt, numel % CHUNK)
    pool = int(n[full].sum()) + int(chunk_keeps[own[st.seg_of]].sum())
    for s in np.flatnonzero((k > 0) & (k < n) & ~own).tolist():
        seg = segments[s]
        a, b = int(samp_off[seg[0]]), int(samp_off[seg[-1] + 1])
        m = np.diff(samp_off[seg[0] : seg[-1] + 2])
        per = st.numel[seg[0] : seg[-1] + 1].astype(np.float64) / np.maximum(m, 1)
        ns, ks_ = int(n[s]), int(k[s])
        lo[s], cap = bracket(
            host_sample[a:b], np.repeat(per, m), ns, ks_, ns <= SAMPLE_ALL, BRACKET_MISS / max(1, sampled)
        )
        pool += cap
    return lo, own_k, pool


def hist_select(widest: int, chunks: int, nseg: int) -> bool:
    """Whether the selection on the candidates runs as histogram rounds with a block per chunk (cand_hist), rather
    than one block per segment (cand_select): where the widest segment spans more than SELECT_BLOCK_CHUNKS chunks
    and the segments average at least that many."""
    return widest > SELECT_BLOCK_CHUNKS and chunks >= SELECT_BLOCK_CHUNKS * nseg


def scan_kernel(dtypes, crit: int, ext_scores) -> str:
    """The fused selection's one pass over the inputs: where every tensor is scored by the magnitude of its delta
    with no score of the caller's, ``fused_scan_f32`` (every tensor fp32) or ``fused_scan_h16`` (every tensor fp16
    or bf16): four consecutive elements a thread, read with one wide load each where a tensor's addresses allow it;
    else ``fused_scan`` (any dtype, criterion and score). All write the same outputs.

    >>> scan_kernel([DT_F32, DT_F32], CRIT_MAGNITUDE, [None, None]), scan_kernel([DT_F64], CRIT_MAGNITUDE, [None])
    ('fused_scan_f32', 'fused_scan')
    >>> none = [None, None]
    >>> scan_kernel([DT_BF16, DT_F16], CRIT_MAGNITUDE, none), scan_kernel([DT_BF16, DT_F32], CRIT_MAGNITUDE, none)
    ('fused_scan_h16', 'fused_scan')
    """
    if int(crit) not in MAGNITUDE_CRITERIA or not _all_none(ext_scores):
        return "fused_scan"
    codes = set(dtypes)  # (the int codes, or enum members equal to them)
    if codes <= {DT_F32}:
        return "fused_scan_f32"
    if codes <= {DT_F16, DT_BF16}:
        return "fused_scan_h16"
    return "fused_scan"


def wide_indices(numels: list[int]) -> bool:
    """Whether the fused path writes 64-bit indices: where a tensor has more elements than uint32 indexes."""
    return bool(numels) and index_dtype(max(numels)) == np.uint64  # (the largest decides: one call, not one a tensor)


def _all_none(xs) -> bool:
    """Whether every item of ``xs`` is None (one C loop, no comparison of arrays)."""
    return not any(map(is_not, xs, repeat(None)))


def code_array(codes: list) -> np.ndarray:
    """The dtype codes of a tensor list (ints, or :class:`~gpu_codec.constants.DType` members) as an int32 array:
    one fill where they are all one (NumPy reads an enum member through its ``__index__``, about 80 ns each).

    >>> from gpu_codec.constants import DType
    >>> code_array([DType.F32] * 3).tolist(), code_array([DType.F32, DT_F64]).tolist(), code_array(()).size
    ([0, 0, 0], [0, 3], 0)
    """
    if isinstance(codes, np.ndarray):
        return codes.astype(np.int32, copy=False)
    codes = codes if type(codes) is list else list(codes)
    if codes and codes.count(codes[0]) == len(codes):
        return np.full(len(codes), int(codes[0]), np.int32)
    return np.fromiter(codes, np.int32, len(codes))


def _nbytes(*arrays) -> int:
    return sum(int(a.nbytes) for a in arrays)


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

    def __init__(self, runner: Runner, fused: bool | None = None):
        self.runner = runner
        self.xp = runner.xp
        # the fused one-read selection (_topk_fused); GPU_CODEC_FUSED_SELECT=0 selects the unfused passes
        self.fused = os.environ.get(FUSED_ENV, "1") != "0" if fused is None else fused
        self.fused_fallbacks = 0  # fused selections that ran the unfused passes (bracket miss or overflow)
        self.fused_selections = 0  # fused selections that completed without the fallback
        # peak bytes of scratch alive at once in the last fused selection (device memory beyond its inputs and
        # outputs: the sample, then the candidate pool, per-chunk tables and O(tensors) tables)
        self.fused_workspace_bytes = 0

    def _up(self, host: np.ndarray):
        return self.xp.asarray(host)

    def _ptrs(self, arrays, *, skip_empty: bool = False, sizes: list[int] | None = None) -> Any:
        """A device table of the arrays' addresses (0 for None, and for empty arrays with ``skip_empty``;
        ``sizes``, the arrays' sizes where the caller has them): where every array is there and none is skipped,
        read by the runner's ``ptrs`` in one loop where it has one; else a call a non-empty array."""
        if type(arrays) is DeviceViews:  # (a caller's tensors given by address: no array made)
            addrs = np.asarray(arrays.ptrs, np.uint64)
            addrs[np.asarray(arrays.numels) == 0] = 0  # (as an empty array's address reads)
            return self._up(addrs)
        if _all_none(arrays):  # (no residuals, no external scores: the common case)
            return self._up(np.zeros(len(arrays), np.uint64))
        many = getattr(self.runner, "ptrs", None)
        if (
            many is None
            or any(map(is_, arrays, repeat(None)))
            or (skip_empty and 0 in (sizes_of(arrays) if sizes is None else sizes))
        ):
            ptr = self.runner.ptr
            addrs = [0 if a is None or (skip_empty and not a.size) else ptr(a) for a in arrays]
            return self._up(np.asarray(addrs, dtype=np.uint64))
        return self._up(np.asarray(many(arrays), dtype=np.uint64))

    def topk_select(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode):
        """Same contract as :func:`gpu_codec.cpu_fallback.select.topk_select`, on the runner's memory."""
        _check_segments(segments, len(new))
        numels = sizes_of(new)  # (Python ints, on every array module)
        sizes = [sum(map(numels.__getitem__, seg)) for seg in segments]
        # a large segment kept whole would make every element a candidate: the unfused passes skip its selection
        if self.fused and not any(k >= n > SAMPLE_ALL for n, k in zip(sizes, ks)):
            args = (new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode, numels)
            got = self._topk_fused(*args)
            if got is not None:
                return got
            self.fused_fallbacks += 1
        return self._topk_unfused(new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode)

    def _topk_unfused(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode):
        """score_keys, four radix passes over every key, chunk_count, the chunk scan, chunk_write: exact for any
        input."""
        xp, run = self.xp, self.runner
        nt = len(new)
        seg_of = segment_of(segments)
        tb = TensorTables(sizes_of(new), seg_of, len(segments))
        d_chunk_start, d_elem_off, d_numel = self._up(tb.chunk_start), self._up(tb.elem_off), self._up(tb.numel)
        d_seg_of = self._up(tb.seg_of)
        d_dtypes = self._up(code_array(dtypes))
        p_new, p_base, p_res = self._ptrs(new), self._ptrs(base), self._ptrs(res)
        p_ext = self._ptrs(ext_scores)
        d_ext_dt = self._up(code_array(ext_dtypes))
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
            self._chunk_scan(tb, d_chunk_start, state, cnt, eq_base, out_base, counts)
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
        return self._split_output(idx, vals32, vals64, host_counts, tb.numel.tolist(), dtypes, K)

    def _topk_fused(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit, segments, ks, qmode, numels):
        """The selection reading the full tensors once (kernels/topk.cu, "Fused selection"); None where the
        bracket missed or the candidate pool overflowed (the caller then runs the unfused passes). ``numels``: each
        tensor's size."""
        xp, run = self.xp, self.runner
        nt = len(new)
        codes = code_array(dtypes)
        seg_of = segment_of(segments)
        nseg = len(segments)
        tb = TensorTables(numels, seg_of, nseg)
        grid = tb.nchunks
        if grid == 0:
            return None
        nt32, crit32 = np.int32(nt), np.int32(crit)
        d_cs, d_nm = self._up(tb.chunk_start), self._up(tb.numel)
        d_dt, d_so = self._up(codes), self._up(tb.seg_of)
        p_new, p_base, p_res, p_ext = self._ptrs(new), self._ptrs(base), self._ptrs(res), self._ptrs(ext_scores)
        d_ext_dt = self._up(code_array(ext_dtypes))
        no_res_out = _all_none(res_out)  # (no error feedback)
        # 1) the sample and, on the host, lo per segment and the size of the candidate pool
        st = SegmentTable(tb.numel, segments, ks)  # (the sample's plan and the candidates' share it)
        samp_off, stride = sample_plan(st)
        ns = int(samp_off[-1])
        tables = _nbytes(d_cs, d_nm, d_dt, d_so, p_new, p_base, p_res, p_ext, d_ext_dt)  # live until the end
        host_sample = np.zeros(0, np.uint32)
        peak = tables
        if ns:
            sample, d_off, d_stride = xp.empty(ns, dtype=np.uint32), self._up(samp_off), self._up(stride)
            run.launch(
                "sample_keys",
                -(-ns // BLOCK),
                BLOCK,
                (nt32, np.uint64(ns), d_off, d_nm, d_stride, np.int32(SAMPLE_RUN), d_dt, p_new, p_base)
                + (p_res, p_ext, d_ext_dt, crit32, sample),
            )
            host_sample = run.to_host(sample)
            peak = max(peak, tables + _nbytes(sample, d_off, d_stride))
            del sample, d_off, d_stride  # freed before the candidate pool is allocated
        lo, own_k, pool = candidate_plan(host_sample, samp_off, st, segments)
        cand_base = xp.zeros(grid, dtype=np.uint64)
        cand_cnt = xp.zeros(grid, dtype=np.uint32)
        cand_idx = xp.empty(max(pool, 1), dtype=np.uint16)
        cand_key = xp.empty(max(pool, 1), dtype=np.uint32)
        eq_cnt = xp.zeros(grid, dtype=np.uint32)
        cands = _nbytes(cand_base, cand_cnt, cand_idx, cand_key, eq_cnt)  # live until cand_write
        status = self._up(np.concatenate([np.asarray([U64_MAX, 0], np.uint64), np.zeros(2 * nseg, np.uint64)]))
        # 2) one pass over every element; the residual is written here where it is not also the residual read (an
        # empty one is never that: on a GPU empty arrays share the address 0, where the twins' have their own)
        early = (
            [None] * nt
            if no_res_out
            else [
                ro if ro is not None and (r is None or ro.size == 0 or run.ptr(r) != run.ptr(ro)) else None
                for r, ro in zip(res, res_out)
            ]
        )
        p_early = self._ptrs(early)  # live until cand_write
        d_lo = self._up(lo)
        plan = (p_early, d_lo, self._up(own_k), np.uint64(pool))
        run.launch(
            scan_kernel(dtypes, crit, ext_scores),
            grid,
            BLOCK,
            (nt32, d_cs, d_nm, d_dt, d_so, p_new, p_base, p_res, p_ext, d_ext_dt, crit32)
            + plan
            + (cand_base, cand_cnt, cand_idx, cand_key, eq_cnt, status),
        )
        peak = max(peak, tables + cands + _nbytes(status, *plan[:3]))
        cands += _nbytes(p_early, d_lo)
        self.fused_workspace_bytes = peak
        del plan
        st = run.to_host(status)
        del status
        if int(st[0]) != U64_MAX:
            return None, None, int(st[0])
        above, at_lo = st[2::2].astype(np.int64), st[3::2].astype(np.int64)
        if int(st[1]) > pool or any(int(above[s] + at_lo[s]) < k for s, k in enumerate(ks)):
            return None  # the pool overflowed or the bracket missed
        # 3) exact selection on the candidates, then the ordered write of the kept entries. A segment with fewer
        # candidates than k keeps them all and the first keys equal to lo: threshold lo, no selection to run.
        tied = [s for s, k in enumerate(ks) if k > 0 and above[s] < k]
        state = self._up(initial_state([0 if s in tied else k for s, k in enumerate(ks)]))
        seg_chunks = np.zeros(nseg + 1, np.int64)
        for s, seg in enumerate(segments):
            seg_chunks[s + 1] = tb.chunk_start[seg[-1] + 1] if seg else seg_chunks[s]
        widest = int(np.diff(seg_chunks).max()) if nseg else 0
        if hist_select(widest, grid, nseg):
            hist = xp.zeros(256 * nseg, dtype=np.uint64)
            for shift in (24, 16, 8, 0):  # a block per chunk: every SM works, whatever the segment count
                run.launch(
                    "cand_hist",
                    grid,
                    BLOCK,
                    (nt32, d_cs, d_so, cand_base, cand_cnt, cand_key, state, np.int32(shift), hist),
                )
                run.launch("radix_pick", -(-nseg // 256), 256, (np.int32(nseg), np.int32(shift), hist, state))
            peak = max(peak, tables + cands + _nbytes(state, hist))
            del hist
        else:  # segments of a few chunks: one block each, its histogram in shared memory
            run.launch(
                "cand_select",
                nseg,
                SCAN_THREADS,
                (np.int32(nseg), self._up(seg_chunks), cand_base) + (cand_cnt, cand_key, state),
            )
        if tied:  # state = [lo, keys equal to lo to take] for them
            ix = np.asarray(tied, np.int64)
            state[self._up(np.concatenate([2 * ix, 2 * ix + 1]))] = self._up(
                np.concatenate([lo[ix], np.asarray(ks, np.int64)[ix] - above[ix]]).astype(np.uint64)
            )
        cnt = xp.zeros(2 * grid, dtype=np.uint32)
        run.launch(
            "cand_count", grid, BLOCK, (nt32, d_cs, d_so, cand_base, cand_cnt, cand_key, state, d_lo, eq_cnt, cnt)
        )
        eq_base = xp.zeros(grid, dtype=np.uint64)
        out_base = xp.zeros(grid + 1, dtype=np.uint64)
        counts = xp.zeros(nt, dtype=np.uint64)
        scan = self._chunk_scan(tb, d_cs, state, cnt, eq_base, out_base, counts)
        peak = max(peak, tables + cands + scan + _nbytes(state, cnt, eq_base, out_base, counts))
        K = int(sum(ks))
        wide = wide_indices(numels)
        sfx = "u64" if wide else "u32"
        idx = xp.empty(max(K, 1), dtype=np.uint64 if wide else np.uint32)
        has64 = bool((codes == DT_F64).any())
        vals32 = xp.empty(max(K, 1) if bool((codes != DT_F64).any()) else 1, dtype=np.float32)
        vals64 = xp.empty(max(K, 1) if has64 else 1, dtype=np.float64)
        run.launch(
            "cand_write_" + sfx,
            grid,
            BLOCK,
            (nt32, d_cs, d_dt, d_so, p_new, p_base, p_res, p_early, cand_base, cand_cnt, cand_idx, cand_key, state)
            + (eq_base, out_base, idx, vals32, vals64),
        )
        if tied:  # the chunks that supply the keys equal to lo, read again
            run.launch(
                "tie_write_" + sfx,
                grid,
                BLOCK,
                (nt32, d_cs, d_nm, d_dt, d_so, p_new, p_base, p_res, p_ext, d_ext_dt, crit32, d_lo, cnt, state)
                + (eq_base, out_base, idx, vals32, vals64),
            )
        del cand_base, cand_cnt, cand_idx, cand_key, eq_cnt, cnt, state, eq_base, out_base
        host_counts = run.to_host(counts).astype(np.int64)
        del counts
        # 4) residuals read in place are written now that nothing reads them; then the kept entries' residuals
        late = [] if no_res_out else [ro if ro is not None and e is None else None for ro, e in zip(res_out, early)]
        if not _all_none(late):
            p_late = self._ptrs(late)
            run.launch("residual_delta", grid, BLOCK, (nt32, d_cs, d_nm, d_dt, p_new, p_base, p_res, p_late))
            peak = max(peak, tables + _nbytes(p_late))
            del p_late
        if K and not no_res_out:
            ent, p_ro = self._up(_offsets(host_counts.tolist())), self._ptrs(res_out)
            run.launch(
                "kept_fix_" + sfx,
                -(-K // BLOCK),
                BLOCK,
                (nt32, np.uint64(K), ent, d_dt, p_ro) + (np.int32(qmode), idx, vals32, vals64),
            )
            peak = max(peak, tables + _nbytes(ent, p_ro))
            del ent, p_ro
        self.fused_workspace_bytes = peak
        self.fused_selections += 1
        return self._split_output(idx, vals32, vals64, host_counts, numels, codes, K)

    def _chunk_scan(self, tb: TensorTables, d_chunk_start, state, cnt, eq_base, out_base, counts) -> int:
        """eq_base, out_base and counts from the per-chunk counts (kernels/topk.cu, "The chunk scan"); returns the
        bytes of its own scratch (freed on return)."""
        nblk = -(-tb.nchunks // CHUNK_SCAN_THREADS)
        part = self.xp.empty(CHUNK_SCAN_PART * nblk, dtype=np.uint64)
        nt, nch, nseg, sfc = np.int32(tb.nt), np.int64(tb.nchunks), np.int32(tb.nseg), self._up(tb.seg_first_chunk)
        run = self.runner
        run.launch("chunk_scan_reduce", nblk, CHUNK_SCAN_THREADS, (nch, nseg, sfc, cnt, part))
        run.launch(
            "chunk_scan_eq",
            nblk,
            CHUNK_SCAN_THREADS,
            (nt, nch, d_chunk_start, nseg, sfc, state, cnt, part, eq_base, out_base),
        )
        run.launch("chunk_scan_out", nblk, CHUNK_SCAN_THREADS, (nt, nch, d_chunk_start, part, out_base, counts))
        return int(part.nbytes) + int(sfc.nbytes)

    def _split_output(self, idx, vals32, vals64, host_counts, numels, dtypes, K):
        """Per-tensor indices and values as :class:`~gpu_codec.format.common.Segmented` ranges of the shared
        outputs (no array made per tensor until one is read); tensors whose index dtype is narrower than the
        shared one's (every tensor beside one of over 2^32 elements) get theirs cast, one by one."""
        offsets = np.zeros(len(numels) + 1, np.int64)
        np.cumsum(host_counts[: len(numels)], out=offsets[1:])
        if int(offsets[-1]) != K:
            raise AssertionError(f"kernels kept {int(offsets[-1])} entries, expected {K}")
        off = offsets.tolist()
        which = (code_array(dtypes) == DT_F64).view(np.int8).tolist()
        values = Segmented((vals32, vals64), off, which)
        indices: Any = Segmented((idx,), off)
        if idx.dtype == np.uint64 and any(index_dtype(n) != np.uint64 for n in numels):
            indices = [a if a.dtype == index_dtype(n) else a.astype(index_dtype(n)) for a, n in zip(indices, numels)]
        return indices, values, None

    def dense_delta(self, new, base, res, res_out, dtypes, ext_scores, ext_dtypes, crit):
        """Dense mode in one pass over the inputs (see :meth:`gpu_codec.backends.base.Backend.dense_delta`)."""
        xp, run = self.xp, self.runner
        numels = sizes_of(new)
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
                    self._up(code_array(dtypes)),
                    self._ptrs(new),
                    self._ptrs(base),
                    self._ptrs(res),
                    self._ptrs(ext_scores),
                    self._up(code_array(ext_dtypes)),
                    np.int32(crit),
                    vals32,
                    vals64,
                    err,
                ),
            )
            bad = int(run.to_host(err)[0])
            if bad != U64_MAX:
                return None, bad
        self._zero(res_out)  # every entry is kept and sent exactly: d - decoded(d) = +0.0
        return split_values(vals32, vals64, numels, dtypes, off, DT_F64), None

    def _zero(self, arrays) -> None:
        """Every array of ``arrays`` (None skipped) zeroed: one fill for each run of arrays that lie end to end in
        one flat allocation (an error-feedback binding's outputs are slices of one a value dtype), else one fill
        an array."""
        ptr, run = self.runner.ptr, []

        def flush() -> None:
            base = run[0].base if run else None
            if len(run) > 1 and base is not None and base.ndim == 1 and base.dtype == run[0].dtype:
                at = (ptr(run[0]) - ptr(base)) // base.itemsize
                base[at : at + sum(int(a.size) for a in run)].fill(0)
            else:
                for a in run:
                    a.fill(0)
            run.clear()

        for a in arrays:
            if a is None or not a.size:
                continue
            last = run[-1] if run else None
            if last is not None and not (
                a.base is not None
                and a.base is last.base
                and a.dtype == last.dtype
                and ptr(last) + last.nbytes == ptr(a)
            ):
                flush()
            run.append(a)
        if run:
            flush()

    def scatter(self, outs, out_dtypes, numels, indices, values, mode, defer=False):
        """Write kept entries into dense outputs; returns the lowest bad entry position or None (``defer``: the
        error word, unread).

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
                self._up(code_array(out_dtypes)),
                self._ptrs(outs),
                idx,
                vals32,
                vals64,
                np.int32(mode),
                err,
            ),
        )
        if defer:
            return err
        bad = int(run.to_host(err)[0])
        return None if bad == U64_MAX else bad

    def dense_apply(self, outs, out_dtypes, bases, values, mode, defer=False):
        """Dense records into fresh outputs, reading bases and values in place; the lowest bad entry or None
        (``defer``: the error word, unread)."""
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
                self._up(code_array(out_dtypes)),
                self._ptrs(outs, skip_empty=True),
                self._ptrs(bases, skip_empty=True),
                self._ptrs(vals, skip_empty=True),
                np.int32(mode),
                err,
            ),
        )
        if defer:
            return err
        bad = int(self.runner.to_host(err)[0])
        return None if bad == U64_MAX else bad

    def gather_copy(self, out, sources) -> None:
        """``out`` = the sources end to end, bits as they are, in one launch (kernels/scatter.cu)."""
        counts = sizes_of(sources)
        total = sum(counts)
        if total != out.size:
            raise ValueError(f"gather_copy: the sources hold {total} elements, the output {out.size}")
        if total:
            self.runner.launch(
                "gather_copy",
                math.ceil(total / BLOCK),
                BLOCK,
                (
                    np.int32(len(sources)),
                    np.uint64(total),
                    self._up(_offsets(counts)),
                    self._ptrs(sources, skip_empty=True, sizes=counts),
                    np.int32(out.dtype.itemsize),
                    out,
                ),
            )

    def gather_entries(self, out, sources, starts, indices, counts) -> None:
        """``out[j]`` = the element of its tensor's source at entry j (``counts`` entries a source, at positions
        ``indices`` of a span in which the sources start at ``starts``, then its end), bits as they are, in one
        launch (kernels/scatter.cu)."""
        total = sum(counts)
        if total != out.size or total != indices.size:
            raise ValueError(f"gather_entries: {total} entries, {indices.size} indices, an output of {out.size}")
        if total:
            wide = np.dtype(indices.dtype).itemsize == 8
            self.runner.launch(
                "gather_entries_u64" if wide else "gather_entries_u32",
                math.ceil(total / BLOCK),
                BLOCK,
                (
                    np.int32(len(sources)),
                    np.uint64(total),
                    self._up(_offsets(counts)),
                    self._up(np.asarray(starts, np.uint64)),
                    self._ptrs(sources, skip_empty=True),
                    indices,
                    np.int32(out.dtype.itemsize),
                    out,
                ),
            )

    def _entry_tables(self, values, indices, res):
        counts = [int(v.size) for v in values]
        return (
            counts,
            np.int32(len(values)),
            self._up(_offsets(counts)),
            self._up(np.asarray([DT_F64 if v.dtype == np.float64 else DT_F32 for v in values], np.int32)),
            self._ptrs(values, skip_empty=True, sizes=counts),
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
        return signs, mu[: len(counts)]

    def rice(self, indices, ks, numels) -> tuple[list[Any], Any]:
        xp, run = self.xp, self.runner
        counts = [int(i.size) for i in indices]
        # each stream gets the words of its length's bound (the gaps add up to at most numel - nnz), so that its
        # bit count, read later with the call's other host reads, is not needed to place the streams
        caps = [max_bits(c, n, k) if c else 0 for c, n, k in zip(counts, numels, ks)]
        wide = any(i.dtype == np.uint64 for i in indices)
        idx = [i.astype(np.uint64) if wide and i.dtype != np.uint64 else i for i in indices]
        tb = TensorTables(counts, [0] * len(counts), 1)
        nt, ent, d_ks = np.int32(len(counts)), self._up(_offsets(counts)), self._up(np.asarray(ks, np.int32))
        cs, ip = self._up(tb.chunk_start), self._ptrs(idx, skip_empty=True)
        sfx = "u64" if wide else "u32"
        chunk_base = xp.zeros(max(tb.nchunks, 1), dtype=np.uint64)
        tbits = xp.zeros(max(len(counts), 1), dtype=np.uint64)
        if tb.nchunks:
            chunk_q = xp.zeros(tb.nchunks, dtype=np.uint64)
            run.launch("rice_count_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_q))
            run.launch(
                "rice_scan", 1, RICE_SCAN_THREADS, (nt, np.int64(tb.nchunks), cs, ent, d_ks, chunk_q, chunk_base, tbits)
            )
        nwords = [-(-b // 32) for b in caps]
        word_off = _offsets(nwords)
        words = xp.zeros(max(sum(nwords), 1), dtype=np.uint32)
        if tb.nchunks:
            run.launch(
                "rice_write_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_base, self._up(word_off), words)
            )
        streams = [words[int(word_off[t]) : int(word_off[t + 1])].view(np.uint8) for t in range(len(counts))]
        return streams, tbits[: len(counts)]


class KernelBackendBase:
    """The ops of a kernel backend (GPU or emulated): each one a :class:`KernelOps` launch sequence."""

    name: str
    on_device: bool

    def __init__(self, runner: Runner):
        self.runner = runner
        self.xp = runner.xp
        self.ops = KernelOps(runner)

    def asarrays(self, arrays) -> Sequence[Any]:
        """:meth:`asarray` of each (None stays None); a :class:`~.base.DeviceViews` as it is (arrays of the runner's
        memory, each made where it is read)."""
        if type(arrays) is DeviceViews:
            return arrays
        asarray = self.asarray  # type: ignore[attr-defined]
        return [None if a is None else asarray(a) for a in arrays]

    def to_host(self, a: Any) -> np.ndarray:
        return self.runner.to_host(a)

    @property
    def host(self) -> Any:
        from .cpu import CpuBackend  # (the NumPy backend: nothing of its own to set up)

        return CpuBackend()

    def topk_select(self, req):
        return self.ops.topk_select(*req.select_args())

    def scatter(self, *args, **kwargs):
        return self.ops.scatter(*args, **kwargs)

    def scatter_onto(self, out, base, start, stop, out_dtype, numel, indices, values):
        out[start:stop] = base[start:stop]
        bad = self.ops.scatter([out], [out_dtype], [numel], [indices], [values], SCATTER_ADD)
        return bad, bad is not None or all_finite(out[indices], out_dtype, self.xp)

    def gather_copy(self, out, sources):
        self.ops.gather_copy(out, sources)

    def gather_entries(self, out, sources, starts, indices, counts):
        self.ops.gather_entries(out, sources, starts, indices, counts)

    def dense_apply(self, outs, out_dtypes, bases, values, mode, defer=False):
        return self.ops.dense_apply(outs, out_dtypes, bases, values, mode, defer)

    def dense_delta(self, req):
        return self.ops.dense_delta(*req.delta_args(), req.criterion)

    def cast16(self, values, dtype, indices, res):
        return self.ops.cast16(values, dtype, indices, res)

    def int8(self, values, block, indices, res):
        return self.ops.int8(values, block, indices, res)

    def ternary(self, values, indices, res):
        return self.ops.ternary(values, indices, res)

    def rice(self, indices, ks, numels):
        return self.ops.rice(indices, ks, numels)
