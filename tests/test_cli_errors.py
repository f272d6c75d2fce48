"""User mistakes on the command line: exit status 2, one line on stderr, no traceback, nothing written, and names
treated as data (never as paths, never printed raw to a terminal)."""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile

import numpy as np
import pytest

import gpu_codec
from gpu_codec.cli import main


def user_error(capsys, *argv: str, says: str = "") -> str:
    """Run the command; assert a clean user error and return its one line."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("gpu-codec: error: ") and "Traceback" not in err
    assert "\x1b" not in err and "\r" not in err
    assert out == ""
    assert says in err, err
    return err


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    new = {k: v + 1 for k, v in base.items()}
    np.savez(tmp_path / "base.npz", **base)
    np.savez(tmp_path / "new.npz", **new)
    blob = gpu_codec.compress(new, base, fraction=0.5).to_bytes()
    (tmp_path / "u.gcodec").write_bytes(blob)
    return tmp_path


def test_corrupt_npz(files, capsys):
    (files / "junk.npz").write_bytes(os.urandom(300))
    user_error(capsys, "compress", str(files / "junk.npz"), "-o", str(files / "o"), says="not a readable .npz")
    whole = (files / "new.npz").read_bytes()
    (files / "cut.npz").write_bytes(whole[: len(whole) // 2])
    user_error(capsys, "compress", str(files / "cut.npz"), "-o", str(files / "o"), says="cut.npz")
    flipped = bytearray(whole)
    flipped[len(whole) // 3] ^= 0xFF  # inside the first array's data: the member's CRC-32 no longer matches
    (files / "flip.npz").write_bytes(bytes(flipped))
    user_error(capsys, "compress", str(files / "flip.npz"), "-o", str(files / "o"), says="flip.npz")
    assert not (files / "o").exists()


def test_npy_files(files, capsys):
    np.save(files / "one.npy", np.ones(3, np.float32))
    user_error(capsys, "compress", str(files / "one.npy"), "-o", str(files / "o"), says="save the state dict as .npz")
    os.replace(files / "one.npy", files / "one.npz")  # an .npy in disguise
    user_error(capsys, "compress", str(files / "one.npz"), "-o", str(files / "o"), says="not a readable .npz")


def test_object_arrays_are_refused_without_unpickling(files, capsys):
    np.savez(files / "obj.npz", w=np.array([{"a": 1}, None], dtype=object))
    user_error(capsys, "compress", str(files / "obj.npz"), "-o", str(files / "o"), says="object arrays are refused")


def test_npy_header_that_lies_about_its_size(files, capsys):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    with zipfile.ZipFile(files / "big.npz", "w") as zf:
        zf.writestr("w.npy", buf.getvalue() + bytes(16))  # 4 TB claimed, 16 bytes held: refused before allocating
    user_error(capsys, "compress", str(files / "big.npz"), "-o", str(files / "o"), says="header says")
    # a deflated member whose header and zip entries agree on 4 GiB while 1 MiB is there: refused when it runs out
    total = 0xFFFFFFFF
    hlen = 0
    for _ in range(3):  # the header's length depends on the shape written in it
        hb = io.BytesIO()
        np.lib.format.write_array_header_1_0(hb, {"descr": "|u1", "fortran_order": False, "shape": (total - hlen,)})
        hlen = len(hb.getvalue())
    head = hb.getvalue()
    with zipfile.ZipFile(files / "bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", head + bytes(1 << 20))
    raw = (files / "bomb.npz").read_bytes()
    true_size = (len(head) + (1 << 20)).to_bytes(4, "little")
    assert raw.count(true_size) == 2
    (files / "bomb.npz").write_bytes(raw.replace(true_size, total.to_bytes(4, "little")))
    err = user_error(capsys, "compress", str(files / "bomb.npz"), "-o", str(files / "o"), says="bomb.npz")
    assert "header says" not in err  # the claim was consistent; the data ran out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--clients", "0"], "--clients must be at least 1"),
        (["demo", "--params", "10"], "--params must be at least 117200"),
        (["demo", "--params", "1e12"], "--params must be at most"),
        (["demo", "--params", "2.5e3x"], "must be an integer"),
        (["demo", "--params", "1e99"], "too large"),
        (["demo", "--params", "10^99"], "too large"),
        (["demo", "--params", "2500.5"], "must be an integer"),
        (["demo", "--params", "1000000000000"], "--params must be at most"),
        (["demo", "--fraction", "nan"], "'nan'"),
        (["demo", "--fraction", "0"], "(0, 1]"),
        (["demo", "--fraction", "1.5"], "(0, 1]"),
        (["demo", "--fraction", "inf"], "(0, 1]"),
        (["demo", "--clients", "two"], "must be an integer"),
        (["demo", "--pipeline", "lzma"], "unknown stage 'lzma'"),
        (["demo", "--pipeline", "zstd,fp16"], "--pipeline"),
        (["demo", "--pipeline", "int8:0"], "int8"),
        (["demo", "--pipeline", ""], "a stage name is empty"),  # not the default, not raw: said
        (["demo", "--pipeline", ","], "a stage name is empty"),
        (["demo", "--pipeline", "fp16,,zstd"], "a stage name is empty"),
        (["frobnicate"], "invalid choice"),
        (["compress", "x.npz"], "required: -o/--output"),
        (["compress", "x.npz", "-o", "u", "--score", "biggest"], "invalid choice"),
        (["decompress", "u", "-o", "m.npz", "--max-output-bytes", "lots"], "byte count"),
        (["decompress", "u", "-o", "m.npz", "--max-output-bytes", "1.5"], "whole number of bytes"),
        (["decompress", "u", "-o", "m.npz", "--max-output-bytes", "-3"], "byte count"),
        (["bench", "--sizes", "0"], "element count"),
        (["bench", "--fractions", "dense", "--quick"], "dense mode has no top-k to time"),
        (["demo", "--pipeline", "zstd:abc"], "its argument must be a whole number such as 64 or 2^10, got 'abc'"),
        (["demo", "--pipeline", "int8:2^30"], "block_size must be in"),
        (["demo", "--fraction", "dense", "--pipeline", "rice", "--params", "2e5"], "--fraction dense encodes"),
        (["--backend", "xx", "info"], "argument --backend: invalid choice: 'xx'"),
        (["--backend", "cpu", "inspect", "u.gcodec"], "--backend does not apply to inspect"),
        (["--backend", "cpu", "bench", "--quick"], "--backend does not apply to bench"),
    ],
)
def test_bad_arguments(capsys, argv, says):
    user_error(capsys, *argv, says=says)


def test_missing_and_unknown_files(files, capsys):
    user_error(capsys, "compress", str(files / "nope.npz"), "-o", str(files / "o"), says="no such file")
    user_error(
        capsys, "compress", str(files / "new.txt"), "-o", str(files / "o"), says="cannot tell the checkpoint format"
    )
    user_error(capsys, "inspect", str(files / "nope.gcodec"), says="nope.gcodec")
    user_error(capsys, "inspect", str(files), says="is a directory")
    if os.path.exists("/dev/zero"):  # an endless input is refused, not read
        user_error(capsys, "inspect", "/dev/zero", says="not a regular file")
    user_error(capsys, "compress", str(files / "new.npz"), "-o", "", says="output path is empty")
    user_error(capsys, "compress", str(files / "new.npz"), str(files / "base.npz"), "--base", "x.npz", "-o", "o")


def test_output_directory_is_refused_and_nothing_is_written(files, capsys):
    out_dir = files / "outdir"
    out_dir.mkdir()
    user_error(capsys, "decompress", str(files / "u.gcodec"), "-o", str(out_dir), says="is a directory")
    user_error(capsys, "compress", str(files / "new.npz"), "-o", str(out_dir), says="is a directory")
    user_error(capsys, "apply", str(files / "base.npz"), str(files / "u.gcodec"), "-o", str(out_dir), says="directory")
    user_error(capsys, "decompress", str(files / "u.gcodec"), "-o", str(files / "no" / "m.npz"), says="does not exist")
    assert sorted(os.listdir(out_dir)) == []
    assert not (files / "outdir.npz").exists()
    assert not [n for n in os.listdir(files) if n.startswith(".gpu-codec-")]


def test_bad_payloads(files, capsys):
    blob = (files / "u.gcodec").read_bytes()
    (files / "cut.gcodec").write_bytes(blob[:-5])
    user_error(capsys, "inspect", str(files / "cut.gcodec"))
    (files / "flip.gcodec").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    user_error(capsys, "decompress", str(files / "flip.gcodec"), "-o", str(files / "m.npz"), says="checksum")
    (files / "zero.gcodec").write_bytes(b"GPUCODEC" + b"\x00" * 40)
    user_error(capsys, "apply", str(files / "base.npz"), str(files / "zero.gcodec"), "-o", str(files / "m.npz"))
    assert not (files / "m.npz").exists()


def test_max_output_bytes(files, capsys):
    u = str(files / "u.gcodec")
    user_error(capsys, "decompress", u, "-o", str(files / "m.npz"), "--max-output-bytes", "100", says="over --max")
    user_error(capsys, "apply", str(files / "base.npz"), u, "-o", str(files / "m.npz"), "--max-output-bytes", "100B")
    assert main(["decompress", u, "-o", str(files / "m.npz"), "--max-output-bytes", "140"]) == 0  # 35 fp32 values
    assert main(["decompress", u, "-o", str(files / "n.npz"), "--max-output-bytes", "none"]) == 0
    capsys.readouterr()
    user_error(capsys, "decompress", u, "-o", str(files / "p.npz"), "--max-output-bytes", "1.3e2", says="over --max")
    assert main(["decompress", u, "-o", str(files / "p.npz"), "--max-output-bytes", "2^30"]) == 0  # counts too
    capsys.readouterr()
    # the default cap (4 GiB) is the option's: its error names the option, as the cap given does
    none = gpu_codec.SparseEntries(np.zeros(0, np.int64), np.zeros(0), (5 << 28,), "float32")
    huge = gpu_codec.encode_coo({"w": none})
    (files / "huge.gcodec").write_bytes(huge.to_bytes())
    err = user_error(capsys, "decompress", str(files / "huge.gcodec"), "-o", str(files / "h.npz"), says="over --max")
    assert "4,294,967,296" in err and "'none'" in err and not (files / "h.npz").exists()


def test_mismatched_checkpoints(files, capsys):
    np.savez(files / "other.npz", w=np.zeros((5, 6), np.float32), b=np.zeros(5, np.float32))
    user_error(capsys, "compress", str(files / "new.npz"), str(files / "other.npz"), "-o", "o", says="shape")
    np.savez(files / "fewer.npz", w=np.zeros((6, 5), np.float32))
    user_error(capsys, "apply", str(files / "fewer.npz"), str(files / "u.gcodec"), "-o", str(files / "m.npz"))
    np.savez(files / "ints.npz", w=np.zeros((6, 5), np.int32), b=np.zeros(5, np.int32))
    user_error(capsys, "compress", str(files / "ints.npz"), "-o", "o", says="not a float tensor")
    user_error(capsys, "compress", str(files / "ints.npz"), "-o", "o", "--skip-non-float", says="no float tensors")


def test_apply_refuses_a_different_output_format(files, capsys):
    user_error(
        capsys,
        "apply",
        str(files / "base.npz"),
        str(files / "u.gcodec"),
        "-o",
        str(files / "m.pt"),
        says="base's format",
    )


def test_decompress_refuses_a_format_the_output_name_contradicts(files, capsys):
    u = str(files / "u.gcodec")
    err = user_error(capsys, "decompress", u, "-o", str(files / "m.npz"), "--format", "pt", says="--format pt")
    assert "names npz" in err and not (files / "m.npz").exists()
    assert main(["decompress", u, "-o", str(files / "m.pth"), "--format", "pt"]) == 0  # what it names
    assert main(["decompress", u, "-o", str(files / "m.bin"), "--format", "npz"]) == 0  # no format named: --format's
    capsys.readouterr()
    with np.load(files / "m.bin") as z:
        assert sorted(z.files) == ["b", "w"]


def test_bench_refuses_a_missing_backend_before_making_its_folder(tmp_path, capsys):
    if gpu_codec.backend_info()["backend"] == "gpu":
        pytest.skip("a GPU is usable here")
    out = tmp_path / "report"
    user_error(capsys, "bench", "--quick", "--backends", "gpu", "--out", str(out), says="--backends gpu")
    assert not out.exists()


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_torch_files_are_never_unpickled(files, capsys):
    torch = pytest.importorskip("torch")
    marker = files / "pwned"
    with open(files / "evil.pt", "wb") as f:
        pickle.dump({"w": _Evil(str(marker))}, f)
    user_error(capsys, "compress", str(files / "evil.pt"), "-o", str(files / "o"), says="not a readable torch")
    torch.save({"w": _Evil(str(marker))}, files / "evil2.pt")
    user_error(capsys, "compress", str(files / "evil2.pt"), "-o", str(files / "o"), says="evil2.pt")
    assert not marker.exists()
    torch.save([torch.zeros(3)], files / "list.pt")
    user_error(capsys, "compress", str(files / "list.pt"), "-o", "o", says="not a state dict")
    torch.save({"w": torch.zeros(3), "epoch": 3}, files / "mixed.pt")
    user_error(capsys, "compress", str(files / "mixed.pt"), "-o", "o", says="'epoch' is a int")
    (files / "junk.pt").write_bytes(os.urandom(200))
    user_error(capsys, "compress", str(files / "junk.pt"), "-o", "o", says="junk.pt")


def test_safetensors_problems(files, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    (files / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    user_error(capsys, "compress", str(files / "junk.safetensors"), "-o", "o", says="not a readable .safetensors")
    np.savez(files / "meta.npz", __metadata__=np.ones(2, np.float32))
    blob = gpu_codec.compress({"__metadata__": np.ones(2, np.float32)}, fraction=1.0).to_bytes()
    (files / "meta.gcodec").write_bytes(blob)
    user_error(capsys, "decompress", str(files / "meta.gcodec"), "-o", str(files / "m.safetensors"), says="reserved")
    torch.save({"w": torch.ones(3, dtype=torch.bfloat16)}, files / "bf.pt")
    blob = gpu_codec.compress({"w": torch.ones(3, dtype=torch.bfloat16)}, fraction=1.0).to_bytes()
    (files / "bf.gcodec").write_bytes(blob)
    args = ("decompress", str(files / "bf.gcodec"), "--base", str(files / "bf.pt"), "-o", str(files / "m.npz"))
    user_error(capsys, *args, says="bfloat16")


def test_backend_that_is_not_there(capsys):
    if gpu_codec.backend_info()["backend"] == "gpu":
        pytest.skip("a GPU is present")
    user_error(capsys, "info", "--backend", "gpu", says="no GPU backend is usable")
    assert os.environ.get("GPU_CODEC_BACKEND") is None


def test_names_are_data_not_paths_nor_terminal_codes(files, capsys):
    evil = {
        "file": np.ones(3, np.float32),
        "allow_pickle": np.full(3, 2, np.float32),
        "../../escaped": np.full(3, 3, np.float32),
        "\x1b[2J\x1b]0;owned\x07red": np.full(3, 4, np.float32),
    }
    base = {k: np.zeros_like(v) for k, v in evil.items()}
    blob = gpu_codec.compress(evil, base, fraction=1.0).to_bytes()
    (files / "e.gcodec").write_bytes(blob)
    assert main(["decompress", str(files / "e.gcodec"), "-o", str(files / "e.npz")]) == 0
    with zipfile.ZipFile(files / "e.npz") as zf:
        assert all("/" not in m and ".." not in m.split("%")[0] and "\x1b" not in m for m in zf.namelist())
    assert main(["apply", str(files / "e.npz"), str(files / "e.gcodec"), "-o", str(files / "e2.npz")]) == 0
    capsys.readouterr()
    from gpu_codec.cli.checkpoints import read_checkpoint

    back = read_checkpoint(str(files / "e2.npz")).tensors
    assert list(back) == list(evil)  # file and allow_pickle survive: nothing was dropped
    for k, v in evil.items():
        np.testing.assert_array_equal(back[k], 2 * v)
    assert not (files.parent / "escaped.npy").exists() and not (files / "escaped.npy").exists()
    assert main(["inspect", str(files / "e.gcodec")]) == 0
    out, _ = capsys.readouterr()
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out
    ints = {"\x1b[31mcount": np.ones(2, np.int64), "w": np.ones(2, np.float32)}
    np.savez(files / "ints.npz", **ints)
    err = user_error(capsys, "compress", str(files / "ints.npz"), "-o", "o", says="not a float tensor")
    assert "\\x1b[31mcount" in err


def test_base_tensors_copied_into_an_output_that_cannot_hold_them_as_they_are(tmp_path, capsys):
    """Non-float tensors of the base are copied into the output: two names of one storage are written to
    .safetensors (which refuses shared memory) as copies, and a float8 tensor into .npz is refused in one line."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    c = torch.tensor(7)
    torch.save({"w": torch.ones(4), "a": c, "b": c}, tmp_path / "b.pt")
    torch.save({"w": torch.ones(4) * 2, "a": c, "b": c}, tmp_path / "n.pt")
    p = str(tmp_path / "p.gcodec")
    assert main(["compress", str(tmp_path / "n.pt"), str(tmp_path / "b.pt"), "-o", p, "--skip-non-float"]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["decompress", p, "--base", str(tmp_path / "b.pt"), "-o", str(out)]) == 0
    from safetensors.torch import load_file

    got = load_file(str(out))
    assert got["a"].item() == got["b"].item() == 7 and got["w"].tolist() == [2.0, 1.0, 1.0, 1.0]
    capsys.readouterr()
    if not hasattr(torch, "float8_e4m3fn"):
        return
    f8 = torch.zeros(3, dtype=torch.float8_e4m3fn)
    torch.save({"w": torch.ones(4), "f8": f8}, tmp_path / "b8.pt")
    torch.save({"w": torch.ones(4) * 2, "f8": f8}, tmp_path / "n8.pt")
    p8 = str(tmp_path / "p8.gcodec")
    assert main(["compress", str(tmp_path / "n8.pt"), str(tmp_path / "b8.pt"), "-o", p8, "--skip-non-float"]) == 0
    capsys.readouterr()
    o = str(tmp_path / "o.npz")
    user_error(capsys, "decompress", p8, "--base", str(tmp_path / "b8.pt"), "-o", o, says="float8")
    assert not (tmp_path / "o.npz").exists()


