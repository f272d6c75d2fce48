"""The decoders every backend shares, written once for any ``xp`` (NumPy or CuPy) and run by a backend on its own
memory through ``self.xp``: the Rice decoder (:mod:`gpu_codec.xp.rice`, array code of its own) and the value
decoders, which are the twins' own (:mod:`gpu_codec.cpu_fallback.quantize`: the encoders fix residuals with them;
the kernel backends replace the int8 decode and the widening with their kernels, :mod:`.float_ops`); and a run of
sparse tensors written onto their bases from the backend's own copy and scatter.
"""

from __future__ import annotations

from typing import Any

from ..constants import ScatterMode
from ..cpu_fallback import quantize as _q
from ..xp import rice as _rice
from ..xp.finite import all_finite


class ArrayDecoders:
    """The decode ops of :class:`~gpu_codec.backends.base.Backend`, on ``self.xp``."""

    xp: Any

    def decode_f16(self, bits: Any) -> Any:
        return _q.decode_f16(bits, self.xp)

    def decode_bf16(self, bits: Any) -> Any:
        return _q.decode_bf16(bits, self.xp)

    def int8_decode(self, q: Any, scales: Any, block: int) -> Any:
        return _q.int8_decode(q, scales, block, self.xp)

    def as_values(self, x: Any, dtype: Any) -> Any:
        """Decoded fp32 values as the tensor's value dtype (fp64 for fp64 tensors): exact."""
        return x if x.dtype == dtype else _q.widen_f32(x)

    def ternary_decode(self, signs: Any, mu: float, n: int) -> Any:
        return _q.ternary_decode(signs, mu, n, self.xp)

    def rice_decode(self, stream: Any, bits: int, k: int, nnz: int, numel: int) -> Any:
        return _rice.rice_decode(stream, bits, k, nnz, numel, self.xp)

    def scatter_onto_bases(self, out: Any, bases: list, out_dtype: Any, indices: Any, values: Any) -> tuple:
        """The bases copied in (``gather_copy``), then the entries added (``scatter``): a kernel backend's two
        launches (the NumPy backend runs both in one pass: ``cpu_fallback.kernels.scatter_onto_bases``)."""
        self.gather_copy(out, bases)
        bad = self.scatter([out], [out_dtype], [int(out.size)], [indices], [values], ScatterMode.ADD)
        return bad, bad is not None or all_finite(out[indices], out_dtype, self.xp)
