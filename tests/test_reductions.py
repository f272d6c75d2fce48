"""Parallel passes whose order must not show in the bytes: ternary_mu as a reduction (one block per tensor, the
same fp64 pairwise tree as the NumPy twin) and rice_write's warp-aggregated ORs, in every block and thread order."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_codec.backends.cpu import CpuBackend
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
    s_want, mu_want = CpuBackend().ternary(values, idx, res)
    s_got, mu_got = emu.ternary(values, idx, res)
    assert mu_got.tobytes() == mu_want.tobytes()
    assert [s.tobytes() for s in s_got] == [s.tobytes() for s in s_want]
    assert mu_want[0] == 0.0 and mu_want[2] > 0


@pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_rice_streams_match_twin(schedule):
    """Dense runs (k = 0: every bit in the unary section), sparse ones (large k: low bits spanning three words),
    u32 and u64 indices; warp-aggregated writes give the twin's bytes."""
    from gpu_codec.cpu_fallback.rice import max_bits, rice_param

    from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

    rng = np.random.default_rng(8)
    cases = [
        (np.arange(5000, dtype=np.uint32), 5000),
        (np.sort(rng.choice(1 << 20, 9000, replace=False)).astype(np.uint32), 1 << 20),
        (np.sort(rng.choice(1 << 30, 300, replace=False)).astype(np.uint32), 1 << 30),
        (np.zeros(0, np.uint32), 10),
    ]
    wide = [np.sort(rng.choice(1 << 40, 2000, replace=False)).astype(np.uint64) + (1 << 60)]
    emu = EmulatedBackend(EmulatorRunner(schedule=schedule, seed=6))
    for group, numels in (([c for c, _ in cases], [n for _, n in cases]), (wide, [1 << 62])):
        ks = [rice_param(int(i.size), n) for i, n in zip(group, numels)]
        want = CpuBackend().rice(group, ks, numels)
        got = emu.rice(group, ks, numels)
        assert np.asarray(got[1]).tolist() == np.asarray(want[1]).tolist()
        for g, w, b, c, n, k in zip(got[0], want[0], want[1].tolist(), group, numels, ks):
            # placed before its bit count is read: the stream runs on to its length bound's words, in zero bytes
            g = np.asarray(g)
            assert g.tobytes()[: -(-b // 8)] == w.tobytes() and not g[-(-b // 8) :].any()
            assert g.size == 4 * -(-max_bits(c.size, n, k) // 32) if c.size else g.size == 0
    assert max(ks) + 31 > 64  # the low bits of a gap at word offset 31 span three words


@pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
def test_zeroing_slices_of_one_allocation_fills_their_run_once():
    """KernelOps._zero (the dense pass's residual outputs): slices end to end in one flat allocation are zeroed by
    one fill of their span; a slice after a gap, of another allocation or another dtype, by a fill of its own;
    nothing outside them is written."""
    from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

    ops = EmulatedBackend(EmulatorRunner(seed=1)).ops
    fills = []

    class Tracked(np.ndarray):
        def fill(self, v):
            fills.append(self.size)
            super().fill(v)

    span = np.arange(1, 31, dtype=np.float32).view(Tracked)
    other = np.arange(1, 5, dtype=np.float64)
    parts = [span[0:4], span[4:4], None, span[4:10], span[10:15], other[1:3], span[16:20], span[20:30]]
    ops._zero(parts)
    assert span.tolist() == [0.0] * 15 + [16.0] + [0.0] * 14
    assert other.tolist() == [1.0, 0.0, 0.0, 4.0]
    assert fills == [15, 14]  # [0, 15) in one, [16, 30) in one (the float64 slice, of another allocation, alone)
