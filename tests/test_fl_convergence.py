"""Smoke run of the federated convergence study (benchmarks/fl_convergence.py) on the small MLP, a few rounds.

Needs scikit-learn (the digits data set; extra ``bench``) and torch; skipped where either is missing.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("torch")


ROUNDS = 10


@pytest.fixture(scope="module")
def flc():
    return importlib.import_module("benchmarks.fl_convergence")


@pytest.fixture(scope="module")
def data(flc):
    return flc.load_data()


@pytest.fixture(scope="module")
def smoke(flc, data):
    names = ("dense", "top1", "top1_ef_fp16", "dense_int8")
    return {n: flc.federated_run("small", flc.CONFIGS[n], 0, ROUNDS, data) for n in names}


def test_models_have_the_studied_sizes(flc):
    assert flc.n_params(flc.MODELS["small"]) == 17_226
    assert flc.n_params(flc.MODELS["wide"]) == 1_126_410
    net = flc.make_mlp(flc.MODELS["small"])
    assert sum(p.numel() for p in net.parameters()) == 17_226


def test_partition_covers_the_training_set_once_and_is_not_iid(flc, data):
    y = data["ytr"]
    parts = flc.dirichlet_partition(y, 10, 0.5, np.random.default_rng(0))
    assert len(parts) == 10
    assert min(p.size for p in parts) >= 10
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(y.size))
    overall = np.bincount(y, minlength=10) / y.size
    tv = [0.5 * np.abs(np.bincount(y[p], minlength=10) / p.size - overall).sum() for p in parts]
    assert max(tv) > 0.3  # Dirichlet(0.5) skews label mixes far from the global one
    again = flc.dirichlet_partition(y, 10, 0.5, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_compressed_uploads_are_smaller_by_the_expected_order(smoke):
    total = {n: sum(r["bytes"]) for n, r in smoke.items()}
    assert all(len(r["bytes"]) == ROUNDS for r in smoke.values())
    assert len(set(smoke["dense"]["bytes"])) == 1  # the same dense payload size every round
    # 17k params: top-1% + fp16 + Rice + zstd is ~30x smaller than dense (the header is most of it); raw top-1%
    # (u32 + fp32 values) costs more than the coded one; int8 values + zstd are about a quarter of fp32
    assert total["top1_ef_fp16"] * 20 < total["dense"]
    assert total["top1_ef_fp16"] < total["top1"] < total["dense"] / 10
    assert total["dense"] / 8 < total["dense_int8"] < total["dense"] / 2


def test_accuracy_is_above_chance_and_error_feedback_helps(smoke):
    final = {n: float(np.mean(r["acc"][-3:])) for n, r in smoke.items()}
    assert final["dense"] > 0.6  # 10 classes: chance is 0.1
    assert min(final.values()) > 0.25
    assert final["top1_ef_fp16"] > final["top1"] + 0.05  # what top-k drops comes back through the residual
    assert abs(final["dense_int8"] - final["dense"]) < 0.03  # int8 blockwise is close to lossless here
    assert all(b >= a - 0.02 for a, b in zip(smoke["dense"]["acc"], smoke["dense"]["acc"][1:]))  # learns steadily


def test_error_feedback_keeps_a_nonzero_residual_per_client(smoke):
    norms = smoke["top1_ef_fp16"]["residual_norms"]
    assert len(norms) == 10
    assert all(np.isfinite(norms)) and min(norms) > 0
    assert smoke["top1"]["residual_norms"] == []


def test_main_writes_json_table_and_plot(flc, tmp_path):
    out = tmp_path / "conv.json"
    argv = ["--models", "small", "--configs", "dense", "top1_ef_fp16", "--seeds", "0", "1", "--rounds", "2"]
    assert flc.main([*argv, "--at", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 4 and doc["machine"]["torch_threads"] == 1
    rows = {r["config"]: r for r in doc["summary"]}
    assert rows["dense"]["seeds"] == 2 and rows["dense"]["ratio@2"] == pytest.approx(1.0)
    assert rows["top1_ef_fp16"]["ratio@2"] > 20
    assert rows["top1_ef_fp16"]["bytes@2"] == np.mean([sum(r["bytes"]) for r in doc["runs"][2:]])
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| model | upload | acc @2 (%)") and "top-1% + EF + fp16 + Rice + zstd" in table
    assert out.with_suffix(".png").stat().st_size > 10_000
    # --merge re-measures one configuration and keeps the others
    again = ["--models", "small", "--configs", "dense", "--seeds", "0", "--rounds", "2", "--at", "2"]
    assert flc.main([*again, "--out", str(out), "--merge", "--no-plot"]) == 0
    doc2 = json.loads(out.read_text())
    assert len(doc2["runs"]) == 4
    assert sorted((r["config"], r["seed"]) for r in doc2["runs"]) == sorted(
        (r["config"], r["seed"]) for r in doc["runs"]
    )