def test_an_npz_shape_with_negative_sizes_is_refused(files, capsys):
    import struct

    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (-2, -2), }"
    header += b" " * (64 - (10 + len(header) + 1) % 64) + b"\n"  # (-2 x -2 x 4 bytes: the data's 16 bytes)
    member = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(16)
    with zipfile.ZipFile(files / "neg.npz", "w") as z:
        z.writestr("w.npy", member)
    user_error(capsys, "compress", str(files / "neg.npz"), "-o", str(files / "o"), says="negative size")
    user_error(capsys, "apply", str(files / "neg.npz"), str(files / "u.gcodec"), "-o", str(files / "m.npz"))
    assert not (files / "o").exists() and not (files / "m.npz").exists()


def test_an_empty_base_path_is_refused_not_taken_as_no_base(files, capsys):
    new, u = str(files / "new.npz"), str(files / "u.gcodec")
    user_error(capsys, "compress", new, "", "-o", str(files / "o"), says="the base path is empty")
    user_error(capsys, "compress", new, "--base", " ", "-o", str(files / "o"), says="the base path is empty")
    user_error(capsys, "decompress", u, "--base", "", "-o", str(files / "m.npz"), says="the base path is empty")
    assert not (files / "o").exists() and not (files / "m.npz").exists()


def test_skip_non_float_refuses_a_tensor_that_is_float_in_the_base(files, capsys):
    np.savez(files / "n2.npz", w=np.ones((6, 5), np.float32), c=np.arange(3))
    np.savez(files / "b2.npz", w=np.zeros((6, 5), np.float32), c=np.zeros(3, np.float32))
    err = user_error(
        capsys, "compress", str(files / "n2.npz"), str(files / "b2.npz"), "-o", str(files / "o"), "--skip-non-float"
    )
    assert "'c' is int64" in err and "float32" in err and not (files / "o").exists()


