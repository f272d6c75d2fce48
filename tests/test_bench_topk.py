"""Smoke run of benchmarks/bench_topk.py on the NumPy backend: its JSON holds every timing and the ratios it prints
are the ones its timings give (medians and least disturbed samples)."""

from __future__ import annotations

import importlib
import json

import pytest

from .common import use_backend


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_topk")


def test_quick_run_writes_consistent_rows(bench, tmp_path, capsys):
    out = tmp_path / "topk.json"
    with use_backend("cpu"):
        args = ["--sizes", "20000", "300000", "--repeat", "3", "--no-torch", "--no-plot", "--out", str(out)]
        assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "topk" and doc["machine"]["cpu_count"] >= 1 and doc["machine"]["simd"]
    rows = doc["rows"]
    assert [r["n"] for r in rows] == [20000, 300000]
    for r in rows:
        assert r["k"] == r["n"] // 100  # fraction 0.01
        for key in ("subtract_s", "ours_s", "ours_1thread_s", "numpy_s", "decompress_s", "probe_s", "probe_compute_s"):
            assert r[key] > 0 and 0 < r["min"][key] <= r[key]
        assert r["x_subtract"] == pytest.approx(r["ours_s"] / r["subtract_s"])
        assert r["x_subtract_min"] == pytest.approx(r["min"]["ours_s"] / r["min"]["subtract_s"])
        assert r["x_threads_min"] == pytest.approx(r["min"]["ours_1thread_s"] / r["min"]["ours_s"])
        assert r["decompress_x_subtract"] == pytest.approx(r["decompress_s"] / r["subtract_s"])
        assert 0 < r["peak_extra_pct"] < 100
        assert set(r["codec_gb_per_s"]) >= {"float16 encode", "int8 decode", "rice encode", "rice decode"}
    header = capsys.readouterr().out.splitlines()[1]
    assert "x sub min" in header and "x thr min" in header and "dec/sub" in header
