"""The model zoo (benchmarks/zoo.py): every entry has the stated shapes and properties, the trained ones really
learned, each compresses and decompresses to the same bytes on the NumPy and emulated backends; and
benchmarks/bench_zoo.py runs end to end, checks the targets and writes the README's zoo section."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

import gpu_codec
from benchmarks import bench_zoo
from benchmarks.zoo import ZOO, fewer_nonzeros

from .common import HAS_EMULATOR, use_backend

SMALL = 1 << 13  # elements an entry is scaled down to for the backend comparisons


@functools.cache
def built(name: str, scale: float | None = None):
    e = ZOO[name]
    return e.build(scale if scale is not None else bench_zoo.scale_for(e, SMALL))


def _raw(a) -> np.ndarray:
    return bench_zoo._raw(a)


@pytest.mark.parametrize(
    ("name", "tensors", "params"),
    [
        ("resnet-50", 320, 25_557_032 + 2 * 26_560 + 53),  # torchvision's count + running stats + batch counters
        ("bert-base", 199, 109_482_240),
        ("gpt2-small", 148, 124_439_808),
        ("vit-b16", 152, 86_567_656),
        ("llama-1b", 291, 979_207_680),
        ("lora", 256, 32 * 4 * 2 * 16 * 4096),
        ("digits-cnn-sgd", 8, 281_674),
        ("char-transformer", 54, None),
        ("split-2^23-1000", 1000, 1 << 23),
    ],
)
def test_entry_has_the_architecture_shapes(name, tensors, params):
    e = ZOO[name]
    assert e.tensors() == tensors
    if params is not None:
        assert e.params(1.0) == params
    else:
        assert 3e6 < e.params(1.0) < 4e6  # a few million: the transformer target's size
    if not name.startswith("digits"):  # the digits CNN is small at any scale
        assert e.params(0.01) < e.params(1.0) / 20 and len(e.shapes(0.01)) == tensors  # scaling keeps the tensors


def test_architectures_move_as_training_does():
    u = built("resnet-50", 1e-3)
    assert len(u.new) == 320 and all(a.dtype == np.float32 for a in u.new.values())
    frozen = set(u.info["frozen"])
    assert "conv1.weight" in frozen and "layer1.0.conv1.weight" in frozen and "layer2.0.conv1.weight" not in frozen
    for name in u.new:
        d = u.new[name].astype(np.float64) - u.base[name]
        if name in frozen:
            assert not d.any(), name
        elif name.endswith("num_batches_tracked"):
            assert d.shape == () and d == 100.0  # the same exact step in every counter: ties
        else:
            assert np.count_nonzero(d) > d.size // 2, name
    head = np.abs(u.new["fc.weight"] - u.base["fc.weight"]).mean()
    conv = np.abs(u.new["layer4.0.conv2.weight"] - u.base["layer4.0.conv2.weight"]).mean()
    assert head > 3 * conv  # the head moves more than a weight deep inside
    g = built("gpt2-small", 1e-3)
    rows = np.abs(g.new["wte.weight"] - g.base["wte.weight"]).sum(1)
    assert 0 < np.count_nonzero(rows) < rows.size  # unseen tokens' embedding rows stay still


def test_llama_is_bfloat16_through_torch():
    import torch

    u = built("llama-1b", 2e-4)
    assert len(u.new) == 291 and {a.dtype for a in u.new.values()} == {torch.bfloat16}
    assert not (u.new["model.layers.0.mlp.up_proj.weight"] != u.base["model.layers.0.mlp.up_proj.weight"]).any()
    assert (u.new["model.layers.9.mlp.up_proj.weight"] != u.base["model.layers.9.mlp.up_proj.weight"]).any()


def test_distributions_have_the_stated_properties():
    n = 1 << 16
    scale = n / (1 << 24)
    nz = lambda u: int(np.count_nonzero(u.new["w"] != u.base["w"]))  # noqa: E731
    assert nz(built("zeros-99", scale)) == n // 100
    assert nz(built("zeros-100", scale)) == 0
    few = built("fewer-than-k", scale)
    assert nz(few) == fewer_nonzeros(n) and 0 < nz(few) < gpu_codec.kept_count(0.001, n)
    tl = built("three-level", scale)
    assert set(np.unique(tl.new["w"] - tl.base["w"]).tolist()) == {-1 / 16, 0.0, 1 / 16}
    ms = built("mixed-scales", scale)
    assert np.abs(ms.new["tiny"]).max() < 1e-28 and np.abs(ms.new["huge"]).max() > 1e29
    sp = built("split-2^23-100", 1 / 64)
    sizes = [a.size for a in sp.new.values()]
    assert len(sizes) == 100 and sum(sizes) == (1 << 23) // 64 and max(sizes) > 2 * min(sizes)  # uneven


@pytest.mark.parametrize("name", ["digits-cnn-sgd", "digits-cnn-adam", "digits-cnn-frozen", "char-transformer"])
def test_trained_entries_really_learned(name):
    u = built(name)
    losses = u.info["losses"]
    assert len(losses) == u.info["rounds"] * u.info["steps"] and len(u.rounds) == u.info["rounds"] >= 3
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1  # the loss fell over training
    for r, (base, new) in enumerate(u.rounds):
        moved = {k for k in new if np.any(new[k] != base[k])}
        assert moved == set(new) - set(u.info["frozen"]), r
        if r:  # each round starts from the server's model: the last one plus a sparse update
            prev_base = u.rounds[r - 1][0]
            step = {k: base[k] - prev_base[k] for k in base}
            kept = sum(int(np.count_nonzero(v)) for v in step.values())
            assert 0 < kept <= gpu_codec.kept_count(0.01, sum(v.size for v in base.values()))
    if name == "digits-cnn-frozen":
        assert set(u.info["frozen"]) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}


def test_builds_are_deterministic():
    a, b = ZOO["digits-cnn-adam"].build(seed=3), ZOO["digits-cnn-adam"].build(seed=3)
    assert all(np.array_equal(a.new[k], b.new[k]) for k in a.new)
    c = ZOO["bert-base"].build(1e-3, seed=3)
    d = ZOO["bert-base"].build(1e-3, seed=4)
    assert not np.array_equal(c.new["pooler.dense.weight"], d.new["pooler.dense.weight"])


@pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_numpy_and_emulated_give_the_same_bytes(name):
    u = built(name)
    out = {}
    for backend in ("cpu", "emulated"):
        with use_backend(backend):
            ef = gpu_codec.ErrorFeedback()
            for base, new in u.rounds[-2:]:  # a residual carried from a real round
                blobs = [
                    gpu_codec.compress(new, base, fraction=0.01, residual=ef).to_bytes(),
                    gpu_codec.compress(new, base, fraction=0.001, scope="per_tensor").to_bytes(),
                ]
            dec = gpu_codec.decompress(blobs[0], base=u.base)
            out[backend] = blobs, {k: _raw(v).copy() for k, v in dec.items()}, ef.residual(next(iter(u.new)))
    (b_cpu, d_cpu, r_cpu), (b_emu, d_emu, r_emu) = out["cpu"], out["emulated"]
    assert b_cpu == b_emu
    assert d_cpu.keys() == d_emu.keys() and all(np.array_equal(d_cpu[k], d_emu[k]) for k in d_cpu)
    assert np.array_equal(np.asarray(r_cpu), np.asarray(r_emu))
    p = gpu_codec.Payload.from_bytes(b_cpu[0])
    n = sum(math.prod(a.shape) for a in u.new.values())
    assert sum(t.nnz for t in p.tensors) == gpu_codec.kept_count(0.01, n)


def test_quick_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "zoo.json"
    names = ["zeros-99", "iid-2^24", "split-2^23-100"]
    rc = bench_zoo.main(["--quick", "--entries", *names, "--out", str(out), "--check", "--no-torch"])
    doc = json.loads(out.read_text())
    assert [r["entry"] for r in doc["rows"]] == names and doc["machine"]["simd"] and doc["commit"]
    for r in doc["rows"]:
        c = r["cpu"]
        assert c["x_subtract"] == pytest.approx(c["ours_s"] / c["subtract_s"])
        assert c["x_numpy"] == pytest.approx(c["numpy_s"] / c["ours_s"])
        assert c["decompress_x_subtract"] == pytest.approx(c["decompress_s"] / c["subtract_s"])
        assert c["decompress_bytes_x_subtract"] == pytest.approx(c["decompress_bytes_s"] / c["subtract_s"])
        assert c["decompress_bytes_s"] > 0  # (the payload's bytes, as a server receives them)
        assert set(c["bracket_misses"]) == set(bench_zoo.CPU_CONFIGS)  # the NumPy selection's rescans, counted
        assert all(isinstance(v, int) and v >= 0 for v in c["bracket_misses"].values())
        if HAS_EMULATOR:  # the recording launcher's counts beside the emulated traffic
            rec = r["recording"]
            assert set(rec) == {"compress", "decompress", "add"} and all(rec[op]["syncs"] >= 1 for op in rec)
            assert rec["compress"]["launches"] > 0 and rec["decompress"]["host_ms"] > 0
            assert len(r["emulated"]) == 8
            for e in r["emulated"]:
                assert e["bytes_per_element"] >= 8 and e["fused"] + e["fallbacks"] >= 0
    printed = capsys.readouterr().out
    verdicts = bench_zoo.check(doc)
    assert rc == (1 if any(v == "FAIL" for v, _, _ in verdicts) else 0)
    assert any(e == "split-2^23-100" and "NumPy pipeline" in t for _, e, t in verdicts)
    assert any(e == "zeros-99" and "i.i.d." in t for _, e, t in verdicts)
    assert "zeros-99" in printed and ("PASS" in printed or "FAIL" in printed)
    md = out.with_suffix(".md").read_text()
    assert md == bench_zoo.markdown(doc) and "| split-2^23-100 |" in md


@pytest.mark.skipif(not HAS_EMULATOR, reason="the emulated traffic needs the emulator")
def test_traffic_from_an_earlier_run_is_taken_at_the_same_scale_only(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    names = ["three-level"]
    bench_zoo.main(["--quick", "--entries", *names, "--out", str(first), "--no-torch", "--no-cpu"])
    a = json.loads(first.read_text())
    a["commit"] = "abc1234"
    a["rows"][0]["emulated"][0]["bytes_per_element"] = 99.0  # tells the copy from a new count
    first.write_text(json.dumps(a))
    bench_zoo.main(["--quick", "--entries", *names, "--out", str(second), "--no-cpu", "--traffic-from", str(first)])
    b = json.loads(second.read_text())
    row = b["rows"][0]
    assert row["emulated"] == a["rows"][0]["emulated"] and row["emulated_commit"] == "abc1234"
    assert row["recording"]["compress"]["launches"] > 0  # the host side is measured again
    assert "(measured at commit abc1234)" in bench_zoo.markdown(b)
    with pytest.raises(SystemExit, match="no traffic of three-level"):  # another scale: nothing to take
        bench_zoo.main(
            ["--entries", *names, "--no-cpu", "--emulated-max-params", "4096", "--repeat", "1"]
            + ["--out", str(tmp_path / "c.json"), "--traffic-from", str(first)]
        )


def test_check_judges_each_target():
    def row(name, **cpu):
        return {"entry": name, "tensors": 100, "cpu": {"n": 1 << 23, **cpu}, "recording": None, "emulated": []}

    ok = row("split-2^23-100", x_subtract=2.9, x_numpy=5.1, decompress_x_subtract=1.9, ours_s=1.0)
    bad = row("split-2^23-1000", x_subtract=3.1, x_numpy=4.9, decompress_x_subtract=2.1, ours_s=1.0)
    emu = {"fraction": 0.01, "scope": "global", "residual": True, "bytes_per_element": 18.5, "fallbacks": 1}
    bad["emulated"] = [emu]
    got = bench_zoo.check({"rows": [ok, bad]})
    assert [v for v, e, _ in got if e == "split-2^23-100" and v != "N/A"] == ["PASS"] * 3
    assert [v for v, e, _ in got if e == "split-2^23-1000" and v != "N/A"] == ["FAIL"] * 5


def test_readme_section_is_generated_from_the_committed_results():
    doc = json.loads((bench_zoo.RESULTS / "zoo_cpu.json").read_text())
    text = bench_zoo.README.read_text()
    a, b = text.index(bench_zoo.MARK_START) + len(bench_zoo.MARK_START), text.index(bench_zoo.MARK_END)
    assert text[a:b] == "\n" + bench_zoo.markdown(doc)
    assert (bench_zoo.RESULTS / "zoo_cpu.md").read_text() == bench_zoo.markdown(doc)
