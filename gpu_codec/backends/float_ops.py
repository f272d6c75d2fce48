"""The float steps outside the selection and codec kernels, in our kernels (kernels/limbs.cu) on the kernel
backends: the aggregator's limb split and mean, the int8 decode and the fp32 -> fp64 widening of decoded values.

Written with the array module's own operations they would run, on a GPU, in CuPy's elementwise kernels, which
CuPy compiles with ``-ftz=true``: fp32 subnormals flushed to zero, where the NumPy twins
(:mod:`gpu_codec.cpu_fallback.limbs`, :mod:`gpu_codec.cpu_fallback.quantize`) keep them. Our kernels compile
without it (:mod:`gpu_codec.backends.nvrtc`), so the bytes match. :mod:`gpu_codec.testing.ftz_audit` checks that
no other float operation of the GPU path runs through the array module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..constants import BLOCK
from .kernels import _offsets

GRID_MAX = 1 << 16  # blocks of a grid-stride launch (enough to fill any device; each thread loops beyond)


def _grid(n: int) -> int:
    return max(1, min(GRID_MAX, -(-n // BLOCK)))


class KernelFloatOps:
    """Mixin of the kernel backends (before :class:`~gpu_codec.backends.decode.ArrayDecoders` and
    :class:`~gpu_codec.backends.kernels.KernelBackendBase` in the bases): the ops above as launches."""

    runner: Any
    xp: Any

    def limb_accumulate(self, limbs: Any, start: int, counts: Any, exps: Any, vals: Any, idx: Any, w: float) -> None:
        total = int(vals.size)
        if not total:
            return
        exps = np.asarray(exps, np.int64).reshape(len(counts), -1)
        ent = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.uint64)
        grid = np.concatenate([np.ldexp(1.0, -exps), np.ldexp(1.0, exps)], axis=1)  # powers of two: exact
        tables = self.xp.asarray(np.concatenate([ent.view(np.float64), grid.ravel()]))  # one copy to the device
        dense, wide = idx is None, idx is not None and idx.dtype.itemsize == 8
        if dense:
            idx = tables.view(np.uint32)  # (not read: a dense tensor's entries are its elements)
        elif idx.dtype.kind != "u":
            idx = idx.view(np.uint64 if wide else np.uint32)
        self.runner.launch(
            f"limb_accumulate_{'f64' if vals.dtype == np.float64 else 'f32'}_{'u64' if wide else 'u32'}",
            -(-total // BLOCK),
            BLOCK,
            (
                np.int32(len(counts)),
                np.uint64(total),
                tables[: ent.size].view(np.uint64),
                tables[ent.size :],
                self.xp.ascontiguousarray(vals),
                idx,
                np.int32(dense),
                np.float64(w),
                np.uint64(start),
                np.uint64(limbs.shape[1]),
                limbs,
            ),
        )

    def limb_shift(self, limbs: Any, starts: Any, numels: Any, shifts: Any) -> None:
        numels = np.asarray(numels, np.int64)
        total = int(numels.sum())
        if total:
            nt = numels.size
            shift = np.zeros(nt + nt % 2, np.int32)
            shift[:nt] = shifts
            tables = self.xp.asarray(
                np.concatenate([_offsets(numels), np.asarray(starts, np.uint64), shift.view(np.uint64)])
            )
            self.runner.launch(
                "limb_shift",
                -(-total // BLOCK),
                BLOCK,
                (
                    np.int32(nt),
                    np.uint64(total),
                    tables[: nt + 1],
                    tables[nt + 1 : 2 * nt + 1],
                    tables[2 * nt + 1 :].view(np.int32),
                    np.uint64(limbs.shape[1]),
                    limbs,
                ),
            )

    def segment_abs_max(self, vals: Any, counts: Any) -> Any:
        out = self.xp.zeros(len(counts), dtype=np.uint64)
        total = int(vals.size)
        if total:
            wide = vals.dtype.itemsize == 8
            self.runner.launch(
                "segment_abs_max_u64" if wide else "segment_abs_max_u32",
                -(-total // BLOCK),
                BLOCK,
                (
                    np.int32(len(counts)),
                    np.uint64(total),
                    self.xp.asarray(_offsets(counts)),
                    self.xp.ascontiguousarray(vals).view(np.uint64 if wide else np.uint32),
                    out,
                ),
            )
        return out

    def limb_mean(self, limbs: Any, starts: Any, numels: Any, scales: Any, total: float, out: Any) -> None:
        numels = np.asarray(numels, np.int64)
        n = int(numels.sum())
        if n:
            nt = numels.size
            ent = np.concatenate([_offsets(numels), np.asarray(starts, np.uint64)])
            tables = self.xp.asarray(np.concatenate([ent.view(np.float64), np.asarray(scales, np.float64).ravel()]))
            self.runner.launch(
                "limb_mean_f64" if out.dtype == np.float64 else "limb_mean_f32",
                _grid(n),
                BLOCK,
                (
                    np.int32(nt),
                    np.uint64(n),
                    tables[: nt + 1].view(np.uint64),
                    tables[nt + 1 : 2 * nt + 1].view(np.uint64),
                    tables[2 * nt + 1 :],
                    np.uint64(limbs.shape[1]),
                    limbs,
                    np.float64(total),
                    out,
                ),
            )

    def int8_decode(self, q: Any, scales: Any, block: int) -> Any:
        out = self.xp.empty(q.size, dtype=np.float32)
        if q.size:
            self.runner.launch(
                "int8_dequant",
                _grid(q.size),
                BLOCK,
                (
                    np.uint64(q.size),
                    np.int32(block),
                    self.xp.ascontiguousarray(q),
                    self.xp.ascontiguousarray(scales),
                    out,
                ),
            )
        return out

    def as_values(self, x: Any, dtype: Any) -> Any:
        dt = np.dtype(dtype)
        if x.dtype == dt:
            return x
        if x.dtype != np.float32 or dt != np.float64:
            raise TypeError(f"decoded values are {x.dtype}, expected float32 or {dt}")
        out = self.xp.empty(x.size, dtype=np.float64)
        if x.size:
            self.runner.launch(
                "widen_f32", _grid(x.size), BLOCK, (np.uint64(x.size), self.xp.ascontiguousarray(x), out)
            )
        return out.reshape(x.shape)