def test_torch_tensors_a_state_dict_may_hold(files, capsys):
    """What torch's weights_only loader gives beside plain tensors: lazily negated or conjugated views (read as their
    values), nested tensors (refused), and dtypes a format cannot store (refused in one line)."""
    torch = pytest.importorskip("torch")
    w = torch.arange(6, dtype=torch.float32)
    torch.save({"w": w._neg_view()}, files / "neg.pt")
    assert main(["compress", str(files / "neg.pt"), "-o", str(files / "n.gc"), "--fraction", "dense", "-q"]) == 0
    np.testing.assert_array_equal(gpu_codec.decompress((files / "n.gc").read_bytes())["w"], -np.arange(6))
    capsys.readouterr()
    with warnings.catch_warnings():  # (torch warns that its nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    torch.save({"w": w, "x": nested}, files / "nest.pt")
    user_error(capsys, "compress", str(files / "nest.pt"), "-o", str(files / "o"), "--skip-non-float", says="dense")
    # non-float base tensors copied into the output as they read: a conjugated view's values, or a refusal
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    torch.save({"w": w, "c": c.conj()}, files / "conj.pt")
    with warnings.catch_warnings():  # (torch warns that complex32 is experimental)
        warnings.simplefilter("ignore")
        torch.save({"w": w, "c": torch.zeros(2, dtype=torch.complex32)}, files / "c32.pt")
    blob = gpu_codec.compress({"w": w.numpy() + 1}, {"w": w.numpy()}, fraction=0.5).to_bytes()
    (files / "w.gc").write_bytes(blob)
    out = str(files / "o.safetensors")
    assert main(["decompress", str(files / "w.gc"), "--base", str(files / "conj.pt"), "-o", out, "-q"]) == 0
    from safetensors.torch import load_file

    assert load_file(out)["c"].tolist() == [1 - 2j, 3 + 4j]
    capsys.readouterr()
    err = user_error(
        capsys, "decompress", str(files / "w.gc"), "--base", str(files / "c32.pt"), "-o", str(files / "c.safetensors")
    )
    assert "complex32" in err and not (files / "c.safetensors").exists()


