"""The NumPy backend's passes over the aggregator's integer limbs (:mod:`gpu_codec.aggregate`), in blocks on the
thread pool: the same values, to the byte, as the whole-array forms the kernel backends run with their array
module, since every step is element-wise (int32 sums of distinct entries, then one fp64 sum per element in limb
order).

>>> limbs = np.zeros((3, 5), np.int32)
>>> limb_add(limbs, np.array([1, 3], np.uint32), np.array([[1, 2], [3, 4], [5, 6]], np.int32))
>>> limbs[:, 1].tolist(), limbs[:, 3].tolist()
([1, 3, 5], [2, 4, 6])
>>> out = np.empty(5, np.float32)
>>> limb_mean(limbs, [0, 3], [3, 2], [[4.0, 2.0, 1.0], [4.0, 2.0, 1.0]], 2.0, out)
>>> out.tolist()                                    # (1*4 + 3*2 + 5) / 2 and (2*4 + 4*2 + 6) / 2
[0.0, 7.5, 0.0, 11.0, 0.0]
"""

from __future__ import annotations

import math

import numpy as np

from gpu_codec.xp.limbs import add_span, mean_span  # (the steps every backend runs, on its own memory)

from .parallel import parallel_map, spans, thread_count

BLOCK = 1 << 18  # elements per block of the mean (fewer, longer calls: 2^18 took 20 % less time than 2^16 in
# one thread at 2^24, on an AMD EPYC with AVX-512, though its two fp64 buffers are 4 MiB)
TASK = 1 << 20  # elements per pool task of a dense limb_add
SMALL = 1 << 16  # elements under which a tensor is averaged in one task with its neighbours (see limb_mean)
ADD_TASK = 1 << 15  # entries per pool task of limb_add


def limb_split(vals, w: float, exps, xp=np, counts=None):
    """The limbs of ``vals * w`` (fp64) on the grids ``2^exps[j]`` (coarsest first), as int32 rows: ``rem = v * w``;
    ``q_j = rint(rem * 2^-e_j)``; ``rem -= q_j * 2^e_j`` but after the last. Every product is by a power of two,
    so exact. With ``counts``, ``exps`` holds a row of grids per tensor, whose entries are ``counts`` of ``vals``
    in turn. The split of kernels/limbs.cu ``limb_accumulate_*``.

    >>> limb_split(np.array([1.5, -0.25], np.float32), 2.0, [0, -1, -2]).tolist()
    [[3, 0], [0, -1], [0, 0]]
    """
    rem = vals.astype(np.float64) * w
    per = counts is not None and len(counts) > 1
    rows = np.asarray(exps, np.int64).reshape(-1, np.shape(exps)[-1])
    nl = rows.shape[1]
    qs = xp.empty((nl, rem.size), dtype=np.int32)
    for j in range(nl):
        e = rows[:, j]
        inv = np.repeat(np.ldexp(1.0, -e), counts) if per else math.ldexp(1.0, -int(e[0]))
        q = xp.rint(rem * inv)
        if j < nl - 1:
            step = np.repeat(np.ldexp(1.0, e), counts) if per else math.ldexp(1.0, int(e[0]))
            rem = rem - q * step  # exact: q * 2^e is within half a grid step of rem
        qs[j] = q
    return qs


def limb_accumulate(limbs: np.ndarray, start: int, counts, exps, vals, idx, w: float) -> None:
    """Twin of kernels/limbs.cu ``limb_accumulate_*``: ``limbs[j][start + e] += q_j`` for every entry, ``q`` the
    limbs of ``vals * w`` (:func:`limb_split`) on its tensor's grids (a row of ``exps`` per tensor, whose entries
    are ``counts`` of ``vals`` in turn), ``e`` its index ``idx`` (``None``: dense tensors end to end, element ``e``
    the entry's position)."""
    qs = limb_split(vals, w, exps, counts=counts)
    limb_add(limbs[:, start:] if idx is not None else limbs[:, start : start + qs.shape[1]], idx, qs)


def limb_shift(limbs: np.ndarray, starts, numels, shifts) -> None:
    """Twin of kernels/limbs.cu ``limb_shift``: each tensor's grid made coarser by ``shifts[t]`` whole limbs (row j
    takes row j - s, 0 past the top; the lowest falls off)."""
    nl = limbs.shape[0]
    for a, n, s in zip(starts, numels, shifts):
        a, n, s = int(a), int(n), int(s)
        for j in range(nl - 1, -1, -1):
            limbs[j, a : a + n] = limbs[j - s, a : a + n] if j >= s else 0


