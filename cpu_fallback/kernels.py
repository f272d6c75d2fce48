"""NumPy twins of every kernel in kernels/*.cu: same name, same arguments, same result to the byte.

Where a kernel takes a table of device addresses (``new_ptrs``, ``out_ptrs``, ...), its twin takes the list of
arrays those addresses point to (``None`` for a null address). Scalars and small tables are the same NumPy
arrays the GPU wrapper (gpu_codec/backends/kernels.py) uploads. Outputs are written into the arrays passed in, as
the kernels do. These twins are what the emulated and GPU backends are tested against; the NumPy backend itself
runs the faster composition in :mod:`cpu_fallback.select`, which gives the same bytes.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from gpu_codec.constants import CHUNK_SCAN_PART, CHUNK_SCAN_THREADS
from gpu_codec.xp.finite import all_finite

from .elementwise import (
    DT_F32,
    DT_F64,
    array_sizes,
    decoded,
    delta,
    load_f32,
    score_key,
    store_from_f32,
    tensor_delta_scores,
)
from .parallel import parallel_map, spans

BLOCK = 256
ITEMS = 16
CHUNK = BLOCK * ITEMS
U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)


def _chunk_ids(numel: int) -> np.ndarray:
    return np.arange(numel, dtype=np.int64) // CHUNK


def score_keys(
    nt, chunk_start, elem_off, numel, dtypes, new_ptrs, base_ptrs, res_ptrs, score_ptrs, score_dtypes, crit, keys, err
):
    for t in range(int(nt)):
        n = int(numel[t])
        if n == 0:
            continue
        _, _, s, bad = tensor_delta_scores(t, new_ptrs, base_ptrs, res_ptrs, dtypes, crit, score_ptrs, score_dtypes)
        off = int(elem_off[t])
        keys[off : off + n] = score_key(s)
        if bad:
            err[0] = min(int(err[0]), t)


def radix_hist(nt, chunk_start, elem_off, numel, seg_of, keys, state, shift, hist):
    shift = int(shift)
    for t in range(int(nt)):
        n = int(numel[t])
        s = int(seg_of[t])
        if n == 0 or int(state[2 * s + 1]) == 0:
            continue
        k = keys[int(elem_off[t]) : int(elem_off[t]) + n]
        if shift != 24:
            prefix = np.uint32(int(state[2 * s]))
            k = k[(k >> np.uint32(shift + 8)) == (prefix >> np.uint32(shift + 8))]
        digits = (k >> np.uint32(shift)) & np.uint32(255)
        hist[256 * s : 256 * (s + 1)] += np.bincount(digits, minlength=256).astype(np.uint64)


def radix_pick(nseg, shift, hist, state):
    for s in range(int(nseg)):
        h = hist[256 * s : 256 * (s + 1)]
        k_rem = int(state[2 * s + 1])
        if k_rem != 0:
            prefix = int(state[2 * s])
            for b in range(255, -1, -1):
                c = int(h[b])
                if k_rem <= c:
                    prefix |= b << int(shift)
                    break
                k_rem -= c
            state[2 * s] = prefix
            state[2 * s + 1] = k_rem
        h[:] = 0


def chunk_count(nt, chunk_start, elem_off, numel, seg_of, keys, state, cnt):
    for t in range(int(nt)):
        n = int(numel[t])
        if n == 0:
            continue
        T = np.uint32(int(state[2 * int(seg_of[t])]))
        k = keys[int(elem_off[t]) : int(elem_off[t]) + n]
        ids = _chunk_ids(n)
        nch = int(chunk_start[t + 1] - chunk_start[t])
        c0 = int(chunk_start[t])
        cnt[2 * c0 : 2 * (c0 + nch) : 2] = np.bincount(ids[k > T], minlength=nch)[:nch]
        cnt[2 * c0 + 1 : 2 * (c0 + nch) : 2] = np.bincount(ids[k == T], minlength=nch)[:nch]


def _tensor_of_chunk(chunk_start: np.ndarray, nt: int, nchunks: int) -> np.ndarray:
    return np.searchsorted(np.asarray(chunk_start[:nt]), np.arange(nchunks), side="right") - 1


def _scan_blocks(nchunks: int) -> tuple[np.ndarray, np.ndarray]:
    """First and end chunk of every chunk-scan block."""
    c0 = np.arange(-(-nchunks // CHUNK_SCAN_THREADS), dtype=np.int64) * CHUNK_SCAN_THREADS
    return c0, np.minimum(c0 + CHUNK_SCAN_THREADS, nchunks)


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x, dtype=np.uint64)]).astype(np.uint64)


def _seg_of_chunks(nseg: int, seg_first_chunk, chunks: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(seg_first_chunk[:nseg]), chunks, side="right") - 1


def chunk_scan_reduce(nchunks, nseg, seg_first_chunk, cnt, part):
    nchunks, nseg = int(nchunks), int(nseg)
    c0, c1 = _scan_blocks(nchunks)
    sfc = np.asarray(seg_first_chunk[:nseg], dtype=np.int64)
    start = np.maximum(c0, sfc[_seg_of_chunks(nseg, sfc, c1 - 1)])
    E = _prefix(cnt[1 : 2 * nchunks : 2])
    part[0 : CHUNK_SCAN_PART * c0.size : CHUNK_SCAN_PART] = E[c1] - E[start]


def chunk_scan_eq(nt, nchunks, chunk_start, nseg, seg_first_chunk, state, cnt, part, eq_base, out_base):
    nt, nchunks, nseg = int(nt), int(nchunks), int(nseg)
    gt = cnt[0 : 2 * nchunks : 2].astype(np.uint64)
    eq = cnt[1 : 2 * nchunks : 2].astype(np.uint64)
    sfc = np.asarray(seg_first_chunk[:nseg], dtype=np.int64)
    seg = _seg_of_chunks(nseg, sfc, np.arange(nchunks))
    E = _prefix(eq)
    eqb = E[:nchunks] - E[sfc[seg]]
    eq_base[:nchunks] = eqb
    take = np.asarray(state)[1::2][seg]
    rest = np.where(take > eqb, take - eqb, 0).astype(np.uint64)
    kept = gt + np.minimum(rest, eq)
    out_base[:nchunks] = kept
    K = _prefix(kept)
    c0, c1 = _scan_blocks(nchunks)
    cs = np.asarray(chunk_start, dtype=np.int64)
    last_first = np.maximum(c0, cs[_tensor_of_chunk(cs, nt, nchunks)[c1 - 1]])
    m = CHUNK_SCAN_PART * c0.size
    part[1:m:CHUNK_SCAN_PART] = K[c1] - K[c0]
    part[2:m:CHUNK_SCAN_PART] = K[c1] - K[last_first]


def chunk_scan_out(nt, nchunks, chunk_start, part, out_base, tensor_counts):
    nt, nchunks = int(nt), int(nchunks)
    ob = _prefix(out_base[:nchunks])
    out_base[: nchunks + 1] = ob
    cs = np.asarray(chunk_start, dtype=np.int64)
    tensor_counts[:nt] = ob[cs[1 : nt + 1]] - ob[cs[:nt]]


def _chunk_write(
    nt,
    chunk_start,
    elem_off,
    numel,
    dtypes,
    seg_of,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    res_out_ptrs,
    qmode,
    keys,
    state,
    eq_base,
    out_base,
    out_idx,
    vals32,
    vals64,
):
    for t in range(int(nt)):
        n = int(numel[t])
        if n == 0:
            continue
        s = int(seg_of[t])
        T = np.uint32(int(state[2 * s]))
        take = int(state[2 * s + 1])
        k = keys[int(elem_off[t]) : int(elem_off[t]) + n]
        ids = _chunk_ids(n)
        c0 = int(chunk_start[t])
        gt = k > T
        eq = k == T
        # rank of each equal key among the equal keys of its segment
        eq_cum = np.cumsum(eq, dtype=np.int64) - eq
        chunk_first = np.arange(0, n, CHUNK)
        eq_in_chunk_before = eq_cum - eq_cum[chunk_first][ids]
        eq_rank = np.asarray(eq_base, dtype=np.int64)[c0 + ids] + eq_in_chunk_before
        sel = gt | (eq & (eq_rank < take))
        sel_cum = np.cumsum(sel, dtype=np.int64) - sel
        pos = np.asarray(out_base, dtype=np.int64)[c0 + ids] + (sel_cum - sel_cum[chunk_first][ids])
        where = np.flatnonzero(sel)
        dt = int(dtypes[t])
        d = delta(new_ptrs[t], base_ptrs[t], res_ptrs[t], dt)
        slots = pos[where]
        out_idx[slots] = where.astype(out_idx.dtype)
        if dt == DT_F64:
            vals64[slots] = d[where]
        else:
            vals32[slots] = d[where]
        ro = res_out_ptrs[t]
        if ro is not None:
            r = d.copy()
            r[where] = d[where] - decoded(d[where], int(qmode))
            ro[:] = r


def chunk_write_u32(*args):
    _chunk_write(*args)


def chunk_write_u64(*args):
    _chunk_write(*args)


SCATTER_CHUNK = 1 << 16  # entries per pool task of the scatter twin


def _first_bad(idx, vals, a, numel, chunk):
    """Lowest entry in [s, e) whose index is out of range or not above the previous one, or whose value is not
    finite (None if there is none)."""
    s, e = chunk
    i = idx[s:e]
    bad = i >= i.dtype.type(numel) if numel <= np.iinfo(i.dtype).max else np.zeros(i.size, bool)
    bad[1:] |= i[1:] <= i[:-1]
    if s > a:
        bad[0] |= i[0] <= idx[s - 1]
    bad |= ~np.isfinite(vals[s:e])
    first = np.flatnonzero(bad)
    return s + int(first[0]) if first.size else None


def _written(out, ii, v, dt, mode):
    """What the scatter writes at elements ``ii`` of ``out``: v (mode 0) or the element plus v (mode 1), in fp32
    (fp64 for fp64 tensors) rounded to the storage; IEEE overflow to inf, as on the device (the caller checks)."""
    with np.errstate(over="ignore"):
        if dt == DT_F64 or (dt == DT_F32 and mode == 1):
            if mode != 1:
                return v
            w = out.take(ii.astype(np.intp, copy=False))  # (in place: one temporary, the same sums; NumPy 1.x's
            # take refuses uint64 indices)
            w += v
            return w
        return store_from_f32(load_f32(out[ii], dt) + v if mode == 1 else v, dt)


def _apply(out, idx, vals, dt, mode, chunk):
    s, e = chunk
    ii = idx[s:e]
    out[ii] = _written(out, ii, vals[s:e], dt, mode)


def _scatter_checked(a, b, numel, dt, out, idx, vals32, vals64, mode):
    i = np.asarray(idx[a:b]).astype(np.uint64)
    bad = i >= np.uint64(numel)
    bad[1:] |= i[1:] <= i[:-1]
    bad |= ~np.isfinite(vals64[a:b] if dt == DT_F64 else vals32[a:b])
    ok = np.flatnonzero(~bad)
    ii = i[ok].astype(np.int64)
    out[ii] = _written(out, ii, (vals64 if dt == DT_F64 else vals32)[a:b][ok], dt, mode)


def _scatter(nt, total, ent_start, numel, out_dtypes, out_ptrs, idx, vals32, vals64, mode, err):
    """Entries whose index is in range, increasing and whose value is finite are written; ``err`` gets the
    lowest other entry. Tensors with no such entry run in chunks on the thread pool (the indices are distinct,
    so the chunks touch distinct elements); the others run in entry order, as one piece."""
    nt, total, mode = int(nt), int(total), int(mode)
    es = np.asarray(ent_start, dtype=np.uint64)
    for t in range(nt):
        a, b = int(es[t]), int(es[t + 1])
        if b <= a:
            continue
        n, dt, out = int(numel[t]), int(out_dtypes[t]), out_ptrs[t]
        vals = vals64 if dt == DT_F64 else vals32
        chunks = spans(a, b, SCATTER_CHUNK)
        bad = [f for f in parallel_map(partial(_first_bad, idx, vals, a, n), chunks) if f is not None]
        if bad:
            err[0] = min(int(err[0]), *bad)
            _scatter_checked(a, b, n, dt, out, idx, vals32, vals64, mode)
        else:
            parallel_map(partial(_apply, out, idx, vals, dt, mode), chunks)


ONTO_BLOCK = 1 << 20  # elements per pool task of scatter_onto: copied, then its entries applied while in cache
FEW_CHUNKS = 4  # entry chunks that scatter_onto checks in the calling thread


def _bad_entries(idx, v, numel):
    """The lowest entry whose index is out of range [0, numel) or not above the previous one, or whose value is not
    finite; None if there is none."""
    chunks = spans(0, int(idx.size), SCATTER_CHUNK)
    check = partial(_first_bad, idx, v, 0, numel)
    # (a few chunks take less time in this thread than the pool's hand-over)
    found = map(check, chunks) if len(chunks) <= FEW_CHUNKS else parallel_map(check, chunks)
    bad = [f for f in found if f is not None]
    return min(bad) if bad else None


def _onto_blocks(out, sources, start, stop, dt, idx, v, sizes=None):
    """``out[start:stop]`` = the ``sources`` end to end, and the entries ``idx`` (checked: ascending, within
    [start, stop)) added to it, in blocks of ONTO_BLOCK elements on the thread pool, each block's entries applied
    while the block is in cache; whether every sum written is finite. ``sizes``: the sources' sizes, where known."""
    if sizes is None:
        sizes = array_sizes(sources)
    ends = np.cumsum(sizes) + start
    begins = ends - sizes
    firsts = np.arange(start, stop, ONTO_BLOCK, dtype=np.int64)
    lasts = np.minimum(firsts + ONTO_BLOCK, stop)
    n = int(idx.size)
    edges = np.searchsorted(idx, firsts.astype(idx.dtype)).tolist() + [n]  # each block's entries
    src_lo = np.searchsorted(ends, firsts, side="right").tolist()  # the sources each block copies from
    src_hi = np.searchsorted(begins, lasts, side="left").tolist()
    begins, ends = begins.tolist(), ends.tolist()

    def block(j: int) -> bool:
        s, e = int(firsts[j]), int(lasts[j])
        o = out[s:e]
        lo, hi = src_lo[j], src_hi[j]
        parts = sources[lo:hi]
        if begins[lo] < s:
            parts[0] = parts[0][s - begins[lo] :]
        if ends[hi - 1] > e:
            parts[-1] = parts[-1][: parts[-1].size - (ends[hi - 1] - e)]
        if len(parts) == 1:
            np.copyto(o, parts[0], casting="no")
        else:
            np.concatenate(parts, out=o, casting="no")
        a, b = edges[j], edges[j + 1]
        if a == b:
            return True
        ii = np.subtract(idx[a:b], s, dtype=np.intp)  # (NumPy indexes with intp: converted once, not twice)
        o[ii] = w = _written(o, ii, v[a:b], dt, 1)
        return all_finite(w, dt)

    return all(parallel_map(block, range(firsts.size)))


