"""The command line: the demo, a compress/decompress round trip on .npz files, inspect, and clear errors."""

from __future__ import annotations

import json

import numpy as np

from gpu_codec.cli import main


def test_demo_prints_sizes_ratio_time_backend(capsys):
    assert main(["demo", "--params", "20000", "--clients", "2", "--quiet", "--codec", "ternary"]) == 0
    out = capsys.readouterr().out
    for word in ("backend:", "parameters", "ratio", "compress:", "decompress:", "B per kept parameter"):
        assert word in out


def test_compress_decompress_inspect_round_trip(tmp_path, capsys):
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((30, 20)).astype(np.float32), "b": np.zeros(20, np.float32)}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    np.savez(tmp_path / "base.npz", **base)
    np.savez(tmp_path / "new.npz", **new)
    blob = tmp_path / "u.gcodec"
    assert (
        main(
            [
                "compress",
                str(tmp_path / "new.npz"),
                "--base",
                str(tmp_path / "base.npz"),
                "-o",
                str(blob),
                "--fraction",
                "1.0",
            ]
        )
        == 0
    )
    assert main(["decompress", str(blob), "--base", str(tmp_path / "base.npz"), "-o", str(tmp_path / "m.npz")]) == 0
    with np.load(tmp_path / "m.npz", allow_pickle=False) as z:
        for k in base:
            np.testing.assert_array_equal(z[k], base[k] + (new[k] - base[k]))
    capsys.readouterr()
    assert main(["inspect", str(blob), "--json"]) == 0
    header = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in header["tensors"]] == ["w", "b"]


def test_bad_payload_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.gcodec"
    bad.write_bytes(b"GPUCODEC" + b"\x00" * 40)
    assert main(["inspect", str(bad)]) == 2
    assert "gpu-codec: error:" in capsys.readouterr().err
