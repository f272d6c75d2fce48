"""The CUDA kernels of kernels/*.cu executed on the CPU (gpu_codec.backends.emulated), compared to the byte with their
NumPy twins (cpu_fallback/), plus tests of the emulator itself: barrier and warp-lockstep semantics, shared
memory, atomics, the errors it reports, and planted bugs it must catch.

What the emulator cannot catch (races inside one barrier interval, out-of-bounds accesses, FMA contraction,
NaN bit patterns) is listed in kernels/host/README.md; benchmarks/gpu_suite.py covers those on a real GPU.

The case-based tests also run on a GPU with the CuPy runner (``pytest -m gpu``); CPU CI runs the emulated ones.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_codec.backends import emulated as emu
from gpu_codec.backends import gpu_probe
from gpu_codec.backends.base import SelectRequest
from gpu_codec.backends.sources import kernel_files, kernel_signatures
from gpu_codec.constants import CHUNK_SCAN_THREADS, Criterion
from gpu_codec.testing import kernel_cases as kc

ROOT = Path(__file__).resolve().parents[1]


def _has_compiler() -> bool:
    try:
        emu._compiler()
    except emu.EmulatorUnavailableError:
        return False
    return True


HAS_CXX = _has_compiler()


@pytest.fixture(autouse=True)
def _needs_compiler(request):
    """Everything here needs the emulator's C++ compiler, except the case tests run with the GPU runner."""
    if HAS_CXX:
        return
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("runner") == "gpu":
        return
    pytest.skip("no C++20 compiler (g++/clang++) for the emulator")


HAS_GPU = gpu_probe()[0]
RUNNERS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request):
    if request.param == "gpu":
        from gpu_codec.backends.gpu import CupyRunner

        return CupyRunner()
    if not HAS_CXX:
        pytest.skip("no C++20 compiler (g++/clang++) for the emulator")
    return emu.EmulatorRunner()


@pytest.fixture(scope="module")
def emulated():
    if not HAS_CXX:
        pytest.skip("no C++20 compiler (g++/clang++) for the emulator")
    return emu.EmulatorRunner()


TOPK = kc.topk_cases()
SCATTER = kc.scatter_cases()


# ------------------------------------------------------------------------------- kernels against their twins


@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_topk_select_matches_cpu_backend(runner, case):
    """KernelOps(runner).topk_select == cpu_fallback.select.topk_select: indices, values, residuals, errors."""
    assert kc.topk_vs_reference(runner, case) == []


@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_dense_kernels_match_twins(runner, case):
    """dense_delta and dense_apply (dense mode) against their twins on every top-k case: values, residuals, errors."""
    assert kc.dense_vs_reference(runner, case) == []


@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_topk_kernels_match_twins_stepwise(runner, case):
    """Each top-k kernel on its own against its twin, every intermediate buffer compared after every launch."""
    assert kc.topk_stepwise(runner, case) == []


WIDE = [
    c
    for c in TOPK
    if c.name in ("mixed_global", "odd_sizes_tensor", "residual_q1", "pattern_ties", "k_all_global", "empty_tensors")
]


@pytest.mark.parametrize("case", WIDE, ids=[c.name for c in WIDE])
def test_chunk_write_u64_matches_twin(runner, case):
    """The 64-bit index variant (used for tensors over 2^32 elements) on small tensors."""
    assert kc.topk_stepwise(runner, case, wide=True) == []


@pytest.mark.parametrize("own", ["", "one"], ids=["own_few_chunks", "own_one_chunk"])
@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_fused_topk_matches_twins_stepwise(runner, case, own):
    """The fused selection (sample_keys, fused_scan, cand_select, cand_count, chunk_scan_*, cand_write,
    residual_delta, kept_fix) against the twins of cpu_fallback/fused.py launch by launch, and against the NumPy
    backend; with the production rule (segments of a few chunks selected by their blocks) and with only one-chunk
    segments so (the others bracketed by a sample, as larger segments are)."""
    assert kc.topk_fused_stepwise(runner, case, own=own) == []


@pytest.mark.parametrize("force", ["miss", "overflow"])
@pytest.mark.parametrize("case", WIDE, ids=[c.name for c in WIDE])
def test_fused_topk_fallback_is_exact(runner, case, force):
    """A bracket that misses (fewer candidates than k) or an overflowing candidate region runs the unfused passes:
    counted in KernelOps.fused_fallbacks, and the result is the same to the byte."""
    assert kc.topk_fused_stepwise(runner, case, force=force) == []


@pytest.mark.parametrize("case", WIDE, ids=[c.name for c in WIDE])
def test_fused_cand_write_u64_matches_twin(runner, case):
    assert kc.topk_fused_stepwise(runner, case, wide=True) == []


REJECT = [c for c in TOPK if c.name.startswith("reject_")]


@pytest.mark.parametrize("res_out", ["alias", "new"])
@pytest.mark.parametrize("case", REJECT, ids=[c.name for c in REJECT])
def test_fused_topk_rejects_nonfinite_without_touching_the_residual(runner, case, res_out):
    """A non-finite delta or score: the lowest bad tensor is reported and a residual read in place is unchanged."""
    assert kc.topk_fused_stepwise(runner, case.with_(res=True, res_out=res_out)) == []


