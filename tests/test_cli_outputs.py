"""Command-line outputs never destroy anything: an input is never an output, an existing file is replaced only
with --force (atomically, keeping its mode), a symlink stays a symlink, devices and FIFOs are written through and
stay what they are, and ``-o -`` is stdout. Each case of the report that found the CLI replacing files is here."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

import gpu_codec
from gpu_codec.cli import main

PIPELINE = [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd()]


def refused(capsys, *argv: str, says: str = "") -> str:
    """Run the command; assert exit 2 with one line on stderr that contains ``says``."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    assert err.startswith("gpu-codec: error: ") and err.count("\n") == 1 and out == "", err
    assert says in err, err
    return err


def no_temporaries(folder) -> None:
    assert not [n for n in os.listdir(folder) if n.startswith(".gpu-codec-")]


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    np.savez(tmp_path / "base.npz", **base)
    np.savez(tmp_path / "new.npz", **new)
    (tmp_path / "u.gcodec").write_bytes(gpu_codec.compress(new, base, fraction=0.5, pipeline=PIPELINE).to_bytes())
    return tmp_path


def expected_payload(files) -> bytes:
    with np.load(files / "new.npz") as n, np.load(files / "base.npz") as b:
        new, base = {k: n[k] for k in n.files}, {k: b[k] for k in b.files}
    return gpu_codec.compress(new, base, pipeline=PIPELINE).to_bytes()


def test_an_input_is_never_the_output_whatever_its_name(files, capsys):
    base, u = files / "base.npz", files / "u.gcodec"
    before_base, before_u = base.read_bytes(), u.read_bytes()
    os.symlink(base, files / "link.npz")
    os.link(base, files / "hard.npz")
    dotted = os.path.join(str(files), ".", "base.npz")
    for out in (str(base), str(files / "link.npz"), str(files / "hard.npz"), dotted):
        for force in ([], ["--force"]):  # --force replaces an existing file, never an input
            refused(
                capsys, "compress", str(files / "new.npz"), str(base), "-o", out, *force, says="same file as the input"
            )
    for force in ([], ["--force"]):
        refused(capsys, "apply", str(base), str(u), "-o", str(u), *force, says="same file as the input")
        refused(capsys, "decompress", str(u), "--base", str(base), "-o", str(base), *force, says="same file")
    assert base.read_bytes() == before_base and u.read_bytes() == before_u
    assert os.path.islink(files / "link.npz")
    no_temporaries(files)


def test_an_existing_file_is_replaced_only_with_force_keeping_its_mode(files, capsys):
    out = files / "out.gcodec"
    out.write_bytes(b"precious")
    os.chmod(out, 0o640)
    refused(capsys, "compress", str(files / "new.npz"), str(files / "base.npz"), "-o", str(out), says="--force")
    assert out.read_bytes() == b"precious"
    ino = os.stat(out).st_ino
    assert main(["compress", str(files / "new.npz"), str(files / "base.npz"), "-o", str(out), "--force", "-q"]) == 0
    capsys.readouterr()
    assert out.read_bytes() == expected_payload(files)
    st = os.stat(out)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_ino != ino  # a new file put in place, with the old mode
    no_temporaries(files)


def test_a_read_only_file_stays_read_only(files, capsys):
    out = files / "model.npz"
    out.write_bytes(b"read-only")
    os.chmod(out, 0o444)
    argv = ["apply", str(files / "base.npz"), str(files / "u.gcodec"), "-o", str(out)]
    refused(capsys, *argv, says="exists (read-only); pass --force")
    assert out.read_bytes() == b"read-only"
    assert main([*argv, "-f"]) == 0
    capsys.readouterr()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o444
    with np.load(out) as z:
        assert sorted(z.files) == ["b", "w"]


