"""Processors: the base class, and the compressor / decompressor pair on the gpu_codec engine."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .. import adapt
from .. import engine as _engine
from ..errors import InvalidInputError
from .context import (
    CLARA_KEY,
    CLARA_META_KEY,
    ENVELOPE_MAGIC,
    AppContext,
    DataContext,
    ProcessingAbortedError,
    ProcessorOrderError,
)

__all__ = ["DataCompressor", "DataDeCompressor", "DataProcessor", "decode_payload", "header_metadata", "payload_of"]


class DataProcessor:
    """Base of every processor: ``process(data_ctx, app_ctx)`` transforms the data context in place;
    ``abort(app_ctx)`` (from any thread) stops the run in progress, or the next run if none is."""

    def __init__(self) -> None:
        self._aborted = threading.Event()

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        raise NotImplementedError

    def abort(self, app_ctx: AppContext) -> None:
        self._aborted.set()

    def _check_abort(self) -> None:
        if self._aborted.is_set():
            raise ProcessingAbortedError(f"{type(self).__name__} was aborted")

    def _reset_abort(self) -> None:
        self._aborted.clear()

    def inverse(self) -> DataProcessor | None:
        """The processor that undoes this one on the receiving side (None where nothing needs undoing)."""
        return None

    def get_config(self) -> dict[str, Any]:
        return {}


def _require_mapping_model(model: Any, who: str) -> Mapping[str, Any]:
    if isinstance(model, (bytes, bytearray, memoryview)):
        if bytes(model[: len(ENVELOPE_MAGIC)]) == ENVELOPE_MAGIC:
            raise ProcessorOrderError(
                f"{who} got an encrypted model: list it before ModelEncryptor in "
                "pre_processors (compress first, then encrypt)"
            )
        raise ProcessorOrderError(f"{who} got a serialized model; it takes a mapping name -> tensor")
    if isinstance(model, _engine.Payload):
        raise ProcessorOrderError(f"{who} got a model that is already compressed")
    if not isinstance(model, Mapping):
        raise InvalidInputError(
            f"{who}: the data context's model must be a mapping name -> tensor, got {type(model).__name__}"
        )
    return model


def _base_for(model: Mapping[str, Any], app_ctx: AppContext, who: str) -> dict[str, Any]:
    glob = app_ctx.global_model
    if not isinstance(glob, Mapping):
        raise InvalidInputError(
            f"{who}: the app context holds no global model (app_ctx['global_model']) to take the delta against"
        )
    missing = [n for n in model if n not in glob]
    if missing:
        raise InvalidInputError(f"{who}: the global model lacks tensors {missing[:5]}")
    return {n: glob[n] for n in model}


def header_metadata(data_ctx: DataContext, delta: bool, app_ctx: AppContext) -> dict[str, Any]:
    return {
        CLARA_KEY: {"delta": delta, "round": adapt.json_safe(app_ctx.round_number)},
        CLARA_META_KEY: adapt.json_safe(data_ctx.get_all_metadata()),
    }


class DataCompressor(DataProcessor):
    """Compress the data context's model in place: a :class:`~gpu_codec.Payload` replaces it (on the GPU when the
    model is there).

    Parameters
    ----------
    fraction, scope, score, pipeline
        As for :func:`gpu_codec.compress` (``fraction=None``: dense, every entry). ``fraction`` applies to a
        delta: ``model - global_model``, or with ``delta=False`` the model as given (a delta already, as an
        NVFlare ``WEIGHT_DIFF``).
    delta
        ``"auto"`` (the default): compress ``model - global_model`` when the app context holds a global model,
        else the model itself, dense through the pipeline's value and bytes stages (top-k of raw weights would
        send 1% of the model and zero the rest; Clara's own configs list ``DataCompressor`` with no arguments,
        on the server's way down as on the client's way up); ``True``: require the global model; ``False``:
        never (the model is a delta already: ``fraction`` applies to it).

    The data context's metadata (JSON values only) travels in the payload header, so the receiver's
    :class:`DataDeCompressor` restores it.
    """

    def __init__(
        self,
        fraction: float | None = 0.01,
        scope: str = "global",
        score: str = "magnitude",
        pipeline: Any = None,
        delta: bool | str = "auto",
    ) -> None:
        super().__init__()
        if delta not in (True, False, "auto"):
            raise InvalidInputError(f"delta must be True, False or 'auto', got {delta!r}")
        self.fraction = None if fraction is None else _engine.check_fraction(fraction)
        self.scope = scope
        self.score = score
        self.pipeline = adapt.pipeline_configs(pipeline)
        self.delta = delta

    def get_config(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "scope": self.scope,
            "score": self.score,
            "pipeline": self.pipeline,
            "delta": self.delta,
        }

    def inverse(self) -> DataDeCompressor:
        return DataDeCompressor()

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To compress the data_ctx."""
        self._check_abort()
        model = _require_mapping_model(data_ctx.get_model(), "DataCompressor")
        use_delta = self.delta is True or (self.delta == "auto" and isinstance(app_ctx.global_model, Mapping))
        base = _base_for(model, app_ctx, "DataCompressor") if use_delta else None
        fraction, pipeline = self.fraction, self.pipeline
        if self.delta == "auto" and not use_delta:  # (the model itself, whole weights: dense)
            fraction, pipeline = None, adapt.dense_stages(pipeline)
        payload = adapt.engine_compress(
            model,
            base,
            fraction=fraction,
            scope=self.scope,
            score=self.score,
            pipeline=pipeline,
            metadata=header_metadata(data_ctx, use_delta, app_ctx),
        )
        self._check_abort()
        data_ctx.set_model(payload)