def test_fused_fallback_is_counted(emulated):
    from gpu_codec.backends.kernels import KernelOps

    case = TOPK[0]
    inp = kc.make_topk_inputs(case)
    args = (inp["new"], inp["base"], inp["res"], [None] * len(inp["new"]), inp["dtypes"], inp["ext"])
    args += (inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    ops = KernelOps(emulated, fused=True)
    want = ops.topk_select(*args)
    assert (ops.fused_selections, ops.fused_fallbacks) == (1, 0)
    with kc.forced("miss"):
        got = ops.topk_select(*args)
    assert (ops.fused_selections, ops.fused_fallbacks) == (1, 1)
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert a.tobytes() == b.tobytes()


def test_unfused_topk_matches_cpu_backend(emulated, monkeypatch):
    """GPU_CODEC_FUSED_SELECT=0 selects the unfused passes (also the fused path's fallback)."""
    from gpu_codec.backends.kernels import FUSED_ENV, KernelOps

    monkeypatch.setenv(FUSED_ENV, "0")
    assert KernelOps(emulated).fused is False
    for case in TOPK[::4]:
        assert kc.topk_vs_reference(emulated, case) == []


@pytest.mark.parametrize("schedule", ["reverse", "shuffle"])
@pytest.mark.parametrize("case", TOPK[::3], ids=[c.name for c in TOPK[::3]])
def test_topk_independent_of_schedule(schedule, case):
    """Blocks, and threads between barriers, in another order: a race would change the bytes."""
    r = emu.EmulatorRunner(schedule=schedule, seed=7)
    assert kc.topk_stepwise(r, case) == []
    assert kc.topk_vs_reference(r, case) == []
    assert kc.topk_fused_stepwise(r, case) == []


CHUNK_SCAN = kc.chunk_scan_cases()


@pytest.mark.parametrize("case", CHUNK_SCAN, ids=[c.name for c in CHUNK_SCAN])
def test_chunk_scan_across_blocks_matches_twins(runner, case):
    """chunk_scan_reduce, chunk_scan_eq and chunk_scan_out over hundreds of chunks (several scan blocks; tensors
    and segments across block boundaries, empty tensors), launch by launch against their twins, and the result
    against the definition of eq_base, out_base and the tensor counts."""
    assert kc.chunk_scan_vs_twins(runner, case) == []


@pytest.mark.parametrize("schedule", ["reverse", "shuffle"])
def test_chunk_scan_independent_of_schedule(schedule):
    r = emu.EmulatorRunner(schedule=schedule, seed=5)
    for case in CHUNK_SCAN:
        assert kc.chunk_scan_vs_twins(r, case) == []


def test_topk_over_several_scan_blocks(runner):
    """600 small tensors (one chunk each, a few empty) in pairs: the whole selection, unfused and fused, over a
    chunk scan of three blocks, against the twins kernel by kernel."""
    rng = np.random.default_rng(4)
    sizes = tuple(int(x) for x in rng.integers(0, 40, 600))
    dtypes = tuple(("f32", "f16", "bf16", "f64")[i % 4] for i in range(600))
    case = kc.TopkCase("many_tensors_pairs", sizes, dtypes, scope="pairs", k=0.3, pattern="ties")
    assert sum(n > 0 for n in sizes) > 2 * CHUNK_SCAN_THREADS
    assert kc.topk_stepwise(runner, case) == []
    assert kc.topk_fused_stepwise(runner, case) == []


@pytest.mark.parametrize("case", SCATTER, ids=[c.name for c in SCATTER])
def test_scatter_matches_cpu_backend(runner, case):
    """KernelOps(runner).scatter == the NumPy backend's scatter, bad entries (lowest one) included."""
    assert kc.scatter_vs_reference(runner, case) == []


@pytest.mark.parametrize("case", SCATTER, ids=[c.name for c in SCATTER])
def test_scatter_kernels_match_twins(runner, case):
    assert kc.scatter_stepwise(runner, case) == []


QUANT = kc.quant_cases()
RICE = kc.rice_cases()


@pytest.mark.parametrize("case", QUANT, ids=[c.name for c in QUANT])
def test_value_codec_kernels_match_twins(runner, case):
    """quantize_cast (fp16/bf16), quantize_int8, ternary_partial/mu/fixup against cpu_fallback/quantize.py.

    Not modelled here: quantize_int8's residual ``v - q * scale`` rounds twice on the host (as the twin does); a
    GPU's ptxas may fuse it into one FMA (tests/test_nvrtc.py KNOWN_CONTRACTION_HAZARDS), so only the GPU run of
    this test (``pytest -m gpu``, benchmarks/gpu_suite.py) can tell whether the device matches.
    """
    assert kc.quant_stepwise(runner, case) == []


@pytest.mark.parametrize("case", RICE, ids=[c.name for c in RICE])
def test_rice_kernels_match_twin(runner, case):
    """rice_count, rice_scan (per-chunk intermediates too) and rice_write against cpu_fallback/rice.py."""
    assert kc.rice_stepwise(runner, case) == []


@pytest.mark.parametrize("schedule", ["reverse", "shuffle"])
def test_codecs_independent_of_schedule(schedule):
    r = emu.EmulatorRunner(schedule=schedule, seed=11)
    for case in QUANT[:4]:
        assert kc.quant_stepwise(r, case) == []
    for case in RICE[:4]:
        assert kc.rice_stepwise(r, case) == []


def test_scatter_reports_lowest_bad_entry(emulated):
    """The planted bad entries are found, and the lowest one wins over a later one in the last tensor."""
    from gpu_codec.backends.kernels import KernelOps

    for case in SCATTER:
        if case.bad == "none":
            continue
        inp = kc.make_scatter_inputs(case)
        bad = KernelOps(emulated).scatter(
            [o.copy() for o in inp["outs"]], inp["dtypes"], list(case.sizes), inp["idx"], inp["vals"], case.mode
        )
        first = sum(int(i.size) for i in inp["idx"][: case.bad_tensor])  # entries of the tensors before
        assert bad is not None and first <= bad < first + inp["idx"][case.bad_tensor].size, case.name


def test_gather_copy_matches_twin(emulated):
    """gather_copy (a run's bases copied into its output in one launch) keeps every bit, against its twin."""
    from gpu_codec.backends.kernels import KernelOps

    assert kc.gather_copy_vs_twin(emulated) == []
    with pytest.raises(ValueError, match="gather_copy"):  # sources that do not fill the output exactly
        KernelOps(emulated).gather_copy(np.zeros(3, np.float32), [np.zeros(2, np.float32)])


def test_gather_entries_matches_twin(emulated):
    """gather_entries (a run's bases read at its entries in one launch) keeps every bit, against its twin and the
    NumPy backend, and reads nothing outside an entry's tensor."""
    from gpu_codec.backends.kernels import KernelOps

    assert kc.gather_entries_vs_twin(emulated) == []
    with pytest.raises(ValueError, match="gather_entries"):  # counts that do not match the output
        KernelOps(emulated).gather_entries(
            np.zeros(3, np.float32), [np.zeros(2, np.float32)], [0, 2], np.zeros(2, np.uint32), [2]
        )


def test_every_kernel_is_exercised():
    """The cases above launch every kernel of kernels/*.cu (a new kernel needs cases here)."""
    r = emu.EmulatorRunner()
    kc.topk_stepwise(r, TOPK[0])
    kc.topk_stepwise(r, TOPK[0], wide=True)
    alias = next(c for c in TOPK if c.res_out == "alias" and c.qmode)
    kc.topk_fused_stepwise(r, alias)
    kc.topk_fused_stepwise(r, next(c for c in TOPK if c.res_out == "new"), wide=True)
    kc.topk_fused_stepwise(r, alias, select="multi")
    tied = kc.TopkCase("equal_global", (3000, 5000), ("f32", "f16"), k=0.01, pattern="equal")
    kc.topk_fused_stepwise(r, tied, own="one")
    kc.topk_fused_stepwise(r, tied, wide=True, own="one")
    kc.topk_fused_stepwise(r, next(c for c in TOPK if c.name == "f32_residual_q1"))  # fused_scan_f32
    h16 = kc.TopkCase("h16", (5000, 300), ("bf16", "f16"), k=0.05, res=True, res_out="new")
    kc.topk_fused_stepwise(r, h16)  # fused_scan_h16
    kc.scatter_stepwise(r, SCATTER[0])
    kc.scatter_stepwise(r, SCATTER[1])
    kc.quant_stepwise(r, QUANT[0])
    kc.rice_stepwise(r, RICE[0])
    kc.rice_stepwise(r, RICE[1])
    assert kc.dense_vs_reference(r, TOPK[0]) == []
    assert kc.float_steps(r, n=300) == []
    assert kc.gather_copy_vs_twin(r) == []
    assert kc.gather_entries_vs_twin(r) == []
    missing = set(kernel_signatures()) - set(r.launch_counts)
    assert not missing, f"kernels without emulated test cases: {sorted(missing)}"


def test_emulated_backend_is_selectable(monkeypatch):
    from gpu_codec import backends as backend

    monkeypatch.setenv(backend.ENV, "emulated")
    backend.reset_backend()
    try:
        b = backend.get_backend()
        assert b.name == "emulated" and isinstance(b.runner, emu.EmulatorRunner)
        inp = kc.make_topk_inputs(TOPK[0])
        req = SelectRequest(
            inp["new"],
            inp["base"],
            inp["res"],
            [None] * 4,
            inp["dtypes"],
            inp["ext"],
            inp["ext_dtypes"],
            Criterion.MAGNITUDE,
            inp["segments"],
            inp["ks"],
        )
        idx, _vals, bad = b.topk_select(req)
        assert bad is None and sum(i.size for i in idx) == inp["ks"][0]
    finally:
        backend.reset_backend()


# --------------------------------------------------------------------------------------- the emulator itself


def test_signatures_parse_like_sources():
    """The launch glue is generated from the same signatures the CuPy runner resolves."""
    want = kernel_signatures()
    got = {}
    for f in kernel_files():
        for name, args in emu.parse_signatures(emu.expand_source(f)).items():
            got[name] = (f, args)
    assert got == want


def test_library_is_cached_and_keyed_by_source():
    a, _ = emu.build_library()
    b, _ = emu.build_library()
    assert a == b and a.exists()
    src = (ROOT / "kernels" / "scatter.cu").read_text() + "\n// a comment changes the key\n"
    c, _ = emu.build_library({"scatter.cu": src}, package=False)
    assert c != a


PROBE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

extern "C" __global__ void probe_barrier(u32* out, int use_barrier) {
    __shared__ u32 sh[1024];
    const u32 n = blockDim.x, t = threadIdx.x;
    sh[t] = t * 7u + blockIdx.x;
    if (use_barrier) __syncthreads();
    out[blockIdx.x * n + t] = sh[(t + 1) % n];
}

extern "C" __global__ void probe_scan(u64* out) {  // Hillis-Steele over the whole block, as the scans do
    __shared__ u64 sh[1024];
    sh[threadIdx.x] = threadIdx.x + 1;
    __syncthreads();
    for (u32 o = 1; o < blockDim.x; o <<= 1) {
        const u64 add = threadIdx.x >= o ? sh[threadIdx.x - o] : 0ull;
        __syncthreads();
        sh[threadIdx.x] += add;
        __syncthreads();
    }
    out[threadIdx.x] = sh[threadIdx.x];
}

extern "C" __global__ void probe_warp(const u32* in, u32* out, int d) {
    const u32 t = threadIdx.x + blockIdx.x * blockDim.x;
    const u32 v = in[t];
    out[8 * t + 0] = __shfl_down_sync(0xFFFFFFFFu, v, d);
    out[8 * t + 1] = __shfl_up_sync(0xFFFFFFFFu, v, d);
    out[8 * t + 2] = __shfl_xor_sync(0xFFFFFFFFu, v, d);
    out[8 * t + 3] = __shfl_sync(0xFFFFFFFFu, v, d);
    out[8 * t + 4] = __ballot_sync(0xFFFFFFFFu, v & 1u);
    out[8 * t + 5] = __any_sync(0xFFFFFFFFu, v == 5u);
    out[8 * t + 6] = __all_sync(0xFFFFFFFFu, v != 0u);
    out[8 * t + 7] = __shfl_down_sync(0xFFFFFFFFu, v, d, 8);
}

extern "C" __global__ void probe_warp_sum(const u32* in, u32* out) {  // the reduction of chunk_count
    u32 g = in[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) g += __shfl_down_sync(0xFFFFFFFFu, g, o);
    out[threadIdx.x] = g;
}

extern "C" __global__ void probe_wide_shuffles(const u64* in, u64* out, const double* din, double* dout) {
    const u32 t = threadIdx.x;
    out[t] = __shfl_xor_sync(0xFFFFFFFFu, in[t], 1);
    dout[t] = __shfl_sync(0xFFFFFFFFu, din[t], 31);
}

extern "C" __global__ void probe_half_masks(u32* out) {
    const u32 lane = threadIdx.x & 31u;
    u32 v = lane * 10u;
    if (lane < 16) v = __shfl_down_sync(0x0000FFFFu, v, 1, 16);
    else v = __shfl_up_sync(0xFFFF0000u, v, 2, 16);
    out[threadIdx.x] = v;
}

extern "C" __global__ void probe_syncwarp(u32* out) {
    __shared__ u32 sh[32];
    const u32 lane = threadIdx.x & 31u;
    sh[lane] = lane * 3u + 1u;
    __syncwarp();
    out[lane] = sh[(lane + 1u) & 31u];
}

extern "C" __global__ void probe_atomics(u32* g32, u64* g64, u64* gmin, float* gf, u64* per_block) {
    __shared__ u32 s32;
    __shared__ u64 s64, smin;
    if (threadIdx.x == 0) { s32 = 0; s64 = 0; smin = ~0ull; }
    __syncthreads();
    atomicAdd(&s32, 1u);
    atomicAdd(&s64, (u64)threadIdx.x << 33);
    atomicMin(&smin, (u64)(1000 + (threadIdx.x * 37u) % 101u));
    atomicAdd(g32, 2u);
    atomicAdd(g64, 3ull << 40);
    atomicMin(gmin, (u64)((blockIdx.x * blockDim.x + threadIdx.x) ^ 5u) + 17ull);
    atomicAdd(gf, 0.5f);
    __threadfence_block();
    __syncthreads();
    if (threadIdx.x == 0) {
        per_block[3 * blockIdx.x] = s32;
        per_block[3 * blockIdx.x + 1] = s64;
        per_block[3 * blockIdx.x + 2] = smin;
    }
}

extern "C" __global__ void probe_shared_garbage(u32* out) {
    __shared__ u32 sh[4];
    if (threadIdx.x == 0) { out[blockIdx.x] = sh[2]; sh[2] = 12345u + blockIdx.x; }
}

extern "C" __global__ void probe_indices(u32* out) {
    const u32 b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const u32 nthr = blockDim.x * blockDim.y * blockDim.z;
    const u32 t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    u32* o = out + 4 * (b * nthr + t);
    o[0] = threadIdx.x | (threadIdx.y << 10) | (threadIdx.z << 20);
    o[1] = blockIdx.x | (blockIdx.y << 10) | (blockIdx.z << 20);
    o[2] = blockDim.x | (blockDim.y << 10) | (blockDim.z << 20);
    o[3] = gridDim.x | (gridDim.y << 10) | (gridDim.z << 20);
}

extern "C" __global__ void probe_bits(const float* f, const double* d, u32* o32, u64* o64, float* fo, double* dout) {
    const u32 t = threadIdx.x;
    o32[t] = __float_as_uint(f[t]);
    fo[t] = fabsf(__uint_as_float(o32[t]));
    o64[t] = (u64)__double_as_longlong(d[t]);
    dout[t] = fabs(d[t]);
}

extern "C" __global__ void probe_divergent_barrier(u32* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void probe_exit_before_barrier(u32* out) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void probe_warp_lane_exits(u32* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
}

extern "C" __global__ void probe_mask_excludes_caller(u32* out) {
    out[threadIdx.x] = __ballot_sync(0x1u, 1);
}

extern "C" __global__ void probe_divergent_collectives(u32* out) {
    if (threadIdx.x & 1) out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
    else out[threadIdx.x] = __shfl_sync(0xFFFFFFFFu, 1u, 0);
}
"""


@pytest.fixture(scope="module")
def probe():
    if not HAS_CXX:
        pytest.skip("no C++20 compiler (g++/clang++) for the emulator")
    return emu.EmulatorRunner({"probe.cu": PROBE}, package=False)


def _probe(schedule="forward", poison=0xA5):
    r = emu.EmulatorRunner({"probe.cu": PROBE}, package=False, schedule=schedule, seed=3, poison=poison)
    return r


@pytest.mark.parametrize("schedule", list(emu.SCHEDULES))
@pytest.mark.parametrize("block", [1, 32, 96, 1024])
def test_syncthreads_is_a_real_barrier(schedule, block):
    r = _probe(schedule)
    out = np.zeros(3 * block, np.uint32)
    r.launch("probe_barrier", 3, block, (out, np.int32(1)))
    t = np.arange(block)
    want = np.concatenate([((t + 1) % block) * 7 + b for b in range(3)]).astype(np.uint32)
    assert out.tolist() == want.tolist()
    assert r.last_stats["barriers"] == 3 and r.last_stats["blocks"] == 3


def test_missing_barrier_is_visible():
    """Without the barrier, a thread reads its neighbour's slot before the neighbour wrote it (poison)."""
    seen = set()
    for schedule in emu.SCHEDULES:
        r = _probe(schedule)
        out = np.zeros(256, np.uint32)
        r.launch("probe_barrier", 1, 256, (out, np.int32(0)))
        seen.add(int(np.count_nonzero(out == 0xA5A5A5A5)))
    assert max(seen) > 0


@pytest.mark.parametrize("schedule", list(emu.SCHEDULES))
def test_block_scan_of_1024_threads(schedule):
    r = _probe(schedule)
    out = np.zeros(1024, np.uint64)
    r.launch("probe_scan", 1, 1024, (out,))
    assert out.tolist() == np.cumsum(np.arange(1, 1025)).tolist()
    assert r.last_stats["barriers"] == 1 + 2 * 10


@pytest.mark.parametrize("schedule", list(emu.SCHEDULES))
@pytest.mark.parametrize("d", [0, 1, 3, 16, 31])
def test_warp_intrinsics(schedule, d):
    r = _probe(schedule)
    rng = np.random.default_rng(d)
    n = 128
    vin = rng.integers(0, 8, n).astype(np.uint32)
    vin[40:64] = np.maximum(vin[40:64], 1)  # warp 1 has no zero: __all_sync true there
    out = np.zeros(8 * n, np.uint32)
    r.launch("probe_warp", 2, 64, (vin, out, np.int32(d)))
    got = out.reshape(n, 8)
    for t in range(n):
        w0, lane = t - t % 32, t % 32
        warp = vin[w0 : w0 + 32]
        pos8 = lane % 8
        want = [
            warp[lane + d] if lane + d < 32 else warp[lane],
            warp[lane - d] if lane >= d else warp[lane],
            warp[lane ^ d] if (lane ^ d) < 32 else warp[lane],
            warp[d % 32],
            sum(1 << i for i in range(32) if warp[i] & 1),
            int(bool(np.any(warp == 5))),
            int(bool(np.all(warp != 0))),
            warp[lane + d] if pos8 + d < 8 else warp[lane],
        ]
        assert got[t].tolist() == [int(x) for x in want], (t, d)
    assert r.last_stats["warp_collectives"] == 8 * n


def test_warp_reduction_and_wide_values(probe):
    vin = np.arange(64, dtype=np.uint32) * 3
    out = np.zeros(64, np.uint32)
    probe.launch("probe_warp_sum", 1, 64, (vin, out))
    assert out[0] == vin[:32].sum() and out[32] == vin[32:].sum()
    u = (np.arange(32, dtype=np.uint64) << np.uint64(40)) + np.uint64(7)
    d = np.linspace(-1, 1, 32)
    uo, do = np.zeros(32, np.uint64), np.zeros(32, np.float64)
    probe.launch("probe_wide_shuffles", 1, 32, (u, uo, d, do))
    assert uo.tolist() == u[np.arange(32) ^ 1].tolist()
    assert do.tobytes() == np.full(32, d[31]).tobytes()


def test_partial_masks_and_width(probe):
    out = np.zeros(64, np.uint32)
    probe.launch("probe_half_masks", 1, 64, (out,))
    lane = np.arange(64) % 32
    want = (
        np.where(lane < 16, np.where(lane % 16 + 1 < 16, lane + 1, lane), np.where(lane % 16 >= 2, lane - 2, lane)) * 10
    )
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize("schedule", list(emu.SCHEDULES))
def test_syncwarp_lanes_all_arrive_before_any_returns(schedule):
    r = _probe(schedule)
    out = np.zeros(32, np.uint32)
    r.launch("probe_syncwarp", 1, 32, (out,))
    assert out.tolist() == [((lane + 1) % 32) * 3 + 1 for lane in range(32)]


def test_atomics_shared_and_global(probe):
    blocks, threads = 3, 256
    g32, g64 = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
    gmin, gf = np.full(1, 2**63, np.uint64), np.zeros(1, np.float32)
    per_block = np.zeros(3 * blocks, np.uint64)
    probe.launch("probe_atomics", blocks, threads, (g32, g64, gmin, gf, per_block))
    n = blocks * threads
    assert int(g32[0]) == 2 * n and int(g64[0]) == n * (3 << 40) and float(gf[0]) == 0.5 * n
    assert int(gmin[0]) == min((i ^ 5) + 17 for i in range(n))
    t = np.arange(threads)
    for b in range(blocks):
        assert per_block[3 * b : 3 * b + 3].tolist() == [
            threads,
            int(sum(int(x) << 33 for x in t)),
            int(min(1000 + (t * 37) % 101)),
        ]


def test_shared_memory_starts_as_poison_in_every_block():
    r = _probe(poison=0x5C)
    out = np.zeros(4, np.uint32)
    r.launch("probe_shared_garbage", 4, 32, (out,))
    assert out.tolist() == [0x5C5C5C5C] * 4  # not the value the previous block left
    r = _probe(poison=None)  # without poisoning, static storage would leak one block's values into the next
    r.launch("probe_shared_garbage", 4, 32, (out,))
    assert out[1:].tolist() == [12345, 12346, 12347]


def test_three_dimensional_indices(probe):
    grid, block = (3, 2, 2), (4, 3, 2)
    nb, nthr = 12, 24
    out = np.zeros(4 * nb * nthr, np.uint32)
    probe.launch("probe_indices", grid, block, (out,))
    o = out.reshape(nb, nthr, 4)
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                b = bx + 3 * (by + 2 * bz)
                for tz in range(2):
                    for ty in range(3):
                        for tx in range(4):
                            t = tx + 4 * (ty + 3 * tz)
                            assert o[b, t].tolist() == [
                                tx | ty << 10 | tz << 20,
                                bx | by << 10 | bz << 20,
                                4 | 3 << 10 | 2 << 20,
                                3 | 2 << 10 | 2 << 20,
                            ]


def test_bit_casts_and_fabs(probe):
    f = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 1e-45, -3e-39] * 4, np.float32)
    d = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -1e-310, 1e300, -7.0] * 4, np.float64)
    o32, o64 = np.zeros(32, np.uint32), np.zeros(32, np.uint64)
    fo, do = np.zeros(32, np.float32), np.zeros(32, np.float64)
    probe.launch("probe_bits", 1, 32, (f, d, o32, o64, fo, do))
    assert o32.tobytes() == f.view(np.uint32).tobytes() and o64.tobytes() == d.view(np.uint64).tobytes()
    assert fo.tobytes() == np.abs(f).tobytes() and do.tobytes() == np.abs(d).tobytes()


