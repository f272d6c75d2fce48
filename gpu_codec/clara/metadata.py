"""Metadata generators: values of the app context attached to the data context's metadata."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError
from .context import AppContext, DataContext
from .processors import DataProcessor

__all__ = ["BestMetricGenerator", "InitialValidationMetricGenerator", "IteratorNumberGenerator", "MetadataGenerator"]


class MetadataGenerator(DataProcessor):
    """Attach ``app_ctx[source]`` to the data context's metadata as ``field`` (skipped when the app context has
    no such value, or holds None).

    Parameters
    ----------
    field
        The metadata field written (:meth:`get_field`).
    source
        The app-context key read; the base class reads ``field`` itself, the subclasses their own key.

    >>> from gpu_codec.clara import AppContext, DataContext
    >>> g, ctx = MetadataGenerator("site"), DataContext(model={})
    >>> g.process(ctx, AppContext(site="site-1")); g.get_field(), ctx.get_metadata("site")
    ('site', 'site-1')
    """

    source = ""

    def __init__(self, field: str, source: str | None = None) -> None:
        super().__init__()
        if not isinstance(field, str) or not field:
            raise InvalidInputError(f"field must be a non-empty string, got {field!r}")
        if source is not None and (not isinstance(source, str) or not source):
            raise InvalidInputError(f"source must be a non-empty string, got {source!r}")
        self.field = field
        self.source = source or self.source or field

    def get_field(self) -> str:
        """The metadata field this generator writes."""
        return self.field

    def get_config(self) -> dict[str, Any]:
        return {"field": self.field, "source": self.source}

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        if self.source in app_ctx and app_ctx[self.source] is not None:
            data_ctx.add_metadata(self.field, app_ctx[self.source])


class IteratorNumberGenerator(MetadataGenerator):
    """The number of training iterations of this round (``app_ctx["n_iter"]``), as aggregation weight."""

    source = "n_iter"

    def __init__(self, field: str = "n_iter", source: str | None = None) -> None:
        super().__init__(field, source)


class BestMetricGenerator(MetadataGenerator):
    """The best validation metric so far (``app_ctx["best_metric"]``)."""

    source = "best_metric"

    def __init__(self, field: str = "best_validation_metric", source: str | None = None) -> None:
        super().__init__(field, source)


class InitialValidationMetricGenerator(MetadataGenerator):
    """The validation metric of the received global model, before local training (``app_ctx["initial_metric"]``)."""

    source = "initial_metric"

    def __init__(self, field: str = "initial_validation_metric", source: str | None = None) -> None:
        super().__init__(field, source)
