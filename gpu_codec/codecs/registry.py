"""The codec registry: ``get_codec({"id": ..., ...})`` and ``register_codec(cls)`` (numcodecs style).

The built-in codecs are registered here, by name, in one list (:data:`BUILTIN`); nothing registers itself on
import. The registry also gathers the wire forms of the value and index codecs and the bytes codecs' wrapper
encodings into the layout rules a reader needs (:func:`wire_layouts`).

>>> from gpu_codec.codecs import get_codec
>>> get_codec({"id": "topk", "fraction": 0.01})
TopK(fraction=0.01, scope='global', score='magnitude')
>>> get_codec({"id": "lzma"})
Traceback (most recent call last):
...
gpu_codec.errors.UnknownCodecError: codec id 'lzma' is not registered (known: int8, nvcomp, quantize, ...)
>>> sorted(wire_layouts())
['coo', 'dense', 'dense_q', 'nvcomp', 'sparse', 'zstd']
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..errors import CodecConfigError, UnknownCodecError
from ..format.schema import WireTables
from .base import STAGES, BytesCodec, Codec, Form, IndexCodec, ValueCodec
from .nvcomp import Nvcomp
from .quantize import Int8Blockwise, Quantize
from .rice import RawIndices, RiceIndices
from .ternary import Ternary
from .topk import TopK
from .wire import build_layouts
from .zstd import Zstd

BUILTIN: tuple[type[Codec], ...] = (TopK, Quantize, Int8Blockwise, Ternary, RiceIndices, Zstd, Nvcomp)

_REGISTRY: dict[str, type[Codec]] = {}
_lock = threading.Lock()
_layouts: WireTables | None = None


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register a codec class under its ``codec_id`` (replacing any class of that id); usable as a decorator.

    A value or index codec brings its wire forms along, a bytes codec its wrapper encoding. Wire codes (a codec's
    ``wire_code``, a form's ``code``) belong to the built-in codecs: a codec of one's own leaves them None, and
    its config and forms are written by name, with the fields it declares.
    """
    global _layouts
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecConfigError(f"register_codec takes a Codec subclass, got {cls!r}")
    if not isinstance(cls.codec_id, str) or not cls.codec_id:
        raise CodecConfigError(f"{cls.__name__} has no codec_id")
    if cls.stage not in STAGES:
        raise CodecConfigError(f"{cls.__name__}.stage must be one of {list(STAGES)}, got {cls.stage!r}")
    builtin_forms = {id(f) for c in BUILTIN for f in getattr(c, "forms", ())}
    if cls not in BUILTIN and (
        cls.__dict__.get("wire_code") is not None
        or any(f.code is not None and id(f) not in builtin_forms for f in getattr(cls, "forms", ()))
    ):
        raise CodecConfigError(
            f"{cls.__name__}: wire codes are fixed for the built-in codecs; leave wire_code and each form's code "
            "None (a codec of its own is written by its id and tags)"
        )
    with _lock:
        _REGISTRY[cls.codec_id] = cls
        _layouts = None
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


def _forms(kind: type[Codec], always: tuple[type[Codec], ...]) -> dict[str, Form]:
    out: dict[str, Form] = {}
    for cls in (*always, *_REGISTRY.values()):
        if issubclass(cls, kind):
            for f in cls.forms:  # type: ignore[attr-defined]
                out[f.tag] = f
    return out


def value_forms() -> dict[str, Form]:
    """Value forms by tag (``f32``, ``f16``, ``bf16``, ``int8``, ``ternary``, ...)."""
    return _forms(ValueCodec, (Quantize,))


def index_forms() -> dict[str, Form]:
    """Index forms by tag: ``raw`` (the engine's own indices, always known) and those of index codecs."""
    return _forms(IndexCodec, (RawIndices,))


def wire_layouts() -> WireTables:
    """Layout rules of every encoding the registered codecs write, and the compact table's declarations of their
    configs and forms, for :func:`gpu_codec.format.pack` and :func:`gpu_codec.format.unpack`."""
    global _layouts
    with _lock:
        if _layouts is None:
            wrappers = {c.encoding: c for c in _REGISTRY.values() if issubclass(c, BytesCodec)}
            vf, inf = value_forms(), index_forms()
            # a config is stored by its code only for the built-in codec of that id (one of one's own, even a
            # subclass of a built-in one, is stored as JSON)
            specs = [s for s in (c.stage_spec() for c in _REGISTRY.values() if c in BUILTIN) if s is not None]
            _layouts = WireTables(
                build_layouts(vf, inf, wrappers),
                specs,
                {t: f.spec() for t, f in vf.items()},
                {t: f.spec() for t, f in inf.items()},
            )
        return _layouts


for _cls in BUILTIN:
    register_codec(_cls)