@pytest.mark.parametrize(
    "kernel, block, message",
    [
        ("probe_divergent_barrier", 32, r"divergent __syncthreads"),
        ("probe_exit_before_barrier", 32, r"while 1 have exited"),
        ("probe_warp_lane_exits", 32, r"deadlock: __ballot_sync .* lane 5, which has exited"),
        ("probe_mask_excludes_caller", 32, r"does not name it"),
        ("probe_divergent_collectives", 32, r"divergent warp collectives"),
        ("probe_barrier", 1025, r"invalid configuration"),
    ],
)
def test_undefined_behaviour_is_reported(probe, kernel, block, message):
    out = np.zeros(2048, np.uint32)
    args = (out, np.int32(1)) if kernel == "probe_barrier" else (out,)
    with pytest.raises(emu.EmulatorError, match=message):
        probe.launch(kernel, 1, block, args)
    probe.launch("probe_barrier", 2, 64, (out, np.int32(1)))  # the runner is usable afterwards


def test_empty_grid_is_rejected_like_cuda(probe):
    with pytest.raises(emu.EmulatorError, match="invalid configuration"):
        probe.launch("probe_barrier", 0, 32, (np.zeros(32, np.uint32), np.int32(1)))


def test_arguments_are_checked_against_the_signature(probe):
    out = np.zeros(64, np.uint32)
    with pytest.raises(TypeError, match="2 arguments"):
        probe.launch("probe_barrier", 1, 32, (out,))
    with pytest.raises(TypeError, match="int32 scalar"):
        probe.launch("probe_barrier", 1, 32, (out, 1))
    with pytest.raises(TypeError, match="needs dtype uint32"):
        probe.launch("probe_barrier", 1, 32, (out.astype(np.int64), np.int32(1)))
    with pytest.raises(TypeError, match="C-contiguous"):
        probe.launch("probe_barrier", 1, 32, (np.zeros(128, np.uint32)[::2], np.int32(1)))
    with pytest.raises(emu.EmulatorError, match="no kernel named"):
        probe.launch("nope", 1, 32, ())


