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

from typing import Any

from ..backends.base import Backend
from ._wire import VALUE_FORMS, Form, check_block, n_blocks, value_dtype_name
from .base import Codec, check_choice, check_int
from .registry import register_codec

DTYPES = ("float32", "float16", "bfloat16")
_TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


class ValueCodec(Codec):
    """A ``values`` stage: encodes every tensor's kept values in one batch and fixes the error-feedback residual
    of each kept entry to ``value - decoded`` (``res`` lists are None where there is no residual)."""

    stage = "values"
    tag = ""

    def encode_values(
        self, values: list[Any], indices: list[Any], res: list[Any], backend: Backend
    ) -> list[tuple[dict, dict, dict]]:
        """Per tensor: (codec fields, buffers by role, buffer dtype names that differ from the array's)."""
        raise NotImplementedError


@register_codec
class Quantize(ValueCodec):
    """Store kept values as ``float32`` (lossless; fp64 tensors keep fp64), ``float16`` or ``bfloat16``."""

    codec_id = "quantize"

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


@register_codec
class Int8Blockwise(ValueCodec):
    """int8 with one float32 absmax scale per block of ``block_size`` kept values (bitsandbytes-style)."""

    codec_id = "int8"
    tag = "int8"

    def __init__(self, block_size: int = 256):
        self.block_size = check_int("int8", "block_size", block_size, 1, 1 << 20)

    @property
    def lossless(self) -> bool:
        return False

    def encode_values(self, values, indices, res, backend):
        qs, ss = backend.int8(values, self.block_size, indices, res)
        return [({"block": self.block_size}, {"values": q, "scales": s}, {}) for q, s in zip(qs, ss)]


def _float_layout(dtype: str | None):
    def layout(rec, n):
        return {"values": ((dtype or value_dtype_name(rec),), n)}

    return layout


def _decode_f32(rec, bufs, n, backend):
    return bufs["values"]


def _decode_f16(rec, bufs, n, backend):
    return backend.decode_f16(bufs["values"])


def _decode_bf16(rec, bufs, n, backend):
    return backend.decode_bf16(bufs["values"])


def _int8_layout(rec, n):
    b = check_block(rec)
    return {"values": (("int8",), n), "scales": (("float32",), n_blocks(n, b))}


def _decode_int8(rec, bufs, n, backend):
    return backend.int8_decode(bufs["values"], bufs["scales"], rec.codec["block"])


VALUE_FORMS["f32"] = Form("f32", (), _float_layout(None), _decode_f32)
VALUE_FORMS["f16"] = Form("f16", (), _float_layout("float16"), _decode_f16)
VALUE_FORMS["bf16"] = Form("bf16", (), _float_layout("bfloat16"), _decode_bf16)
VALUE_FORMS["int8"] = Form("int8", ("block",), _int8_layout, _decode_int8)

__all__ = ["DTYPES", "Int8Blockwise", "Quantize", "ValueCodec"]
