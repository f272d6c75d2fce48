"""dense_apply (kernels/scatter.cu): dense records written in one pass that reads base and values in place; the
kernel in every block order against its NumPy twin (cpu_fallback/dense.py), and through the engine."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends.base import DeltaRequest
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.constants import DT_BF16, DT_F16, DT_F32, DT_F64
from tests.common import has_emulator, use_backend

STORAGE = {DT_F32: np.float32, DT_F16: np.float16, DT_BF16: np.uint16, DT_F64: np.float64}


def _case(seed: int, mode: int, bad: bool):
    rng = np.random.default_rng(seed)
    dts = [DT_F32, DT_F16, DT_BF16, DT_F64, DT_F32]
    sizes = [700, 1, 513, 300, 0]
    bases, values = [], []
    for dt, n in zip(dts, sizes):
        b = (rng.standard_normal(n) * 3).astype(np.float32)
        if dt == DT_BF16:
            b = (b.view(np.uint32) >> 16).astype(np.uint16)
        bases.append(b.astype(STORAGE[dt]) if dt != DT_BF16 else b)
        v = rng.standard_normal(n).astype(np.float64 if dt == DT_F64 else np.float32)
        if n:
            v[rng.integers(n)] = 1e-42 if dt != DT_F64 else 1e-310  # subnormals survive
        values.append(v)
    if bad:
        values[2][7] = np.inf
        values[3][5] = np.nan
    return dts, sizes, (bases if mode == 1 else [None] * len(dts)), values


def _run(backend, dts, sizes, bases, values, mode):
    outs = [np.full(n * np.dtype(STORAGE[dt]).itemsize, 0x5A, np.uint8).view(STORAGE[dt]) for dt, n in zip(dts, sizes)]
    bad = backend.dense_apply(outs, dts, bases, values, mode)
    return bad, [o.tobytes() for o in outs]


@pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_kernel_matches_twin_in_every_block_order(schedule):
    from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

    emu = EmulatedBackend(EmulatorRunner(schedule=schedule, seed=5))
    for mode in (0, 1):
        for bad in (False, True):
            case = _case(1 + mode, mode, bad)
            want = _run(CpuBackend(), *case, mode)
            got = _run(emu, *case, mode)
            assert got == want
            assert (want[0] is None) == (not bad)
    assert want[0] == 700 + 1 + 7  # the lowest bad entry: tensor 2, entry 7


@pytest.mark.parametrize(
    "backend", ["cpu", pytest.param("emulated", marks=pytest.mark.skipif(not has_emulator(), reason="no emulator"))]
)
def test_dense_payload_decodes_onto_base(backend):
    rng = np.random.default_rng(3)
    new = {"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal((7, 9)).astype(np.float16)}
    base = {"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal((7, 9)).astype(np.float16)}
    with use_backend(backend):
        blob = gpu_codec.compress(new, base, fraction=None).to_bytes()
        out = gpu_codec.decompress(blob, base=base)
        delta = gpu_codec.decompress(blob)
    d_a = new["a"] - base["a"]
    assert out["a"].tolist() == (base["a"] + d_a).tolist()
    d_b = new["b"].astype(np.float32) - base["b"].astype(np.float32)
    assert (
        out["b"].dtype == np.float16
        and out["b"].tolist() == (base["b"].astype(np.float32) + d_b).astype(np.float16).tolist()
    )
    assert delta["a"].tolist() == d_a.tolist() and delta["b"].shape == (7, 9)


def _delta_case(seed: int, bad: bool):
    rng = np.random.default_rng(seed)
    dts = [DT_F32, DT_F16, DT_BF16, DT_F64, DT_F32]
    sizes = [5000, 1, 700, 300, 0]
    new, base, res = [], [], []
    for dt, n in zip(dts, sizes):
        w = rng.standard_normal(n).astype(np.float32)
        w0 = rng.standard_normal(n).astype(np.float32)
        if dt == DT_BF16:
            w, w0 = (w.view(np.uint32) >> 16).astype(np.uint16), (w0.view(np.uint32) >> 16).astype(np.uint16)
        else:
            w, w0 = w.astype(STORAGE[dt]), w0.astype(STORAGE[dt])
        new.append(w)
        base.append(w0)
        vd = np.float64 if dt == DT_F64 else np.float32
        res.append(rng.standard_normal(n).astype(vd) * 1e-3)
    if bad:
        new[3][17] = np.inf
    return dts, new, base, res


def _delta(backend, case, crit):
    dts, new, base, res = case
    res = [r.copy() for r in res]  # the output aliases the input, as error feedback does
    req = DeltaRequest(new, base, res, res, dts, [None] * len(dts), [0] * len(dts), crit)
    vals, bad = backend.dense_delta(req)
    return bad, None if vals is None else [v.tobytes() for v in vals], [r.tobytes() for r in res]


@pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")
@pytest.mark.parametrize("schedule", ["forward", "reverse", "shuffle"])
def test_dense_delta_matches_twin_and_spares_the_residual_on_bad_input(schedule):
    from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

    emu = EmulatedBackend(EmulatorRunner(schedule=schedule, seed=9))
    for crit in (0, 5):
        for bad in (False, True):
            case = _delta_case(2, bad)
            want = _delta(CpuBackend(), case, crit)
            assert _delta(emu, case, crit) == want
            if bad:
                assert want[0] == 3 and want[1] is None
                assert want[2] == [r.tobytes() for r in case[3]]  # residual untouched
            else:
                assert want[0] is None and all(not np.frombuffer(r, np.uint8).any() for r in want[2])


@pytest.mark.parametrize("dt", [DT_F32, DT_F16, DT_F64])
def test_a_signalling_nan_value_is_refused_without_a_warning(dt):
    """A payload's value that is a signalling NaN (its bits as the payload holds them) raises the invalid-operation
    flag where it is added to the base: the twin reports the entry as non-finite and writes nothing there, with no
    floating-point warning (the suite runs with warnings as errors)."""
    vdt = np.float64 if dt == DT_F64 else np.float32
    bits = np.uint64(0x7FF0000000000001) if dt == DT_F64 else np.uint32(0x7F800001)
    v = np.ones(5, vdt)
    v[3:4].view(bits.dtype)[0] = bits
    base = np.ones(5, STORAGE[dt])
    bad, outs = _run(CpuBackend(), [dt], [5], [base], [v], 1)
    assert bad == 3
    assert np.frombuffer(outs[0], STORAGE[dt])[[0, 4]].tolist() == [2.0, 2.0]


def test_a_dense_payload_holding_a_signalling_nan_is_a_payload_error():
    base = {"w": np.ones(6, np.float32)}
    p = gpu_codec.compress({"w": np.full(6, 2.0, np.float32)}, base, fraction=None)
    vals = np.array(p.tensors[0].buffers["values"], np.float32)
    vals[2:3].view(np.uint32)[0] = 0x7F800001
    p.tensors[0].buffers["values"] = vals
    with pytest.raises(gpu_codec.PayloadError, match="tensor 'w'"):
        gpu_codec.decompress(p.to_bytes(), base=base)


@pytest.mark.parametrize("with_base", [False, True])
def test_a_dense_value_that_is_not_finite_is_named_as_a_value_not_an_index(with_base):
    p = gpu_codec.compress({"w": np.ones(6, np.float32)}, fraction=None)
    vals = np.array(p.tensors[0].buffers["values"], np.float32)
    vals[3] = np.inf
    p.tensors[0].buffers["values"] = vals
    base = {"w": np.zeros(6, np.float32)} if with_base else None
    with pytest.raises(gpu_codec.PayloadError, match=r"tensor 'w': dense value at entry 3 is not finite") as e:
        gpu_codec.decompress(p.to_bytes(), base)
    assert "index" not in str(e.value)
