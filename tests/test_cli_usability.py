"""What a new user of the command line hits: dense updates with the default pipeline, bench without matplotlib,
inspect's per-tensor truth, truncated payloads, -v after the command, --version, counts written as 2e6 or 2^14,
--backend reported as the option, plurals, and torch files refused in one line of our own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpu_codec
from gpu_codec.cli import build_parser, main
from gpu_codec.cli.commands import DEFAULT_DENSE_PIPELINE, parse_pipeline


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(1)
    base = {"w": rng.standard_normal((60, 50)).astype(np.float32), "b": np.zeros(50, np.float32)}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    np.savez(tmp_path / "base.npz", **base)
    np.savez(tmp_path / "new.npz", **new)
    return tmp_path, new, base


def test_dense_works_with_the_default_pipeline(files, capsys):
    tmp, new, base = files
    rc, out, err = run(capsys, "compress", str(tmp / "new.npz"), str(tmp / "base.npz"), "-o", str(tmp / "d"), "--json")
    assert (rc, err) == (0, "")  # the sparse default is unchanged
    assert json.loads(out)["pipeline"][1:] == [c.get_config() for c in parse_pipeline("fp16,rice,zstd")]
    args = ("compress", str(tmp / "new.npz"), str(tmp / "base.npz"), "--fraction", "dense", "--json")
    rc, out, err = run(capsys, *args, "-o", str(tmp / "dense"))
    assert (rc, err) == (0, ""), err
    want = gpu_codec.compress(new, base, fraction=None, pipeline=parse_pipeline(DEFAULT_DENSE_PIPELINE)).to_bytes()
    assert (tmp / "dense").read_bytes() == want and json.loads(out)["kept"] == 3050
    # an explicit index stage on a dense update is still the user's mistake, said as such
    rc, _, err = run(capsys, *args, "-o", str(tmp / "dense2"), "--pipeline", "fp16,rice")
    assert rc == 2 and "rice" in err and not (tmp / "dense2").exists()
    for codec in ("fp16", "ternary", "raw"):
        rc, out, err = run(capsys, "demo", "--params", "2e5", "--clients", "1", "--fraction", "dense", "--codec", codec)
        assert (rc, err) == (0, ""), (codec, err)
        assert "rice" not in out.splitlines()[2]


def test_bench_says_on_stderr_that_no_plots_were_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out_dir = tmp_path / "b"
    rc, out, err = run(capsys, "bench", "--quick", "--sizes", "2^12", "--no-torch", "--out", str(out_dir), "--json")
    assert rc == 0
    assert "no plots were written" in err and "'plot' extra" in err and "matplotlib" in err
    doc = json.loads(out)
    assert doc["plots"] == [] and "no plots" in doc["plots_skipped"]
    assert doc["settings"]["sizes"] == [4096] and sorted(os.listdir(out_dir)) == ["bench.json"]


def test_inspect_shows_each_tensors_encoding_and_bytes(files, capsys):
    tmp, new, base = files
    cases = {
        "shared": gpu_codec.compress(new, base, fraction=0.01, pipeline=parse_pipeline("fp16,rice,zstd")).to_bytes(),
        "records": gpu_codec.compress(new, base, fraction=0.01, pipeline=parse_pipeline("fp16,rice")).to_bytes(),
        "v1": gpu_codec.compress(new, base, fraction=0.01, pipeline=parse_pipeline("fp16,rice,zstd")).to_bytes(
            version=1
        ),
    }
    for name, blob in cases.items():
        (tmp / name).write_bytes(blob)
        rc, out, _ = run(capsys, "inspect", str(tmp / name), "--json")
        doc = json.loads(out)
        assert rc == 0
        rows = doc["tensors"]
        p = gpu_codec.Payload.from_bytes(blob)
        assert [t["nnz"] for t in rows] == [r.nnz for r in p.tensors] and rows[1]["nnz"] >= 0
        if name == "records":  # no lossless stage: each tensor's own buffers, back to back
            assert doc["data_mode"] == "records"
            assert all(t["encoding"] == "sparse" and t["inner"] is None for t in rows)
            assert all(t["wire_nbytes"] == t["raw_nbytes"] > 0 for t in rows if t["nnz"])
            assert sum(t["wire_nbytes"] for t in rows) == doc["data_nbytes"] - 4  # the checksum
        elif name == "shared":  # one frame (or plain bytes) over every tensor: no wire size per tensor
            assert doc["data_mode"] in ("zstd", "plain")
            assert all(t["encoding"] == "zstd" and t["inner"] == "sparse" for t in rows)
            assert all(t["wire_nbytes"] is None for t in rows)
            assert [t["raw_nbytes"] for t in rows] == [t["codec"]["raw"] for t in rows]
            assert rows[0]["raw_nbytes"] > 0
        else:  # version 1: a frame per tensor
            assert all(t["inner"] == "sparse" and t["wire_nbytes"] == t["codec"]["zbytes"] > 0 for t in rows)
        rc, out, _ = run(capsys, "inspect", str(tmp / name))
        table = out.splitlines()
        row_w = next(line for line in table if line.startswith("w "))
        assert ("sparse+zstd" in row_w) == (name != "records") and " 0 " not in row_w


# (fraction, pipeline, data mode) giving each layout of the data section on this update; v1 has no modes
TRUNCATED = {
    "records": (0.05, "fp16,rice", 0),
    "records_zstd": (None, "fp16,zstd", 0),  # a zstd frame per tensor
    "zstd": (0.05, "fp16,rice,zstd", 1),  # one frame over every tensor
    "plain": (0.01, "fp16,rice,zstd", 2),
    "v1": (0.05, "fp16,rice,zstd", None),
}


@pytest.mark.parametrize("kind", list(TRUNCATED))
def test_a_truncated_payload_is_reported_as_truncated(tmp_path, capsys, kind):
    rng = np.random.default_rng(2)
    update = {"w": rng.standard_normal(4000).astype(np.float32), "z": np.zeros(3000, np.float32)}
    fraction, spec, mode = TRUNCATED[kind]
    p = gpu_codec.compress(update, fraction=fraction, pipeline=parse_pipeline(spec))
    blob = p.to_bytes(version=1 if kind == "v1" else None)
    if mode is not None:
        assert (blob[12] >> 2) & 3 == mode
    for cut in (1, 3, 4, 5, 40, len(blob) // 2):
        (tmp_path / "cut").write_bytes(blob[:-cut])
        rc, _, err = run(capsys, "inspect", str(tmp_path / "cut"))
        assert rc == 2 and err.count("\n") == 1 and "payload is truncated" in err, (cut, err)
        assert f"{len(blob) - cut} bytes" in err, err
        if kind in ("v1", "records", "records_zstd") and cut <= 4:  # the length the header or the table implies
            assert f" {len(blob)} " in err or f" {len(blob)}\n" in err, err
        if kind == "zstd":  # one frame of one block: its block header gives the whole length, cut where it may be
            assert f"{len(blob)} bytes" in err or f"need {len(blob)}" in err, err
        rc, _, err = run(capsys, "decompress", str(tmp_path / "cut"), "-o", str(tmp_path / "d.npz"))
        assert rc == 2 and "truncated" in err and not (tmp_path / "d.npz").exists()
    flipped = bytearray(blob)
    flipped[len(blob) - 6] ^= 0x10  # same length, changed bytes: a checksum mismatch, not a truncation
    (tmp_path / "flip").write_bytes(bytes(flipped))
    rc, _, err = run(capsys, "inspect", str(tmp_path / "flip"))
    assert rc == 2 and "checksum" in err and "truncated" not in err


def test_verbose_before_or_after_the_command(capsys, monkeypatch):
    import gpu_codec.cli.commands as commands

    assert build_parser().parse_args(["info", "-v"]).verbose is True
    assert build_parser().parse_args(["-v", "info"]).verbose is True
    assert build_parser().parse_args(["info"]).verbose is False
    assert build_parser().parse_args(["inspect", "x", "--verbose"]).verbose is True

    def broken(a):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "cmd_info", broken)
    for argv in (["info", "-v"], ["-v", "info"]):
        rc, _, err = run(capsys, *argv)
        assert rc == 1 and "Traceback" in err, argv


def test_quiet_and_json_before_or_after_the_command(capsys):
    p = build_parser()
    for argv in (["-q", "--json", "info"], ["info", "-q", "--json"], ["--json", "info", "-q"]):
        a = p.parse_args(argv)
        assert (a.quiet, a.json) == (True, True), argv
    a = p.parse_args(["info"])
    assert (a.quiet, a.json) == (False, False)
    rc, out, _ = run(capsys, "--json", "info")
    assert rc == 0 and json.loads(out)["gpu_codec"] == gpu_codec.__version__


def test_version(capsys):
    rc, out, err = run(capsys, "--version")
    assert (rc, out, err) == (0, f"gpu-codec {gpu_codec.__version__}\n", "")


def test_counts_take_the_notation_the_help_shows(capsys):
    p = build_parser()
    assert p.parse_args(["demo", "--params", "2e6"]).params == 2_000_000
    assert p.parse_args(["demo", "--params", "2^17", "--clients", "1e1"]).params == 131072
    assert p.parse_args(["bench", "--sizes", "2^14", "1e6", "4194304", "2**10"]).sizes == [16384, 10**6, 4194304, 1024]
    assert p.parse_args(["bench", "--params", "1_000_000", "--repeat", "5"]).params == 10**6
    for bad in ("2^41", "0.5", "1e-3", "two"):
        rc, _, err = run(capsys, "bench", "--sizes", bad)
        assert rc == 2 and "element count" in err, bad


def test_backend_option_is_reported_as_the_option(capsys, monkeypatch):
    monkeypatch.delenv("GPU_CODEC_BACKEND", raising=False)
    rc, out, _ = run(capsys, "info", "--backend", "emulated", "--json")
    assert rc == 0 and json.loads(out)["reason"].startswith("forced by --backend emulated")
    rc, out, _ = run(capsys, "demo", "--params", "2e5", "--clients", "1", "--backend", "cpu")
    assert rc == 0 and "backend: cpu (forced by --backend cpu)" in out and "GPU_CODEC_BACKEND" not in out
    monkeypatch.setenv("GPU_CODEC_BACKEND", "cpu")  # set by the user: reported as the variable
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "forced by GPU_CODEC_BACKEND=cpu" in out


def test_plurals(tmp_path, capsys):
    rc, out, _ = run(capsys, "demo", "--params", "2e5", "--clients", "1", "-q")
    assert rc == 0 and "(global), 1 client\n" in out and "1 clients" not in out
    blob = gpu_codec.compress({"w": np.arange(1.0, 9.0, dtype=np.float32)}, fraction=0.125).to_bytes()
    (tmp_path / "u").write_bytes(blob)
    rc, out, _ = run(capsys, "decompress", str(tmp_path / "u"), "-o", str(tmp_path / "d.npz"))
    assert rc == 0 and "1 tensor (npz)" in out
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "u"))
    assert rc == 0 and "1 entry kept" in out
    rc, out, _ = run(capsys, "compress", str(tmp_path / "d.npz"), "-o", str(tmp_path / "u2"), "--fraction", "1")
    assert rc == 0 and "8 of 8 entries kept" in out


def test_pickled_and_text_pt_files_get_one_line_of_our_own(tmp_path):
    pytest.importorskip("torch")
    import pickle

    with open(tmp_path / "pickled.pt", "wb") as f:
        pickle.dump({"w": [1.0, 2.0]}, f, protocol=4)  # torch warns about protocol 4 before refusing
    (tmp_path / "text.pt").write_text("these are not the weights you are looking for\n")
    script = (
        "import os, sys\nfrom gpu_codec.cli import main\n"
        f"d = {str(tmp_path)!r}\n"
        "out = os.path.join(d, 'o')\n"
        "codes = [main(['compress', os.path.join(d, n), '-o', out]) for n in ('pickled.pt', 'text.pt')]\n"
        "sys.exit(0 if codes == [2, 2] else 1)\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="default")
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert r.returncode == 0 and r.stdout == "", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("gpu-codec: error: ") for line in lines), r.stderr
    assert "pickled.pt" in lines[0] and "pickle" in lines[0] and "text.pt" in lines[1]
    assert "weights_only" not in r.stderr and "Warning" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_pt_file_in_torchs_older_format_is_read(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "old.pt").read_bytes()[:1] == b"\x80"  # a pickle stream, not a zip archive
    assert main(["compress", str(tmp_path / "old.pt"), "-o", str(tmp_path / "u"), "--fraction", "dense", "-q"]) == 0
    capsys.readouterr()
    got = gpu_codec.decompress((tmp_path / "u").read_bytes())
    np.testing.assert_allclose(got["w"], state["w"].numpy(), rtol=1e-3)
    assert sorted(got) == ["b", "w"]
