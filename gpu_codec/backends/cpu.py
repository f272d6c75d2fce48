"""The CPU backend (``"cpu"``): host memory, the twins of :mod:`gpu_codec.cpu_fallback` (the kernels' bytes)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..constants import DT_F64, U64_MAX
from ..cpu_fallback import dense as _dense
from ..cpu_fallback import kernels as _twins
from ..cpu_fallback import limbs as _limbs
from ..cpu_fallback import quantize as _q
from ..cpu_fallback import rice as _rice
from ..cpu_fallback import select as _select
from ..format.common import Segmented
from .base import dense_values, flat_tables, scatter_args, split_values
from .decode import ArrayDecoders


class CpuBackend(ArrayDecoders):
    """Host memory, NumPy arithmetic: :mod:`gpu_codec.cpu_fallback`."""

    name = "cpu"
    xp = np
    on_device = False
    # scans run again after the sample's bracket missed (the NumPy selection's exact fallback; see
    # gpu_codec.cpu_fallback.select), over every selection this backend ran (an instance's own once it counts one)
    bracket_misses = 0

    def asarray(self, a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        if type(a).__module__.startswith("cupy"):
            return a.get()
        return np.asarray(a)

    def asarrays(self, arrays: Sequence[Any]) -> list[Any]:
        nd = np.ndarray
        return [a if a is None or type(a) is nd else self.asarray(a) for a in arrays]

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    @property
    def host(self) -> CpuBackend:
        return self

    def stream(self, tensors) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def info(self) -> dict[str, Any]:
        return {"allocator": "numpy"}

    def topk_select(self, req):
        stats: dict[str, int] = {}
        idx, vals, bad = _select.topk_select(*req.select_args(), stats=stats, shared=True)
        if type(idx) is tuple:  # (global scope: every tensor's entries in one array a role, as the kernels give them)
            idx, vals = Segmented((idx[0],), idx[1]), Segmented((vals[0],), vals[1])
        self.bracket_misses += stats.get("misses", 0)
        return idx, vals, bad

    def dense_delta(self, req):
        new, base, res, res_out, dtypes, ext_scores, ext_dtypes = req.delta_args()
        crit = req.criterion
        numels = [int(a.size) for a in new]
        off, n32, n64 = flat_tables(numels, dtypes, DT_F64)
        vals32, vals64 = np.empty(n32, np.float32), np.empty(n64, np.float64)
        err = np.full(1, U64_MAX, dtype=np.uint64)
        _dense.dense_delta(
            len(new), None, off, numels, dtypes, new, base, res, ext_scores, ext_dtypes, crit, vals32, vals64, err
        )
        if int(err[0]) != U64_MAX:
            return None, int(err[0])
        for r in res_out:
            if r is not None:
                r[...] = 0  # every entry is kept and sent exactly: d - decoded(d) = +0.0
        return split_values(vals32, vals64, numels, dtypes, off, DT_F64), None

    def scatter(self, outs, out_dtypes, numels, indices, values, mode, defer=False):
        packed = scatter_args(np, indices, values)
        if packed is None:
            return None
        total, ent_start, idx, vals32, vals64 = packed
        err = np.full(1, U64_MAX, dtype=np.uint64)
        _twins._scatter(len(outs), total, ent_start, numels, out_dtypes, outs, idx, vals32, vals64, mode, err)
        if defer:
            return err
        bad = int(err[0])
        return None if bad == U64_MAX else bad

    def limb_accumulate(self, limbs, start, counts, exps, vals, idx, w):
        _limbs.limb_accumulate(limbs, start, counts, exps, vals, idx, w)

    def limb_shift(self, limbs, starts, numels, shifts):
        _limbs.limb_shift(limbs, starts, numels, shifts)

    def segment_abs_max(self, vals, counts):
        return _limbs.segment_abs_max(vals.view(np.uint64 if vals.dtype.itemsize == 8 else np.uint32), counts)

    def limb_mean(self, limbs, starts, numels, scales, total, out):
        _limbs.limb_mean(limbs, starts, numels, scales, total, out)

    def scatter_onto(self, out, base, start, stop, out_dtype, numel, indices, values):
        return _twins.scatter_onto(out, base, start, stop, out_dtype, numel, indices, values)

    def scatter_onto_bases(self, out, bases, out_dtype, indices, values):
        return _twins.scatter_onto_bases(out, bases, out_dtype, indices, values)

    def gather_copy(self, out, sources):
        np.concatenate(sources, out=out, casting="no")  # the twin's bytes (the bits copied), in one call

    def gather_entries(self, out, sources, starts, indices, counts):
        ends = np.cumsum(counts).tolist()
        if not ends or not ends[-1]:
            return
        # every entry's position in its own source, in one subtraction; then one take a source that has entries
        own = indices[: ends[-1]] - np.repeat(np.asarray(starts[: len(counts)], indices.dtype), counts)
        own = own.astype(np.intp, copy=False)  # (NumPy 1.x's take refuses uint64 indices)
        parts = [s.take(own[e - c : e]) for s, c, e in zip(sources, counts, ends) if c]
        np.concatenate(parts, out=out, casting="no")  # (the twin's bytes: each source's elements at its entries)

    def dense_apply(self, outs, out_dtypes, bases, values, mode, defer=False):
        counts = [int(o.size) for o in outs]
        ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
        err = np.full(1, U64_MAX, dtype=np.uint64)
        vals = dense_values(values, out_dtypes, DT_F64)
        _dense.dense_apply(len(outs), sum(counts), ent_start, out_dtypes, outs, bases, vals, mode, err)
        if defer:
            return err
        bad = int(err[0])
        return None if bad == U64_MAX else bad

    def cast16(self, values, dtype, indices, res):
        return _q.encode_cast16_many(values, dtype, indices, res)  # (small tensors cast together)

    def int8(self, values, block, indices, res):
        coded = [_q.encode_int8(v, block, i, r) for v, i, r in zip(values, indices, res)]
        return [q for q, _ in coded], [s for _, s in coded]

    def ternary(self, values, indices, res):
        coded = [_q.encode_ternary(v, i, r) for v, i, r in zip(values, indices, res)]
        return [s for s, _ in coded], np.asarray([mu for _, mu in coded], dtype=np.float32)

    def rice(self, indices, ks, numels):
        streams, bits = _rice.rice_encode_many(indices, ks)  # (small tensors coded together)
        return streams, np.asarray(bits, dtype=np.uint64)
