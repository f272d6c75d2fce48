"""Random updates, the same bytes on the CPU backend and the emulated kernels: uneven tensors of every float dtype,
exact zeros, three levels, sparse deltas, scales far apart, ties; fractions from 0.01 % to all of it, both scopes,
several rounds of error feedback. The payload, the residual left behind and any error must be identical, and the
fused selection must not fall back."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from tests.common import has_emulator

pytestmark = pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")

SIZES = (1, 3, 255, 4096, 4097, 20000, 70000)
KINDS = ("normal", "zeros", "levels", "sparse", "scales", "ties")


def _update(rng: np.random.Generator) -> tuple[dict, dict]:
    new, base = {}, {}
    for i in range(int(rng.integers(1, 8))):
        n = int(rng.choice(SIZES))
        kind = rng.choice(KINDS)
        if kind == "normal":
            d = rng.standard_normal(n)
        elif kind == "zeros":
            d = np.zeros(n)
        elif kind == "levels":
            d = rng.choice([-1.0, 0.0, 1.0], n)
        elif kind == "sparse":
            d = rng.standard_normal(n) * (rng.random(n) < 0.01)
        elif kind == "scales":
            d = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 12, n)
        else:
            d = np.round(rng.standard_normal(n) * 4) / 4
        b = rng.standard_normal(n)
        dt = rng.choice(["float32", "float16", "float64"])
        with np.errstate(over="ignore"):
            new[f"t{i}"], base[f"t{i}"] = (b + d * 10.0 ** rng.integers(-3, 2)).astype(dt), b.astype(dt)
    return new, base


def _run(backend, new, base, fraction, scope, rounds):
    with using_backend(backend):
        ef = gpu_codec.ErrorFeedback() if rounds else None
        try:
            for _ in range(max(1, rounds)):
                p = gpu_codec.compress(new, base, fraction=fraction, scope=scope, residual=ef)
            return p.to_bytes(), b"".join(ef.residual(k).tobytes() for k in new) if ef else b""
        except gpu_codec.errors.GpuCodecError as e:
            return type(e).__name__, str(e)


@pytest.mark.parametrize("seed", range(4))
def test_random_updates_give_the_same_bytes_on_both_backends(seed):
    from gpu_codec.backends.emulated import EmulatedBackend

    rng = np.random.default_rng(1000 + seed)
    cpu, emu = CpuBackend(), EmulatedBackend()
    for _ in range(12):
        new, base = _update(rng)
        fraction = float(rng.choice([0.0001, 0.001, 0.01, 0.1, 0.5, 1.0]))
        scope = str(rng.choice(["global", "per_tensor"]))
        rounds = int(rng.integers(0, 3))
        want = _run(cpu, new, base, fraction, scope, rounds)
        assert _run(emu, new, base, fraction, scope, rounds) == want, (fraction, scope, rounds)
    assert emu.ops.fused_fallbacks == 0 and emu.ops.fused_selections > 0
