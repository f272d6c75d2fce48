"""Compression stages as composable codecs (numcodecs style), and the pipeline that chains them.

Stages, in pipeline order: :class:`TopK` (sparsify; run by the engine), :class:`Quantize` / :class:`Int8Blockwise`
/ :class:`Ternary` (values), :class:`RiceIndices` (indices), :class:`Zstd` / :class:`Nvcomp` (lossless bytes).
The stage base classes are in :mod:`gpu_codec.codecs.base`; :mod:`gpu_codec.codecs.registry` registers the
built-in codecs and gathers their wire layouts.

>>> from gpu_codec.codecs import get_codec, registered_codecs
>>> registered_codecs()
['int8', 'nvcomp', 'quantize', 'rice', 'ternary', 'topk', 'zstd']
>>> get_codec({"id": "int8", "block_size": 64}).get_config()
{'id': 'int8', 'block_size': 64}
"""

from .base import BytesCodec, Codec, IndexCodec, ValueCodec
from .nvcomp import Nvcomp
from .pipeline import Decoded, Pipeline, as_pipeline, decode_records, decoder_for, host_resident
from .quantize import Int8Blockwise, Quantize
from .registry import get_codec, register_codec, registered_codecs, wire_layouts
from .rice import RiceIndices
from .ternary import Ternary
from .topk import SCOPES, TopK, check_fraction
from .wire import inner_encoding
from .zstd import Zstd

__all__ = [
    "SCOPES",
    "BytesCodec",
    "Codec",
    "Decoded",
    "IndexCodec",
    "Int8Blockwise",
    "Nvcomp",
    "Pipeline",
    "Quantize",
    "RiceIndices",
    "Ternary",
    "TopK",
    "ValueCodec",
    "Zstd",
    "as_pipeline",
    "check_fraction",
    "decode_records",
    "decoder_for",
    "get_codec",
    "host_resident",
    "inner_encoding",
    "register_codec",
    "registered_codecs",
    "wire_layouts",
]