# ------------------------------------------------------------------------------------------- planted bugs


def _mutate(fname: str, old: str, new: str) -> dict[str, str]:
    src = (ROOT / "kernels" / fname).read_text()
    assert src.count(old) == 1, f"the planted bug no longer applies to {fname}: {old!r}"
    return {fname: src.replace(old, new)}


def _caught(runner, cases) -> list[str]:
    found = []
    for case in cases:
        # Stepwise first: it stops at the first buffer that differs, before a later kernel is launched on
        # inconsistent inputs (which could then write out of bounds: the emulator has no memcheck).
        m = kc.topk_stepwise(runner, case)
        if not m:
            m = kc.topk_vs_reference(runner, case)
        if m:
            found.append(f"{case.name}: {m[0]}")
    return found


BUG_CASES = [c for c in TOPK if c.name in ("pattern_ties", "k_all_global", "crit_0_ties", "mixed_tensor")]


def test_planted_off_by_one_in_cand_select_is_caught():
    r = emu.EmulatorRunner(_mutate("topk.cu", "if (k_rem <= hb)", "if (k_rem < hb)"), package=False)
    assert [m for c in BUG_CASES for m in kc.topk_fused_stepwise(emu.EmulatorRunner(), c, select="one")] == []
    found = [m for c in BUG_CASES for m in kc.topk_fused_stepwise(r, c, select="one")]
    assert any("cand_select" in m for m in found), "an off-by-one in cand_select went unnoticed"


