"""Index codecs: ``raw`` (the engine's uint32/uint64 flat indices) and Rice coding of the index gaps.

The Rice parameter k comes from each tensor's density (``k = floor(log2(ln2 x mean gap))``, the optimal
power-of-two Golomb parameter for geometric gaps): about 8.1 bits per index at 1% density on uniformly random
positions, and never more than ``k + 1 + (numel - nnz) / (nnz 2^k)`` bits per index whatever the positions.
Encoding is parallel on the GPU (kernels/rice.cu: per-chunk counts, one scan, then each entry writes its bits
with atomicOr); cpu_fallback/rice.py gives the same bytes with vectorized NumPy. Decoding is vectorized array
code that validates the stream completely (PayloadError on any inconsistency, work bounded by its length).

>>> import numpy as np, gpu_codec
>>> u = {"w": np.arange(1000, dtype=np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.01, pipeline=[RiceIndices()])
>>> p.tensors[0].codec
{'v': 'f32', 'i': 'rice', 'k': 6, 'bits': 85}
>>> np.flatnonzero(gpu_codec.decompress(p.to_bytes())["w"]).tolist()
[990, 991, 992, 993, 994, 995, 996, 997, 998, 999]
"""

from __future__ import annotations

import numpy as np

from ..backends.base import later
from ..cpu_fallback import rice as _rice
from ..errors import PayloadHeaderError
from ..format.schema import Field
from .base import Form, IndexCodec
from .wire import is_int, n_blocks, where

MAX_BITS = 1 << 62  # a Rice bit count's bound in the table (the layout checks the real one, from nnz and numel)


def _raw_layout(rec, n):
    return {"indices": (("uint32", "uint64"), n)}


def _raw_decode(rec, bufs, n, backend):
    return bufs["indices"]


def _rice_layout(rec, n):
    k, bits = rec.codec.get("k"), rec.codec.get("bits")
    want = _rice.rice_param(n, rec.numel)
    if not is_int(k) or k != want:
        raise PayloadHeaderError(
            f"{where(rec)}: Rice parameter {k!r} is not the {want} that nnz {n} of {rec.numel} implies"
        )
    hi = _rice.max_bits(n, rec.numel, k) if n else 0  # no index, no stream: no byte goes unexamined
    if not is_int(bits) or not n * (k + 1) <= bits <= hi:
        raise PayloadHeaderError(
            f"{where(rec)}: Rice bit count {bits!r} is outside [{n * (k + 1)}, {hi}] for "
            f"nnz {n} of {rec.numel} with k={k}"
        )
    return {"indices": (("uint8",), -(-bits // 8))}


def _raw_many(cols, n):
    return {"indices": (("uint32", "uint64"), n)}


def _rice_many(cols, n):
    """:func:`_rice_layout` of every record at once (Form.many): None where a parameter or a bit count is not
    what that rule takes."""
    ks = [c.get("k") for c in cols.codecs]
    bits = [c.get("bits") for c in cols.codecs]
    if set(map(type, ks)) != {int} or set(map(type, bits)) != {int}:  # (is_int, without bools)
        return None
    if ks != list(map(_rice.rice_param, n.tolist(), cols.numels.tolist())):  # (the rule's own arithmetic)
        return None
    try:
        k, b = np.array(ks, np.int64), np.array(bits, np.int64)
    except OverflowError:
        return None
    lo = n * (k + 1)
    hi = np.where(n > 0, _rice.max_bits(n, cols.numels, k), 0)  # (nothing kept: no stream)
    if not ((lo <= b) & (b <= hi)).all():
        return None
    return {"indices": (("uint8",), n_blocks(b, 8))}


def _rice_decode(rec, bufs, n, backend):
    return backend.rice_decode(bufs["indices"], rec.codec["bits"], rec.codec["k"], n, rec.numel)


class RawIndices(IndexCodec):
    """The engine's own indices (not registered: it is what a pipeline without an index stage stores)."""

    codec_id = "raw"
    forms = (Form("raw", (), _raw_layout, _raw_decode, code=0, many=_raw_many),)

    @property
    def lossless(self) -> bool:
        return True

    def encode_indices(self, indices, numels, backend):
        return [({}, {"indices": i}, {}) for i in indices]


class RiceIndices(IndexCodec):
    """Rice (Golomb power-of-two) coded index gaps, parameter chosen per tensor from its density."""

    codec_id = "rice"
    wire_code = 5
    # k follows from nnz and numel (stored nowhere); the bit count is stored where something is kept
    forms = (
        Form(
            "rice",
            ("k", Field("bits", "varint", hi=MAX_BITS, empty=0)),
            _rice_layout,
            _rice_decode,
            code=1,
            derive=lambda nnz, numel: {"k": _rice.rice_param(nnz, numel)},
            many=_rice_many,
        ),
    )

    def __init__(self) -> None:
        pass

    @property
    def lossless(self) -> bool:
        return True

    def encode_indices(self, indices, numels, backend):
        ks = [_rice.rice_param(int(i.size), n) for i, n in zip(indices, numels)]
        streams, bits = backend.rice(indices, ks, numels)
        parts = [({"k": k, "bits": 0}, {"indices": s}, {}) for k, s in zip(ks, streams)]

        def finish(host):  # each bit count, read with the call's other host reads; its stream cut to its bytes
            for (fields, bufs, _), b in zip(parts, host[0].tolist()):
                fields["bits"] = b
                bufs["indices"] = bufs["indices"][: -(-b // 8)]

        later(backend, [bits], finish)
        return parts