def test_a_new_file_gets_the_usual_mode_and_is_never_half_written(files, capsys):
    out = files / "new.gcodec"
    assert main(["compress", str(files / "new.npz"), "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask
    # a write that fails leaves nothing: no temporary, and an existing file as it was
    blob = gpu_codec.compress({"__metadata__": np.ones(2, np.float32)}, fraction=1.0).to_bytes()
    (files / "meta.gcodec").write_bytes(blob)
    (files / "m.safetensors").write_bytes(b"old")
    args = ("decompress", str(files / "meta.gcodec"), "-o", str(files / "m.safetensors"), "--force")
    refused(capsys, *args, says="reserved")
    assert (files / "m.safetensors").read_bytes() == b"old"
    no_temporaries(files)


def test_a_symlink_is_never_replaced_by_a_regular_file(files, capsys):
    target = files / "real.gcodec"
    target.write_bytes(b"old")
    link = files / "link.gcodec"
    os.symlink(target, link)
    argv = ["compress", str(files / "new.npz"), str(files / "base.npz"), "-o", str(link)]
    refused(capsys, *argv, says="symbolic link to an existing file")
    assert main([*argv, "--force", "-q"]) == 0
    capsys.readouterr()
    assert os.path.islink(link) and os.readlink(link) == str(target)  # the link stays; its file is replaced
    assert target.read_bytes() == expected_payload(files)
    os.symlink(files / "nowhere", files / "dangling.gcodec")
    refused(capsys, "compress", str(files / "new.npz"), "-o", str(files / "dangling.gcodec"), "-f", says="missing")
    assert os.path.islink(files / "dangling.gcodec") and not (files / "nowhere").exists()
    no_temporaries(files)


def through_fifo(fifo, argv: list[str]) -> tuple[int, bytes]:
    """Make a FIFO, run the command with a reader on the other end; (exit status, bytes read)."""
    os.mkfifo(fifo)
    got: list[bytes] = []

    def reader() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc = main(argv)
    if not got and t.is_alive():  # the command never opened the FIFO: release the reader
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    t.join(timeout=60)
    return rc, got[0] if got else b""


def test_a_fifo_is_written_through(files, capsys):
    fifo = files / "pipe"
    rc, got = through_fifo(fifo, ["compress", str(files / "new.npz"), str(files / "base.npz"), "-o", str(fifo), "-q"])
    assert rc == 0 and got == expected_payload(files)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    no_temporaries(files)


def device(tmp_path, real: str) -> str:
    """A character device node with the numbers of ``real`` (``/dev/null``, ``/dev/full``) in ``tmp_path`` where
    this process may make one (a mistake then replaces only that node), else ``real`` itself."""
    if not os.path.exists(real) or not stat.S_ISCHR(os.stat(real).st_mode):
        pytest.skip(f"{real} is not a character device here")
    path = tmp_path / os.path.basename(real)
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.stat(real).st_rdev)
        os.close(os.open(path, os.O_WRONLY))  # a nodev mount refuses to open it
        return str(path)
    except OSError:
        if path.exists():
            path.unlink()
        return real


@pytest.mark.parametrize("cmd", ["compress", "apply", "decompress"])
def test_dev_null_stays_a_device(files, capsys, cmd):
    null = device(files, "/dev/null")
    argv = {
        "compress": ["compress", str(files / "new.npz"), str(files / "base.npz")],
        "apply": ["apply", str(files / "base.npz"), str(files / "u.gcodec")],
        "decompress": ["decompress", str(files / "u.gcodec"), "--format", "safetensors"],
    }[cmd]
    assert main([*argv, "-o", null, "-q"]) == 0
    capsys.readouterr()
    for path in {null, "/dev/null"}:
        assert stat.S_ISCHR(os.lstat(path).st_mode), path


def test_dev_full_is_a_clean_error_and_stays_a_device(files, capsys):
    full = device(files, "/dev/full")
    err = refused(capsys, "compress", str(files / "new.npz"), "-o", full, says="No space left on device")
    assert full in err
    refused(capsys, "apply", str(files / "base.npz"), str(files / "u.gcodec"), "-o", full, says="No space left")
    for path in {full, "/dev/full"}:
        assert stat.S_ISCHR(os.lstat(path).st_mode), path


def test_what_is_never_written(files, capsys):
    (files / "dir.npz").mkdir()
    refused(capsys, "apply", str(files / "base.npz"), str(files / "u.gcodec"), "-o", str(files / "dir.npz"), "-f")
    import socket

    sock_path = files / "s.gcodec"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        refused(capsys, "compress", str(files / "new.npz"), "-o", str(sock_path), "-f", says="not a regular file")
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    refused(capsys, "compress", str(files / "new.npz"), "-o", str(files / "u.gcodec" / "x"), says="u.gcodec")


def test_decompress_to_a_device_needs_a_format(files, capsys):
    refused(capsys, "decompress", str(files / "u.gcodec"), "-o", "/dev/null", says="--format")


def test_bench_refuses_to_replace_its_results_without_force(files, capsys):
    out = files / "bench"
    out.mkdir()
    (out / "bench.json").write_text("{}")
    refused(capsys, "bench", "--quick", "--no-plot", "--out", str(out), says="--force")
    assert (out / "bench.json").read_text() == "{}"


def run_cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="default", FLWR_TELEMETRY_ENABLED="0")
    pipes = {"stderr": subprocess.PIPE} if "stdout" in kw else {"capture_output": True}
    return subprocess.run(
        [sys.executable, "-m", "gpu_codec.cli", *argv], check=False, timeout=120, env=env, **pipes, **kw
    )


