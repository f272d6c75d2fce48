"""The codec contract (numcodecs style): a stable ``codec_id``, a config that is exactly the constructor's
arguments plus ``"id"``, ``from_config`` to rebuild it, and a ``lossless`` flag (OpenFL's ``lossy``, inverted).

Every stage of a :class:`~gpu_codec.Pipeline` is a codec of one ``stage`` kind, in this order:
``"sparsify"`` (top-k), ``"values"`` (how kept values are stored), ``"indices"`` (how kept positions are
stored), ``"bytes"`` (a lossless compressor over each tensor's buffers). Runtime state never enters a config.

>>> from gpu_codec.codecs import Quantize
>>> q = Quantize("float16")
>>> q.get_config(), q.lossless
({'id': 'quantize', 'dtype': 'float16'}, False)
>>> Quantize.from_config(q.get_config()) == q
True
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import CodecConfigError

STAGES = ("sparsify", "values", "indices", "bytes")


class Codec:
    """Base class of every codec. Subclasses set ``codec_id`` and ``stage`` and store each constructor
    argument under an attribute of the same name."""

    codec_id: ClassVar[str] = ""
    stage: ClassVar[str] = ""

    @classmethod
    def _params(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p for p in sig.parameters if p != "self"]

    def get_config(self) -> dict[str, Any]:
        """A JSON dict: ``{"id": codec_id, <each constructor argument>: value}``."""
        return {"id": self.codec_id, **{p: getattr(self, p) for p in self._params()}}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Rebuild a codec from :meth:`get_config`'s dict (missing arguments take their defaults)."""
        if not isinstance(config, Mapping):
            raise CodecConfigError(f"a codec config must be a mapping, got {type(config).__name__}")
        cfg = dict(config)
        cid = cfg.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise CodecConfigError(f"config id {cid!r} does not match codec {cls.codec_id!r}")
        unknown = sorted(set(cfg) - set(cls._params()))
        if unknown:
            raise CodecConfigError(f"codec {cls.codec_id!r} takes {cls._params()}, got unknown field(s) {unknown}")
        return cls(**cfg)

    @property
    def lossless(self) -> bool:
        """True where decoding gives back exactly what was encoded."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash((self.codec_id, tuple(sorted((k, repr(v)) for k, v in self.get_config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self._params())
        return f"{type(self).__name__}({args})"


def check_choice(codec: str, name: str, value: Any, choices: tuple) -> Any:
    if not isinstance(value, str) or value not in choices:
        raise CodecConfigError(f"{codec}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def check_int(codec: str, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecConfigError(f"{codec}: {name} must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise CodecConfigError(f"{codec}: {name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def check_fraction(codec: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CodecConfigError(f"{codec}: {name} must be a number in (0, 1], got {type(value).__name__} {value!r}")
    f = float(value)
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise CodecConfigError(f"{codec}: {name} must be in (0, 1], got {value!r}")
    return f
