"""ternary_mu as a parallel reduction (one block per tensor): the same fp64 pairwise tree as the NumPy twin, in
every block and thread order, for tensors of one chunk and of many (an odd number of chunk sums included)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_codec.backends.numpy import NumpyBackend
from tests.common import has_emulator


@pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_mu_matches_twin(schedule):
    from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

    rng = np.random.default_rng(4)
    sizes = [0, 3, 4096 * 5 + 17, 4096 * 2, 1]  # 6 and 2 chunk sums
    values = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32) for n in sizes]
    values[3] = values[3].astype(np.float64)
    idx = [None] * len(sizes)
    res = [None] * len(sizes)
    emu = EmulatedBackend(EmulatorRunner(schedule=schedule, seed=2))
    s_want, mu_want = NumpyBackend().ternary(values, idx, res)
    s_got, mu_got = emu.ternary(values, idx, res)
    assert mu_got.tobytes() == mu_want.tobytes()
    assert [s.tobytes() for s in s_got] == [s.tobytes() for s in s_want]
    assert mu_want[0] == 0.0 and mu_want[2] > 0
