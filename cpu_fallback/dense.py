"""NumPy twins of the dense-mode kernels: ``dense_delta`` (kernels/topk.cu, every element kept) and ``dense_apply``
(kernels/scatter.cu, dense records written onto their base, or into zeros)."""

from __future__ import annotations

import numpy as np

from gpu_codec.constants import CRIT_EXTERNAL, DT_F32, DT_F64, SCATTER_ADD

from .elementwise import delta, load_f32, nonfinite, store_from_f32, tensor_delta_scores


def dense_apply(nt, total, ent_start, out_dtypes, out_ptrs, base_ptrs, val_ptrs, mode, err):
    """out[t] = v (mode 0) or round(base[t] + v) (mode 1) for every element; the lowest non-finite entry goes to
    ``err[0]`` and writes nothing. The ``*_ptrs`` are lists of arrays (None for no base).

    >>> out, err = np.zeros(3, np.float32), np.full(1, 2**64 - 1, np.uint64)
    >>> dense_apply(1, 3, np.array([0, 3], np.uint64), [0], [out], [np.ones(3, np.float32)],
    ...             [np.array([1, np.inf, 2], np.float32)], 1, err)
    >>> out.tolist(), int(err[0])
    ([2.0, 0.0, 3.0], 1)
    """
    es = np.asarray(ent_start, dtype=np.uint64)
    for t in range(int(nt)):
        a, b = int(es[t]), int(es[t + 1])
        dt, add = int(out_dtypes[t]), int(mode) == SCATTER_ADD
        out, base, v = out_ptrs[t], base_ptrs[t], val_ptrs[t]
        for s in range(0, b - a, APPLY_BLOCK):  # (a block at a time: temporaries of a block, not of the tensor)
            e = min(b - a, s + APPLY_BLOCK)
            _apply_block(out[s:e], None if base is None else base[s:e], v[s:e], dt, add, a + s, err)


APPLY_BLOCK = 1 << 16  # elements dense_apply takes at a time (its fp32 temporaries: 256 KiB a block)


def _apply_block(out, base, v, dt: int, add: bool, first: int, err) -> None:
    """:func:`dense_apply` of one block of one tensor (``first``: its first entry's number)."""
    ok = np.isfinite(v)
    every = bool(ok.all())  # (then a plain assignment, not a masked one)
    if not every:
        err[0] = min(int(err[0]), first + int(np.flatnonzero(~ok)[0]))
    if every and add and dt == DT_F32 and base.dtype == v.dtype == np.float32:
        with np.errstate(over="ignore"):  # (the fp32 sum, rounded once: the stored one, written in place)
            np.add(base, v, out=out)
        return
    with np.errstate(invalid="ignore", over="ignore"):  # (a payload's NaN, even signalling, is refused above;
        # a sum past the dtype's range is the device's IEEE overflow, which the caller checks)
        if dt == DT_F64:
            new = base + v if add else v
        else:
            new = store_from_f32(load_f32(base, dt) + v if add else v, dt)
    if every:
        out[...] = new
    else:
        out[ok] = new[ok]


def dense_delta(
    nt,
    chunk_start,
    elem_off,
    numel,
    dtypes,
    new_ptrs,
    base_ptrs,
    res_ptrs,
    score_ptrs,
    score_dtypes,
    crit,
    vals32,
    vals64,
    err,
):
    """Twin of ``dense_delta`` (kernels/topk.cu): every element's delta at ``elem_off[t]`` in ``vals32`` (``vals64``
    for fp64 tensors), and the lowest tensor with a non-finite delta, or a non-finite score of a caller's score
    function, in ``err[0]`` (a built-in criterion selects nothing here: its fp32 score may overflow, and is not
    computed). A tensor is taken DELTA_BLOCK elements at a time: the temporaries are a block's, not the tensor's
    (whole, a bf16 tensor's took about 20 bytes an element).

    >>> v32, err = np.zeros(4, np.float32), np.full(1, 2**64 - 1, np.uint64)
    >>> dense_delta(1, None, [0], [4], [0], [np.arange(4, dtype=np.float32)], [np.ones(4, np.float32)], [None],
    ...             [None], [0], 0, v32, None, err)
    >>> v32.tolist(), int(err[0]) == 2**64 - 1
    ([-1.0, 0.0, 1.0, 2.0], True)
    """
    external = int(crit) == CRIT_EXTERNAL
    for t in range(int(nt)):
        n, off, dt = int(numel[t]), int(elem_off[t]), int(dtypes[t])
        out = vals64 if dt == DT_F64 else vals32
        bad = False
        for s in range(0, n, DELTA_BLOCK):
            e = min(n, s + DELTA_BLOCK)
            if external:
                _, d, sc, _ = tensor_delta_scores(
                    t, new_ptrs, base_ptrs, res_ptrs, dtypes, crit, score_ptrs, score_dtypes, slice(s, e)
                )
                bad = bad or nonfinite(sc)
            else:
                d = delta(*(None if a is None else a[s:e] for a in (new_ptrs[t], base_ptrs[t], res_ptrs[t])), dt)
            out[off + s : off + e] = d
            bad = bad or nonfinite(d)
        if bad:
            err[0] = min(int(err[0]), t)


DELTA_BLOCK = 1 << 18  # elements dense_delta takes at a time
