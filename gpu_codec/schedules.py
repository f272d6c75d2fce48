"""What the literature adds to error feedback when updates are sparsified hard: schedules and momentum.

Built on the public API only; nothing here touches the wire format.

* :func:`warmup_fraction`: Deep Gradient Compression's warm-up (Lin et al., ICLR 2018): the kept fraction starts
  high and decays geometrically to its target over the first rounds, so the residual does not pile up while the
  model moves fastest.
* :class:`ServerMomentum`: FedAvgM (Hsu et al., 2019): the server keeps a velocity ``v = beta v + mean delta``
  and applies ``v``; an entry sent once keeps moving the model for the next rounds.

>>> [round(warmup_fraction(r, 0.01, start=0.04, rounds=4), 4) for r in range(6)]
[0.04, 0.0283, 0.02, 0.0141, 0.01, 0.01]
>>> import numpy as np
>>> sm = ServerMomentum(0.5)
>>> [sm.step({"w": np.array([1.0])})["w"].tolist() for _ in range(3)]
[[1.0], [1.5], [1.75]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .codecs import check_fraction
from .errors import InvalidInputError


def _check_fraction(name: str, f: Any) -> float:
    return check_fraction(f, name)


def warmup_fraction(round_index: int, target: float, *, start: float, rounds: int) -> float:
    """Kept fraction for round ``round_index`` (0-based): ``start`` at round 0, geometrically down to ``target`` at
    round ``rounds``, ``target`` from then on. DGC's schedule is ``start=0.25``, four epochs, to 0.001."""
    target, start = _check_fraction("target", target), _check_fraction("start", start)
    if not isinstance(rounds, int) or rounds < 0:
        raise InvalidInputError(f"rounds must be an integer >= 0, got {rounds!r}")
    if round_index < 0:
        raise InvalidInputError(f"round_index must be >= 0, got {round_index!r}")
    if round_index >= rounds or start <= target:
        return target
    return start * (target / start) ** (round_index / rounds)


class ServerMomentum:
    """FedAvgM's server velocity: :meth:`step` takes the averaged delta and returns what to add to the model."""

    def __init__(self, beta: float = 0.9):
        if not 0.0 <= beta < 1.0:
            raise InvalidInputError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self._v: dict[str, Any] = {}

    def step(self, delta: Mapping[str, Any]) -> dict[str, Any]:
        for name, d in delta.items():
            v = self._v.get(name)
            self._v[name] = d.copy() if v is None else self.beta * v + d
        return {name: self._v[name].copy() for name in delta}