def scatter_onto(out, base, start, stop, dt, numel, idx, vals):
    """``out[start:stop] = base[start:stop]``, then the entries ``idx`` (ascending, every one in [start, stop))
    added to it as :func:`scatter_u32` mode 1 adds them, to the byte; in blocks of ONTO_BLOCK elements on the
    thread pool, each block's entries applied while the block is in cache (a copy of the whole base first, then
    the scatter, would read and write every kept entry's cache line from memory again).

    Returns ``(bad, finite)``: the lowest entry (counted from 0) whose index is out of range or not above the
    previous one, or whose value is not finite (``None`` if none; then nothing is written), and whether every
    sum written is finite in the tensor's dtype.

    >>> out, base = np.empty(6, np.float32), np.arange(6, dtype=np.float32)
    >>> scatter_onto(out, base, 0, 6, 0, 6, np.array([1, 4], np.uint32), np.array([10, 20], np.float32))
    (None, True)
    >>> out.tolist()
    [0.0, 11.0, 2.0, 3.0, 24.0, 5.0]
    >>> scatter_onto(out, base, 0, 6, 0, 6, np.array([4, 1], np.uint32), np.array([1, 1], np.float32))
    (1, True)
    """
    n = int(idx.size)
    if n and (int(idx[0]) < start or int(idx[-1]) >= stop):
        raise ValueError(f"entries [{int(idx[0])}, {int(idx[-1])}] are not within the range [{start}, {stop})")
    v = vals if dt == DT_F64 else vals.astype(np.float32, copy=False)
    bad = _bad_entries(idx, v, numel)
    if bad is not None:
        return bad, True
    return None, _onto_blocks(out, [base[start:stop]], start, stop, dt, idx, v)


