"""NumPy twin of kernels/rice.cu (Rice coding of ascending flat indices); the validating decoder, array code any
backend runs, is :mod:`gpu_codec.xp.rice`.

Stream layout (see rice.cu): gap l is ``g = idx[l] - idx[l - 1] - 1`` (``idx[-1] = -1``), ``q = g >> k``. The
low section holds the k low bits of every gap at fixed offsets ``l * k``; the unary section, from bit ``n * k``,
holds q zeros then a one per gap. Bits are numbered least significant first within little-endian bytes. Both
sections decode with vectorized array code (the positions of the ones give every q), so the decoder runs the
same on NumPy and CuPy and never loops over entries. On NumPy, encoding and the low fields of decoding work on
bit arrays packed and unpacked by NumPy, in chunks of entries on the thread pool.

>>> idx = np.array([3, 4, 90, 200], np.uint32)
>>> k = rice_param(4, 256); k
5
>>> stream, bits = rice_encode(idx, k)
>>> bits, len(stream)
(29, 4)
>>> from gpu_codec.xp.rice import rice_decode
>>> rice_decode(stream, bits, k, 4, 256).tolist()
[3, 4, 90, 200]
"""

from __future__ import annotations

import math

import numpy as np

# The parameter rule and the length bound are the wire format's (docs/FORMAT.md); re-exported for the twins' users
# (the rule, one home for all); and the bounds of small tensors coded together.
from gpu_codec.constants import MAX_K, TOGETHER_BATCH, TOGETHER_MOST, max_bits, rice_param  # noqa: F401


def gaps(idx: np.ndarray) -> np.ndarray:
    i = np.asarray(idx).astype(np.uint64)
    g = np.empty(i.size, np.uint64)
    if i.size:
        g[0] = i[0]
        g[1:] = i[1:] - i[:-1] - np.uint64(1)
    return g


CHUNK = 1 << 16  # entries per pool task: temporaries stay a few MB whatever the count


def _step() -> int:
    """Entries per encoder chunk: CHUNK rounded down to a multiple of 8 (at least 8), so that every chunk's low fields
    start on a byte."""
    return max(8, CHUNK - CHUNK % 8)


def _deposit(pos: np.ndarray, vals: np.ndarray) -> tuple[int, np.ndarray]:
    """Bit fields ``vals`` (under 64 bits wide) placed at ascending, disjoint bit positions ``pos``, as uint64
    words from word ``pos[0] >> 6`` on: (first word, words). Fields never overlap, so summing them is OR-ing."""
    w, sh = pos >> np.uint64(6), pos & np.uint64(63)
    first = int(w[0])
    lw = (w - np.uint64(first)).astype(np.int64)
    words = np.zeros(int(lw[-1]) + 2, np.uint64)
    starts = np.flatnonzero(np.concatenate(([True], lw[1:] != lw[:-1])))
    words[lw[starts]] += np.add.reduceat(vals << sh, starts)
    spill = (vals >> np.uint64(1)) >> (np.uint64(63) - sh)  # the bits past the word's end (a shift by 64 - sh)
    words[lw[starts] + 1] += np.add.reduceat(spill, starts)
    return first, words


UNARY_DENSE = 32  # a chunk's unary bits are set in a bit array (one byte a bit) where they are at most this many a
# entry; sparser ones (long gaps) are deposited into 64-bit words, so temporaries stay bounded for any gaps


def _width(k: int) -> int:
    """Bits of the narrowest unsigned integer that holds k bits."""
    return next(w for w in (8, 16, 32, 64) if w >= k)


