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

from .parallel import parallel_map, spans, thread_count

BLOCK = 1 << 18  # elements per block of the mean (fewer, longer calls: 2^18 took 20 % less time than 2^16 in
# one thread at 2^24, on an AMD EPYC with AVX-512, though its two fp64 buffers are 4 MiB)
TASK = 1 << 20  # elements per pool task of a dense limb_add
ADD_TASK = 1 << 15  # entries per pool task of limb_add


def add_span(limbs, idx, qs, a: int, b: int) -> None:
    """Entries [a, b) of :func:`limb_add`, with the arrays' own module (NumPy or CuPy): ``limbs[j][idx[a:b]] +=
    qs[j, a:b]`` for every limb j (``idx`` None: elements a to b)."""
    for j in range(limbs.shape[0]):
        if idx is None:
            limbs[j, a:b] += qs[j, a:b]
        else:
            limbs[j, idx[a:b]] += qs[j, a:b]


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


def abs_max(vals, to_host=np.asarray) -> float:
    """``max |v|`` of finite float values on the host, from their bits: the sign bit cleared and the largest
    magnitude found as an unsigned integer (IEEE order; ``to_host`` copies the one word back), so no float operation
    runs (a GPU array module's own
    float kernels flush subnormals to zero).

    >>> abs_max(np.array([-3.0, 2.0, 1e-45], np.float32)), abs_max(np.array([], np.float64))
    (3.0, 0.0)
    """
    if vals.size == 0:
        return 0.0
    return from_abs_bits(to_host(abs_max_bits(vals)), vals.dtype)


def abs_max_bits(vals):
    """The bits of :func:`abs_max` of non-empty ``vals``, left where ``vals`` is (a 0-d unsigned array of their
    width), for a caller that reads many at once and turns each into the value with :func:`from_abs_bits`."""
    ut = np.uint64 if vals.dtype.itemsize == 8 else np.uint32
    return (vals.view(ut) & ut(np.iinfo(ut).max >> 1)).max()


def from_abs_bits(bits, dtype) -> float:
    """The float of ``dtype`` whose bits (a host integer or array of one) :func:`abs_max_bits` gave."""
    ut = np.uint64 if np.dtype(dtype).itemsize == 8 else np.uint32
    return float(np.asarray(bits).astype(ut).reshape(1).view(dtype)[0])


def limb_add(limbs: np.ndarray, idx: np.ndarray | None, qs: np.ndarray) -> None:
    """``limbs[j][idx] += qs[j]`` for every limb j (``idx`` ascending and distinct; ``None``: every element,
    ``qs`` then holds one row of numel per limb). The entries are split into ranges on the pool: distinct
    indices make the ranges' writes disjoint, and int32 sums do not depend on the order.
    """
    parallel_map(lambda c: add_span(limbs, idx, qs, *c), spans(0, qs.shape[1], TASK if idx is None else ADD_TASK))


def mean_span(limbs, scales: list[float], total: float, out, a: int, b: int, acc, term) -> None:
    """Elements [a, b) of :func:`limb_mean`, with the arrays' own module (NumPy or CuPy), through two fp64 buffers
    ``acc`` and ``term`` of at least b - a elements: the same steps, so the same bytes, for every backend."""
    s, t = acc[: b - a], term[: b - a]
    s[...] = limbs[0, a:b]  # int32 -> fp64: exact (a copy casts faster than the ufunc's own casting)
    s *= scales[0]  # a power of two: exact
    for j in range(1, limbs.shape[0]):
        t[...] = limbs[j, a:b]
        t *= scales[j]
        s += t
    s /= total
    out[a:b] = s


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
