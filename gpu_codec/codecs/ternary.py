"""Ternary values as in STC (Sattler et al.): each kept value becomes +mu or -mu, with
mu = mean |kept value| of its tensor, so a tensor's values cost one sign bit each plus one float.

mu is the mean over the *kept* entries, as the STC paper defines it (OpenFL's STCPipeline divides by the dense
element count instead, which shrinks every value by the density). The sum is taken in fp64 as a pairwise tree
in a fixed order, so the GPU kernels (kernels/quantize.cu) and the NumPy twin give the same mu to the bit.
A kept value of exactly 0 is sent as +mu (one bit cannot say 0; error feedback carries the difference).

>>> import numpy as np, gpu_codec
>>> u = {"w": np.array([0.5, -3.0, 0.1, 1.0], np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.5, pipeline=[Ternary()])
>>> p.tensors[0].codec
{'v': 'ternary', 'mu': 2.0, 'i': 'raw'}
>>> gpu_codec.decompress(p.to_bytes())["w"].tolist()
[0.0, -2.0, 0.0, 2.0]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backends.base import later
from ..errors import PayloadHeaderError
from ..format import TensorRecord
from ..format.schema import Field
from .base import Form, ValueCodec, ValueOverflow
from .wire import n_blocks, where

_F32_MAX = float(np.finfo(np.float32).max)


def _mu_ok(mu: Any) -> bool:
    return (
        not isinstance(mu, bool)
        and isinstance(mu, (int, float))
        and 0 <= mu <= _F32_MAX
        and float(np.float32(mu)) == float(mu)
    )


def check_mu(rec: TensorRecord) -> float:
    mu = rec.codec.get("mu")
    if not _mu_ok(mu):
        raise PayloadHeaderError(f"{where(rec)}: ternary mu {mu!r} must be a finite, non-negative float32 value")
    return float(mu)


def _layout(rec, n):
    check_mu(rec)
    return {"signs": (("uint8",), n_blocks(n, 8))}


def _many(cols, n):  # (Form.many)
    if not all(_mu_ok(c.get("mu")) for c in cols.codecs):
        return None
    return {"signs": (("uint8",), n_blocks(n, 8))}


def _part(rec, bufs, a, b):
    return {"signs": bufs["signs"][a // 8 : n_blocks(b, 8)]}


def _decode(rec, bufs, n, backend):
    return backend.ternary_decode(bufs["signs"], rec.codec["mu"], n)


class Ternary(ValueCodec):
    """Sign bits plus one fp32 magnitude per tensor (``"mu"`` in the tensor's codec dict)."""

    codec_id = "ternary"
    wire_code = 4
    # mu is stored where something is kept (an empty tensor's is 0)
    forms = (
        Form("ternary", (Field("mu", "f32", empty=0.0),), _layout, _decode, _part, lambda rec: 8, code=4, many=_many),
    )

    def __init__(self) -> None:
        pass

    @property
    def lossless(self) -> bool:
        return False

    def encode_values(self, values, indices, res, backend):
        signs, mus = backend.ternary(values, indices, res)
        parts = [({"mu": 0.0}, {"signs": s}, {}) for s in signs]

        def finish(host):  # each mu, read with the call's other host reads
            for j, ((fields, _, _), mu) in enumerate(zip(parts, host[0].tolist())):
                if not math.isfinite(mu):  # (kept values past float32's range, from float64)
                    raise ValueOverflow(j, f"the ternary codec's mu is {mu}")
                fields["mu"] = mu

        later(backend, [mus], finish)
        return parts