def segment_abs_max(bits: np.ndarray, counts) -> np.ndarray:
    """Twin of kernels/limbs.cu ``segment_abs_max_*``: each tensor's largest magnitude as bits (uint64; 0 for no
    entry), ``bits`` the unsigned view of its values.

    >>> segment_abs_max(np.array([-3.0, 2.0, 5.0], np.float32).view(np.uint32), [2, 0, 1]).view(np.uint64)
    array([1077936128,          0, 1084227584], dtype=uint64)
    """
    counts = np.asarray(counts, np.int64)
    out = np.zeros(counts.size, np.uint64)
    mag = bits & bits.dtype.type(np.iinfo(bits.dtype).max >> 1)
    some = counts > 0
    if some.any():
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        out[some] = np.maximum.reduceat(mag, starts[some]).astype(np.uint64)
    return out


def limb_add(limbs: np.ndarray, idx: np.ndarray | None, qs: np.ndarray) -> None:
    """``limbs[j][idx] += qs[j]`` for every limb j (``idx`` ascending and distinct; ``None``: every element,
    ``qs`` then holds one row of numel per limb). The entries are split into ranges on the pool: distinct
    indices make the ranges' writes disjoint, and int32 sums do not depend on the order.
    """
    parallel_map(lambda c: add_span(limbs, idx, qs, *c), spans(0, qs.shape[1], TASK if idx is None else ADD_TASK))


def limb_mean(limbs: np.ndarray, starts, numels, scales, total: float, out: np.ndarray) -> None:
    """Twin of kernels/limbs.cu ``limb_mean_*``: ``out`` (the tensors end to end) = ``(limbs[0] * scales[t][0] +
    limbs[1] * scales[t][1] + ...) / total`` over each tensor's elements (from ``starts[t]``), each step in fp64 and
    the last cast to ``out``'s dtype, as ``((l0.astype(f64) * s0 + l1.astype(f64) * s1 + ...) /
    total).astype(out.dtype)`` computes it; in blocks of at most BLOCK elements (and an eighth of the tensor) on the
    pool, each task through two fp64 buffers of its own. Tensors under SMALL elements whose limbs lie end to end
    make one task, taken one after another: their calls are short, and two threads making short calls take turns
    at the interpreter lock, which costs more than the calls (1,000 tensors of 8,388 elements: 29 ms in one task,
    61 ms as a task each on two threads; AMD EPYC, AVX2).

    >>> limbs = np.array([[1, 2, 3, 4]], np.int32); out = np.empty(4, np.float32)
    >>> limb_mean(limbs, [0, 1, 3], [1, 2, 1], [[1.0], [0.5], [0.25]], 1.0, out); out.tolist()
    [1.0, 1.0, 1.5, 1.0]
    """
    starts, numels = [int(a) for a in starts], [int(n) for n in numels]
    # a task: its pieces (tensor, start in the limbs, start in out, element count) and its buffers' size
    tasks: list[tuple[list[tuple[int, int, int, int]], int]] = []
    o, t, nt = 0, 0, len(numels)
    while t < nt:
        a, n = starts[t], numels[t]
        if n >= SMALL:
            blk = min(BLOCK, max(n // 8, 1 << 16))  # the fp64 buffers: at most an eighth of the tensor's elements
            step = -(-n // (thread_count() * blk)) * blk  # a large tensor: one task per thread, in whole blocks
            tasks += [([(t, a + lo, o + lo, hi - lo)], blk) for lo, hi in spans(0, n, max(step, 1))]
            o, t = o + n, t + 1
            continue
        pieces, m = [], 0  # a run of small tensors, end to end in the limbs, each one whole
        while t < nt and (not pieces or (numels[t] < SMALL and starts[t] == a + m)):
            pieces.append((t, starts[t], o + m, numels[t]))
            m, t = m + numels[t], t + 1
        tasks.append((pieces, min(BLOCK, max(m, 1))))
        o += m

    def task(job: tuple[list[tuple[int, int, int, int]], int]) -> None:
        pieces, blk = job
        acc = np.empty(max(1, min(blk, max(n for *_, n in pieces))), np.float64)
        term = np.empty_like(acc)
        for t, a, o, n in pieces:
            sc = [float(x) for x in scales[t]]
            for b in range(0, n, acc.size):
                e = min(n, b + acc.size)
                mean_span(limbs[:, a + b : a + e], sc, total, out[o + b : o + e], 0, e - b, acc, term)

    parallel_map(task, tasks)
