"""Every kernel compiles through NVRTC for sm_80 and sm_90 with an empty program log (no warning), and ptxas
reports no local-memory use (spills, stack frames) for any of them. No GPU is needed: NVRTC is a library
(CI installs cupy-cuda12x and nvidia-cuda-nvrtc-cu12). Where NVRTC cannot load these tests skip, unless
GPU_CODEC_REQUIRE_NVRTC=1 (then they fail), so that CI cannot lose them silently.

benchmarks/kernel_resources.py prints the per-kernel table these tests check; its nvcc variant runs where nvcc
is on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_codec.backends import nvrtc
from gpu_codec.backends.sources import kernel_files, kernel_signatures, kernel_source
from gpu_codec.constants import compile_options

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernel_resources.py"
ARCHS = ("sm_80", "sm_90")
MAX_REGISTERS = 40  # per thread, every kernel: full occupancy headroom at 256-thread blocks


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_codec_kernel_resources", ROOT / "benchmarks" / "kernel_resources.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


kr = _load_script()
HAVE_NVRTC, WHY = kr.nvrtc_available()
if not HAVE_NVRTC and os.environ.get("GPU_CODEC_REQUIRE_NVRTC") == "1":
    raise RuntimeError(f"GPU_CODEC_REQUIRE_NVRTC=1 but NVRTC cannot be loaded: {WHY}")
pytestmark = pytest.mark.skipif(not HAVE_NVRTC, reason=f"NVRTC not available: {WHY}")
HAVE_NVCC = shutil.which(os.environ.get("NVCC", "nvcc")) is not None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fname", kernel_files())
def test_compiles_with_empty_log(fname, arch):
    """The runtime's own compile (gpu_codec.backends.nvrtc, what the GPU backend loads): a CUBIN, and a clean
    compile leaves an empty program log."""
    image, log = nvrtc.compile_source(kernel_source(fname), fname, arch)
    assert image[:4] == b"\x7fELF", f"{fname}: not a CUBIN"
    assert log.strip() == "", f"NVRTC says for {fname} ({arch}):\n{log}"


def test_runtime_and_ci_compile_with_the_same_options():
    for arch in ARCHS:
        assert nvrtc.options_for(arch) == (*compile_options(), f"--gpu-architecture={arch}")
    assert compile_options() == kr.OPTIONS
    assert "-ftz=false" in compile_options() and "--fmad=false" in compile_options()


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_keeps_subnormals(arch):
    """No flush-to-zero anywhere: a .ftz instruction would flush subnormals where the NumPy twins keep them."""
    for f in kernel_files():
        ptx = nvrtc.ptx_of(kernel_source(f), f, arch)
        assert ".entry" in ptx
        bad = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
        assert bad == [], f"{f} ({arch}): {bad[:5]}"


def test_ftz_check_is_not_vacuous():
    """CuPy's RawModule(code=...) appends -ftz=true after the caller's options; that compile shows .ftz, ours not."""
    import inspect

    import cupy

    assert "'-ftz=true'" in inspect.getsource(cupy.cuda.compiler._compile_with_cache_cuda)
    probe = 'extern "C" __global__ void d(const float* a, float* o) { o[0] = fabsf(a[0] - a[1]); }'
    ours = nvrtc.ptx_of(probe, "probe.cu", "sm_90")
    cupys, _ = nvrtc.compile_source(probe, "probe.cu", "compute_90", ("-ftz=true",))
    assert ".ftz" not in ours and ".ftz" in cupys.decode(errors="replace")


@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_uses_local_memory(arch):
    rep = kr.collect((arch,), ("nvrtc",))
    assert rep.problems == []
    entries = {r.function for r in rep.rows if r.entry}
    assert entries == set(kernel_signatures())
    for r in rep.rows:
        assert r.registers > 0 and not r.spills, r
        assert not r.entry or r.registers <= MAX_REGISTERS, f"{r.function} ({arch}): {r.registers} registers"


def test_resources_script(tmp_path):
    out = tmp_path / "res.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--tool", "nvrtc", "--arch", *ARCHS, "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["problems"] == []
    for arch in ARCHS:
        got = {row["function"] for row in data["rows"] if row["arch"] == arch and row["entry"]}
        assert got == set(kernel_signatures())
    assert "no spills, no warnings" in r.stdout
    for k in kernel_signatures():
        assert k in r.stdout


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not on PATH")
def test_resources_with_nvcc():
    rep = kr.collect(ARCHS, ("nvcc",))
    assert rep.problems == []
    for arch in ARCHS:
        assert {r.function for r in rep.rows if r.entry and r.arch == arch} == set(kernel_signatures())
    for r in rep.rows:
        assert not r.entry or r.registers <= MAX_REGISTERS, f"{r.function} ({r.arch}, nvcc): {r.registers} registers"


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_scan_f32_reads_and_writes_128_bits_a_thread(arch):
    """fused_scan_f32 reads new, base and residual with one 128-bit load each (read-only path) and writes the early
    residual with one 128-bit store, beside its scalar loads for tails and misaligned tensors; fused_scan keeps its
    32-bit accesses."""
    import re
    from collections import Counter

    per = kr._per_entry(kr._ptx(kernel_source("topk.cu"), "topk.cu", arch))
    ops = {
        k: Counter(m for line in per[k] for m in re.findall(r"^(?:@!?%\w+\s+)?((?:ld|st)\.[a-z.]*v4\.f32)", line))
        for k in ("fused_scan_f32", "fused_scan")
    }
    assert ops["fused_scan_f32"] == {"ld.global.nc.v4.f32": 3, "st.v4.f32": 1}, ops
    assert not ops["fused_scan"], ops


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_scan_h16_reads_new_and_base_64_bits_a_thread(arch):
    """fused_scan_h16 reads new and base (fp16/bf16) with one 64-bit load each and the fp32 residual with one 128-bit
    load, and writes the early residual with one 128-bit store."""
    import re
    from collections import Counter

    per = kr._per_entry(kr._ptx(kernel_source("topk.cu"), "topk.cu", arch))
    vec = r"^(?:@!?%\w+\s+)?((?:ld|st)\.[a-z.]*v[24]\.[a-z0-9]+)"
    ops = Counter(m for line in per["fused_scan_h16"] for m in re.findall(vec, line))
    assert ops == {"ld.global.nc.v2.u32": 2, "ld.global.nc.v4.f32": 1, "st.v4.f32": 1}, ops


SPILLER = """
extern "C" __global__ void spiller(const int* idx, float* out) {
    float a[256];
    for (int i = 0; i < 256; ++i) a[i] = out[i] * 2.0f;
    out[threadIdx.x] = a[idx[threadIdx.x]];
}
"""
WARNER = """
extern "C" __global__ void warner(float* out) { int unused = 3; out[0] = 1.0f; }
"""


def test_checker_catches_local_memory_and_warnings():
    """The checks above are not vacuous: a dynamically indexed local array needs a stack frame, and a warning
    leaves text in the log."""
    rep = kr.collect(("sm_90",), ("nvrtc",), sources={"spiller.cu": SPILLER, "warner.cu": WARNER})
    text = "\n".join(rep.problems)
    assert "spiller uses local memory (stack frame" in text
    assert "warner.cu: compiler output beyond ptxas -v" in text and "#177" in text
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=False, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "ptxas" in r.stdout and "--arch" in r.stdout


def test_ptxas_log_parser():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'a' for 'sm_80'\n"
        "ptxas info    : Function properties for a\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 22 registers, 1024 bytes smem, 380 bytes cmem[0]\n"
        "ptxas info    : Function properties for _Z6helperv\n"
        "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Compiling entry function 'b' for 'sm_80'\n"
        "ptxas info    : Used 10 registers, used 1 barriers, 8 bytes lmem\n\x00"
    )
    rows = {r.function: r for r in kr.parse_ptxas(log, "sm_80", "nvrtc")}
    assert rows["a"].entry and rows["a"].registers == 22 and rows["a"].smem_bytes == 1024 and not rows["a"].spills
    assert not rows["_Z6helperv"].entry and rows["_Z6helperv"].spill_store_bytes == 8 and rows["_Z6helperv"].spills
    assert rows["b"].lmem_bytes == 8 and rows["b"].barriers == 1 and rows["b"].spills


# Kernels known to leave float multiplies the device may fuse (see kernel_resources.contraction_hazards). The
# emulator and the twins round the multiply and the subtract separately; a GPU whose ptxas fuses them gives other
# bytes. Pinning the multiply with __fmul_rn (or compiling with --fmad=false) removes the entry.
KNOWN_CONTRACTION_HAZARDS: dict[str, str] = {}


def test_no_new_fma_contraction_hazards():
    found = {}
    for f in kernel_files():
        found.update(kr.contraction_hazards(kernel_source(f), f))
    new = {k: v for k, v in found.items() if k not in KNOWN_CONTRACTION_HAZARDS}
    assert new == {}, f"float arithmetic the GPU may fuse into FMAs (use __fmul_rn / __fadd_rn): {new}"


def test_contraction_audit_finds_fusable_arithmetic():
    probe = """
extern "C" __global__ void fused(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }
extern "C" __global__ void split(const float* a, float* o) {
    const float m = a[0] * a[1];
    if (a[3] > 0.0f) o[0] = a[2] - m; else o[1] = m;
}
extern "C" __global__ void pinned(const float* a, float* o) {
    o[0] = __fmul_rn(a[0], a[1]) + a[2];
    o[1] = fmaf(a[0], a[1], a[2]);
}
"""
    found = kr.contraction_hazards(probe, "probe.cu")
    assert set(found) == {"fused", "split"}
