"""Model visualizers: how the model changes from round to round, as TensorBoard histograms."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from .context import AppContext, DataContext
from .processors import DataProcessor
from .reader_writers import compile_exclude

__all__ = ["ModelVisualizer", "TensorboardModelVisualizer"]


def _host(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch, any device
        value = value.detach().float().cpu().numpy()
    elif type(value).__module__.startswith("cupy"):
        value = value.get()
    return np.asarray(value, dtype=np.float64)


class ModelVisualizer(DataProcessor, abc.ABC):
    """Visualizes a model each round. :meth:`visualize` takes the model (``model_data``, name -> tensor) and,
    optionally, the round; run as a processor it visualizes the data context's model (when it is a mapping)
    with the app context's round."""

    @abc.abstractmethod
    def visualize(self, model_data: Mapping[str, Any], *, round_number: int | None = None) -> None:
        """Record ``model_data`` (at ``round_number``; None: one step after the previous call)."""

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        model = data_ctx.get_model()
        if isinstance(model, Mapping):
            self.visualize(model, round_number=app_ctx.round_number)


class TensorboardModelVisualizer(ModelVisualizer):
    """Model-diff histograms for TensorBoard, written with torch's ``SummaryWriter``.

    Each call after the first writes, per variable, a histogram of ``model - previous model`` (tag
    ``<tag>/<variable>``) and the L2 norm of that change (scalar ``<tag>_norm/<variable>``), at step
    ``round_number`` (without one: the number of calls so far, 0 first); the first call only records the model
    it will be compared against. Variables matching ``exclude_vars`` are skipped. Open ``log_dir`` with
    ``tensorboard --logdir``.

    Parameters
    ----------
    log_dir
        The event-file directory.
    exclude_vars
        A regular expression of variables not visualized.
    tag
        The tag prefix (``"model_diff"``).
    """

    def __init__(self, log_dir: str, exclude_vars: str | None = None, tag: str = "model_diff") -> None:
        super().__init__()
        if not isinstance(log_dir, str) or not log_dir:
            raise InvalidInputError(f"log_dir must be a directory path, got {log_dir!r}")
        self.log_dir = log_dir
        self.exclude_vars = exclude_vars
        self._exclude = compile_exclude(exclude_vars)
        self.tag = tag
        self._previous: dict[str, np.ndarray] | None = None
        self._calls = 0
        self._writer: Any = None

    def get_config(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir, "exclude_vars": self.exclude_vars, "tag": self.tag}

    def _get_writer(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - torch and tensorboard are optional
                raise InvalidInputError(
                    "TensorboardModelVisualizer needs torch and tensorboard: "
                    f"pip install tensorboard torch==2.13.0 ({e})"
                ) from None
            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def visualize(self, model_data: Mapping[str, Any], *, round_number: int | None = None) -> None:
        """Write the histograms of the change since the previous call (nothing on the first call)."""
        if not isinstance(model_data, Mapping):
            raise InvalidInputError(f"model_data must be a mapping name -> tensor, got {type(model_data).__name__}")
        step = self._calls if round_number is None else int(round_number)
        self._calls += 1
        current = {k: _host(v) for k, v in model_data.items() if not (self._exclude and self._exclude.search(k))}
        previous, self._previous = self._previous, current
        if previous is None:
            return
        writer = self._get_writer()
        for name, value in current.items():
            before = previous.get(name)
            if before is None or before.shape != value.shape:
                continue
            d = value - before
            writer.add_histogram(f"{self.tag}/{name}", d, global_step=step)
            writer.add_scalar(f"{self.tag}_norm/{name}", float(np.linalg.norm(d)), global_step=step)
        writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
