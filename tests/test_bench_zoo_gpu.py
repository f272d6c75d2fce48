"""benchmarks/bench_zoo_gpu.py on the emulated backend (--dry-run): the script that makes the committed GPU zoo
results runs, checks the bytes, counts, and never replaces a result unasked."""

from __future__ import annotations

import json

import pytest

from tests.common import has_emulator

pytestmark = pytest.mark.skipif(not has_emulator(), reason="the emulated backend needs a C++20 compiler")


def test_dry_run_writes_rows_with_parity_and_counts(tmp_path, capsys):
    from benchmarks import bench_zoo_gpu

    out = tmp_path / "zoo_gpu.json"
    argv = ["--dry-run", "--entries", "zeros-99", "mixed-scales", "--max-params", "3000", "--repeat", "1"]
    assert bench_zoo_gpu.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dry_run"] and [r["entry"] for r in doc["rows"]] == ["zeros-99", "mixed-scales"]
    for r in doc["rows"]:
        assert r["parity"] == "equal" and r["n"] <= 3000
        assert set(r["counts"]) == set(bench_zoo_gpu.OPS)
        assert r["counts"]["ours_s"]["launches"] > 0 and r["counts"]["decompress_s"]["reads"] <= 1
        assert all(r[k] > 0 for k in bench_zoo_gpu.OPS)
    assert "| zeros-99 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # an existing result is kept unless --force
        bench_zoo_gpu.main([*argv, "--out", str(out)])
    assert "exists" in capsys.readouterr().err
