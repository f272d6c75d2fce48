"""The NumPy backend's passes over the aggregator's integer limbs (:mod:`gpu_codec.aggregate`), in blocks on the
thread pool: the same values, to the byte, as the whole-array forms the kernel backends run with their array
module, since every step is element-wise (int32 sums of distinct entries, then one fp64 sum per element in limb
order).

>>> limbs = np.zeros((3, 5), np.int32)
>>> limb_add(limbs, np.array([1, 3], np.uint32), np.array([[1, 2], [3, 4], [5, 6]], np.int32))
>>> limbs[:, 1].tolist(), limbs[:, 3].tolist()
([1, 3, 5], [2, 4, 6])
>>> out = np.empty(5, np.float32)
>>> limb_mean(limbs, [4.0, 2.0, 1.0], 2.0, out)
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
ADD_TASK = 1 << 15  # entries per pool task of limb_add


def limb_split(vals, w: float, exps: list[int], xp=np):
    """The limbs of ``vals * w`` (fp64) on the grids ``2^exps[j]`` (coarsest first), as int32 rows: ``rem = v * w``;
    ``q_j = rint(rem * 2^-e_j)``; ``rem -= q_j * 2^e_j`` but after the last. Every product is by a power of two,
    so exact. Twin of kernels/limbs.cu ``limb_split_f32`` / ``limb_split_f64``.

    >>> limb_split(np.array([1.5, -0.25], np.float32), 2.0, [0, -1, -2]).tolist()
    [[3, 0], [0, -1], [0, 0]]
    """
    rem = vals.astype(np.float64) * w
    qs = xp.empty((len(exps), rem.size), dtype=np.int32)
    for j, e in enumerate(exps):
        q = xp.rint(rem * math.ldexp(1.0, -e))
        if j < len(exps) - 1:
            rem = rem - q * math.ldexp(1.0, e)  # exact: q * 2^e is within half a grid step of rem
        qs[j] = q
    return qs


def limb_add(limbs: np.ndarray, idx: np.ndarray | None, qs: np.ndarray) -> None:
    """``limbs[j][idx] += qs[j]`` for every limb j (``idx`` ascending and distinct; ``None``: every element,
    ``qs`` then holds one row of numel per limb). The entries are split into ranges on the pool: distinct
    indices make the ranges' writes disjoint, and int32 sums do not depend on the order.
    """
    parallel_map(lambda c: add_span(limbs, idx, qs, *c), spans(0, qs.shape[1], TASK if idx is None else ADD_TASK))


def limb_mean(limbs: np.ndarray, scales: list[float], total: float, out: np.ndarray) -> None:
    """``out = (limbs[0] * scales[0] + limbs[1] * scales[1] + ...) / total``, each step in fp64 and the last cast
    to ``out``'s dtype, as ``((l0.astype(f64) * s0 + l1.astype(f64) * s1 + ...) / total).astype(out.dtype)``
    computes it; one task per thread, each in blocks of BLOCK elements through two fp64 buffers of its own.
    """
    numel = limbs.shape[1]
    step = -(-numel // (thread_count() * BLOCK)) * BLOCK  # one task per thread, in whole blocks

    def task(span: tuple[int, int]) -> None:
        acc = np.empty(min(BLOCK, span[1] - span[0]), np.float64)
        term = np.empty_like(acc)
        for a in range(span[0], span[1], BLOCK):
            mean_span(limbs, scales, total, out, a, min(span[1], a + BLOCK), acc, term)

    parallel_map(task, spans(0, numel, step))
