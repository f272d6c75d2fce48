"""The command line end to end: every command on small .pt, .safetensors and .npz files, round trips compared to
the library API's bytes, and ``--json`` on every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import gpu_codec
from gpu_codec.cli import main
from gpu_codec.cli.checkpoints import read_checkpoint, write_checkpoint
from gpu_codec.cli.commands import header_split, parse_pipeline

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

FORMATS = {"npz": ".npz", "torch": ".pt", "safetensors": ".safetensors"}
PIPELINE = [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd()]


def make_pair(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "conv.bias": np.zeros(8, np.float32),
        "fc.weight": rng.standard_normal((10, 16)).astype(np.float64),
        "norm.weight": (1 + rng.standard_normal(16)).astype(np.float16),
        "norm.num_batches_tracked": np.array(7.0, np.float32),  # 0-d, as a BatchNorm's counter (a float here)
    }
    new = {k: np.asarray(v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}
    return new, base


def save(path, tensors: dict[str, np.ndarray]) -> str:
    path = str(path)
    if path.endswith(".npz"):
        np.savez(path, **tensors)  # a plain NumPy archive, as users have them
    elif path.endswith(".pt"):
        torch.save({k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, path)
    else:
        st_torch.save_file({k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, path)
    return path


def load(path) -> dict[str, np.ndarray]:
    path = str(path)
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    if path.endswith(".pt"):
        return {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    return {k: v.numpy() for k, v in st_torch.load_file(path).items()}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compress_apply_decompress_round_trip_matches_the_library(tmp_path, capsys, fmt):
    new, base = make_pair()
    suffix = FORMATS[fmt]
    new_p, base_p = save(tmp_path / f"new{suffix}", new), save(tmp_path / f"base{suffix}", base)
    blob_p = tmp_path / "u.gcodec"
    rc, out, err = run(capsys, "compress", new_p, base_p, "-o", str(blob_p), "--fraction", "0.1", "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    blob = blob_p.read_bytes()
    if fmt == "safetensors":  # safetensors keeps no order; its readers list names sorted
        new, base = dict(sorted(new.items())), dict(sorted(base.items()))
    expected = gpu_codec.compress(new, base, fraction=0.1, pipeline=PIPELINE).to_bytes()
    assert blob == expected  # the same bytes as the API, whatever the file format
    assert doc["bytes"] == len(blob) and doc["kept"] == gpu_codec.Payload.from_bytes(blob).nnz
    assert doc["header_nbytes"] + doc["data_nbytes"] == len(blob)

    # apply: base + payload, in the base's format, equal to the API's decompress
    out_p = tmp_path / f"model{suffix}"
    rc, out, _ = run(capsys, "apply", base_p, str(blob_p), "-o", str(out_p), "--json")
    assert rc == 0 and json.loads(out)["format"] == fmt
    want = gpu_codec.decompress(blob, base)
    got = load(out_p)
    assert (sorted(got) if fmt == "safetensors" else list(got)) == list(want)
    for k in want:
        assert got[k].dtype == base[k].dtype
        np.testing.assert_array_equal(got[k], want[k])
        assert not np.array_equal(got[k], base[k]) or k in ("conv.bias", "norm.num_batches_tracked")

    # decompress without a base: the dense delta, format chosen by the suffix
    delta_p = tmp_path / "delta.npz"
    rc, out, _ = run(capsys, "decompress", str(blob_p), "-o", str(delta_p), "--json")
    assert rc == 0 and json.loads(out)["tensors"] == len(new)
    got = load(delta_p)
    for k, v in gpu_codec.decompress(blob).items():
        np.testing.assert_array_equal(got[k], v)


def test_base_as_option_and_pipelines_and_dense(tmp_path, capsys):
    new, base = make_pair(1)
    new_p, base_p = save(tmp_path / "new.npz", new), save(tmp_path / "base.npz", base)
    cases = [
        (["--pipeline", "raw", "--fraction", "0.05"], dict(fraction=0.05, pipeline=None)),
        (
            ["--pipeline", "int8:64,rice,zstd:9", "--scope", "per_tensor"],
            dict(
                fraction=0.01,
                scope="per_tensor",
                pipeline=[gpu_codec.Int8Blockwise(64), gpu_codec.RiceIndices(), gpu_codec.Zstd(9)],
            ),
        ),
        (["--pipeline", "bf16", "--fraction", "dense"], dict(fraction=None, pipeline=[gpu_codec.Quantize("bfloat16")])),
        (
            ["--pipeline", "ternary,rice", "--score", "largest_final_magnitude"],
            dict(score="largest_final_magnitude", pipeline=[gpu_codec.Ternary(), gpu_codec.RiceIndices()]),
        ),
    ]
    for i, (opts, kwargs) in enumerate(cases):
        out_p = tmp_path / f"u{i}.gcodec"
        rc, _, err = run(capsys, "compress", new_p, "--base", base_p, "-o", str(out_p), *opts)
        assert (rc, err) == (0, ""), opts
        assert out_p.read_bytes() == gpu_codec.compress(new, base, **kwargs).to_bytes(), opts


def test_non_float_tensors_are_skipped_on_request_and_copied_back(tmp_path, capsys):
    new, base = make_pair(2)
    base["bn.num_batches_tracked"] = np.array([7], np.int64)
    new["bn.num_batches_tracked"] = np.array([8], np.int64)
    new_p, base_p = save(tmp_path / "new.pt", new), save(tmp_path / "base.pt", base)
    blob_p = tmp_path / "u.gcodec"
    rc, _, err = run(capsys, "compress", new_p, base_p, "-o", str(blob_p))
    assert rc == 2 and "--skip-non-float" in err and "bn.num_batches_tracked" in err
    rc, out, _ = run(capsys, "compress", new_p, base_p, "-o", str(blob_p), "--skip-non-float", "--json")
    assert rc == 0 and json.loads(out)["skipped"] == ["bn.num_batches_tracked"]
    rc, out, _ = run(capsys, "apply", base_p, str(blob_p), "-o", str(tmp_path / "m.pt"), "--json")
    assert rc == 0 and json.loads(out)["copied_from_base"] == ["bn.num_batches_tracked"]
    got = load(tmp_path / "m.pt")
    assert list(got) == list(base) and got["bn.num_batches_tracked"].tolist() == [7]


def test_inspect_text_and_json(tmp_path, capsys):
    new, base = make_pair(3)
    blob = gpu_codec.compress(new, base, fraction=0.1, pipeline=PIPELINE).to_bytes()
    (tmp_path / "u.gcodec").write_bytes(blob)
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "u.gcodec"), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["version"] == 2 and doc["bytes"] == len(blob)
    assert doc["header_nbytes"] == gpu_codec.Payload.from_bytes(blob).header_nbytes
    assert doc["header_nbytes"] + doc["data_nbytes"] == len(blob)
    assert [t["name"] for t in doc["tensors"]] == list(new)
    assert sum(t["nnz"] for t in doc["tensors"]) == doc["kept"] == gpu_codec.kept_count(0.1, 401)
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "u.gcodec"))
    assert rc == 0 and "format v2" in out.splitlines()[0] and "fc.weight" in out


def test_header_split_follows_the_format_version():
    p = gpu_codec.compress({"w": np.ones(16, np.float32)}, fraction=0.5)
    v1, v2 = p.to_bytes(version=1), p.to_bytes()
    h, d = header_split(v1)
    assert h == 16 + int.from_bytes(v1[12:16], "little") and h + d == len(v1)
    h, d = header_split(v2)
    assert h == p.header_nbytes and h + d == len(v2)


def test_info_and_demo_json(capsys):
    rc, out, _ = run(capsys, "info", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["backend"] in ("cpu", "gpu", "emulated") and "packages" in doc
    rc, out, _ = run(capsys, "info", "--backend", "cpu")
    assert rc == 0 and "backend: cpu (forced by --backend cpu)" in out  # the option the user gave, not the variable
    assert os.environ.get("GPU_CODEC_BACKEND") is None or gpu_codec.backend_info()["backend"]  # restored
    rc, out, _ = run(capsys, "demo", "--params", "2e5", "--clients", "2", "--codec", "ternary", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["clients"] == 2 and doc["parameters"] >= 20000 and doc["ratio"] > 1
    assert doc["pipeline"] == "ternary,rice,zstd"


def test_demo_text_keeps_its_lines(capsys):
    rc, out, _ = run(capsys, "demo", "--params", "2e5", "--clients", "2", "--quiet", "--codec", "raw")
    assert rc == 0
    for word in ("backend:", "parameters", "ratio", "compress:", "decompress:", "B per kept parameter", "aggregate:"):
        assert word in out


def test_bench_quick_writes_json_and_plots(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    rc, out, err = run(capsys, "bench", "--quick", "--sizes", "4096", "--out", str(out_dir), "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert doc == json.loads((out_dir / "bench.json").read_text()) | {"json": doc["json"]}
    m = doc["machine"]
    assert m["cpu_count"] >= 1 and m["cpu_model"] and isinstance(m["simd"], list)
    rows = doc["timings"]
    assert {(r["n"], r["fraction"]) for r in rows if r["backend"] == "cpu"} == {(4096, 0.01), (4096, 0.1)}
    cpu = [r for r in rows if r["backend"] == "cpu"]
    assert all(r["ours_s"] > 0 and r["numpy_s"] > 0 and r["torch_s"] > 0 for r in cpu)
    assert all(r["selection_matches_numpy"] for r in cpu)
    pipes = {r["pipeline"] for r in doc["sizes"]}
    assert {"raw", "fp16,rice,zstd", "ternary,rice"} <= pipes
    assert doc["settings"]["params"] == 117_200 and doc["settings"]["repeat"] == 1  # (the smallest model)

    raw = next(r for r in doc["sizes"] if r["pipeline"] == "raw" and r["fraction"] == 0.1)
    tern = next(r for r in doc["sizes"] if r["pipeline"] == "ternary,rice" and r["fraction"] == 0.1)
    assert tern["bytes_per_kept_parameter"] < raw["bytes_per_kept_parameter"]
    names = {os.path.basename(p) for p in doc["plots"]}
    assert {"throughput.png", "bytes_per_param.png"} <= names
    for p in doc["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_quick_takes_the_options_given(tmp_path, capsys):
    out_dir = tmp_path / "bench"
    argv = ["bench", "--quick", "--sizes", "4096", "--fractions", "0.1", "--params", "2e5", "--repeat", "2"]
    rc, out, err = run(capsys, *argv, "--no-plot", "--no-torch", "--out", str(out_dir), "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert doc["settings"]["params"] == 200_000 and doc["settings"]["repeat"] == 2


def test_names_json_member_round_trips_awkward_names(tmp_path):
    names = ["file", "allow_pickle", "../../etc/passwd", "/abs", ".hidden", "a%2Fb", "ü ñ", "x" * 400, "with\\back"]
    tensors = {n: np.full(i + 1, i, np.float32) for i, n in enumerate(names)}
    path = tmp_path / "m.npz"
    write_checkpoint(str(path), tensors)
    with zipfile.ZipFile(path) as zf:
        members = zf.namelist()
    assert len(members) == len(names)
    for m in members:
        assert "/" not in m and "\\" not in m and not m.startswith(".") and len(m) < 260
    back = read_checkpoint(str(path)).tensors
    assert list(back) == names
    for n in names:
        np.testing.assert_array_equal(back[n], tensors[n])
    with np.load(path, allow_pickle=False) as z:  # still an ordinary .npz for NumPy, arrays only
        assert len(z.files) == len(names) and z["file"].tolist() == [0.0] and z["a%252Fb"].tolist() == [5.0] * 6


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zero_dim_tensors_keep_their_shape_through_every_checkpoint_format(tmp_path, fmt):
    """A BatchNorm's counter is 0-d: written from a NumPy 0-d array, a NumPy scalar or a torch 0-d tensor, and read
    back, it stays 0-d (np.ascontiguousarray would make it 1-d), in every format."""
    tensors = {"w": np.ones((2, 3), np.float32), "a": np.array(7.0, np.float32), "s": np.float32(5.0)}
    if fmt != "npz":
        tensors["t"] = torch.tensor(3.0)
    path = str(tmp_path / f"m{FORMATS[fmt]}")
    write_checkpoint(path, tensors)
    back = read_checkpoint(path).tensors
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in tensors.items()}
    assert float(back["s"]) == 5.0 and float(back["a"]) == 7.0
    # and a file the format's own library wrote
    saved = save(tmp_path / f"own{FORMATS[fmt]}", {"n": np.array(2.0, np.float32), "w": np.ones(3, np.float32)})
    assert tuple(read_checkpoint(saved).tensors["n"].shape) == ()


def test_backend_to_torch_keeps_a_zero_dim_array_zero_dim():
    from gpu_codec.arrays import backend_to_torch

    assert backend_to_torch(np.array(2.5, np.float32)).shape == () and backend_to_torch(np.float32(1)).shape == ()
    assert backend_to_torch(np.ones((2, 3), np.float32)[:, 1]).shape == (2,)  # (a strided one is copied)


def test_parse_pipeline_names():
    assert parse_pipeline("raw") == [] and parse_pipeline("fp32,rice")[0].get_config() == {"id": "rice"}
    assert [c.codec_id for c in parse_pipeline("bf16,rice,zstd")] == ["quantize", "rice", "zstd"]
    assert parse_pipeline("ternary")[0].codec_id == "ternary"


def test_console_module_exit_codes_without_traceback(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip archive")
    env = dict(os.environ, PYTHONWARNINGS="error")
    cmd = [sys.executable, "-m", "gpu_codec.cli", "compress", str(bad), "-o", str(tmp_path / "u")]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-codec: error:") and "Traceback" not in r.stderr


def test_internal_error_is_status_1(monkeypatch, capsys):
    import gpu_codec.cli.commands as cli_main

    def broken(a):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_main, "cmd_info", broken)
    rc, out, err = run(capsys, "info")
    assert rc == 1 and out == "" and err == "gpu-codec: error: internal error: RuntimeError: a bug\n"
    rc, _, err = run(capsys, "-v", "info")
    assert rc == 1 and "Traceback" in err  # -v shows where the bug is


def test_speedup_plot_from_gpu_rows(tmp_path):
    from gpu_codec.cli.bench import plot_report

    rows = []
    for n in (1 << 20, 1 << 22):
        rows.append({"backend": "cpu", "n": n, "fraction": 0.01, "ours_s": 1e-2, "numpy_s": 4e-2, "torch_s": 8e-2})
        rows.append({"backend": "gpu", "n": n, "fraction": 0.01, "ours_s": 1e-4, "torch_cuda_s": 3e-4})
    sizes = [{"fraction": 0.01, "pipeline": "raw", "bytes_per_kept_parameter": 8.1}]
    report = {"timings": rows, "sizes": sizes, "settings": {"params": 1000}}
    paths = plot_report(report, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["bytes_per_param.png", "speedup.png", "throughput.png"]


def test_odd_but_valid_inputs(tmp_path, capsys):
    np.savez(
        tmp_path / "be.npz", w=np.arange(6, dtype=">f4"), f=np.asfortranarray(np.arange(6, dtype="f4").reshape(3, 2))
    )
    rc, _, _ = run(
        capsys, "compress", str(tmp_path / "be.npz"), "-o", str(tmp_path / "u"), "--pipeline", "raw", "--fraction", "1"
    )
    assert rc == 0
    rc, _, _ = run(capsys, "decompress", str(tmp_path / "u"), "-o", str(tmp_path / "d.npz"))
    got = load(tmp_path / "d.npz")
    assert rc == 0 and got["w"].tolist() == list(range(6)) and got["f"].tolist() == [[0, 1], [2, 3], [4, 5]]
    # parameters saved with requires_grad, and a transposed view
    torch.save({"p": torch.nn.Parameter(torch.ones(3)), "t": torch.arange(6.0).reshape(3, 2).t()}, tmp_path / "p.pt")
    rc, _, err = run(
        capsys, "compress", str(tmp_path / "p.pt"), "-o", str(tmp_path / "u2"), "--pipeline", "raw", "--fraction", "1"
    )
    assert (rc, err) == (0, "")
    got = gpu_codec.decompress((tmp_path / "u2").read_bytes())
    assert got["t"].tolist() == [[0, 2, 4], [1, 3, 5]] and got["p"].tolist() == [1, 1, 1]


def test_fingerprint_base_is_recorded_shown_and_checked(tmp_path, capsys):
    """compress --fingerprint-base writes the library's bytes (fingerprint_base=True), inspect shows the
    fingerprint, apply and decompress refuse another base in one line and write nothing; without BASE it is a
    usage error."""
    new, base = make_pair(4)
    other = make_pair(5)[1]
    new_p, base_p, other_p = (save(tmp_path / f"{n}.npz", t) for n, t in (("new", new), ("base", base), ("o", other)))
    blob_p = tmp_path / "u.gcodec"
    rc, out, err = run(capsys, "compress", new_p, base_p, "-o", str(blob_p), "--fingerprint-base", "--json")
    want = gpu_codec.compress(new, base, fraction=0.01, pipeline=PIPELINE, fingerprint_base=True)
    assert (rc, err) == (0, "") and blob_p.read_bytes() == want.to_bytes()
    assert json.loads(out)["base_fingerprint"] == want.base_fingerprint
    rc, out, _ = run(capsys, "inspect", str(blob_p))
    assert rc == 0 and f"base fingerprint: {want.base_fingerprint}" in out
    rc, out, _ = run(capsys, "inspect", str(blob_p), "--json")
    assert json.loads(out)["base_fingerprint"] == want.base_fingerprint
    rc, _, err = run(capsys, "apply", base_p, str(blob_p), "-o", str(tmp_path / "ok.npz"))
    assert (rc, err) == (0, "")
    for argv in (["apply", other_p, str(blob_p)], ["decompress", str(blob_p), "--base", other_p]):
        rc, _, err = run(capsys, *argv, "-o", str(tmp_path / "no.npz"))
        assert rc != 0 and len(err.strip().splitlines()) == 1 and "not the one this payload was made against" in err
        assert not (tmp_path / "no.npz").exists()
    rc, _, err = run(capsys, "compress", new_p, "-o", str(tmp_path / "v.gcodec"), "--fingerprint-base")
    assert rc == 2 and "--fingerprint-base needs BASE" in err and not (tmp_path / "v.gcodec").exists()