def test_a_pt_file_pickled_with_another_protocol_is_refused_saying_so(files, capsys):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3)}, files / "p5.pt", pickle_protocol=5)
    err = user_error(capsys, "compress", str(files / "p5.pt"), "-o", str(files / "o"), says="opcodes")
    assert "did not write" not in err and "beyond tensors" not in err


def test_an_output_that_cannot_be_made_is_named_by_the_path_given(files, monkeypatch, capsys):
    # the folder goes away between the check and the write: the error names the output, not a hidden temp file
    from gpu_codec.cli import outputs

    (files / "gone").mkdir()
    target = outputs.resolve_output(str(files / "gone" / "u.gcodec"))
    (files / "gone").rmdir()
    with pytest.raises(FileNotFoundError) as e:
        outputs.write_output(target, lambda f: f.write(b"x"))
    assert e.value.filename == str(files / "gone" / "u.gcodec")

    def full(f):  # a write error without a file name (a full disk)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as e:
        outputs.write_output(outputs.resolve_output(str(files / "d.npz")), full)
    assert (e.value.errno, e.value.filename) == (28, str(files / "d.npz"))
    assert not (files / "d.npz").exists() and not [p for p in os.listdir(files) if p.endswith(".tmp")]


def _cli(args: list[str], **kw):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "gpu_codec.cli", *args], check=False, **kw)


