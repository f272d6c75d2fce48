"""Helpers shared by the framework adapters (:mod:`gpu_codec.clara`, :mod:`gpu_codec.openfl`,
:mod:`gpu_codec.fl4health`, :mod:`gpu_codec.flower`).

They call the engine and nothing else: engine calls that also run on an engine without codec pipelines (dense
becomes ``fraction=1.0``, which is lossless), and moves between backend arrays and torch tensors that never pass
through the host when both sides are on the GPU.

>>> import numpy as np
>>> p = engine_compress({"w": np.array([1., -3., 2.], np.float32)}, fraction=None)   # dense: every entry kept
>>> p.nnz, is_lossy(None, None), is_lossy(0.5, None)
(3, False, True)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import engine as _engine
from .arrays import array_kind
from .errors import InvalidInputError

# Codec stage ids that only re-encode bytes or integers (never change a value). Used only where gpu_codec has
# no codec registry to ask.
_KNOWN_LOSSLESS = frozenset({"zstd", "rice", "lz4", "zlib", "gzip", "deflate", "bitshuffle", "shuffle", "delta_index"})


def _engine_params() -> Mapping[str, inspect.Parameter]:
    return inspect.signature(_engine.compress).parameters


def pipeline_configs(pipeline: Any) -> list[dict] | None:
    """Normalize a codec pipeline (None, a list of stage configs, or a ``gpu_codec.Pipeline``) to stage configs."""
    if pipeline is None:
        return None
    if hasattr(pipeline, "get_config"):
        cfg = pipeline.get_config()
        if isinstance(cfg, Mapping) and "stages" in cfg:
            cfg = cfg["stages"]
        pipeline = cfg
    if isinstance(pipeline, Mapping) or not isinstance(pipeline, Sequence) or isinstance(pipeline, (str, bytes)):
        raise InvalidInputError(
            f"a codec pipeline must be a list of stage configs like [{{'id': 'zstd'}}] or a "
            f"gpu_codec.Pipeline, got {type(pipeline).__name__}"
        )
    out = []
    for i, stage in enumerate(pipeline):
        if hasattr(stage, "get_config"):  # a codec object
            stage = stage.get_config()
        if not isinstance(stage, Mapping) or not isinstance(stage.get("id"), str):
            raise InvalidInputError(f"pipeline stage {i} must be a dict with a string 'id', got {stage!r}")
        out.append(dict(stage))
    return out


def is_lossy(fraction: float | None, pipeline: Any) -> bool:
    """Whether compressing with this top-k fraction and these codec stages can change a value."""
    if fraction is not None and float(fraction) < 1.0:
        return True
    stages = pipeline_configs(pipeline)
    if not stages:
        return False
    import gpu_codec

    if hasattr(gpu_codec, "Pipeline"):
        return bool(gpu_codec.Pipeline.from_config(stages).is_lossy())
    if hasattr(gpu_codec, "get_codec"):
        return any(not getattr(gpu_codec.get_codec(s), "lossless", False) for s in stages)
    return any(s["id"] not in _KNOWN_LOSSLESS for s in stages)


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
    """:func:`gpu_codec.compress`, with ``fraction=None`` (dense) and ``pipeline`` mapped onto what this engine has.

    An engine without dense support gets ``fraction=1.0``: every entry kept, exactly (a lossless encoding).
    An engine without codec pipelines refuses a pipeline with a clear error rather than ignoring it.
    """
    params = _engine_params()
    kw: dict[str, Any] = {"scope": scope, "score": score, "metadata": metadata}
    stages = pipeline_configs(pipeline)
    if stages:
        if "pipeline" not in params:
            raise InvalidInputError(
                "this gpu_codec build has no codec pipelines (gpu_codec.codecs is missing); "
                f"cannot apply stages {[s['id'] for s in stages]}"
            )
        kw["pipeline"] = stages
    if fraction is None:
        try:
            return _engine.compress(update, base, fraction=None, **kw)
        except InvalidInputError as e:
            if "fraction must be a number" not in str(e):
                raise
            fraction = 1.0  # an engine without dense mode: keep every entry, which is exact
    return _engine.compress(update, base, fraction=fraction, **kw)


# ---------------------------------------------------------------- torch <-> backend arrays


def backend_to_torch(a: Any, device: Any = None) -> Any:
    """A NumPy or CuPy array as a torch tensor on ``device``: zero-copy (DLPack, or shared host memory) where the
    array already lives there; one copy of just this array otherwise."""
    import torch

    if type(a).__module__.startswith("cupy"):
        t = torch.from_dlpack(a)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    if device is not None and t.device != torch.device(device):
        t = t.to(device)
    return t


def torch_to_backend(t: Any, on_device: bool) -> Any:
    """A torch tensor as the backend's array kind (CuPy on the GPU backend, NumPy otherwise), zero-copy where the
    memory allows. bfloat16 becomes its uint16 bit pattern."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    t = t.contiguous()
    if t.is_cuda:
        import cupy

        a = cupy.from_dlpack(t)
        return a if on_device else cupy.asnumpy(a)
    a = t.numpy()
    if on_device:
        import cupy

        return cupy.asarray(a)
    return a


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
    """``value`` if it survives a JSON round trip unchanged in kind (str, finite numbers, bools, None, lists and
    str-keyed dicts of those); else raises InvalidInputError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if not math.isfinite(f):
            raise InvalidInputError(f"metadata value {value!r} is not finite")
        return f
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidInputError(f"metadata keys must be strings, got {k!r}")
            out[k] = json_safe(v)
        return out
    raise InvalidInputError(f"metadata value of type {type(value).__name__} cannot travel in a payload header")