def _pack_fields(v: np.ndarray, k: int) -> np.ndarray:
    """The k low bits of each of ``v`` (uint64, below 2^k) side by side, least significant first, as bytes
    (little-endian bit order). Groups of g fields whose g·k bits are whole bytes of one 64-bit word are OR-ed
    into that word (g shifted columns), and its low bytes kept; other widths go through NumPy's bit unpacking.

    >>> _pack_fields(np.array([5, 2, 7], np.uint64), 3).tolist()  # 101 010 111, from bit 0 up
    [213, 1]
    >>> v = np.arange(41, dtype=np.uint64) * np.uint64(2654435761)  # against bit-by-bit packing, both paths:
    >>> def bitwise(x, k):
    ...     return np.packbits(((x[:, None] >> np.arange(k, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8).ravel(),
    ...                        bitorder="little")
    >>> all(np.array_equal(_pack_fields(v % np.uint64(1 << k), k), bitwise(v, k)) for k in (1, 6, 8, 9, 13, 40))
    True
    """
    g = 8 // math.gcd(k, 8)  # fields in a group of whole bytes
    if g * k > 64:
        w = _width(k)
        b = np.unpackbits(v.astype(f"<u{w // 8}").view(np.uint8), bitorder="little").reshape(-1, w)
        return np.packbits(b[:, :k].ravel() if k < w else b.ravel(), bitorder="little")
    m = v.size
    rows = -(-m // g)
    cols = np.zeros(rows * g, np.uint64)
    cols[:m] = v
    cols = cols.reshape(rows, g)
    word = cols[:, 0].copy()
    for j in range(1, g):
        word |= cols[:, j] << np.uint64(j * k)
    return word.view(np.uint8).reshape(rows, 8)[:, : g * k // 8].ravel()[: -(-(m * k) // 8)]


def rice_encode(idx: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """(stream bytes as uint8, bit count) for strictly increasing indices ``idx`` with parameter ``k``.

    Chunks of entries (:func:`_step`: a multiple of 8, so each chunk's low fields are whole bytes) are coded on the
    pool: the low fields packed by :func:`_pack_fields`, the unary codes set in a bit array and packed
    (or, where the gaps are long, deposited into 64-bit words); neighbouring chunks' unary bits may share a byte,
    so the pieces are OR-ed in chunk order. The bytes are the same for any chunking.
    """
    from .parallel import parallel_map, spans

    i = np.asarray(idx)
    n = i.size
    if n == 0:
        return np.zeros(0, np.uint8), 0
    kk = np.uint64(k)
    chunks = spans(0, n, _step())

    def chunk_gaps(a: int, b: int) -> np.ndarray:
        g = i[a:b].astype(np.uint64)
        prev = np.empty(b - a, np.uint64)
        prev[0] = np.uint64(int(i[a - 1]) + 1) if a else np.uint64(0)
        prev[1:] = g[:-1] + np.uint64(1)
        return g - prev

    qsum = parallel_map(lambda c: int((chunk_gaps(*c) >> kk).sum()), chunks)
    bits = n * k + sum(qsum) + n
    ustart = n * k
    uoff = np.concatenate(([0], np.cumsum(np.asarray(qsum, np.int64) + np.diff([a for a, _ in chunks] + [n]))))

    def code(j: int) -> list[tuple[int, np.ndarray]]:
        """(first byte, bytes) of chunk j's low fields and unary codes."""
        a, b = chunks[j]
        g = chunk_gaps(a, b)
        out = [(a * k // 8, _pack_fields(g & np.uint64((1 << k) - 1), k))] if k else []
        first = ustart + int(uoff[j])  # the chunk's first unary bit
        q = g >> kk
        q += np.uint64(1)
        ones = np.cumsum(q, dtype=np.int64)  # the unary bits set, from the chunk's first: at most 2^40 each
        ones += first % 8 - 1  # every cumulative count is at least 1
        span = int(ones[-1]) + 1
        if span <= UNARY_DENSE * (b - a):
            u = np.zeros(span, np.bool_)
            u[ones] = True
            out.append((first // 8, np.packbits(u, bitorder="little")))
        else:
            ones += first - first % 8
            w, words = _deposit(ones.astype(np.uint64), np.ones(b - a, np.uint64))
            out.append((w * 8, words.view(np.uint8)))
        return out

    stream = np.zeros(-(-bits // 8) + 16, np.uint8)  # word deposits may run up to two words past the end
    for pieces in parallel_map(code, range(len(chunks))):
        for first, piece in pieces:  # neighbouring chunks may share a byte: OR in chunk order
            stream[first : first + piece.size] |= piece
    return stream[: -(-bits // 8)].copy(), bits


MANY_MOST, MANY_BATCH = TOGETHER_MOST, TOGETHER_BATCH  # (a tensor coded with others, at most; a batch, at most)


def rice_encode_many(indices: list, ks: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """:func:`rice_encode` of each of ``indices`` with its parameter of ``ks``: (streams, bit counts), the same
    bytes. Tensors of at most MANY_MOST entries are coded together, in batches of at most MANY_BATCH entries: each
    stream laid out from its own byte of one bit array (one byte a bit), every low field and unary one of the
    batch set by a few array operations, then the array packed once and cut. A tensor of more entries, or whose
    gaps are long for its k (more than UNARY_DENSE unary bits an entry), is coded alone.

    >>> streams, bits = rice_encode_many([np.array([3, 4, 90, 200], np.uint32), np.array([7], np.uint32)], [5, 2])
    >>> bits, [s.tolist() for s in streams] == [rice_encode(np.array([3, 4, 90, 200]), 5)[0].tolist(),
    ...                                         rice_encode(np.array([7]), 2)[0].tolist()]
    ([29, 4], True)
    """
    n = len(indices)
    streams: list = [None] * n
    bits: list = [0] * n
    batch: list[int] = []
    held = 0
    for t, size in enumerate(map(_size, indices)):
        if size > MANY_MOST:
            streams[t], bits[t] = rice_encode(indices[t], ks[t])
            continue
        if held + size > MANY_BATCH:
            _encode_batch(indices, ks, batch, streams, bits)
            batch, held = [], 0
        batch.append(t)
        held += size
    if batch:
        _encode_batch(indices, ks, batch, streams, bits)
    return streams, bits


def _size(a: np.ndarray) -> int:
    return int(np.asarray(a).size)


def _encode_batch(indices: list, ks: list[int], batch: list[int], streams: list, bits: list) -> None:
    """:func:`rice_encode_many` of tensors ``batch`` (their streams and bit counts written into ``streams`` and
    ``bits``)."""
    parts = [indices[t] for t in batch]
    counts = np.fromiter(map(_size, parts), np.int64, len(parts))
    k = np.asarray([ks[t] for t in batch], np.int64)
    total = int(counts.sum())
    if not total:
        for t in batch:
            streams[t], bits[t] = np.zeros(0, np.uint8), 0
        return
    i = np.concatenate(parts).astype(np.uint64, copy=False)  # (uint32 and uint64 parts: uint64)
    heads = np.cumsum(counts) - counts  # each tensor's first entry (its end, for an empty one)
    tensor = np.repeat(np.arange(len(parts)), counts)  # each entry's tensor
    g = np.empty(total, np.uint64)  # each gap: idx - previous - 1 (a tensor's first: idx)
    g[1:] = i[1:] - i[:-1] - np.uint64(1)
    some = heads[counts > 0]
    g[some] = i[some]
    ke = k[tensor]  # each entry's k
    q1 = (g >> ke.astype(np.uint64)).astype(np.int64) + 1  # each unary code's bits: q zeros, then a one
    ones = np.cumsum(q1)  # (gaps are below 2^40: no overflow)
    before = np.concatenate(([0], ones))[heads]  # unary bits of the batch before each tensor's
    unary = np.concatenate(([0], ones))[heads + counts] - before
    long = unary > UNARY_DENSE * counts  # (long gaps for their k: coded alone, their unary bits deposited)
    if long.any():
        for j in np.flatnonzero(long).tolist():
            streams[batch[j]], bits[batch[j]] = rice_encode(parts[j], ks[batch[j]])
        _encode_batch(indices, ks, [t for t, x in zip(batch, long.tolist()) if not x], streams, bits)
        return
    nbits = counts * k + unary
    nbytes = -(-nbits // 8)
    start = 8 * (np.cumsum(nbytes) - nbytes)  # each stream's first bit in the array
    u = np.zeros(int(8 * nbytes.sum()), np.bool_)
    u[(start + counts * k - before)[tensor] + ones - 1] = True  # each one: after its tensor's low fields
    lbits = int(ke.sum())
    if lbits:  # each low field's bits, least significant first, from its tensor's start + its entry x k
        field = start[tensor] + (np.arange(total, dtype=np.int64) - heads[tensor]) * ke  # each field's first bit
        shift = np.arange(lbits, dtype=np.int64) - np.repeat(np.cumsum(ke) - ke, ke)  # each bit's place in it
        bit = (np.repeat(g, ke) >> shift.astype(np.uint64)) & np.uint64(1)
        u[np.repeat(field, ke) + shift] = bit.astype(np.bool_)  # (zeros too: no unary bit lies there)
    packed = np.packbits(u, bitorder="little")
    firsts, sizes, counted = (start // 8).tolist(), nbytes.tolist(), nbits.tolist()
    for j, t in enumerate(batch):
        streams[t], bits[t] = packed[firsts[j] : firsts[j] + sizes[j]], counted[j]