def test_a_closed_stdout_is_refused_in_one_line(files):
    import subprocess
    import sys

    for args in (["info"], ["compress", str(files / "new.npz"), str(files / "base.npz"), "-o", "-"]):
        cmd = " ".join([sys.executable, "-m", "gpu_codec.cli", *args]) + " >&-"
        r = subprocess.run(["bash", "-c", cmd], check=False, stderr=subprocess.PIPE, text=True)
        assert r.returncode == 2, r.stderr
        assert (
            r.stderr.strip()
            == "gpu-codec: error: stdout is closed; redirect it (to /dev/null to discard what is printed)"
        )


def test_stdout_that_is_an_input_is_refused_and_the_input_kept(files):
    before = (files / "new.npz").read_bytes()
    with open(files / "new.npz", "ab") as out:
        r = _cli(["compress", str(files / "new.npz"), str(files / "base.npz"), "-o", "-"], stdout=out, stderr=-1)
    assert r.returncode == 2
    assert b"stdout is the same file as the input" in r.stderr and r.stderr.count(b"\n") == 1
    assert (files / "new.npz").read_bytes() == before
    payload = (files / "u.gcodec").read_bytes()
    with open(files / "u.gcodec", "r+b") as out:
        r = _cli(["decompress", str(files / "u.gcodec"), "--format", "npz", "-o", "-"], stdout=out, stderr=-1)
    assert r.returncode == 2 and (files / "u.gcodec").read_bytes() == payload