def scatter_onto_bases(out, bases, dt, idx, vals):
    """``out`` = the ``bases`` end to end (flat, of ``out``'s dtype, their sizes summing to ``out.size``: a run
    of tensors), then the entries ``idx`` (flat positions in ``out``, ascending) added as :func:`scatter_onto`
    adds them, in its blocks: the bytes of :func:`gather_copy` and :func:`scatter_u32` mode 1 over ``out``, in one
    pass over the memory whatever the number of tensors. Returns ``(bad, finite)`` as :func:`scatter_onto`
    (an index is bad where it is past ``out``).

    >>> out = np.empty(5, np.float32)
    >>> scatter_onto_bases(out, [np.ones(2, np.float32), np.zeros(3, np.float32)], 0, np.array([1, 2], np.uint32),
    ...                    np.array([5, 7], np.float32))
    (None, True)
    >>> out.tolist()
    [1.0, 6.0, 7.0, 0.0, 0.0]
    """
    sizes = array_sizes(bases)
    total, held = int(out.size), int(sizes.sum())
    if held != total:
        raise ValueError(f"the bases hold {held} elements, the output {total}")
    v = vals if dt == DT_F64 else vals.astype(np.float32, copy=False)
    bad = _bad_entries(idx, v, total)
    if bad is not None:
        return bad, True
    return None, _onto_blocks(out, list(bases), 0, total, dt, idx, v, sizes)


