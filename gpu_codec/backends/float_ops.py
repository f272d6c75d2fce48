"""The float steps outside the selection and codec kernels, in our kernels (kernels/limbs.cu) on the kernel
backends: the aggregator's limb split and mean, the int8 decode and the fp32 -> fp64 widening of decoded values.

Written with the array module's own operations they would run, on a GPU, in CuPy's elementwise kernels, which
CuPy compiles with ``-ftz=true``: fp32 subnormals flushed to zero, where the NumPy twins
(:mod:`gpu_codec.cpu_fallback.limbs`, :mod:`gpu_codec.cpu_fallback.quantize`) keep them. Our kernels compile
without it (:mod:`gpu_codec.backends.nvrtc`), so the bytes match. :mod:`gpu_codec.testing.ftz_audit` checks that
no other float operation of the GPU path runs through the array module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..constants import BLOCK

GRID_MAX = 1 << 16  # blocks of a grid-stride launch (enough to fill any device; each thread loops beyond)


def _grid(n: int) -> int:
    return max(1, min(GRID_MAX, -(-n // BLOCK)))


class KernelFloatOps:
    """Mixin of the kernel backends (before :class:`~gpu_codec.backends.decode.ArrayDecoders` and
    :class:`~gpu_codec.backends.kernels.KernelBackendBase` in the bases): the ops above as launches."""

    runner: Any
    xp: Any

    def limb_split(self, vals: Any, w: float, exps: list[int]) -> Any:
        qs = self.xp.empty((len(exps), vals.size), dtype=np.int32)
        if vals.size:
            grid = [math.ldexp(1.0, -e) for e in exps] + [math.ldexp(1.0, e) for e in exps]
            f64 = vals.dtype == np.float64
            self.runner.launch(
                "limb_split_f64" if f64 else "limb_split_f32",
                _grid(vals.size),
                BLOCK,
                (np.uint64(vals.size), vals, np.float64(w), self.xp.asarray(np.asarray(grid, np.float64)), qs),
            )
        return qs

    def limb_mean(self, limbs: Any, scales: list[float], total: float, out: Any) -> None:
        n = int(limbs.shape[1])
        if n:
            limbs = self.xp.ascontiguousarray(limbs)  # the kernel reads rows of n: a column slice is copied
            self.runner.launch(
                "limb_mean_f64" if out.dtype == np.float64 else "limb_mean_f32",
                _grid(n),
                BLOCK,
                (
                    np.int32(limbs.shape[0]),
                    np.uint64(n),
                    limbs,
                    self.xp.asarray(np.asarray(scales, np.float64)),
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
