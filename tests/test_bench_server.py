"""Smoke run of benchmarks/bench_server.py: every entry timed in child processes of the checkout, the result's
digest the same in each process, and the page it writes is the table of the JSON."""

from __future__ import annotations

import importlib
import json


def test_a_small_run_writes_the_table_of_its_results(tmp_path):
    bench = importlib.import_module("benchmarks.bench_server")
    out = tmp_path / "server.json"
    argv = ["--elements", "30000", "--repeat", "1", "--rounds", "2", "--entries", "split-1", "split-100"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["entry"] for r in doc["rows"]] == ["split-1", "split-100"]
    assert [r["tensors"] for r in doc["rows"]] == [1, 100]
    for r in doc["rows"]:
        assert r["same_result"]
        assert all(r[f"{op}_ms"]["checkout"] > 0 for op in bench.OPS)
    assert out.with_suffix(".md").read_text() == bench.markdown(doc)
    assert "| split-100 | 100 |" in bench.markdown(doc)
