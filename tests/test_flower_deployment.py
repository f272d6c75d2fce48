"""``examples/flower`` on Flower's deployment engine: a ``flower-superlink`` process, three ``flower-supernode``
processes (one damaging its compressed replies) and ``flwr run``, all insecure on 127.0.0.1, with runtime
dependency installation off so that Flower installs nothing. Asserts the bytes on the wire, the accuracy, and that
the damaged node is dropped every round while the rounds go on with the others."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import distribution

import pytest

pytest.importorskip("flwr")
pytest.importorskip("torch")

APP = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flower"
ROUNDS = 3
NODES = 3  # partitions 0 and 1 honest, 2 damaged
DEADLINE_S = 150


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def flwr_bin(where: pathlib.Path) -> pathlib.Path:
    """Flower's commands run by this interpreter: the SuperLink and SuperNodes start ``flwr-serverapp`` and
    ``flwr-clientapp`` by name, and they must import this environment's gpu_codec."""
    where.mkdir()
    for ep in distribution("flwr").entry_points:
        if ep.group != "console_scripts":
            continue
        module, attr = ep.value.split(":")
        script = where / ep.name
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {attr}\nsys.exit({attr}())\n")
        script.chmod(0o755)
    return where


def wait_port(port: int, procs: list[subprocess.Popen], deadline: float) -> None:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a Flower process exited before the SuperLink listened")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def test_flower_deployment_engine(tmp_path):
    link, *node_ports = free_ports(1 + NODES)  # one SuperLink port: its Fleet, Control and Runtime HTTP APIs
    home = tmp_path / "flwr_home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "PATH": f"{flwr_bin(tmp_path / 'bin')}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(home),
        "HOME": str(tmp_path),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONWARNINGS": "ignore",
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(
                cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(p)
        return p

    result = tmp_path / "result.json"
    deadline = time.monotonic() + DEADLINE_S
    t0 = time.monotonic()
    try:
        start(
            "superlink",
            ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
             "--port", str(link)],
        )  # fmt: skip
        wait_port(link, procs, deadline)
        for i, port in enumerate(node_ports):
            node_config = f"partition-id={i} num-partitions={NODES}" + (" damaged=true" if i == NODES - 1 else "")
            start(
                f"supernode-{i}",
                ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}", "--host", "127.0.0.1",
                 "--port", str(port), "--node-config", node_config],
            )  # fmt: skip
        run_config = f"num-server-rounds={ROUNDS} min-nodes={NODES} result-file='{result}'"
        run = subprocess.run(
            ["flwr", "run", str(APP), "test", "--run-config", run_config, "--stream"],
            check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(f"deployment run: {time.monotonic() - t0:.1f} s")
    assert result.exists(), (logs / "superlink.log").read_text(errors="replace")[-3000:]
    out = json.loads(result.read_text())

    up = [w for w in out["wire"] if w["dir"] == "up"]
    down = [w for w in out["wire"] if w["dir"] == "down"]
    assert len(down) == NODES * ROUNDS and len(up) == NODES * ROUNDS  # every node was asked, every round
    # the damaged node (partition NODES - 1) is dropped every round; the others are aggregated
    dropped = [w for w in up if "dropped" in w]
    assert [w["round"] for w in dropped] == list(range(1, ROUNDS + 1))
    assert {w["partition"] for w in dropped} == {NODES - 1}
    assert all("PayloadChecksumError" in w["dropped"] for w in dropped)
    honest = [w for w in up if "dropped" not in w]
    assert {w["partition"] for w in honest} == set(range(NODES - 1))
    # bytes on the wire: a reply (top-10 %) against the model it answers (dense fp32 + zstd, lossless)
    dense = 4 * (32 * 64 + 64 + 64 * 10 + 10)
    assert max(w["bytes"] for w in honest) * 4 <= dense, (honest, dense)
    assert min(w["bytes"] for w in down) >= dense * 0.8
    # the model learned with one node of three dropped every round
    assert len(out["accuracy"]) == ROUNDS + 1 and out["accuracy"][0] < 0.2
    assert out["accuracy"][-1] >= 0.9, out["accuracy"]
