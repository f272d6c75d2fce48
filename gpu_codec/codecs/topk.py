"""Top-k sparsification as a codec: the first stage of a sparse pipeline (the engine runs it).

>>> from gpu_codec.codecs import TopK
>>> TopK(0.01).get_config()
{'id': 'topk', 'fraction': 0.01, 'scope': 'global', 'score': 'magnitude'}
>>> TopK(0.01).lossless, TopK(1.0).lossless
(False, True)
"""

from __future__ import annotations

from .. import dtypes
from ..dtypes import SCOPES
from .base import Codec, check_choice, check_fraction
from .registry import register_codec

SCORES = (*dtypes.CRITERIA, "custom")  # "custom": a callable score (a config can only describe, not rebuild, it)


@register_codec
class TopK(Codec):
    """Keep k = ceil(fraction x N) entries of largest score, globally or per tensor (see :func:`gpu_codec.compress`)."""

    codec_id = "topk"
    stage = "sparsify"

    def __init__(self, fraction: float = 0.01, scope: str = "global", score: str = "magnitude"):
        self.fraction = check_fraction("topk", "fraction", fraction)
        self.scope = check_choice("topk", "scope", scope, SCOPES)
        self.score = check_choice("topk", "score", score, SCORES)

    @property
    def lossless(self) -> bool:
        return self.fraction == 1.0
