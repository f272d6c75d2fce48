"""Model processors (reader-writers): the local model in and out of the processor chain."""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..arrays import array_kind, backend_to_torch
from ..errors import InvalidInputError
from .context import DataContext
from .processors import decode_payload, payload_of

__all__ = ["DictModelReaderWriter", "ModelProcessor", "PTModelReaderWriter", "compile_exclude", "torch_module_of"]


class ModelProcessor(abc.ABC):
    """The model reader-writer contract of Clara's ``fed_learn.components``: how a client's local model meets the
    model received from the server and the one it sends.

    Subclasses implement all four methods: :meth:`initialize` (bind to the trainer, called once before the
    first round), :meth:`get_local_models`, :meth:`extract_model` and :meth:`apply_model`.
    """

    @abc.abstractmethod
    def initialize(self, fitter: Any) -> None:
        """Bind to ``fitter`` (the trainer, or the model it trains)."""

    @abc.abstractmethod
    def get_local_models(self) -> dict[str, Any]:
        """Every local variable, name -> tensor."""

    @abc.abstractmethod
    def extract_model(self, model_vars: Sequence[str] | None = None) -> dict[str, Any]:
        """The local variables named in ``model_vars`` (all when None); unknown names are skipped."""

    @abc.abstractmethod
    def apply_model(self, model_params: Any, options: Any = None) -> bool:
        """Assign received values to local variables; True if any was assigned."""


def compile_exclude(pattern: str | None) -> Any:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidInputError(f"exclude_vars must be a regular expression, got {pattern!r}: {e}") from None


def _params_from(model_params: Any, local: Mapping[str, Any], like: str | None, who: str) -> Mapping[str, Any]:
    if isinstance(model_params, DataContext):
        model_params = model_params.get_model()
    if isinstance(model_params, Mapping):
        return model_params
    payload = payload_of(model_params, who)
    return decode_payload(payload, None, local, like, who)


class DictModelReaderWriter(ModelProcessor):
    """A training-platform independent model reader-writer: the local model is a dict name -> tensor (NumPy,
    CuPy or torch, any device), held in memory.

    ``exclude_vars`` (a regular expression, as in Clara configs) names variables never read nor written.

    >>> import numpy as np
    >>> rw = DictModelReaderWriter()
    >>> rw.initialize({"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)})
    >>> rw.apply_model({"w": np.ones(2, np.float32), "unknown": np.ones(1)})
    True
    >>> {k: v.tolist() for k, v in rw.extract_model(["w"]).items()}
    {'w': [1.0, 1.0]}
    """

    def __init__(self, exclude_vars: str | None = None) -> None:
        self.exclude_vars = exclude_vars
        self._exclude = compile_exclude(exclude_vars)
        self._local: dict[str, Any] = {}

    def _excluded(self, name: str) -> bool:
        return self._exclude is not None and self._exclude.search(name) is not None

    def initialize(self, fitter: Any = None) -> None:
        """Start from ``fitter``'s model: None (an empty model: the first received model is adopted whole), a
        mapping name -> tensor, or an object whose ``model`` attribute is such a mapping."""
        model = getattr(fitter, "model", fitter) if not isinstance(fitter, Mapping) else fitter
        if model is not None and not isinstance(model, Mapping):
            raise InvalidInputError(
                "DictModelReaderWriter.initialize takes None, a mapping name -> tensor or an object with a "
                f"'model' mapping, got {type(fitter).__name__}"
            )
        self._local = {k: v for k, v in (model or {}).items() if not self._excluded(k)}

    def get_local_models(self) -> dict[str, Any]:
        """The local model (the tensors themselves, not copies)."""
        return dict(self._local)

    def extract_model(self, model_vars: Sequence[str] | None = None) -> dict[str, Any]:
        """The local weights whose names are in ``model_vars`` (all when None)."""
        if model_vars is None:
            return dict(self._local)
        return {n: self._local[n] for n in model_vars if n in self._local}

    def apply_model(self, model_params: Any, options: Any = None) -> bool:
        """Assign local variables from ``model_params`` (a dict, a :class:`DataContext`, a Payload or its bytes;
        a delta payload is added to the local model). Returns True if any variable was assigned; with an empty
        local model every received variable is adopted."""
        params = _params_from(model_params, self._local, None, "DictModelReaderWriter")
        adopt = not self._local
        assigned = False
        for name, value in params.items():
            if self._excluded(name) or not (adopt or name in self._local):
                continue
            self._local[name] = value
            assigned = True
        return assigned


class PTModelReaderWriter(ModelProcessor):
    """A torch ``nn.Module``'s weights in and out of the processor chain, left on the module's device.

    ``get_local_models`` returns the module's state tensors (no copies); ``apply_model`` copies received values
    into them in place, so parameters keep their identity, dtype and device.
    """

    def __init__(self, exclude_vars: str | None = None) -> None:
        self.exclude_vars = exclude_vars
        self._exclude = compile_exclude(exclude_vars)
        self.model: Any = None

    def _excluded(self, name: str) -> bool:
        return self._exclude is not None and self._exclude.search(name) is not None

    def initialize(self, fitter: Any) -> None:
        """Bind to ``fitter``: a ``torch.nn.Module``, or a trainer whose ``model`` attribute is one."""
        self.model = torch_module_of(fitter, "PTModelReaderWriter.initialize")

    def _state(self) -> dict[str, Any]:
        if self.model is None:
            raise InvalidInputError("PTModelReaderWriter is not initialized: call initialize(model) first")
        return {k: v for k, v in self.model.state_dict().items() if not self._excluded(k)}

    def get_local_models(self) -> dict[str, Any]:
        return self._state()

    def extract_model(self, model_vars: Sequence[str] | None = None) -> dict[str, Any]:
        state = self._state()
        if model_vars is None:
            return state
        return {n: state[n] for n in model_vars if n in state}

    def apply_model(self, model_params: Any, options: Any = None) -> bool:
        """Copy received values into the module's tensors (in place). Returns True if any was assigned. Every
        received value is converted and checked against its tensor's shape before any is written: a refused
        model leaves the module as it was."""
        import torch

        state = self._state()
        params = _params_from(model_params, state, "torch", "PTModelReaderWriter")
        pairs = []
        for name, value in params.items():
            if name not in state:
                continue
            dst = state[name]
            try:
                src = to_torch_on(value, dst.device)
            except (TypeError, ValueError) as e:  # (an object array, a string: no tensor)
                what = type(value).__name__
                raise InvalidInputError(f"tensor {name!r}: received a {what} torch cannot take ({e})") from None
            if tuple(src.shape) != tuple(dst.shape):
                raise InvalidInputError(
                    f"tensor {name!r}: received shape {tuple(src.shape)}, the model has {tuple(dst.shape)}"
                )
            pairs.append((dst, src))
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        return bool(pairs)


def torch_module_of(fitter: Any, who: str) -> Any:
    """``fitter`` if it is a ``torch.nn.Module``, else its ``model`` attribute if that is one."""
    import torch

    for m in (fitter, getattr(fitter, "model", None)):
        if isinstance(m, torch.nn.Module):
            return m
    raise InvalidInputError(
        f"{who} takes a torch.nn.Module or a trainer with a 'model' module, got {type(fitter).__name__}"
    )


def to_torch_on(value: Any, device: Any) -> Any:

    if array_kind(value) == "torch":
        return value.to(device) if value.device != device else value
    return backend_to_torch(value, device)
