"""No single-precision float arithmetic of the GPU path runs through the array module's own kernels (CuPy's,
compiled with -ftz=true, would flush subnormals): checked on the CPU by running the library on the emulated
backend whose array module logs every such operation (gpu_codec.testing.ftz_audit), and the kernels that took
that arithmetic over (kernels/limbs.cu) against their twins on subnormal-rich inputs."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends import using_backend
from gpu_codec.testing import ftz_audit
from gpu_codec.testing import kernel_cases as kc

emu = pytest.importorskip("gpu_codec.backends.emulated")

PIPELINES = ftz_audit.audit_pipelines()


@pytest.fixture(scope="module")
def audit():
    try:
        return ftz_audit.audit_backend()
    except emu.EmulatorUnavailableError as e:
        pytest.skip(str(e))


def _update(seed: int):
    rng = np.random.default_rng(seed)
    base = {"w": rng.standard_normal(2000).astype(np.float32), "d": rng.standard_normal(300)}
    new = {
        "w": base["w"] + kc.subnormal_mix(2000, np.float32, seed),
        "d": base["d"] + kc.subnormal_mix(300, np.float64, seed) * 1e-3,
    }
    return base, new


@pytest.mark.parametrize("pipe", list(PIPELINES))
def test_gpu_path_runs_no_flushable_float_op_outside_our_kernels(audit, pipe):
    base, new = _update(3)
    tiny = {"w": kc.subnormal_mix(500, np.float32, 4)}
    with using_backend(audit), ftz_audit.recording() as log:
        ef = gpu_codec.ErrorFeedback()
        p = gpu_codec.compress(new, base, fraction=0.2, pipeline=PIPELINES[pipe], residual=ef)
        gpu_codec.decompress(p.to_bytes(), base=base)
        gpu_codec.decompress(p.to_bytes())
        agg = gpu_codec.Aggregator(base=base)
        agg.add(p, 1.0)
        agg.add(p, 0.75)
        agg.result()
        q = gpu_codec.compress(tiny, fraction=0.5, pipeline=PIPELINES[pipe])  # subnormals only
        gpu_codec.aggregate([q, q], weights=[1.0, 3.0])
    assert [(e.op, e.dtypes, e.where) for e in log] == []


def test_the_device_aggregator_runs_no_flushable_float_op_outside_our_kernels():
    """The aggregator's device path (runs of small tensors checked on the device, a segmented max, the limb
    passes over many tensors, the result onto the base in one pass), on the audited array module."""
    from gpu_codec.testing.recording import _Cuda

    try:
        b = ftz_audit.audit_backend()
    except emu.EmulatorUnavailableError as e:
        pytest.skip(str(e))
    b.on_device = True  # the GPU backend's paths (its stream events on a stand-in)
    b.xp.cuda = _Cuda()
    rng = np.random.default_rng(3)
    base = {f"w{i}": rng.standard_normal(200).astype(np.float32) for i in range(6)}
    base["d"] = rng.standard_normal(300)
    new = {k: v + kc.subnormal_mix(v.size, v.dtype, i) * 1e-3 for i, (k, v) in enumerate(base.items())}
    with using_backend(b), ftz_audit.recording() as log:
        for pipe in ("raw", "int8", "f16"):
            p = gpu_codec.compress(new, base, fraction=0.2, pipeline=PIPELINES[pipe])
            agg = gpu_codec.Aggregator(base=base)
            agg.add(p.to_bytes(), 1.0)
            agg.add(p, 0.75)
            agg.result()
            gpu_codec.aggregate([p.to_bytes()], weights=[3.0])
    assert b.runner.launch_counts["segment_abs_max_u32"]  # (the device path ran)
    assert [(e.op, e.dtypes, e.where) for e in log] == []


def test_audit_sees_the_forms_the_kernels_replaced():
    """The audit is not vacuous: the array-module forms that ran before (the fp64 cast and multiply of the limb
    split, the limb mean's fp32 store, the int8 decode's multiply, abs().max()) are logged."""
    from gpu_codec.cpu_fallback import limbs as lt
    from gpu_codec.cpu_fallback import quantize as qt

    from gpu_codec.xp.limbs import abs_max

    xp = ftz_audit.RecordingXP()
    v = xp.asarray(np.array([1e-45, -2.0], np.float32))
    with ftz_audit.recording() as log:
        lt.limb_split(v, 1.0, [0, -18, -36], xp)
        out = xp.empty(2, np.float32)
        out[...] = xp.asarray(np.array([1e-300, 1.0]))
        qt.int8_decode(xp.asarray(np.array([1, 2], np.int8)), xp.asarray(np.array([1e-40], np.float32)), 2, xp)
        xp.abs(v).max()
        abs_max(v)  # bits only: not logged
    ops = [e.op for e in log]
    assert ops == ["astype", "setitem", "multiply", "absolute", "maximum.reduce"], ops


def test_float_kernels_match_their_twins_on_subnormals():
    assert kc.float_steps(emu.EmulatorRunner()) == []


def test_float_steps_catch_a_flush():
    """A limbs.cu that flushes the int8 decode's subnormal products (as -ftz would) is caught."""
    src = emu.package_sources()["limbs.cu"]
    body = "out[i] = __fmul_rn((float)q[i], scales[i / (u64)block]);"
    assert body in src
    flush = (
        "{ const float r = __fmul_rn((float)q[i], scales[i / (u64)block]);"
        " out[i] = fabsf(r) < 1.17549435e-38f ? 0.0f * r : r; }"
    )
    runner = emu.EmulatorRunner(sources={"limbs.cu": src.replace(body, flush)})
    bad = kc.float_steps(runner)
    assert bad and all("int8_dequant" in m for m in bad), bad


