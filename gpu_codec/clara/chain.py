"""Processor chains, processors built from Clara component configs, and (de)serialization of a data context."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .. import engine as _engine
from ..errors import InvalidInputError
from .context import ENVELOPE_MAGIC, AppContext, DataContext, ProcessingAbortedError, ProcessorOrderError
from .encryption import ModelDecryptor, ModelEncryptor
from .metadata import BestMetricGenerator, InitialValidationMetricGenerator, IteratorNumberGenerator
from .processors import DataCompressor, DataDeCompressor, DataProcessor
from .round_robin import RoundRobinClientFieldProcessor, RoundRobinClientStateProcessor
from .visualizers import TensorboardModelVisualizer

__all__ = ["PROCESSORS", "ProcessorChain", "build_processor", "deserialize", "serialize"]

PROCESSORS: dict[str, type[DataProcessor]] = {
    c.__name__: c
    for c in (
        DataCompressor,
        DataDeCompressor,
        ModelEncryptor,
        ModelDecryptor,
        IteratorNumberGenerator,
        BestMetricGenerator,
        InitialValidationMetricGenerator,
        RoundRobinClientFieldProcessor,
        RoundRobinClientStateProcessor,
        TensorboardModelVisualizer,
    )
}


def build_processor(config: Mapping[str, Any]) -> DataProcessor:
    """A processor from a Clara component config: ``{"name": "DataCompressor", "args": {...}}``, or
    ``{"path": "package.module.Class", "args": {...}}`` for your own component."""
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"a processor config must be a dict with 'name' (or 'path') and 'args', got {config!r}")
    args = config.get("args", {}) or {}
    if not isinstance(args, Mapping):
        raise InvalidInputError(f"processor 'args' must be a dict, got {args!r}")
    if "path" in config:
        mod, _, cls_name = str(config["path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
        except (ImportError, AttributeError, ValueError) as e:
            raise InvalidInputError(f"cannot load processor {config['path']!r}: {e}") from None
    else:
        name = config.get("name")
        if name not in PROCESSORS:
            raise InvalidInputError(f"unknown processor {name!r}; known: {sorted(PROCESSORS)} (or give 'path')")
        cls = PROCESSORS[name]
    try:
        proc = cls(**args)
    except TypeError as e:
        raise InvalidInputError(
            f"processor {config.get('name') or config.get('path')!r}: bad args {dict(args)}: {e}"
        ) from None
    if not isinstance(proc, DataProcessor) and not (hasattr(proc, "process") and hasattr(proc, "abort")):
        raise InvalidInputError(f"{type(proc).__name__} is not a DataProcessor (needs process and abort)")
    return proc


class ProcessorChain:
    """Clara's processor lists. ``pre_processors`` run in order on the way out (:meth:`process_outgoing`);
    ``post_processors`` run in reverse on the way in (:meth:`process_incoming`), so each is listed beside the
    pre-processor it undoes. Without ``post_processors`` the inverses of the pre-processors are used.

    ``reverse_post=False`` runs ``post_processors`` in the order listed instead (a list already written in run
    order). If a processor raises or the chain is aborted, the data context is restored to what it was.
    """

    def __init__(
        self,
        pre_processors: Sequence[Any] = (),
        post_processors: Sequence[Any] | None = None,
        *,
        reverse_post: bool = True,
    ) -> None:
        self.pre_processors = [p if not isinstance(p, Mapping) else build_processor(p) for p in pre_processors]
        if post_processors is None:
            post = [p.inverse() for p in self.pre_processors if hasattr(p, "inverse")]
            self.post_processors = [p for p in post if p is not None]
            reverse_post = True
        else:
            self.post_processors = [p if not isinstance(p, Mapping) else build_processor(p) for p in post_processors]
        self.reverse_post = reverse_post
        self._aborted = threading.Event()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, reverse_post: bool = True) -> ProcessorChain:
        """From a Clara config section holding ``pre_processors`` and (optionally) ``post_processors``."""
        post = config.get("post_processors")
        return cls(config.get("pre_processors", []), post, reverse_post=reverse_post)

    def process_outgoing(self, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        """Run the pre-processors in order (before sending)."""
        return self._run(self.pre_processors, data_ctx, app_ctx)

    def process_incoming(self, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        """Run the post-processors (after receiving)."""
        procs = self.post_processors[::-1] if self.reverse_post else self.post_processors
        return self._run(procs, data_ctx, app_ctx)

    def abort(self, app_ctx: AppContext | None = None) -> None:
        """Stop the run in progress (or the next one) between or inside processors."""
        self._aborted.set()
        for p in self.pre_processors + self.post_processors:
            p.abort(app_ctx)

    def _run(self, procs: list, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        saved = dict(data_ctx)
        saved_meta = dict(data_ctx.get(DataContext.METADATA, {}))
        try:
            for p in procs:
                if self._aborted.is_set():
                    raise ProcessingAbortedError("the processor chain was aborted")
                p.process(data_ctx, app_ctx)
        except BaseException:
            data_ctx.clear()
            data_ctx.update(saved)
            data_ctx[DataContext.METADATA] = saved_meta
            self._reset()
            raise
        self._reset()
        return data_ctx

    def _reset(self) -> None:
        self._aborted.clear()
        for p in self.pre_processors + self.post_processors:
            if hasattr(p, "_reset_abort"):
                p._reset_abort()


def serialize(data_ctx: DataContext) -> bytes:
    """The bytes to send: the encrypted model, or the compressed model's wire format (a payload made on the GPU
    is copied to the host here, once)."""
    model = data_ctx.get_model()
    if isinstance(model, _engine.Payload):
        return model.to_bytes()
    if isinstance(model, (bytes, bytearray, memoryview)):
        return bytes(model)
    raise ProcessorOrderError(
        "the model is neither compressed nor encrypted: run DataCompressor or ModelEncryptor before serializing"
    )


def deserialize(blob: bytes | bytearray | memoryview, **props: Any) -> DataContext:
    """A data context holding received bytes, ready for the post-processors (encrypted bytes stay opaque until
    ModelDecryptor; a plain payload is parsed and validated now)."""
    b = bytes(blob)
    model: Any = b if b[: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC else _engine.Payload.from_bytes(b)
    return DataContext(model=model, **props)
