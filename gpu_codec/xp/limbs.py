"""The steps of the aggregator's passes over its integer limbs (:mod:`gpu_codec.aggregate`), written once for any
``xp`` (NumPy or CuPy) and run by every backend on its own memory: element-wise int32 sums of distinct entries,
fp64 sums per element in limb order, and the largest magnitude from the bits (no float operation a GPU array
module's kernels could flush to zero). The NumPy twins split them over the thread pool
(:mod:`gpu_codec.cpu_fallback.limbs`).
"""

from __future__ import annotations

import numpy as np


def add_span(limbs, idx, qs, a: int, b: int) -> None:
    """Entries [a, b) of :func:`limb_add`, with the arrays' own module (NumPy or CuPy): ``limbs[j][idx[a:b]] +=
    qs[j, a:b]`` for every limb j (``idx`` None: elements a to b)."""
    ii = None if idx is None else idx[a:b].astype(np.intp)  # (the array modules index with intp: converted once)
    for j in range(limbs.shape[0]):
        if ii is None:
            limbs[j, a:b] += qs[j, a:b]
        else:
            row = limbs[j]  # (a row, then its elements: a third faster than indexing both at once)
            row[ii] += qs[j, a:b]


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
