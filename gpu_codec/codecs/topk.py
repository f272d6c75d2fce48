"""Top-k sparsification as a codec: the first stage of a sparse pipeline (the engine runs it).

>>> from gpu_codec.codecs import TopK
>>> TopK(0.01).get_config()
{'id': 'topk', 'fraction': 0.01, 'scope': 'global', 'score': 'magnitude'}
>>> TopK(0.01).lossless, TopK(1.0).lossless
(False, True)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from ..dtypes import SCOPES
from ..errors import CodecConfigError, InvalidInputError
from ..format.schema import Field
from .base import Codec, check_choice


def check_fraction(value: Any, name: str = "fraction", error: type[Exception] = InvalidInputError) -> float:
    """The one check of a kept fraction (the engine's, the codec's, every adapter's and the CLI's): a real number
    in (0, 1], raised as ``error`` naming ``name`` otherwise.

    >>> check_fraction(0.01)
    0.01
    >>> check_fraction(float("nan"))
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: fraction must be in (0, 1] (the share of entries kept), got nan
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise error(f"{name} must be a number in (0, 1], got {type(value).__name__} {value!r}")
    f = float(value)
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise error(f"{name} must be in (0, 1] (the share of entries kept), got {value!r}")
    return f


SCORES = (*dtypes.CRITERIA, "custom")  # "custom": a callable score (a config can only describe, not rebuild, it)


class TopK(Codec):
    """Keep k = ceil(fraction x N) entries of largest score, globally or per tensor (see :func:`gpu_codec.compress`)."""

    codec_id = "topk"
    stage = "sparsify"
    wire_code = 1
    wire_fields = (
        Field("fraction", "decimal"),
        Field("scope", "choice", choices=SCOPES),
        Field("score", "choice", choices=SCORES),
    )

    def __init__(self, fraction: float = 0.01, scope: str = "global", score: str = "magnitude"):
        self.fraction = check_fraction(fraction, "topk: fraction", CodecConfigError)
        self.scope = check_choice("topk", "scope", scope, SCOPES)
        self.score = check_choice("topk", "score", score, SCORES)

    @property
    def lossless(self) -> bool:
        return self.fraction == 1.0
