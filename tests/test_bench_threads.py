"""Smoke run of benchmarks/bench_threads.py on the NumPy backend: the ratios it writes are the ones its timings give,
the rounds are split by the floor pass's speed-up as it says, and the selection's block choice is left as it was."""

from __future__ import annotations

import importlib
import json
import statistics

import pytest
from gpu_codec.cpu_fallback import select

from .common import use_backend


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_threads")


def test_quick_run_writes_consistent_results(bench, tmp_path):
    out = tmp_path / "threads.json"
    plan = select.plan
    with use_backend("cpu"):
        assert (
            bench.main(
                ["--quick", "--seconds", "0.2", "--per-tick", "4", "--scaled", "1.0", "--no-plot", "--out", str(out)]
            )
            == 0
        )
    assert select.plan is plan  # the forced block sizes are undone
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "threads" and doc["n"] == 1 << 20 and doc["machine"]["simd"]
    assert doc["survey"] and all(r["floor_x"] > 0 and r["short_x"] > 0 and r["wake_us"] > 0 for r in doc["survey"])
    pr = doc["paired"]
    assert len(pr) == 4
    for r in pr:
        assert r["ours_x"] == pytest.approx(r["ours_1thread_s"] / r["ours_s"])
        assert r["floor_x"] == pytest.approx(r["floor_1thread_s"] / r["floor_s"])
    s = doc["summary"]
    assert s["ours_x"] == pytest.approx(statistics.median(r["ours_x"] for r in pr))
    good = [r["ours_x"] for r in pr if r["floor_x"] >= 1.0]
    assert s["scaled_rounds"] == len(good)
    if good:
        assert s["ours_x_where_floor_scaled"] == pytest.approx(statistics.median(good))
    assert [r["block"] for r in doc["blocks"]] == [1 << 14, 1 << 16]
    for r in doc["blocks"]:
        assert r["x_threads"] == pytest.approx(r["ours_1thread_s"] / r["ours_s"])
    assert doc["backend_block"] == select.plan(4 << 20, doc["machine"]["threads"])[1]


def test_forced_blocks_select_the_same_entries(bench):
    """The block sizes the benchmark forces change how the work is cut, not the payload."""
    import numpy as np

    import gpu_codec

    rng = np.random.default_rng(3)
    base = rng.standard_normal(300_000, dtype=np.float32)
    new = base + rng.standard_normal(300_000, dtype=np.float32)
    plan = select.plan
    with use_backend("cpu"):
        ref = gpu_codec.compress({"w": new}, {"w": base}, fraction=0.01).to_bytes()
        for block in (1 << 13, 1 << 15, 1 << 19):
            select.plan = lambda nbytes, n, block=block: (n, block)
            try:
                assert gpu_codec.compress({"w": new}, {"w": base}, fraction=0.01).to_bytes() == ref
            finally:
                select.plan = plan