def test_aggregate_and_decode_bytes_match_the_numpy_backend_on_subnormals(audit):
    base, new = _update(5)
    tiny = {"w": kc.subnormal_mix(700, np.float32, 6), "d": kc.subnormal_mix(90, np.float64, 7)}
    got, want = [], []
    for backend, sink in ((audit, got), (None, want)):
        ctx = using_backend(backend) if backend is not None else gpu_codec.testing.use_backend("cpu")
        with ctx:
            for pipe in ("raw", "int8"):
                p = gpu_codec.compress(tiny, fraction=0.5, pipeline=PIPELINES[pipe])
                q = gpu_codec.compress(new, base, fraction=0.3, pipeline=PIPELINES[pipe])
                sink.append(p.to_bytes() + q.to_bytes())
                sink += [np.asarray(a).tobytes() for a in gpu_codec.decompress(p.to_bytes()).values()]
                sink += [np.asarray(a).tobytes() for a in gpu_codec.aggregate([p, p], weights=[1, 2]).values()]
                sink += [np.asarray(a).tobytes() for a in gpu_codec.aggregate([q], base=base).values()]
    assert len(got) == len(want) and all(g == w for g, w in zip(got, want))
    # subnormal means survive where the update holds nothing larger (the grid follows the largest value)
    sub = tiny["w"][np.abs(tiny["w"]) < np.finfo(np.float32).smallest_normal]
    with using_backend(audit):
        mean = gpu_codec.aggregate([gpu_codec.compress({"w": sub}, fraction=1.0)] * 2, weights=[1, 2])["w"]
    assert np.count_nonzero((mean != 0) & (np.abs(mean) < np.finfo(np.float32).smallest_normal)) > 100


@pytest.mark.parametrize("pipe", ["raw", "int8", "f16", "ternary"])
def test_half_precision_tensors_run_no_flushable_float_op_outside_our_kernels(audit, pipe):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    base = {"h": rng.standard_normal(1500).astype(np.float16), "b": torch.randn(900).to(torch.bfloat16)}
    new = {"h": base["h"] + np.float16(6e-8), "b": base["b"] + torch.randn(900).to(torch.bfloat16) * 1e-3}
    with using_backend(audit), ftz_audit.recording() as log:
        p = gpu_codec.compress(new, base, fraction=0.1, pipeline=PIPELINES[pipe], residual=gpu_codec.ErrorFeedback())
        gpu_codec.decompress(p.to_bytes(), base=base)
        agg = gpu_codec.Aggregator(base=base)
        agg.add(p)
        agg.result()
        gpu_codec.decompress(
            gpu_codec.compress(new, base, fraction=None, pipeline=PIPELINES[pipe]).to_bytes(), base=base
        )
    assert [(e.op, e.dtypes, e.where) for e in log] == []
