"""The emulator's global-memory traffic counter, and benchmarks/traffic.py at a small N against its targets."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.common import has_emulator

pytestmark = pytest.mark.skipif(not has_emulator(), reason="emulated backend not built")

PROBE = r"""
#include "common.cuh"
extern "C" __global__ void every_other(const float* a, float* o, u64* hits, int n) {
    __shared__ float sh[BLOCK];
    const int i = blockIdx.x * BLOCK + threadIdx.x;
    sh[threadIdx.x] = i < n ? a[2 * i] : 0.0f;  // reads every sector of a (2n floats)
    __syncthreads();
    if (i < n) o[i] = sh[BLOCK - 1 - threadIdx.x];  // writes n floats; shared memory is not global traffic
    if (threadIdx.x == 0) atomicAdd(hits, 1ull);  // one sector, read and written
}
"""


def _sectors(x: np.ndarray) -> int:
    a = int(x.ctypes.data)
    return ((a + x.nbytes - 1) >> 5) - (a >> 5) + 1


@pytest.fixture(scope="module")
def traffic():
    return importlib.import_module("benchmarks.traffic")


def test_counter_counts_sectors_of_global_buffers_only():
    from gpu_codec.backends.emulated import EmulatorRunner

    r = EmulatorRunner({"probe.cu": PROBE}, package=False, trace=True)
    n = 4096
    a = np.arange(2 * n, dtype=np.float32)
    o = np.zeros(n, np.float32)
    hits = np.zeros(1, np.uint64)
    r.launch("every_other", n // 256, 256, (a, o, hits, np.int32(n)))
    assert o[:256].tolist() == a[: 2 * 256 : 2][::-1].tolist() and int(hits[0]) == n // 256
    (rec,) = r.traffic
    assert rec["kernel"] == "every_other"
    assert rec["read_bytes"] == 32 * (_sectors(a) + _sectors(hits))  # a, and the counter's sector
    assert rec["write_bytes"] == 32 * (_sectors(o) + _sectors(hits))  # o, and the counter's sector


def test_benchmark_measures_compress(traffic, tmp_path):
    """At N = 8192: compress reads new and base once (fused_scan_f32, fp32 tensors); the selection and the write
    touch the sample and the candidates only. With error feedback the same pass reads the residual and writes the
    new one (into a separate array, stored only when the call succeeds), and only the kept entries are fixed
    afterwards."""
    records = traffic.run(8192, quick=True)
    ops = {(r["op"], r["residual"]) for r in records}
    assert {("compress", False), ("compress", True), ("decompress", False), ("decompress_dense", False)} <= ops
    assert {"quantize_float16", "int8", "ternary", "rice"} <= {r["op"] for r in records}
    for r in records:
        assert {"op", "fraction", "residual", "tensors", "n", "bytes_per_element"} <= set(r)
    c = next(r for r in records if r["op"] == "compress" and not r["residual"])
    assert "score_keys" not in c["kernels"] and "radix_hist" not in c["kernels"]  # no fallback to the full passes
    assert c["kernels"]["fused_scan_f32"]["launches"] == 1 and "fused_scan" not in c["kernels"]
    scan = c["kernels"]["fused_scan_f32"]
    assert scan["read_bytes"] / 8192 == pytest.approx(8.0, abs=0.1)  # new and base, once
    assert scan["write_bytes"] / 8192 < 0.5  # the candidates (6 B each; the sample of 64 brackets widely here)
    rest = c["bytes_per_element"] - scan["bytes_per_element"]
    assert rest < 2.0  # sample, candidates, kept entries
    cr = next(r for r in records if r["op"] == "compress" and r["residual"])
    assert cr["kernels"]["fused_scan_f32"]["bytes_per_element"] == pytest.approx(16.0, abs=0.3)  # and the residual
    assert "residual_delta" not in cr["kernels"] and "score_keys" not in cr["kernels"]
    assert traffic.main(["--n", "4096", "--quick", "--json", str(tmp_path / "t.json")]) == 0
    assert (tmp_path / "t.json").read_text().startswith("[")


def test_compress_without_residual_within_target(traffic):
    recs = [r for r in traffic.run(8192, quick=True) if r["op"] == "compress" and not r["residual"]]
    assert recs and traffic.check_targets(recs) == []
    assert all(traffic.FLOORS["compress"] <= r["bytes_per_element"] <= traffic.TARGETS["compress"] for r in recs)


def test_dense_decode_and_apply_within_target(traffic):
    (rec,) = [r for r in traffic.decompress_records(traffic.traced_backend(), 8192) if r["op"] == "decompress_dense"]
    assert rec["kernels"].keys() == {"dense_apply"} and rec["glue_bytes_per_element"] == 0
    floor = traffic.FLOORS["decompress_dense"]
    assert floor <= rec["bytes_per_element"] <= traffic.TARGETS["dense_apply_over_floor"] * floor


def test_dense_compress_in_one_pass(traffic):
    rec, rec_res = traffic.dense_compress_records(traffic.traced_backend(), 8192)
    assert rec["kernels"].keys() == {"dense_delta"} and rec["kernels"]["dense_delta"]["launches"] == 1
    assert rec["bytes_per_element"] == pytest.approx(traffic.FLOORS["compress_dense"], abs=0.1)
    assert rec_res["bytes_per_element"] == pytest.approx(traffic.FLOORS["compress_dense"] + 8, abs=0.1)


def test_traffic_targets(traffic):
    """compress at 1% within 10 B/elem, and within 18 with error feedback, at N = 2^16 (the per-call overhead of
    the sample and the candidates is amortized from about that size on)."""
    assert traffic.check_targets(traffic.run(1 << 16, quick=True)) == []


def test_benchmark_reports_the_fused_workspace(traffic):
    (r,) = traffic.workspace_records((18,))
    assert r["op"] == "fused_workspace" and r["n"] == 1 << 18 and r["fallbacks"] == 0
    assert 0 < r["workspace_share"] == r["workspace_bytes"] / (4 << 18)
    assert traffic.check_targets([{**r, "workspace_share": 0.031}]) != []
    assert "2^18" in traffic._table([r])
