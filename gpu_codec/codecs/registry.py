"""The codec registry: ``get_codec({"id": ..., ...})`` and ``register_codec(cls)`` (numcodecs style).

>>> from gpu_codec.codecs import get_codec
>>> get_codec({"id": "topk", "fraction": 0.01})
TopK(fraction=0.01, scope='global', score='magnitude')
>>> get_codec({"id": "lzma"})
Traceback (most recent call last):
...
gpu_codec.errors.UnknownCodecError: codec id 'lzma' is not registered (known: int8, nvcomp, quantize, ...)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CodecConfigError, UnknownCodecError
from .base import STAGES, Codec

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register a codec class under its ``codec_id`` (replacing any class of that id); usable as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecConfigError(f"register_codec takes a Codec subclass, got {cls!r}")
    if not isinstance(cls.codec_id, str) or not cls.codec_id:
        raise CodecConfigError(f"{cls.__name__} has no codec_id")
    if cls.stage not in STAGES:
        raise CodecConfigError(f"{cls.__name__}.stage must be one of {list(STAGES)}, got {cls.stage!r}")
    _REGISTRY[cls.codec_id] = cls
    return cls


def registered_codecs() -> list[str]:
    return sorted(_REGISTRY)


def get_codec(config: Mapping[str, Any]) -> Codec:
    """Build a codec from its config dict. Unknown id: :class:`~gpu_codec.errors.UnknownCodecError`; bad fields:
    :class:`~gpu_codec.errors.CodecConfigError`."""
    if not isinstance(config, Mapping):
        raise CodecConfigError(f"a codec config must be a mapping with an 'id', got {type(config).__name__}")
    cid = config.get("id")
    if not isinstance(cid, str):
        raise CodecConfigError(f"a codec config needs a string 'id', got {cid!r}")
    cls = _REGISTRY.get(cid)
    if cls is None:
        raise UnknownCodecError(f"codec id {cid!r} is not registered (known: {', '.join(registered_codecs())})")
    return cls.from_config(config)
