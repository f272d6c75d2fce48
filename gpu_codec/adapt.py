"""Helpers shared by the framework adapters (:mod:`gpu_codec.clara`, :mod:`gpu_codec.openfl`,
:mod:`gpu_codec.fl4health`, :mod:`gpu_codec.flower`).

They use the public engine API and nothing below it: pipeline spellings normalized, lossiness, casts back to a
tensor's own dtype, JSON-safe metadata. Moves between backend arrays and torch tensors are the one torch bridge
in :mod:`gpu_codec.arrays`, re-exported here for the adapters.

>>> import numpy as np
>>> p = engine_compress({"w": np.array([1., -3., 2.], np.float32)}, fraction=None)   # dense: every entry kept
>>> p.nnz, is_lossy(None, None), is_lossy(0.5, None)
(3, False, True)
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import engine as _engine
from .arrays import (  # noqa: F401 - the adapters' torch bridge and their check of a received array's shape
    array_kind,
    backend_to_torch,
    declared_shape_problem,
    torch_to_backend,
)
from .codecs import Pipeline, as_pipeline
from .errors import CodecConfigError, InvalidInputError, UnknownCodecError
from .format.common import as_uint8


def pipeline_configs(pipeline: Any) -> list[dict] | None:
    """A codec pipeline (None, a list of codecs or stage configs, or a ``gpu_codec.Pipeline``) as stage configs,
    checked by :func:`gpu_codec.codecs.as_pipeline` (the one normalisation: unknown codecs, bad fields and stages out
    of order are refused here, as InvalidInputError naming the pipeline)."""
    if pipeline is None:
        return None
    try:
        return as_pipeline(pipeline).get_config()
    except (CodecConfigError, UnknownCodecError) as e:
        raise InvalidInputError(str(e)) from None


def dense_stages(stages: list[dict] | None) -> list[dict] | None:
    """The stage configs that apply to a dense update (every entry sent): index and top-k stages have nothing to
    work on there.

    >>> dense_stages([{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}])
    [{'id': 'quantize', 'dtype': 'float16'}, {'id': 'zstd', 'level': 3}]
    """
    if not stages:
        return stages
    from .codecs import get_codec

    return [s for s in stages if get_codec(s).stage not in ("indices", "sparsify")]


def restart_if_changed(residual: Any, update: Mapping[str, Any], whole: bool = False) -> list[str]:
    """Forget an error-feedback state (:class:`~gpu_codec.ErrorFeedback`) where the model it was kept for has
    changed: a tensor of ``update`` (name -> float array) whose dtype or shape is not its residual's (a strategy
    that returns the model in another dtype, as flwr's FedAdam gives float64 for float32; a resized layer). Each
    such residual would be refused against every update from then on; what is lost is one round's dropped
    entries. ``whole``: ``update`` is every tensor the state is kept for, so a residual whose tensor it lacks (a
    layer removed or renamed) is discarded alone, the others kept. Returns what changed (empty: the state is kept).

    >>> import numpy as np, gpu_codec
    >>> ef = gpu_codec.ErrorFeedback()
    >>> _ = gpu_codec.compress({"w": np.ones(4, np.float32)}, fraction=0.5, residual=ef)
    >>> restart_if_changed(ef, {"w": np.ones(4, np.float32)}), len(ef)
    ([], 1)
    >>> restart_if_changed(ef, {"w": np.ones(4)}), len(ef)
    (["'w' float32[4] -> float64[4]"], 0)
    >>> two = {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)}
    >>> _ = gpu_codec.compress(two, fraction=0.5, residual=ef)
    >>> restart_if_changed(ef, {"v": np.ones(4, np.float32)}, whole=True), ef.names()
    (["'w' is gone"], ['v'])
    """
    from .arrays import to_tensor

    was = residual.layout()
    changed = []
    for n in [n for n in update if n in was]:
        t = to_tensor(update[n], n)
        if was[n] != (t.dtype, tuple(t.shape)):
            changed.append(f"{n!r} {was[n][0]}{list(was[n][1])} -> {t.dtype}{list(t.shape)}")
    if changed:
        residual.reset()
        return changed
    gone = [n for n in was if n not in update] if whole else []
    residual.discard(gone)
    return [f"{n!r} is gone" for n in gone]


def content_key(model: Mapping[str, Any]) -> tuple | None:
    """What a model holds, to tell a model changed in place from the one a cache was made for: each entry's name,
    dtype, shape and a CRC-32 of its bytes (host NumPy arrays, or objects with ``dtype``, ``shape`` and ``data``
    bytes, as Flower's ``Array``); None where an entry is neither (a cache then is not to be trusted). One read of
    the model, no copy of a contiguous one.

    >>> import numpy as np
    >>> m = {"w": np.zeros(3, np.float32)}
    >>> k = content_key(m)
    >>> m["w"][1] = 2.0
    >>> content_key(m) == k, content_key({"w": [1.0]})
    (False, None)
    """
    out = []
    for name, v in model.items():
        if isinstance(v, np.ndarray) and not v.dtype.hasobject:
            out.append((name, v.dtype.str, v.shape, zlib.crc32(as_uint8(v))))
        elif isinstance(getattr(v, "data", None), (bytes, bytearray)) and hasattr(v, "dtype") and hasattr(v, "shape"):
            out.append((name, str(v.dtype), tuple(v.shape), zlib.crc32(v.data)))
        else:
            return None
    return tuple(out)


def is_lossy(fraction: float | None, pipeline: Any) -> bool:
    """Whether compressing with this top-k fraction and these codec stages can change a value."""
    if fraction is not None and float(fraction) < 1.0:
        return True
    stages = pipeline_configs(pipeline)
    return bool(stages) and Pipeline.from_config(stages).is_lossy()


def engine_compress(
    update: Mapping[str, Any],
    base: Mapping[str, Any] | None = None,
    *,
    fraction: float | None = 0.01,
    scope: str = "global",
    score: Any = "magnitude",
    pipeline: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> Any:
    """:func:`gpu_codec.compress` with the adapters' pipeline spellings (a list of configs, codec objects or a
    :class:`~gpu_codec.Pipeline`) normalized; ``fraction=None`` is dense."""
    return _engine.compress(
        update,
        base,
        fraction=fraction,
        scope=scope,
        score=score,
        pipeline=pipeline_configs(pipeline),
        metadata=metadata,
    )


def cast_to_logical(x: Any, logical: str, kind: str) -> Any:
    """A decompressed delta (fp32, or fp64) cast back to the tensor's own dtype: fp16 as fp16, bfloat16 as torch
    bfloat16 (NumPy and CuPy keep fp32, having no bfloat16)."""
    if logical in ("float32", "float64") or (logical == "bfloat16" and kind != "torch"):
        return x
    if kind == "torch":
        import torch

        return x.to(getattr(torch, logical))
    return x.astype(logical)


def is_torch(x: Any) -> bool:
    try:
        return array_kind(x) == "torch"
    except InvalidInputError:
        return False


def json_safe(value: Any) -> Any:
    """A framework's metadata value as a payload header holds it (:func:`gpu_codec.engine.check_json`, NumPy
    scalars taken as numbers); else raises InvalidInputError."""
    return _engine.check_json(value, numpy_scalars=True)