def scatter_u32(*args):
    _scatter(*args)


def scatter_u64(*args):
    _scatter(*args)


def gather_copy(nt, total, ent_start, src_ptrs, esize, out):
    """Twin of ``gather_copy`` (kernels/scatter.cu): tensor t's elements, bits as they are, at ``out[ent_start[t]:
    ent_start[t + 1]]``; ``src_ptrs`` is the list of source arrays, ``esize`` the bytes of an element.

    >>> out = np.zeros(5, np.float32)
    >>> gather_copy(2, 5, np.array([0, 2, 5], np.uint64), [np.ones(2, np.float32), np.full(3, -0.0, np.float32)],
    ...             4, out)
    >>> out.tolist()
    [1.0, 1.0, -0.0, -0.0, -0.0]
    """
    word = {2: np.uint16, 4: np.uint32, 8: np.uint64}[int(esize)]
    es = np.asarray(ent_start, dtype=np.uint64)
    dst = out.view(word)
    for t in range(int(nt)):
        a, b = int(es[t]), int(es[t + 1])
        if b > a:
            dst[a:b] = src_ptrs[t].reshape(-1).view(word)[: b - a]


def _gather_entries(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out):
    word = {2: np.uint16, 4: np.uint32, 8: np.uint64}[int(esize)]
    es, el = np.asarray(ent_start, dtype=np.uint64), np.asarray(elem_start, dtype=np.uint64)
    dst = out.view(word)
    for t in range(int(nt)):
        a, b = int(es[t]), int(es[t + 1])
        if b <= a:
            continue
        at = idx[a:b].astype(np.uint64)
        inside = (at >= el[t]) & (at < el[t + 1])  # (checked by the caller: one outside writes nothing)
        src = src_ptrs[t].reshape(-1).view(word)
        dst[a:b][inside] = src[(at[inside] - el[t]).astype(np.intp)]


def gather_entries_u32(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out):
    """Twin of ``gather_entries_u32`` (kernels/scatter.cu): entry j of tensor t (``ent_start``), at position idx[j]
    of a run's span in which tensor t holds [elem_start[t], elem_start[t + 1]), reads element idx[j] - elem_start[t]
    of ``src_ptrs[t]`` (the list of source arrays), bits as they are; ``esize`` is the bytes of an element.

    >>> out = np.zeros(3, np.float32)
    >>> srcs = [np.array([5, 6], np.float32), np.array([7, 8, 9], np.float32)]
    >>> gather_entries_u32(2, 3, np.array([0, 1, 3], np.uint64), np.array([0, 2, 5], np.uint64), srcs,
    ...                    np.array([1, 2, 4], np.uint32), 4, out)
    >>> out.tolist()
    [6.0, 7.0, 9.0]
    """
    _gather_entries(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out)


def gather_entries_u64(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out):
    """Twin of ``gather_entries_u64`` (64-bit positions): as :func:`gather_entries_u32`."""
    _gather_entries(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out)
