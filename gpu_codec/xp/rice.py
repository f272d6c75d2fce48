"""Rice stream decoding: vectorized array code written once for any ``xp`` (NumPy or CuPy), which every backend
runs on its own memory. It validates the stream completely (a :class:`~gpu_codec.errors.PayloadError` on any
inconsistency, work bounded by the stream's length). The encoder is the kernel (kernels/rice.cu) and its NumPy
twin (:mod:`gpu_codec.cpu_fallback.rice`); the stream layout is described there.

>>> from gpu_codec.cpu_fallback.rice import rice_encode
>>> stream, bits = rice_encode(np.array([3, 4, 90, 200], np.uint32), 5)
>>> rice_decode(stream, bits, 5, 4, 256).tolist()
[3, 4, 90, 200]
>>> rice_decode(stream, bits, 5, 4, 200)
Traceback (most recent call last):
...
gpu_codec.errors.PayloadIndexError: Rice stream decodes to index 200, beyond the tensor's 200 elements
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..constants import MAX_K, index_dtype, max_bits
from ..errors import PayloadIndexError, PayloadLayoutError


def _windows(stream: np.ndarray) -> np.ndarray:
    """One unaligned little-endian 8-byte word starting at each byte of ``stream`` (zeros past its end)."""
    padded = np.zeros(stream.size + 8, np.uint8)
    padded[: stream.size] = stream
    return np.ndarray((stream.size + 1,), "<u8", padded, strides=(1,))


def _unpack_fields(windows: np.ndarray, first: int, m: int, k: int) -> np.ndarray:
    """Fields ``first`` to ``first + m`` of k bits each (as :func:`_pack_fields` writes them), as int64: each read
    through the window of its first byte (:func:`_windows`), shifted and masked (k <= 57).

    >>> _unpack_fields(_windows(np.array([213, 1], np.uint8)), 1, 2, 3).tolist()
    [2, 7]
    """
    pos = np.arange(first, first + m, dtype=np.uint64) * np.uint64(k)
    v = windows[(pos >> np.uint64(3)).astype(np.intp)]
    v >>= pos & np.uint64(7)
    v &= np.uint64((1 << k) - 1)
    return v.astype(np.int64)


def _bits_of(stream: Any, xp: Any) -> Any:
    return ((stream[:, None] >> xp.arange(8, dtype=xp.uint8)) & 1).reshape(-1)


def rice_decode(stream: Any, bits: int, k: int, nnz: int, numel: int, xp: Any = np) -> Any:
    """Decode and validate one tensor's stream; returns indices (strictly increasing, < numel): int64, or on NumPy
    the tensor's index dtype (uint32 where every index fits), decoded a chunk of the stream at a time.

    Every check happens before any index is returned: the byte count, zero padding, exactly ``nnz`` ones in
    the unary section with the last one at the last bit, and the last index below ``numel``. Work and memory
    are bounded by the stream's length (at most 8 bytes of scratch per stream bit).
    """
    if not (0 <= k <= MAX_K) or bits < nnz * (k + 1) or bits > max_bits(nnz, numel, k):
        raise PayloadLayoutError(f"Rice stream of {bits} bits cannot hold {nnz} indices of {numel} with k={k}")
    if stream.dtype != np.uint8 or stream.ndim != 1:  # (a buffer of a payload made by hand)
        raise PayloadLayoutError(f"Rice stream is {stream.ndim}-D {stream.dtype}, not bytes")
    if int(stream.size) != -(-bits // 8):
        raise PayloadLayoutError(f"Rice stream is {int(stream.size)} bytes, {bits} bits need {-(-bits // 8)}")
    if nnz == 0:
        return xp.zeros(0, xp.int64)
    if xp is np:
        return _decode_numpy(np.asarray(stream), bits, k, nnz, numel)
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


UNARY_CHUNK = (1 << 14, 1 << 22)  # unary bits unpacked at a time by the NumPy decoder: a 32nd of the section, within
# these bounds (its temporaries are about 17 bytes a decoded entry of one chunk, whatever the stream's length)


def _decode_numpy(stream: np.ndarray, bits: int, k: int, nnz: int, numel: int) -> np.ndarray:
    """:func:`rice_decode` after its size checks, on NumPy: the same checks and errors in the same order, the unary
    section unpacked a chunk at a time and each chunk's entries written straight into the output (in the tensor's
    index dtype), the low fields read as 64-bit words. Entry i, whose unary one is at ``p_i`` in the unary section
    and whose low fields up to it sum to ``L_i``, is ``((p_i - i) << k) + L_i + i``."""
    if bits % 8 and int(stream[-1]) >> (bits % 8):
        raise PayloadLayoutError("Rice stream has non-zero bits after its declared end")
    ustart = nnz * k
    ulen = bits - ustart
    out = np.empty(nnz, index_dtype(numel))
    windows = _windows(stream) if k else None
    found, last_one, low_sum, last = 0, -1, 0, -1
    chunk = min(UNARY_CHUNK[1], max(UNARY_CHUNK[0], ulen // 32))
    for s in range(0, ulen, chunk):
        pos = _unary_ones(stream, ustart + s, ustart + min(ulen, s + chunk))
        m = int(pos.size)
        if not m:
            continue
        if found + m > nnz:  # more codes than entries: count them all, for the message
            found += m
            for t in range(s + chunk, ulen, chunk):
                found += int(_unary_ones(stream, ustart + t, ustart + min(ulen, t + chunk)).size)
            break
        last_one = s + int(pos[-1])
        pos += s - found  # p_i - i, i counted from this chunk's first entry (then less its place in the chunk)
        pos -= np.arange(m, dtype=pos.dtype)
        v = np.left_shift(pos, k, out=pos)
        if k:
            low = np.cumsum(_unpack_fields(windows, found, m, k))
            low += low_sum
            low_sum = int(low[-1])
            v += low
            del low
        v += np.arange(found, found + m, dtype=v.dtype)
        last = int(v[-1])
        if last < numel:  # past the tensor, the index is refused below, once the count is checked
            out[found : found + m] = v
        found += m
        del pos, v
    if found != nnz or last_one != ulen - 1:
        raise PayloadLayoutError(
            f"Rice stream's unary section holds {found} codes, expected {nnz} ending at the last bit"
        )
    if last >= numel:
        raise PayloadIndexError(f"Rice stream decodes to index {last}, beyond the tensor's {numel} elements")
    return out


def _unary_ones(stream: np.ndarray, a: int, b: int) -> np.ndarray:
    """Positions (from ``a``, int64) of the set bits in bits [a, b) of ``stream`` (little-endian bit order)."""
    b0 = a >> 3
    u = np.unpackbits(stream[b0 : (b + 7) >> 3], bitorder="little")[a - 8 * b0 : b - 8 * b0]
    return np.flatnonzero(u.view(np.bool_))  # 0/1 bytes: as bool, NumPy's fast nonzero


MANY_BITS = 1 << 24  # stream bits that rice_decode_many unpacks at once, at most (one byte a bit)


def rice_decode_many(
    streams: list[np.ndarray], bits: list[int], ks: list[int], nnzs: list[int], numels: list[int]
) -> list[np.ndarray] | None:
    """:func:`rice_decode` of each stream on NumPy, at once (streams of small tensors, MANY_BITS bits in all at
    most): the same indices, in the same dtypes; or None where any stream fails any of its checks (each stream's
    :func:`rice_decode` then says which and why), and where the streams hold more bits.

    The streams are joined and unpacked once; every stream's low fields are read through 8-byte windows; the
    ones of the bits left are the unary codes, which must fall, in order, ``nnz`` in each stream's unary section,
    the last at its last bit.

    >>> from gpu_codec.cpu_fallback.rice import rice_encode
    >>> (s1, b1), (s2, b2) = rice_encode(np.array([3, 4, 90, 200]), 5), rice_encode(np.array([7]), 3)
    >>> [x.tolist() for x in rice_decode_many([s1, s2], [b1, b2], [5, 3], [4, 1], [256, 20])]
    [[3, 4, 90, 200], [7]]
    >>> rice_decode_many([s1, s2], [b1, b2], [5, 3], [4, 1], [256, 7]) is None  # (7 is past 7 elements)
    True
    """
    n = len(streams)
    if not n:
        return []
    nbits, k = np.asarray(bits, np.int64), np.asarray(ks, np.int64)
    nnz, numel = np.asarray(nnzs, np.int64), np.asarray(numels, np.int64)
    sizes = np.fromiter((s.size for s in streams), np.int64, n)
    if (k < 0).any() or (k > MAX_K).any() or (numel < nnz).any() or int(nbits.sum()) > MANY_BITS:
        return None
    if (nbits < nnz * (k + 1)).any() or (nbits > nnz * (k + 1) + ((numel - nnz) >> k)).any():
        return None  # (rice_decode's bounds: max_bits)
    if (sizes != -(-nbits // 8)).any() or any(s.dtype != np.uint8 or s.ndim != 1 for s in streams):
        return None
    total = int(nnz.sum())
    joined = np.concatenate(streams) if int(sizes.sum()) else np.zeros(0, np.uint8)
    start = 8 * (np.cumsum(sizes) - sizes)  # each stream's first bit
    tail = nbits % 8
    cut = np.flatnonzero(tail)
    if cut.size and (joined[(start[cut] + nbits[cut]) // 8] >> tail[cut].astype(np.uint8)).any():
        return None  # non-zero bits after a stream's end
    u = np.unpackbits(joined, bitorder="little").view(np.bool_)
    tensor = np.repeat(np.arange(n), nnz)  # each entry's stream
    heads = np.cumsum(nnz) - nnz  # each stream's first entry
    local = np.arange(total, dtype=np.int64) - heads[tensor]  # the entry within its stream
    ke = k[tensor]
    field = start[tensor] + local * ke  # each low field's first bit
    low = np.zeros(total, np.int64)
    if int((nnz * k).sum()):
        u[np.repeat(field - (np.cumsum(ke) - ke), ke) + np.arange(int(ke.sum()))] = False  # (unary ones stay)
        win = _windows(joined)
        v = win[(field >> 3).astype(np.intp)] >> (field & 7).astype(np.uint64)
        low = (v & ((np.uint64(1) << ke.astype(np.uint64)) - np.uint64(1))).astype(np.int64)
    ones = np.flatnonzero(u)
    ustart = start + nnz * k  # each stream's unary section, to start + bits
    if ones.size != total or (total and not ((ones >= ustart[tensor]) & (ones < (start + nbits)[tensor])).all()):
        return None  # (each in its stream's section, as many as its entries: no stream has more or fewer)
    some = np.flatnonzero(nnz)
    if (ones[heads[some] + nnz[some] - 1] != start[some] + nbits[some] - 1).any():
        return None  # a stream's last code does not end at its last bit
    p = ones - ustart[tensor]  # each one's place in its unary section
    q = p.copy()
    q[1:] -= p[:-1] + 1
    q[heads[some]] = p[heads[some]]  # (a stream's first code: from the section's start)
    step = (q << ke) + low + 1  # each index less the one before it (from -1)
    csum = np.cumsum(step)
    idx = csum - np.concatenate(([0], csum))[heads[tensor]] - 1
    if total and (idx[heads[some] + nnz[some] - 1] >= numel[some]).any():
        return None  # an index past its tensor
    out = []
    for a, m, size in zip(heads.tolist(), nnz.tolist(), numel.tolist()):
        out.append(idx[a : a + m].astype(index_dtype(size)) if m else np.zeros(0, np.int64))
    return out
