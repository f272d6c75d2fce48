"""MetricManager: a 2-level metric map (group -> metric -> value), encoded into one level to travel in metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .context import MetricsError

__all__ = ["MetricManager"]


def _number(group: str, name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) and hasattr(value, "item"):  # NumPy scalars, 1-element tensors
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise MetricsError(
                f"metric {group}/{name} must be a single number, got shape {tuple(getattr(value, 'shape', ()))}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise MetricsError(f"metric {group}/{name} must be a number, got {type(value).__name__}")
    f = float(value)
    if not math.isfinite(f):
        raise MetricsError(f"metric {group}/{name} is not finite: {value!r}")
    return f


class MetricManager:
    """Named groups of metrics: ``{group_name: {metric_name: value}}``.

    :meth:`encode_metrics` flattens the map into one level, keys ``"group/metric"`` (the TensorBoard tag
    form), so it can travel as flat metadata; :meth:`decode_metrics` rebuilds the two levels. Group names are
    non-empty strings without ``/``; metric names are non-empty strings (they may contain ``/``: a key is split
    at its first one). Values are finite real numbers (Python, NumPy or 1-element tensors), stored as float.

    >>> mm = MetricManager({"validation": {"val_acc": 0.91}})
    >>> mm.add_group("train", {"loss": 0.25})
    >>> enc = mm.encode_metrics(); enc
    {'train/loss': 0.25, 'validation/val_acc': 0.91}
    >>> MetricManager().decode_metrics(enc) == mm.to_dict()
    True
    """

    SEPARATOR = "/"

    def __init__(self, metric_map: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._map: dict[str, dict[str, float]] = self.validate_metrics(metric_map or {})

    def add_group(self, group_name: str, metric_dict: Mapping[str, Any]) -> None:
        """Add the metrics of ``group_name`` (merged into the group when it exists; a metric given again takes
        the new value)."""
        checked = self.validate_metrics({group_name: metric_dict})
        self._map.setdefault(group_name, {}).update(checked[group_name])

    def get_group(self, group_name: str) -> dict[str, float] | None:
        """A copy of the group's metrics, or None when there is no such group."""
        g = self._map.get(group_name)
        return None if g is None else dict(g)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The whole 2-level map (a copy)."""
        return {g: dict(m) for g, m in self._map.items()}

    def encode_metrics(self) -> dict[str, float]:
        """The 2-level map as one level: ``{"group/metric": value}``, keys sorted."""
        flat = {f"{g}{self.SEPARATOR}{n}": v for g, m in self._map.items() for n, v in m.items()}
        return {k: flat[k] for k in sorted(flat)}

    def decode_metrics(self, encoded_metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
        """Rebuild the 2-level map from :meth:`encode_metrics`' output; it replaces this manager's groups and is
        returned. Keys without a ``/`` or with an empty group or metric name raise :class:`MetricsError`."""
        if not isinstance(encoded_metrics, Mapping):
            raise MetricsError(
                f"encoded metrics must be a mapping 'group/metric' -> number, got {type(encoded_metrics).__name__}"
            )
        two: dict[str, dict[str, Any]] = {}
        for key, value in encoded_metrics.items():
            if not isinstance(key, str) or self.SEPARATOR not in key:
                raise MetricsError(f"encoded metric keys look like 'group{self.SEPARATOR}metric', got {key!r}")
            group, name = key.split(self.SEPARATOR, 1)
            two.setdefault(group, {})[name] = value
        self._map = self.validate_metrics(two)
        return self.to_dict()

    @classmethod
    def validate_metrics(cls, metric_map: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        """Check a 2-level metric map and return it with every value as float; raises :class:`MetricsError`
        naming the first group or metric at fault."""
        if not isinstance(metric_map, Mapping):
            raise MetricsError(f"a metric map must be a mapping group -> metrics, got {type(metric_map).__name__}")
        out: dict[str, dict[str, float]] = {}
        for group, metrics in metric_map.items():
            if not isinstance(group, str) or not group or cls.SEPARATOR in group:
                raise MetricsError(f"group names must be non-empty strings without {cls.SEPARATOR!r}, got {group!r}")
            if not isinstance(metrics, Mapping):
                raise MetricsError(f"group {group!r} must map metric names to numbers, got {type(metrics).__name__}")
            out[group] = {}
            for name, value in metrics.items():
                if not isinstance(name, str) or not name:
                    raise MetricsError(f"metric names must be non-empty strings, got {name!r} in group {group!r}")
                out[group][name] = _number(group, name, value)
        return out