def test_bench_out_must_name_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user_error(capsys, "bench", "--quick", "--out", "", says="--out is empty")
    user_error(capsys, "bench", "--quick", "--out", "-", says="--out -")
    assert os.listdir(tmp_path) == []
    user_error(capsys, "bench", "--fractions", "dense", says="dense mode has no top-k to time")
    user_error(capsys, "bench", "--fractions", "0", says="dense mode has no top-k to time")


def test_a_missing_package_for_the_output_format_is_refused_before_decoding(files, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # (import torch raises ImportError)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    (files / "junk.gcodec").write_bytes(b"not a payload")  # (never read: the output is refused first)
    for out in ("d.pt", "d.safetensors"):
        err = user_error(capsys, "decompress", str(files / "junk.gcodec"), "-o", str(files / out), says=out)
        assert "needs" in err and not (files / out).exists()


def test_backend_is_taken_before_the_command_too(capsys):
    from gpu_codec.cli import main

    for argv in (["--backend", "emulated", "info"], ["info", "--backend", "emulated"]):
        assert main(argv) == 0
        assert "backend: emulated (forced by --backend emulated" in capsys.readouterr().out
    assert main(["--backend", "emulated", "info", "--backend", "cpu"]) == 0  # (the command's own wins)
    assert "backend: cpu (forced by --backend cpu)" in capsys.readouterr().out


def _npz_bytes(tmp_path, header: dict, data: bytes = b"") -> str:
    """An .npz of one member 'w.npy' whose .npy header is ``header`` (written as given) followed by ``data``."""
    text = repr(header).encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data
    path = tmp_path / f"h{len(os.listdir(tmp_path))}.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("w.npy", npy)
    return str(path)


@pytest.mark.parametrize(
    "shape, says",
    [
        ((2**40, 2**40, 0), "sizes multiply past 2^56"),
        ((10**3000, 10**3000), "sizes multiply past 2^56"),
        ((True, 4), "not all integers"),
        ((1,) * 40, "40 dimensions; at most 32 are read"),
        ((3, -4, -5), "negative size"),
    ],
)
def test_an_npy_header_with_an_impossible_shape_is_refused_before_anything_is_allocated(tmp_path, capsys, shape, says):
    path = _npz_bytes(tmp_path, {"descr": "<f4", "fortran_order": False, "shape": shape})
    err = user_error(capsys, "compress", path, "-o", str(tmp_path / "o"), says=says)
    assert len(err) < 300  # (a size of 3,000 digits is never printed)


def test_broken_zip_archives_are_one_line(files, capsys):
    good = (files / "new.npz").read_bytes()
    enc = bytearray(good)  # the encrypted flag, in the local header and the central directory
    enc[enc.find(b"PK\x03\x04") + 6] |= 1
    enc[enc.find(b"PK\x01\x02") + 8] |= 1
    (files / "enc.npz").write_bytes(bytes(enc))
    user_error(capsys, "compress", str(files / "enc.npz"), "-o", str(files / "o"), says="is encrypted")
    cd = bytearray(good)  # the central directory's offset past the end of the file
    end = cd.rfind(b"PK\x05\x06")
    cd[end + 16 : end + 20] = (0xFFFFFFFF).to_bytes(4, "little")
    (files / "cd.npz").write_bytes(bytes(cd))
    user_error(capsys, "compress", str(files / "cd.npz"), "-o", str(files / "o"), says="not a readable .npz archive")


def test_torch_views_that_repeat_their_storage_or_declare_huge_empty_shapes_are_refused(files, capsys):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.zeros(1).expand(1 << 20)}, files / "rep.pt")  # 4 MiB of values from 4 bytes
    user_error(capsys, "compress", str(files / "rep.pt"), "-o", str(files / "o"), says="repeats its storage's elements")
    torch.save({"w": torch.empty(2**62, 0)}, files / "empty.pt")
    user_error(capsys, "compress", str(files / "empty.pt"), "-o", str(files / "o"), says="multiply past 2^56")
    (files / "plain.pt").write_bytes(pickle.dumps({"w": 1}, protocol=2))
    user_error(capsys, "compress", str(files / "plain.pt"), "-o", str(files / "o"), says="a pickle that torch.save")
    assert not (files / "o").exists()


def test_running_out_of_memory_is_one_line(files, capsys, monkeypatch):
    from gpu_codec.cli import commands

    def hungry(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(commands, "read_checkpoint", hungry)
    user_error(capsys, "compress", str(files / "new.npz"), "-o", str(files / "o"), says="out of memory")
