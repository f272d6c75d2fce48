"""Backend parity of the codec stages: the kernels of kernels/quantize.cu and kernels/rice.cu, run by the emulated
backend (CPU) or the GPU, give the same payload bytes, residuals and decoded tensors as the NumPy twins
(kvikio's test_cpu_comp_gpu_decomp idea); and the kernels compile cleanly (NVRTC, no warnings; nvcc, no spills)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import gpu_codec
from gpu_codec import ErrorFeedback, Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd
from gpu_codec.constants import compile_options

from .common import HAS_GPU, as_numpy, use_backend

KERNEL_BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]
PIPELINES = {
    "fp16": [Quantize("float16")],
    "bf16": [Quantize("bfloat16")],
    "int8/16": [Int8Blockwise(16)],
    "int8/300": [Int8Blockwise(300)],
    "ternary": [Ternary()],
    "rice": [RiceIndices()],
    "fp16+rice+zstd": [Quantize("float16"), RiceIndices(), Zstd()],
    "ternary+rice": [Ternary(), RiceIndices()],
}
KERNEL_FILES = ("quantize.cu", "rice.cu")


def update():
    """Several tensors: more than one chunk (4096 entries) of kept values, every dtype, extremes, all-zero."""
    rng = np.random.default_rng(7)
    u = {
        "big": (rng.standard_t(3, size=120_000) * 1e-2).astype(np.float32),
        "conv": rng.standard_normal((32, 16, 3, 3)).astype(np.float32),
        "f64": rng.standard_normal(3000) * 10.0,
        "f16": rng.standard_normal(2000).astype(np.float16),
        "huge": np.array([1e6, -3e37, 7e4, -65519.0, 65520.0, 1e-30] * 50, np.float32),
        "zeros": np.zeros(777, np.float32),
        "empty": np.zeros(0, np.float32),
    }
    return u


def run_all(backend: str, fraction):
    out = {}
    with use_backend(backend):
        for name, stages in PIPELINES.items():
            if fraction is None and any(isinstance(s, RiceIndices) for s in stages):
                continue
            ef = ErrorFeedback()
            blobs = [
                gpu_codec.compress(update(), fraction=fraction, pipeline=stages, residual=ef).to_bytes()
                for _ in range(2)
            ]
            res = {n: ef.residual(n).tobytes() for n in ef.names()}
            dec = {k: as_numpy(v) for k, v in gpu_codec.decompress(blobs[1]).items()}
            out[name] = (blobs, res, dec)
    return out


@pytest.fixture(scope="module")
def cpu_results():
    return {f: run_all("cpu", f) for f in (0.05, None)}


@pytest.mark.parametrize("fraction", [0.05, None], ids=["topk5%", "dense"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_same_bytes_residuals_and_decode_as_numpy(backend, fraction, cpu_results):
    got = run_all(backend, fraction)
    want = cpu_results[fraction]
    assert got.keys() == want.keys()
    for name in want:
        (b_got, r_got, d_got), (b_want, r_want, d_want) = got[name], want[name]
        assert b_got[0] == b_want[0], f"{name}: first payload differs"
        assert b_got[1] == b_want[1], f"{name}: payload after error feedback differs"
        assert r_got == r_want, f"{name}: residuals differ"
        for k in d_want:
            assert d_got[k].tobytes() == d_want[k].tobytes(), f"{name}: decoded {k} differs"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_cross_backend_decode(backend):
    """Bytes made on one backend decode to the same tensors on the other."""
    with use_backend("cpu"):
        blob = gpu_codec.compress(update(), fraction=0.05, pipeline=[Ternary(), RiceIndices(), Zstd()]).to_bytes()
        ref = {k: as_numpy(v) for k, v in gpu_codec.decompress(blob).items()}
    with use_backend(backend):
        assert (
            gpu_codec.compress(update(), fraction=0.05, pipeline=[Ternary(), RiceIndices(), Zstd()]).to_bytes() == blob
        )
        got = {k: as_numpy(v) for k, v in gpu_codec.decompress(blob).items()}
    assert all(got[k].tobytes() == ref[k].tobytes() for k in ref)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_rice_wide_indices_and_sparse_extremes(backend):
    """uint64 index tables (a tensor beyond 2^32 elements cannot be built here, so the op is called directly)
    and extreme gaps: first and last element, large k."""
    from gpu_codec.cpu_fallback import rice as twin

    from gpu_codec.xp.rice import rice_decode

    cases = [
        np.array([0, 1, 2, 3], np.uint64),
        np.array([5, (1 << 35) + 7], np.uint64),
        np.array([(1 << 36) - 1], np.uint64),
        np.zeros(0, np.uint64),
        np.unique(np.random.default_rng(0).integers(0, 1 << 33, 9000)).astype(np.uint64),
    ]
    numels = [4, 1 << 36, 1 << 36, 10, 1 << 33]
    ks = [twin.rice_param(c.size, n) for c, n in zip(cases, numels)]
    with use_backend(backend) as be:
        streams, bits = be.rice([be.asarray(c) for c in cases], ks, numels)
        streams, bits = [as_numpy(s) for s in streams], as_numpy(bits).tolist()
    for c, n, k, s, b in zip(cases, numels, ks, streams, bits):
        ws, wb = twin.rice_encode(c, k)
        assert b == wb and s.tobytes()[: ws.size] == ws.tobytes() and not s[ws.size :].any()
        s = s[: ws.size]  # (a device's stream runs on, in zero bytes, to its length bound)
        assert rice_decode(s, b, k, c.size, n).tolist() == c.astype(np.int64).tolist()


# ------------------------------------------------------------------------------------------ compilation


@pytest.mark.parametrize("fname", KERNEL_FILES)
def test_nvrtc_compiles_without_warnings(fname):
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"NVRTC not available: {e}")
    from gpu_codec.backends.sources import kernel_source

    prog = nvrtc.createProgram(kernel_source(fname), fname, [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", *compile_options()])
    finally:
        log = nvrtc.getProgramLog(prog)
        nvrtc.destroyProgram(prog)
    assert log.strip() == "", log


@pytest.mark.parametrize("fname", KERNEL_FILES)
def test_nvcc_no_register_spills(fname, tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not available")
    from gpu_codec.backends.sources import _files

    src = _files().joinpath(fname)
    cmd = [
        nvcc,
        "-arch=sm_90",
        *compile_options(),
        "-Xptxas",
        "-v",
        "-cubin",
        "-I",
        str(src.parent),
        "-o",
        str(tmp_path / "k.cubin"),
        str(src),
    ]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    log = out.stdout + out.stderr
    assert "warning" not in log.lower(), log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), log
