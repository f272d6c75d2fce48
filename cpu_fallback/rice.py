"""NumPy twin of kernels/rice.cu (Rice coding of ascending flat indices) and the validating decoder.

Stream layout (see rice.cu): gap l is ``g = idx[l] - idx[l - 1] - 1`` (``idx[-1] = -1``), ``q = g >> k``. The
low section holds the k low bits of every gap at fixed offsets ``l * k``; the unary section, from bit ``n * k``,
holds q zeros then a one per gap. Bits are numbered least significant first within little-endian bytes. Both
sections decode with vectorized array code (the positions of the ones give every q), so the decoder runs the
same on NumPy and CuPy and never loops over entries.

>>> idx = np.array([3, 4, 90, 200], np.uint32)
>>> k = rice_param(4, 256); k
5
>>> stream, bits = rice_encode(idx, k)
>>> bits, len(stream)
(29, 4)
>>> rice_decode(stream, bits, k, 4, 256).tolist()
[3, 4, 90, 200]
>>> rice_decode(stream, bits, k, 4, 200)
Traceback (most recent call last):
...
gpu_codec.errors.PayloadIndexError: Rice stream decodes to index 200, beyond the tensor's 200 elements
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_K = 40  # gaps are < 2^40 (the format's element limit)
_LN2 = math.log(2.0)


def rice_param(nnz: int, numel: int) -> int:
    """The Rice parameter for ``nnz`` kept indices among ``numel``: the largest k with 2^k <= ln2 x mean gap.

    For geometric gaps of mean m this is the optimal power-of-two Golomb parameter (about 8.1 bits per index
    at 1% density, where the entropy is about 8.08).

    >>> rice_param(1, 100), rice_param(100, 10_000), rice_param(10, 10), rice_param(0, 5)
    (6, 6, 0, 0)
    """
    if nnz <= 0 or numel <= nnz:
        return 0
    mean = (numel - nnz) / nnz
    x = mean * _LN2
    if x < 2.0:
        return 0
    return min(MAX_K, math.floor(math.log2(x)))


def max_bits(nnz: int, numel: int, k: int) -> int:
    """An upper bound on the stream length: the gaps add up to at most ``numel - nnz``."""
    return nnz * (k + 1) + (max(0, numel - nnz) >> k)


def gaps(idx: np.ndarray) -> np.ndarray:
    i = np.asarray(idx).astype(np.uint64)
    g = np.empty(i.size, np.uint64)
    if i.size:
        g[0] = i[0]
        g[1:] = i[1:] - i[:-1] - np.uint64(1)
    return g


def rice_encode(idx: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """(stream bytes as uint8, bit count) for strictly increasing indices ``idx`` with parameter ``k``."""
    g = gaps(idx)
    n = g.size
    q = (g >> np.uint64(k)).astype(np.int64)
    ulen = int(q.sum()) + n
    bits = n * k + ulen
    b = np.zeros(bits, np.uint8)
    if k:
        b[: n * k] = ((g[:, None] >> np.arange(k, dtype=np.uint64)) & np.uint64(1)).reshape(-1)
    b[n * k + np.cumsum(q + 1) - 1] = 1
    out = np.packbits(b, bitorder="little")
    return out, bits


def _bits_of(stream: Any, xp: Any) -> Any:
    return ((stream[:, None] >> xp.arange(8, dtype=xp.uint8)) & 1).reshape(-1)


def rice_decode(stream: Any, bits: int, k: int, nnz: int, numel: int, xp: Any = np) -> Any:
    """Decode and validate one tensor's stream; returns int64 indices (strictly increasing, < numel).

    Every check happens before any index is returned: the byte count, zero padding, exactly ``nnz`` ones in
    the unary section with the last one at the last bit, and the last index below ``numel``. Work and memory
    are bounded by the stream's length (at most 8 bytes of scratch per stream bit).
    """
    from gpu_codec.errors import PayloadIndexError, PayloadLayoutError

    if not (0 <= k <= MAX_K) or bits < nnz * (k + 1) or bits > max_bits(nnz, numel, k):
        raise PayloadLayoutError(f"Rice stream of {bits} bits cannot hold {nnz} indices of {numel} with k={k}")
    if int(stream.size) != -(-bits // 8):
        raise PayloadLayoutError(f"Rice stream is {int(stream.size)} bytes, {bits} bits need {-(-bits // 8)}")
    if nnz == 0:
        return xp.zeros(0, xp.int64)
    b = _bits_of(stream, xp)
    if bool(b[bits:].any()):
        raise PayloadLayoutError("Rice stream has non-zero bits after its declared end")
    ustart = nnz * k
    ones = xp.flatnonzero(b[ustart:bits])
    if int(ones.size) != nnz or int(ones[-1]) != bits - ustart - 1:
        raise PayloadLayoutError(
            f"Rice stream's unary section holds {int(ones.size)} codes, expected {nnz} ending at the last bit"
        )
    q = xp.diff(ones, prepend=-1) - 1
    g = q.astype(xp.int64) << k
    if k:
        low = b[:ustart].reshape(nnz, k).astype(xp.int64) << xp.arange(k, dtype=xp.int64)
        g = g + low.sum(axis=1)
    idx = xp.cumsum(g + 1) - 1
    last = int(idx[-1])
    if last >= numel:
        raise PayloadIndexError(f"Rice stream decodes to index {last}, beyond the tensor's {numel} elements")
    return idx