def payload_of(model: Any, who: str) -> Any:
    if isinstance(model, _engine.Payload):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        if bytes(model[: len(ENVELOPE_MAGIC)]) == ENVELOPE_MAGIC:
            raise ProcessorOrderError(f"{who} got an encrypted model: ModelDecryptor must run before it")
        return _engine.Payload.from_bytes(model)
    if isinstance(model, Mapping):
        raise ProcessorOrderError(f"{who} got a model that is not compressed")
    raise InvalidInputError(f"{who}: expected a Payload or bytes, got {type(model).__name__}")


def decode_payload(
    payload: Any, app_ctx: AppContext | None, local: Mapping[str, Any] | None, like: str | None, who: str
) -> dict[str, Any]:
    """Dense tensors from a payload: ``base + delta`` when the payload is a delta (base: ``local`` if given, else
    the app context's global model), else the values, in their own dtypes."""
    info = payload.metadata.get(CLARA_KEY, {})
    names = [r.name for r in payload.tensors]
    if isinstance(info, Mapping) and info.get("delta"):
        src = local if local is not None else (app_ctx.global_model if app_ctx is not None else None)
        if not isinstance(src, Mapping):
            raise InvalidInputError(f"{who}: the payload is a delta but there is no global model to add it to")
        missing = [n for n in names if n not in src]
        if missing:
            raise InvalidInputError(f"{who}: the base model lacks tensors {missing[:5]}")
        return _engine.decompress(payload, base={n: src[n] for n in names})
    kind = like or "numpy"
    dense = _engine.decompress(payload, like=kind)
    return {r.name: adapt.cast_to_logical(dense[r.name], r.dtype, kind) for r in payload.tensors}


class DataDeCompressor(DataProcessor):
    """Undo :class:`DataCompressor`: the payload (object or bytes) becomes dense tensors again, ``global_model +
    delta`` for a delta (as the global model's kind, on its device), else the values as ``like`` (``"numpy"``,
    ``"cupy"`` or ``"torch"``). The metadata the sender attached is restored into the data context."""

    def __init__(self, like: str | None = None) -> None:
        super().__init__()
        if like not in (None, "numpy", "cupy", "torch"):
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        self.like = like

    def get_config(self) -> dict[str, Any]:
        return {"like": self.like}

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To decompress the data_ctx."""
        self._check_abort()
        payload = payload_of(data_ctx.get_model(), "DataDeCompressor")
        dense = decode_payload(payload, app_ctx, None, self.like, "DataDeCompressor")
        self._check_abort()
        sent = payload.metadata.get(CLARA_META_KEY, {})
        if isinstance(sent, Mapping):
            for k, v in sent.items():
                data_ctx.add_metadata(k, v)
        data_ctx.set_model(dense)