def test_planted_prefix_bug_in_cand_hist_is_caught():
    bug = _mutate("topk.cu", "(key >> (shift + 8)) == high)", "(key >> (shift + 9)) == high)")
    r = emu.EmulatorRunner(bug, package=False)
    control = emu.EmulatorRunner()
    assert [m for c in BUG_CASES for m in kc.topk_fused_stepwise(control, c, select="multi")] == []
    found = [m for c in BUG_CASES for m in kc.topk_fused_stepwise(r, c, select="multi")]
    assert any("cand_hist" in m for m in found), "a wrong prefix match in cand_hist went unnoticed"


@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_fused_multi_block_select_matches_twins(runner, case):
    """The selection on the candidates with a block per chunk (cand_hist, radix_pick), which segments of many
    chunks take: launch by launch against the twins and the NumPy backend, as the one-block form."""
    assert kc.topk_fused_stepwise(runner, case, select="multi") == []


def test_planted_off_by_one_in_radix_pick_is_caught():
    r = emu.EmulatorRunner(_mutate("topk.cu", "if (k_rem <= cnt)", "if (k_rem < cnt)"), package=False)
    assert _caught(emu.EmulatorRunner(), BUG_CASES) == []  # control: the real source passes
    assert _caught(r, BUG_CASES), "an off-by-one in radix_pick went unnoticed"


