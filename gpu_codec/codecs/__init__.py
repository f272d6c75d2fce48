"""Compression stages as composable codecs (numcodecs style), and the pipeline that chains them.

Stages, in pipeline order: :class:`TopK` (sparsify; run by the engine), :class:`Quantize` / :class:`Int8Blockwise`
/ :class:`Ternary` (values), :class:`RiceIndices` (indices), :class:`Zstd` / :class:`Nvcomp` (lossless bytes).
Importing this package registers the codecs and their wire encodings (see :mod:`gpu_codec.codecs._wire`).

>>> from gpu_codec.codecs import get_codec, registered_codecs
>>> registered_codecs()
['int8', 'nvcomp', 'quantize', 'rice', 'ternary', 'topk', 'zstd']
>>> get_codec({"id": "int8", "block_size": 64}).get_config()
{'id': 'int8', 'block_size': 64}
"""

from . import _wire  # noqa: F401 - registers the wire encodings
from .base import Codec
from .nvcomp import Nvcomp
from .pipeline import Pipeline
from .quantize import Int8Blockwise, Quantize
from .registry import get_codec, register_codec, registered_codecs
from .rice import RiceIndices
from .ternary import Ternary
from .topk import TopK
from .zstd import Zstd

__all__ = [
    "Codec",
    "Int8Blockwise",
    "Nvcomp",
    "Pipeline",
    "Quantize",
    "RiceIndices",
    "Ternary",
    "TopK",
    "Zstd",
    "get_codec",
    "register_codec",
    "registered_codecs",
]
