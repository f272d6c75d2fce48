"""Model savers: checkpoints of the local or global model (``ModelSaver``, ``PTModelSaver``)."""

from __future__ import annotations

import abc
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..backends.files import replace_atomically
from ..errors import InvalidInputError
from .context import DataContext
from .reader_writers import compile_exclude, torch_module_of

__all__ = ["ModelSaver", "PTModelSaver"]


class ModelSaver(abc.ABC):
    """The model saver contract of Clara's ``fed_learn.components``: ``initialize(builder=None)`` binds to the
    trainer, ``save_model(model, is_best)`` writes a checkpoint (and here returns its path), ``close()``
    releases what the saver holds. :meth:`load_model` reads a checkpoint back (an addition)."""

    @abc.abstractmethod
    def initialize(self, builder: Any = None) -> None:
        """Bind to ``builder`` (the trainer, or the model it trains)."""

    @abc.abstractmethod
    def save_model(self, model: Any, is_best: bool, *, round_number: int | None = None) -> str:
        """Write a checkpoint of ``model`` (the bound model's when None), the best one so far when
        ``is_best``; return its path. ``round_number`` is recorded with it."""

    @abc.abstractmethod
    def load_model(self, path: str | None = None) -> dict[str, Any]:
        """The weights of a checkpoint (the last one saved, or the preload checkpoint, when ``path`` is None)."""

    def close(self) -> None:  # noqa: B027 - optional hook, as in Clara
        """Release what the saver holds (nothing by default)."""


class PTModelSaver(ModelSaver):
    """PyTorch checkpoints: ``torch.save`` of ``{"model": state_dict, "round": n}``, read back with
    ``torch.load(..., weights_only=True)`` (tensors and plain containers only; nothing else is unpickled).

    Parameters
    ----------
    exclude_vars
        A regular expression: matching variables are neither saved nor loaded.
    model_log_dir
        Where checkpoints go: ``FL_global_model.pt``, and ``best_FL_global_model.pt`` for ``is_best`` (the
        names NVFlare's PyTorch persistor uses). Required for :meth:`save_model`.
    ckpt_preload_path
        A checkpoint loaded into the model by :meth:`initialize` (a file saved by this class, or a plain
        ``state_dict`` file); its shapes must match the model's.

    Writes go to a temporary file renamed into place, so a crash never leaves half a checkpoint. Tensors are
    saved from wherever they live and loaded onto the model's device.

    >>> import torch, tempfile
    >>> d = tempfile.mkdtemp()
    >>> saver = PTModelSaver(model_log_dir=d); saver.initialize(torch.nn.Linear(2, 1))
    >>> path = saver.save_model(None, False, round_number=3)
    >>> sorted(saver.load_model(path)), torch.load(path, weights_only=True)["round"]
    (['bias', 'weight'], 3)
    """

    FILE = "FL_global_model.pt"
    BEST_FILE = "best_FL_global_model.pt"

    def __init__(
        self, exclude_vars: str | None = None, model_log_dir: str | None = None, ckpt_preload_path: str | None = None
    ) -> None:
        self.exclude_vars = exclude_vars
        self._exclude = compile_exclude(exclude_vars)
        self.model_log_dir = model_log_dir
        self.ckpt_preload_path = ckpt_preload_path
        self.model: Any = None
        self.last_path: str | None = None

    def _excluded(self, name: str) -> bool:
        return self._exclude is not None and self._exclude.search(name) is not None

    def initialize(self, builder: Any = None) -> None:
        """Bind to ``builder`` (a ``torch.nn.Module`` or a trainer with a ``model`` module) and, when
        ``ckpt_preload_path`` is set, load that checkpoint into it. With no builder, :meth:`save_model` saves
        the model it is given."""
        if builder is None:
            if self.ckpt_preload_path is not None:
                raise InvalidInputError("PTModelSaver: ckpt_preload_path needs a model to load into (a builder)")
            self.model = None
            return
        self.model = torch_module_of(builder, "PTModelSaver.initialize")
        if self.ckpt_preload_path is not None:
            self._apply(self.load_model(self.ckpt_preload_path), self.ckpt_preload_path)

    def _apply(self, weights: Mapping[str, Any], where: str) -> None:
        import torch

        state = self.model.state_dict()
        with torch.no_grad():
            for name, value in weights.items():
                if self._excluded(name):
                    continue
                if name not in state:
                    raise InvalidInputError(f"checkpoint {where!r} holds {name!r}, which the model does not have")
                if tuple(value.shape) != tuple(state[name].shape):
                    raise InvalidInputError(
                        f"checkpoint {where!r}: {name!r} has shape {tuple(value.shape)}, "
                        f"the model {tuple(state[name].shape)}"
                    )
                state[name].copy_(value.to(state[name].device))

    def _state(self, model: Any) -> dict[str, Any]:
        import torch

        from .reader_writers import to_torch_on

        if isinstance(model, DataContext):
            model = model.get_model()
        elif model is not None and hasattr(model, "state_dict") and not isinstance(model, Mapping):
            model = model.state_dict()
        if model is None:
            if self.model is None:
                raise InvalidInputError("PTModelSaver is not initialized: call initialize(builder) or pass a model")
            model = self.model.state_dict()
        if not isinstance(model, Mapping):
            raise InvalidInputError(f"model must be a mapping name -> tensor or a module, got {type(model).__name__}")
        out = {}
        for k, v in model.items():
            if self._excluded(k):
                continue
            t = to_torch_on(v, torch.device("cpu"))
            out[k] = t.detach().clone()
        return out

    def save_model(self, model: Any, is_best: bool, *, round_number: int | None = None) -> str:
        """Write ``{"model": weights, "round": round_number}`` of ``model`` (a mapping name -> tensor, a module,
        a data context, or None for the bound model); returns the checkpoint's path."""
        import torch

        if not self.model_log_dir:
            raise InvalidInputError("PTModelSaver needs model_log_dir to save a checkpoint")
        os.makedirs(self.model_log_dir, exist_ok=True)
        path = os.path.join(self.model_log_dir, self.BEST_FILE if is_best else self.FILE)
        ckpt = {"model": self._state(model), "round": None if round_number is None else int(round_number)}
        replace_atomically(path, lambda f: torch.save(ckpt, f))
        self.last_path = path
        return path

    def close(self) -> None:
        """Release the bound model (checkpoints are complete files once :meth:`save_model` returns)."""
        self.model = None

    def load_model(self, path: str | None = None) -> dict[str, Any]:
        """The weights in a checkpoint (``weights_only=True``), excluded variables left out."""
        import torch

        path = path or self.last_path or self.ckpt_preload_path
        if not path:
            raise InvalidInputError("no checkpoint to load: give a path, save one first, or set ckpt_preload_path")
        try:
            with warnings.catch_warnings():  # (torch 2.1 warns that TypedStorage is deprecated, on every first load)
                warnings.simplefilter("ignore", UserWarning)
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except OSError as e:
            raise InvalidInputError(f"cannot read checkpoint {path!r}: {e.strerror or e}") from None
        except Exception as e:
            raise InvalidInputError(f"{path!r} is not a weights-only PyTorch checkpoint: {e}") from None
        weights = ckpt.get("model", ckpt) if isinstance(ckpt, Mapping) else None
        if not isinstance(weights, Mapping) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise InvalidInputError(f"checkpoint {path!r} holds no mapping name -> tensor")
        return {k: v for k, v in weights.items() if not self._excluded(k)}