def test_planted_off_by_one_in_scatter_bounds_is_caught():
    """`i >= numel` -> `i > numel`: index == numel is accepted and written one past the tensor (into padding
    here), where the twin reports it."""
    r = emu.EmulatorRunner(_mutate("scatter.cu", "i >= (u64)numel[t]", "i > (u64)numel[t]"), package=False)
    n = 1000
    backing = np.zeros(n + 16, np.float32)
    out = backing[:n]
    idx = np.array([3, 500, n], np.uint32)
    vals = np.array([1.0, 2.0, 3.0], np.float32)
    from gpu_codec.backends.kernels import KernelOps

    assert KernelOps(emu.EmulatorRunner()).scatter([out.copy()], [0], [n], [idx], [vals], 0) == 2
    assert KernelOps(r).scatter([out], [0], [n], [idx], [vals], 0) is None  # the bug: no error reported ...
    assert backing[n] == 3.0  # ... and a write past the tensor


def test_planted_missing_barrier_in_chunk_scan_is_caught():
    """A race: without the barrier between reading sh[t - o] and writing sh[t], threads that run first change
    what later ones read. The forward schedule exposes it (the reverse order happens to hide this one)."""
    src = _mutate(
        "common.cuh",
        "0ull;\n        __syncthreads();\n        sh[threadIdx.x] += add;",
        "0ull;\n        sh[threadIdx.x] += add;",
    )  # block_exclusive_scan, used by the chunk scan
    src["topk.cu"] = (ROOT / "kernels" / "topk.cu").read_text()
    cases = [c for c in TOPK if c.name in ("mixed_tensor", "odd_sizes_tensor", "pairs")]
    assert _caught(emu.EmulatorRunner(src, package=False, schedule="forward"), cases)
    assert _caught(emu.EmulatorRunner(src, package=False, schedule="reverse"), cases) == []


