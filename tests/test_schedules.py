"""gpu_codec.schedules: DGC's warm-up of the kept fraction and FedAvgM's server momentum."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import gpu_codec
from gpu_codec.errors import InvalidInputError
from gpu_codec.schedules import ServerMomentum, warmup_fraction


def test_warmup_is_dgc_schedule():
    # DGC: 75%, 93.75%, 98.4375%, 99.6% sparsity over four epochs, then 99.9%
    got = [warmup_fraction(r, 0.001, start=0.25, rounds=4) for r in range(6)]
    want = [0.25, 0.25 * 0.004**0.25, 0.25 * 0.004**0.5, 0.25 * 0.004**0.75, 0.001, 0.001]
    assert got == pytest.approx(want)
    assert all(a > b for a, b in itertools.pairwise(got[:5]))  # strictly decreasing until the target


def test_warmup_edges():
    assert warmup_fraction(0, 0.01, start=0.04, rounds=0) == 0.01  # no warm-up
    assert warmup_fraction(0, 0.01, start=0.005, rounds=4) == 0.01  # never below the target
    assert warmup_fraction(1000, 0.01, start=0.04, rounds=4) == 0.01
    # the fractions feed compress(): k = ceil(fraction x N) shrinks round by round
    u = {"w": np.arange(1, 1001, dtype=np.float32)}
    ks = [
        gpu_codec.compress(u, fraction=warmup_fraction(r, 0.01, start=0.04, rounds=2))
        .tensors[0]
        .buffers["indices"]
        .size
        for r in range(3)
    ]
    assert ks == [40, math.ceil(1000 * math.sqrt(0.04 * 0.01)), 10]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(round_index=0, target=0.0, start=0.1, rounds=2),
        dict(round_index=0, target=0.01, start=1.5, rounds=2),
        dict(round_index=0, target=0.01, start=True, rounds=2),
        dict(round_index=0, target=0.01, start=0.1, rounds=-1),
        dict(round_index=0, target=0.01, start=0.1, rounds=2.0),
        dict(round_index=-1, target=0.01, start=0.1, rounds=2),
    ],
)
def test_warmup_rejects_bad_arguments(kwargs):
    r = kwargs.pop("round_index")
    t = kwargs.pop("target")
    with pytest.raises(InvalidInputError):
        warmup_fraction(r, t, **kwargs)


def test_server_momentum_is_a_geometric_velocity():
    sm = ServerMomentum(0.9)
    d = {"a": np.ones(3, np.float32), "b": np.full(2, -2.0, np.float32)}
    steps = [sm.step(d) for _ in range(50)]
    assert steps[0]["a"].tolist() == [1.0, 1.0, 1.0]  # first step: the delta itself
    assert steps[1]["b"] == pytest.approx(np.full(2, -2.0 * 1.9))
    assert steps[-1]["a"] == pytest.approx(np.full(3, (1 - 0.9**50) / 0.1), rel=1e-5)
    assert d["a"].tolist() == [1.0, 1.0, 1.0]  # the caller's arrays are not written to
    sm.step({"a": -steps[-1]["a"] * 0.9, "b": np.zeros(2, np.float32)})
    assert sm.step({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})["a"] == pytest.approx(np.zeros(3))


def test_server_momentum_zero_is_fedavg_and_bad_beta_raises():
    sm = ServerMomentum(0.0)
    for x in (1.0, -3.0, 0.5):
        assert sm.step({"w": np.array([x])})["w"].tolist() == [x]
    for beta in (-0.1, 1.0, 2.0):
        with pytest.raises(InvalidInputError):
            ServerMomentum(beta)