def test_dash_is_stdout_for_payloads_and_checkpoints(files):
    r = run_cli("compress", str(files / "new.npz"), str(files / "base.npz"), "-o", "-", cwd=files)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected_payload(files)  # the payload alone; the report went to stderr
    assert b"stdout" in r.stderr and not (files / "-").exists()
    r = run_cli("decompress", str(files / "u.gcodec"), "-o", "-", "--format", "npz", "--json", cwd=files)
    assert r.returncode == 0, r.stderr
    (files / "d.npz").write_bytes(r.stdout)
    want = gpu_codec.decompress((files / "u.gcodec").read_bytes())
    with np.load(files / "d.npz") as z:
        assert sorted(z.files) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(z[k], want[k])
    assert b'"format": "npz"' in r.stderr
    r = run_cli("decompress", str(files / "u.gcodec"), "-o", "-", cwd=files)
    assert r.returncode == 2 and b"--format" in r.stderr and r.stdout == b""
    assert not (files / "-").exists()


def test_binary_output_to_a_terminal_is_refused_without_force(files):
    import pty

    leader, follower = pty.openpty()
    try:
        r = run_cli("compress", str(files / "new.npz"), "-o", "-", stdout=follower, cwd=files)
    finally:
        os.close(follower)
        os.close(leader)
    assert r.returncode == 2 and b"terminal" in r.stderr and r.stderr.count(b"\n") == 1
    assert not (files / "-").exists()


def test_a_fifo_named_like_a_checkpoint_gets_that_format(files, capsys):
    fifo = files / "delta.npz"
    rc, got = through_fifo(fifo, ["decompress", str(files / "u.gcodec"), "-o", str(fifo), "-q"])
    assert rc == 0
    (files / "copy.npz").write_bytes(got)
    with np.load(files / "copy.npz") as z:
        assert sorted(z.files) == ["b", "w"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _big_payload(folder) -> str:
    """A dense payload of 64 MiB of output: a decompress that writes for a while."""
    rng = np.random.default_rng(1)
    path = folder / "big.gcodec"
    path.write_bytes(
        gpu_codec.compress({"w": rng.standard_normal(1 << 24).astype(np.float32)}, fraction=None).to_bytes()
    )
    return str(path)


def test_stdout_closed_early_is_an_error_not_a_short_success(files):
    """A reader that takes a few bytes and closes the pipe: the command fails (a buffered write could stop short
    and report success with the output cut)."""
    big = _big_payload(files)
    env = dict(os.environ, PYTHONWARNINGS="default", FLWR_TELEMETRY_ENABLED="0")
    argv = [sys.executable, "-m", "gpu_codec.cli", "decompress", big, "-o", "-", "--format", "npz"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=files) as p:
        assert len(p.stdout.read(10)) == 10
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=120) != 0, err
    assert b"stdout: 1 tensor" not in err and b"Traceback" not in err


def test_sigterm_leaves_no_temporary_file_behind(files):
    """``kill`` (SIGTERM) while the output is written: exit 143, one line, no temporary and no output file."""
    import signal
    import time

    big = _big_payload(files)
    env = dict(os.environ, PYTHONWARNINGS="default", FLWR_TELEMETRY_ENABLED="0")
    argv = [sys.executable, "-m", "gpu_codec.cli", "decompress", big, "-o", str(files / "out.npz")]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=files) as p:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not [n for n in os.listdir(files) if n.startswith(".gpu-codec-")]:
            time.sleep(0.005)  # (until the temporary file exists: the output is being written)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    if p.returncode == 0:  # (it finished first: the output is whole and nothing else is there)
        assert (files / "out.npz").exists()
    else:
        assert p.returncode == 143 and err == b"gpu-codec: error: terminated\n", (p.returncode, err)
        assert not (files / "out.npz").exists()
    no_temporaries(files)


def test_an_output_named_as_a_folder_is_refused_before_any_work(files, capsys):
    """``-o out/`` (a folder that does not exist) is refused up front; before, the command compressed first and
    then failed naming its temporary file."""
    refused(
        capsys,
        "compress",
        str(files / "new.npz"),
        str(files / "base.npz"),
        "-o",
        str(files / "out") + "/",
        says="names a folder",
    )
    assert not (files / "out").exists()
    no_temporaries(files)