def test_planted_carry_bug_in_chunk_scan_is_caught():
    """What a tensor kept before the scan block holding its last chunk: one block too many in the sum."""
    r = emu.EmulatorRunner(_mutate("topk.cu", "if (q > bs) mid += k;", "if (q >= bs) mid += k;"), package=False)
    assert [m for c in CHUNK_SCAN for m in kc.chunk_scan_vs_twins(emu.EmulatorRunner(), c)] == []  # control
    found = [m for c in CHUNK_SCAN for m in kc.chunk_scan_vs_twins(r, c)]
    assert any("chunk_scan_out" in m for m in found), "a carry bug in chunk_scan_out went unnoticed"


def test_planted_gap_bug_in_rice_is_caught():
    src = _mutate("rice.cu", "(u64)idx[l] - (u64)idx[l - 1] - 1ull", "(u64)idx[l] - (u64)idx[l - 1]")
    assert all(kc.rice_stepwise(emu.EmulatorRunner(), c) == [] for c in RICE[:2])
    r = emu.EmulatorRunner(src, package=False)
    assert any(kc.rice_stepwise(r, c) for c in RICE[:2])


def test_emulator_reports_source_lines():
    """Reports name the original file and line, through the expanded includes."""
    src = _mutate(
        "topk.cu",
        "    if (threadIdx.x == 0) {\n        u32 G = 0, E = 0;",
        "    if (threadIdx.x == 0) { __syncthreads(); }\n    if (threadIdx.x == 0) {\n        u32 G = 0, E = 0;",
    )
    r = emu.EmulatorRunner(src, package=False)
    line = src["topk.cu"].split("\n").index("    if (threadIdx.x == 0) { __syncthreads(); }") + 1
    with pytest.raises(emu.EmulatorError, match=re.escape(f"topk.cu:{line}")):
        kc.topk_stepwise(r, TOPK[0])


# ------------------------------------------------------------------------------ the GPU suite, without a GPU

SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def _suite_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_codec_gpu_suite", SUITE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _run(*args, timeout=300):
    import subprocess

    return subprocess.run(
        [sys.executable, str(SUITE), *args], check=False, capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def test_gpu_suite_help():
    r = _run("--help")
    assert r.returncode == 0
    for step in ("pytest", "parity", "cases", "sanitizer", "resources", "--out", "--max-n"):
        assert step in r.stdout


def test_gpu_suite_workload_launches_every_kernel():
    """The compute-sanitizer workload, run on the emulator instead of the GPU."""
    r = _run("--workload", "--runner", "emulated")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "workload: ok" in r.stdout
    import json

    launched = json.loads(r.stdout.split("launches:", 1)[1].splitlines()[0])
    assert set(launched) == set(kernel_signatures())


def test_gpu_suite_runs_its_cpu_steps(tmp_path):
    """Everything but pytest -m gpu and compute-sanitizer, on the emulator: the summary, parity and cases."""
    import json

    r = _run("--out", str(tmp_path), "--runner", "emulated", "--quick", "--skip", "resources")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {k: v["status"] for k, v in summary["steps"].items()}
    assert steps == {
        "env": "pass",
        "pytest": "skip",
        "parity": "pass",
        "cases": "pass",
        "sanitizer": "skip",
        "resources": "skip",
        "glue": "pass",
    }
    assert summary["steps"]["glue"]["checks"]["subnormals"]["status"] == "pass"
    assert summary["result"] == "pass" and summary["steps"]["cases"]["cases"] > 10
    assert (tmp_path / "suite.log").exists()


def test_gpu_suite_commands_and_log_parsing(tmp_path):
    gs = _suite_module()
    args = gs.argparse.Namespace(
        out=str(tmp_path),
        runner="cupy",
        budget_s=10.0,
        sanitizer="/x/compute-sanitizer",
        pytest_args=["-x"],
        skip=[],
        quick=False,
    )
    s = gs.Suite(args)
    assert s.pytest_command()[1:5] == ["-m", "pytest", "-m", "gpu"] and s.pytest_command()[-1] == "-x"
    cmd = s.sanitizer_command("racecheck")
    assert cmd[:3] == ["/x/compute-sanitizer", "--tool", "racecheck"] and "--workload" in cmd
    assert gs.parse_sanitizer("========= ERROR SUMMARY: 0 errors") == {"errors": 0, "hazards": 0, "summary_found": True}
    assert gs.parse_sanitizer("========= ERROR SUMMARY: 2 errors")["errors"] == 2
    race = gs.parse_sanitizer("========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)")
    assert race == {"errors": 1, "hazards": 3, "summary_found": True}
    assert gs.parse_sanitizer("Segmentation fault")["summary_found"] is False
    s.log_f.close()


@pytest.mark.parametrize("log2n", [22, 24])
def test_fused_workspace_is_small(log2n):
    """The peak of the fused selection's scratch alive at once (the sample, freed before the candidate regions are
    allocated; then the regions, per-chunk and O(tensors) tables) at fraction 0.01 on 2^22 and 2^24 fp32 elements:
    at most 3% of the update's bytes. The sizes are planned on the host from the sample, so the twins give the
    same as a device; benchmarks/traffic.py reports 2^26 as well."""
    from gpu_codec.backends.kernels import KernelOps

    n = 1 << log2n
    rng = np.random.default_rng(1)
    new = rng.standard_normal(n, dtype=np.float32)
    base = new + rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)
    ops = KernelOps(kc.TwinRunner(), fused=True)
    ops.topk_select([new], [base], [None], [None], [0], [None], [0], 0, [[0]], [n // 100], 0)
    assert (ops.fused_selections, ops.fused_fallbacks) == (1, 0)
    assert 0 < ops.fused_workspace_bytes <= 0.03 * 4 * n


def test_large_segment_kept_whole_runs_unfused(emulated):
    """k = n on a segment larger than SAMPLE_ALL: the unfused passes (no candidate per element), the same bytes."""
    from gpu_codec.backends.kernels import SAMPLE_ALL, KernelOps

    case = kc.TopkCase("whole_and_sparse", (SAMPLE_ALL + 5, 3000), ("f32", "f16"), scope="tensor", k="all")
    assert kc.topk_vs_reference(emulated, case) == []
    inp = kc.make_topk_inputs(case)
    ops = KernelOps(emulated, fused=True)
    args = (inp["new"], inp["base"], inp["res"], [None, None], inp["dtypes"], inp["ext"], inp["ext_dtypes"])
    ops.topk_select(*args, inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    assert (ops.fused_selections, ops.fused_fallbacks) == (0, 0)
    ops.topk_select(*args, inp["crit"], inp["segments"], [inp["ks"][0] - 1, inp["ks"][1]], inp["qmode"])
    assert (ops.fused_selections, ops.fused_fallbacks) == (1, 0)


def test_gpu_suite_reads_ncu_csv():
    gs = _suite_module()
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    text = "\n".join(
        [
            "==PROF== Connected to process",
            head,
            '"0","fused_scan(int, const long *)","dram__bytes_read.sum","Mbyte","134.22"',
            '"0","fused_scan(int, const long *)","dram__bytes_write.sum","Kbyte","1,024"',
            '"1","cand_hist","dram__bytes_read.sum","byte","512"',
        ]
    )
    assert gs.parse_ncu_csv(text) == {"fused_scan": 134.22e6 + 1024e3, "cand_hist": 512.0}


SCAN_LAUNCHES = ("fused_scan_f32", "fused_scan_f32", "fused_scan", "fused_scan_f32", "fused_scan_h16")
SCAN_LAUNCHES += ("fused_scan_h16", "fused_scan")
SCAN_RUNS = ("vector", "vector", "general", "misaligned", "vector_h16", "vector_h16", "general_h16")


def _scan_csv(requests: dict[str, float], names=SCAN_LAUNCHES):
    """ncu --csv rows of the scan step's launches (per dtype a warm-up, then its NCU_SCAN_GROUPS runs): 12 B an
    element of DRAM traffic in 1 ms each, ``requests`` load requests an element by run name."""
    gs = _suite_module()
    n = gs.NCU_N
    rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, name in enumerate(names):
        run = SCAN_RUNS[i]
        k = f'"{i}","{name}(int, const long *)"'
        rows += [
            f'{k},"dram__bytes_read.sum","byte","{12 * n}"',
            f'{k},"gpu__time_duration.sum","msecond","1"',
            f'{k},"l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum","","{requests[run] * n}"',
            f'{k},"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum","sector","{n}"',
        ]
    return gs, "\n".join(rows)


def test_gpu_suite_judges_the_scan_loads():
    """The ncu scan step's reading: per run the DRAM bytes, requests, sectors a request and time per element; a
    vector scan with as many load requests as fused_scan's, or launches other than expected, are problems."""
    good = {"vector": 0.04, "general": 0.1, "misaligned": 0.1, "vector_h16": 0.02, "general_h16": 0.05}
    gs, text = _scan_csv(good)
    launches = gs.parse_ncu_launches(text)
    assert [x["kernel"] for x in launches] == list(SCAN_LAUNCHES)
    assert launches[1]["gpu__time_duration.sum"] == pytest.approx(1e-3)
    per, problems = gs.scan_loads(launches)
    assert problems == []
    assert [per[r]["kernel"] for r, _ in gs.NCU_SCAN_RUNS] == [k for _, k in gs.NCU_SCAN_RUNS]
    assert per["vector"]["load_requests_per_element"] == 0.04 and per["general"]["sectors_per_request"] == 10.0
    assert per["vector_h16"]["load_requests_per_element"] == 0.02
    assert per["vector"]["dram_bytes_per_element"] == 12.0 and per["vector"]["dram_gb_per_s"] == pytest.approx(
        12 * gs.NCU_N / 1e-3 / 1e9, rel=1e-3
    )
    gs, text = _scan_csv({**good, "vector": 0.1})
    assert "fused_scan_f32's loads are not wider" in gs.scan_loads(gs.parse_ncu_launches(text))[1][0]
    gs, text = _scan_csv({**good, "vector_h16": 0.05})
    assert "fused_scan_h16's loads are not wider" in gs.scan_loads(gs.parse_ncu_launches(text))[1][0]
    gs, text = _scan_csv(good, names=("fused_scan",) * 7)
    assert "expected" in gs.scan_loads(gs.parse_ncu_launches(text))[1][0]


def test_gpu_suite_scan_workload_on_the_emulator():
    """The workload the ncu scan step profiles, on the emulator at a small size: each dtype's scans give the same
    payload."""
    gs = _suite_module()
    assert gs.ncu_scan_workload("emulated", n=3 * 4096 + 5) == 0
