"""Value codecs that store each kept value on its own: fp32 (lossless), fp16, bf16, and int8 blockwise absmax.

fp16 and bf16 clamp to the target's largest finite value first (as NVFlare's ModelQuantizer does for fp16),
then round to nearest even. int8 splits each tensor's kept values into blocks of ``block_size`` entries and
stores ``q = round(v / scale)`` with ``scale = absmax / 127`` per block (an all-zero block has scale 0).
Kernels: kernels/quantize.cu; NumPy twins: cpu_fallback/quantize.py.

>>> import numpy as np, gpu_codec
>>> u = {"w": np.array([0.0, 3.0, 0.0, -70000.0], np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.5, pipeline=[Quantize("float16")])
>>> p.tensors[0].buffers["values"].view(np.float16).tolist()
[3.0, -65504.0]
>>> gpu_codec.decompress(p.to_bytes())["w"].tolist()
[0.0, 3.0, 0.0, -65504.0]
"""

from __future__ import annotations

import numpy as np

from ..backends.base import later
from ..errors import PayloadHeaderError
from ..format import TensorRecord
from ..format.schema import Field
from .base import Form, ValueCodec, ValueOverflow, check_choice, check_int
from .wire import is_int, n_blocks, value_dtype_name, where

DTYPES = ("float32", "float16", "bfloat16")
MAX_BLOCK = 1 << 20
_TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _float_layout(dtype: str | None):
    def layout(rec, n):
        return {"values": ((dtype or value_dtype_name(rec),), n)}

    return layout


def _float_many(dtype: str | None):
    def many(cols, n):  # (Form.many; f32 stores fp64 tensors' values as float64: a table of one kind of them)
        if dtype is not None:
            return {"values": ((dtype,), n)}
        kinds = {"float64" if d == "float64" else "float32" for d in cols.dtypes}
        return {"values": (tuple(kinds), n)} if len(kinds) == 1 else None

    return many


def _decode_f32(rec, bufs, n, backend):
    return bufs["values"]


def _decode_f16(rec, bufs, n, backend):
    return backend.decode_f16(bufs["values"])


def _decode_bf16(rec, bufs, n, backend):
    return backend.decode_bf16(bufs["values"])


def check_block(rec: TensorRecord) -> int:
    b = rec.codec.get("block")
    if not is_int(b) or not 1 <= b <= MAX_BLOCK:
        raise PayloadHeaderError(f"{where(rec)}: int8 block size {b!r} must be an integer in [1, 2^20]")
    return b


def _int8_layout(rec, n):
    b = check_block(rec)
    return {"values": (("int8",), n), "scales": (("float32",), n_blocks(n, b))}


def _int8_many(cols, n):  # (Form.many: check_block's range, over the table)
    blocks = [c.get("block") for c in cols.codecs]
    if set(map(type, blocks)) != {int} or not 1 <= min(blocks) <= max(blocks) <= MAX_BLOCK:
        return None
    return {"values": (("int8",), n), "scales": (("float32",), n_blocks(n, np.array(blocks, np.int64)))}


def _int8_part(rec, bufs, a, b):
    blk = rec.codec["block"]
    return {"values": bufs["values"][a:b], "scales": bufs["scales"][a // blk : n_blocks(b, blk)]}


def _int8_unit(rec):
    return rec.codec["block"]


def _decode_int8(rec, bufs, n, backend):
    with np.errstate(over="ignore", invalid="ignore"):  # hostile scales give inf, which the scatter refuses
        return backend.int8_decode(bufs["values"], bufs["scales"], rec.codec["block"])


class Quantize(ValueCodec):
    """Store kept values as ``float32`` (lossless; fp64 tensors keep fp64), ``float16`` or ``bfloat16``."""

    codec_id = "quantize"
    wire_code = 2
    wire_fields = (Field("dtype", "choice", choices=DTYPES),)
    forms = (
        Form("f32", (), _float_layout(None), _decode_f32, code=0, many=_float_many(None)),
        Form("f16", (), _float_layout("float16"), _decode_f16, code=1, many=_float_many("float16")),
        Form("bf16", (), _float_layout("bfloat16"), _decode_bf16, code=2, many=_float_many("bfloat16")),
    )

    def __init__(self, dtype: str = "float16"):
        self.dtype = check_choice("quantize", "dtype", dtype, DTYPES)

    @property
    def tag(self) -> str:  # type: ignore[override]
        return _TAGS[self.dtype]

    @property
    def lossless(self) -> bool:
        return self.dtype == "float32"

    def encode_values(self, values, indices, res, backend):
        if self.dtype == "float32":
            return [({}, {"values": v}, {}) for v in values]
        out = backend.cast16(values, self.dtype, indices, res)
        return [({}, {"values": o}, {"values": self.dtype}) for o in out]


class Int8Blockwise(ValueCodec):
    """int8 with one float32 absmax scale per block of ``block_size`` kept values (bitsandbytes-style)."""

    codec_id = "int8"
    wire_code = 3
    wire_fields = (Field("block_size", "varint", lo=1, hi=MAX_BLOCK),)
    forms = (
        Form(
            "int8",
            (Field("block", "varint", lo=1, hi=MAX_BLOCK, per="form"),),
            _int8_layout,
            _decode_int8,
            _int8_part,
            _int8_unit,
            code=3,
            many=_int8_many,
        ),
    )

    def __init__(self, block_size: int = 256):
        self.block_size = check_int("int8", "block_size", block_size, 1, MAX_BLOCK)

    @property
    def lossless(self) -> bool:
        return False

    def encode_values(self, values, indices, res, backend):
        qs, ss = backend.int8(values, self.block_size, indices, res)
        parts = [({"block": self.block_size}, {"values": q, "scales": s}, {}) for q, s in zip(qs, ss)]

        def finish(host: list) -> None:  # (the scales, read with the call's other host reads)
            bad = np.flatnonzero(~np.isfinite(_largest_decoded(host)))
            if bad.size:  # (a block at float32's edge, or past it from float64: 127 x its scale overflows)
                raise ValueOverflow(int(bad[0]), "the int8 codec's scale x 127 is inf")

        later(backend, list(ss), finish)
        return parts


def _largest_decoded(scales: list[np.ndarray]) -> np.ndarray:
    """Each tensor's largest decoded magnitude, ``127 x`` its largest block scale in float32 (0 for no block), from
    host copies of its scales: inf where a block's values were at float32's edge (or past it, from float64)."""
    sizes = np.fromiter((s.size for s in scales), np.int64, len(scales))
    top = np.zeros(len(scales), np.float32)
    some = np.flatnonzero(sizes)
    if some.size:
        joined = np.concatenate([scales[i] for i in some]).astype(np.float32, copy=False)
        starts = (np.cumsum(sizes[some]) - sizes[some]).astype(np.intp)
        top[some] = np.maximum.reduceat(joined, starts)
    with np.errstate(over="ignore"):
        return top * np.float32(127.0)


__all__ = ["DTYPES", "Int8Blockwise", "Quantize"]
