"""Model evaluators and validators: what a site reports about a model."""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidInputError
from .context import AppContext, DataContext
from .metrics import MetricManager
from .processors import DataProcessor

__all__ = ["ModelEvaluator", "ModelValidator"]


class ModelEvaluator(abc.ABC):
    """Evaluates the current model (the site's, or the global one) on local data.

    :meth:`evaluate` runs the evaluation; :meth:`get_metric` then returns the one number used to select the
    best model (higher is better), which :class:`~gpu_codec.clara.BestMetricGenerator` and
    :class:`~gpu_codec.clara.InitialValidationMetricGenerator` read from the app context. :meth:`initialize`
    binds it to the trainer before the first evaluation.
    """

    def initialize(self, builder: Any = None) -> None:
        """Bind to ``builder`` (the trainer, or the model it trains); kept as ``self.builder``."""
        self.builder = builder

    @abc.abstractmethod
    def evaluate(self) -> None:
        """Run the evaluation."""

    @abc.abstractmethod
    def get_metric(self) -> float:
        """The key metric of the last evaluation."""


class ModelValidator(DataProcessor, abc.ABC):
    """Validates a model received from elsewhere (the global model, or another site's in cross-site
    validation) and reports metrics in groups.

    Subclasses implement :meth:`validate` (``model_params`` -> ``{metric_name: value}``). Clara's entry point
    :meth:`validate_model` (``configer``, ``checkpoint``) reads the checkpoint (a path to a PyTorch checkpoint
    saved by :class:`~gpu_codec.clara.PTModelSaver` or a plain ``state_dict`` file, or a mapping name ->
    tensor) and returns :meth:`validate`'s metrics, the ``configer`` passed on in the app context (an
    :class:`~gpu_codec.clara.AppContext` as it is, anything else as ``app_ctx["configer"]``). Run as a processor it
    validates the data context's model (a mapping name -> tensor) and puts the metrics into the data context's
    metadata under ``field``, encoded by :class:`~gpu_codec.clara.MetricManager` under group ``group``
    (``{"validation/accuracy": 0.9}``); the app context's ``key_metric`` entry names the metric also stored in
    ``app_ctx["initial_metric"]``, where :class:`~gpu_codec.clara.InitialValidationMetricGenerator` finds it.

    >>> import numpy as np
    >>> from gpu_codec.clara import AppContext, DataContext
    >>> class NormValidator(ModelValidator):
    ...     def validate(self, model_params, app_ctx=None):
    ...         return {"norm": float(sum(np.abs(v).sum() for v in model_params.values()))}
    >>> ctx, app = DataContext(model={"w": np.array([1.0, -2.0])}), AppContext(key_metric="norm")
    >>> NormValidator().process(ctx, app); ctx.get_metadata("validation_metrics"), app["initial_metric"]
    ({'validation/norm': 3.0}, 3.0)
    """

    def __init__(self, field: str = "validation_metrics", group: str = "validation") -> None:
        super().__init__()
        self.field = field
        self.group = group

    def initialize(self, fitter: Any) -> None:
        """Bind to the trainer (optional)."""

    @abc.abstractmethod
    def validate(self, model_params: Mapping[str, Any], app_ctx: AppContext | None = None) -> dict[str, float]:
        """Metrics of ``model_params``, name -> number."""

    def validate_model(self, configer: Any, checkpoint: Any) -> dict[str, float]:
        """Metrics of the model in ``checkpoint`` (a checkpoint path or a mapping name -> tensor)."""
        if isinstance(checkpoint, Mapping):
            weights = checkpoint
        elif isinstance(checkpoint, (str, os.PathLike)):
            from .savers import PTModelSaver

            weights = PTModelSaver().load_model(os.fspath(checkpoint))
        else:
            raise InvalidInputError(
                f"checkpoint must be a checkpoint path or a mapping name -> tensor, got {type(checkpoint).__name__}"
            )
        app_ctx = configer if isinstance(configer, AppContext) else AppContext(configer=configer)
        return self.validate(weights, app_ctx)

    def close(self) -> None:
        """Release what the validator holds (nothing by default)."""

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        mm = MetricManager()
        mm.add_group(self.group, self.validate(data_ctx.get_model(), app_ctx))
        data_ctx.add_metadata(self.field, mm.encode_metrics())
        key = app_ctx.get("key_metric")
        group = mm.get_group(self.group) or {}
        if key in group:
            app_ctx["initial_metric"] = group[key]

    def get_config(self) -> dict[str, Any]:
        return {"field": self.field, "group": self.group}
