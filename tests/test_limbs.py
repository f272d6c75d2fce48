"""The aggregator's limb passes as the NumPy backend runs them (in blocks and ranges on the pool) give the bytes of
the whole-array forms (the kernels' for the mean), for any thread count, block size and dtype."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import limbs as L
from gpu_codec.cpu_fallback import parallel

from gpu_codec.aggregate import _grid_exponent


def _emulated():
    from gpu_codec.backends.emulated import EmulatedBackend

    return EmulatedBackend()


def _limbs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(1 << 30), 1 << 30, size=(3, n), dtype=np.int32)


def _check_mean(limbs, starts, numels, scales, total, odt) -> None:
    """limb_mean of the NumPy backend against the whole-array form, tensor by tensor, and the kernel's (on the
    emulator), to the byte."""
    got = np.empty(sum(numels), odt)
    L.limb_mean(limbs, starts, numels, scales, total, got)
    want = []
    for a, n, sc in zip(starts, numels, scales):
        acc = limbs[0, a : a + n].astype(np.float64) * sc[0]
        for j in (1, 2):
            acc += limbs[j, a : a + n].astype(np.float64) * sc[j]
        want.append((acc / total).astype(odt))
    assert got.tobytes() == np.concatenate(want).tobytes()
    kernel = np.empty(sum(numels), odt)  # the kernel backends' form: kernels/limbs.cu, on the emulator
    _emulated().limb_mean(limbs, np.asarray(starts), np.asarray(numels), scales, total, kernel)
    assert kernel.tobytes() == got.tobytes()


@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("odt", [np.float32, np.float64])
def test_mean_matches_the_whole_array_form(threads, odt, monkeypatch):
    monkeypatch.setenv(parallel.ENV, threads)
    monkeypatch.setattr(L, "BLOCK", 96)  # several blocks per task, the last one short
    limbs = _limbs(1001 + 77 + 5, 1)
    starts, numels = [5, 1006, 0], [1001, 77, 5]  # tensors in any order in the accumulator
    scales = np.asarray([[2.0**-20, 2.0**-38, 2.0**-56], [2.0**10, 2.0**-8, 2.0**-26], [0.0, 0.0, 0.0]])
    _check_mean(limbs, starts, numels, scales, 7.25, odt)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_mean_of_many_small_tensors_taken_together_matches_the_whole_array_form(threads, monkeypatch):
    # small tensors end to end in the limbs make one task (each element scaled by its own tensor's scales); a gap,
    # a large tensor or a full block starts another
    monkeypatch.setenv(parallel.ENV, threads)
    monkeypatch.setattr(L, "BLOCK", 256)
    monkeypatch.setattr(L, "SMALL", 64)
    rng = np.random.default_rng(5)
    numels = [int(x) for x in rng.integers(0, 40, size=60)] + [300, 7, 0, 9]
    starts, a = [], 0
    for i, n in enumerate(numels):
        a += 3 if i in (17, 41) else 0  # (two gaps: the runs break there)
        starts.append(a)
        a += n
    limbs = _limbs(a, 6)
    scales = 2.0 ** rng.integers(-60, 10, size=(len(numels), 3)).astype(np.float64)
    _check_mean(limbs, starts, numels, scales, 3.5, np.float32)


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("sparse", [True, False], ids=["indices", "dense"])
def test_add_matches_the_whole_array_form(threads, sparse, monkeypatch):
    monkeypatch.setenv(parallel.ENV, threads)
    monkeypatch.setattr(L, "ADD_TASK", 7)
    monkeypatch.setattr(L, "TASK", 64)
    n = 500
    rng = np.random.default_rng(2)
    idx = np.sort(rng.choice(n, 60, replace=False)).astype(np.uint32) if sparse else None
    qs = rng.integers(-1000, 1000, size=(3, 60 if sparse else n), dtype=np.int32)
    got = _limbs(n, 3) >> 8
    L.limb_add(got, idx, qs)
    for j in range(3):
        ref = (_limbs(n, 3) >> 8)[j]
        if sparse:
            ref[idx] += qs[j]
        else:
            ref += qs[j]
        assert np.array_equal(got[j], ref)


def test_accumulate_over_tensors_is_the_split_of_each():
    """One limb_accumulate over several tensors, each on its own grid, adds what a split of each tensor alone adds
    (the twin's per-entry grids against its per-tensor form); the emulated kernel the same."""
    rng = np.random.default_rng(4)
    counts = [40, 0, 25, 1]
    vals = (rng.standard_normal(sum(counts)) * 10.0 ** rng.integers(-30, 30, sum(counts))).astype(np.float32)
    ends = np.cumsum(counts)
    top = [float(np.abs(vals[e - c : e]).max()) * 1.5 if c else 0.0 for c, e in zip(counts, ends)]
    exps = np.asarray([[_grid_exponent(m) or 0] for m in top]) + np.asarray([36, 18, 0])
    idx = np.concatenate([np.sort(rng.choice(100, c, replace=False)) + 100 * t for t, c in enumerate(counts)])
    limbs = _limbs(420, 5) >> 8
    got, kernel = limbs.copy(), limbs.copy()
    L.limb_accumulate(got, 3, counts, exps, vals, idx.astype(np.uint32), 1.5)
    a = 0
    for t, c in enumerate(counts):
        qs = L.limb_split(vals[a : a + c], 1.5, list(exps[t]))
        limbs[:, 3 + idx[a : a + c]] += qs
        a += c
    assert got.tobytes() == limbs.tobytes()
    _emulated().limb_accumulate(kernel, 3, counts, exps, vals, idx.astype(np.uint64), 1.5)
    assert kernel.tobytes() == limbs.tobytes()
