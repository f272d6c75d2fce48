"""The Clara contexts: the data context a processor chain works on, and the app context of the round."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import GpuCodecError, InvalidInputError

__all__ = [
    "CLARA_KEY",
    "CLARA_META_KEY",
    "ENVELOPE_MAGIC",
    "AppContext",
    "ApplicationContext",
    "ClaraError",
    "DataContext",
    "DecryptionError",
    "EncryptionKeyError",
    "FLContext",
    "MetricsError",
    "ProcessingAbortedError",
    "ProcessorOrderError",
]

CLARA_KEY = "gpu_codec.clara"  # payload metadata: {"delta": bool, "round": int}
CLARA_META_KEY = "clara.metadata"  # payload metadata: the data context's metadata, carried to the receiver
ENVELOPE_MAGIC = b"GCAESGCM"  # first bytes of a model encrypted by ModelEncryptor


# ---------------------------------------------------------------- errors


class ClaraError(GpuCodecError):
    """Base class of the Clara adapter's errors."""


class ProcessingAbortedError(ClaraError, RuntimeError):
    """A processor chain was aborted; the data context is as it was before the chain ran."""


class ProcessorOrderError(ClaraError, ValueError):
    """A processor got the model in a form it does not take (compressing an encrypted model, ...)."""


class EncryptionKeyError(ClaraError, InvalidInputError):
    """No key, or a key that is not 16, 24 or 32 bytes (raw, hex or base64), or not bytes at all."""


class DecryptionError(ClaraError, ValueError):
    """An encrypted model that fails authentication (tampered, or encrypted with another key). Nothing was decoded."""


class MetricsError(ClaraError, ValueError):
    """Metrics that are not finite numbers, or names outside the configured groups."""


# ---------------------------------------------------------------- contexts


class DataContext(dict):
    """What flows through a processor chain: the model (``"model"``), its metadata (``"metadata"``), and any
    other properties. The model is a mapping name -> tensor, a :class:`~gpu_codec.Payload`, or bytes."""

    MODEL = "model"
    METADATA = "metadata"

    def __init__(self, model: Any = None, metadata: Mapping[str, Any] | None = None, **props: Any) -> None:
        super().__init__(props)
        self[self.MODEL] = model
        self[self.METADATA] = dict(metadata or {})

    def get_model(self) -> Any:
        return self.get(self.MODEL)

    def set_model(self, model: Any) -> None:
        self[self.MODEL] = model

    def add_metadata(self, field: str, value: Any) -> None:
        self[self.METADATA][field] = value

    def get_metadata(self, field: str, default: Any = None) -> Any:
        return self[self.METADATA].get(field, default)

    def get_all_metadata(self) -> dict[str, Any]:
        return self[self.METADATA]

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self[self.METADATA] = dict(metadata)

    def get_prop(self, key: str, default: Any = None) -> Any:
        return self.get(key, default)

    def set_prop(self, key: str, value: Any) -> None:
        self[key] = value

    def set_props(self, props: Mapping[str, Any]) -> None:
        self.update(props)

    def clone(self) -> DataContext:
        """A shallow copy (the model's tensors are shared, the metadata dict is not)."""
        c = DataContext()
        c.update(self)
        c[self.METADATA] = dict(self[self.METADATA])
        return c


FLContext = DataContext


class AppContext(dict):
    """The overall app context: ``round``, ``phase``, ``task``, ``global_model`` (the model received this round,
    the base of deltas) and anything else (``n_iter``, ``best_metric``, ``initial_metric`` for the generators)."""

    def __init__(
        self, round_number: int = 0, phase: str = "train", task: str = "train", global_model: Any = None, **props: Any
    ) -> None:
        super().__init__(props)
        self.update(round=round_number, phase=phase, task=task, global_model=global_model)

    @property
    def round_number(self) -> int:
        return self.get("round", 0)

    @property
    def phase(self) -> str:
        return self.get("phase", "")

    @property
    def task(self) -> str:
        return self.get("task", "")

    @property
    def global_model(self) -> Any:
        return self.get("global_model")


ApplicationContext = AppContext
