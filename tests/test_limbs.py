"""The aggregator's limb passes as the NumPy backend runs them (in blocks and ranges on the pool) give the bytes of
the whole-array forms (the kernels' for the mean), for any thread count, block size and dtype."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import limbs as L
from gpu_codec.cpu_fallback import parallel

from gpu_codec.backends.kernels import KernelBackendBase


def _emulated():
    from gpu_codec.backends.emulated import EmulatedBackend

    return EmulatedBackend()


def _limbs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(1 << 30), 1 << 30, size=(3, n), dtype=np.int32)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("odt", [np.float32, np.float64])
def test_mean_matches_the_whole_array_form(threads, odt, monkeypatch):
    monkeypatch.setenv(parallel.ENV, threads)
    monkeypatch.setattr(L, "BLOCK", 96)  # 1,001 elements: several blocks per task, the last one short
    limbs = _limbs(1001, 1)
    scales, total = [2.0**-20, 2.0**-38, 2.0**-56], 7.25
    got, want = np.empty(1001, odt), np.empty(1001, odt)
    L.limb_mean(limbs, scales, total, got)
    acc = limbs[0].astype(np.float64) * scales[0]
    for j in (1, 2):
        acc += limbs[j].astype(np.float64) * scales[j]
    want[...] = (acc / total).astype(odt)
    assert got.tobytes() == want.tobytes()
    kernel = np.empty(1001, odt)  # the kernel backends' form: kernels/limbs.cu, on the emulator
    _emulated().limb_mean(limbs, scales, total, kernel)
    assert kernel.tobytes() == want.tobytes()


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
    got, want = _limbs(n, 3) >> 8, _limbs(n, 3) >> 8
    L.limb_add(got, idx, qs)
    KernelBackendBase.limb_add(None, want, idx, qs)
    for j in range(3):
        ref = (_limbs(n, 3) >> 8)[j]
        if sparse:
            ref[idx] += qs[j]
        else:
            ref += qs[j]
        assert np.array_equal(got[j], ref) and np.array_equal(want[j], ref)
