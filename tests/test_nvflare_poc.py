"""The digits job in NVIDIA FLARE's POC mode: a server process and one process per site, NVFlare's own transport
(mutual TLS) on 127.0.0.1, the job submitted through the admin API (``examples/nvflare/poc.py``, run as a
process). One site's payloads are damaged every round; the server must drop them and finish every round with
the others."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("nvflare")
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nvflare"
FRACTION = 0.1
ROUNDS = 3
TIMEOUT_S = 240


def kill_groups(pids: dict[str, int]) -> None:
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def test_digits_job_in_poc_mode(tmp_path):
    ws, result = tmp_path / "poc", tmp_path / "result.json"
    cmd = [sys.executable, str(EXAMPLE / "poc.py"), "--workspace", str(ws), "--rounds", str(ROUNDS)]
    cmd += ["--fraction", str(FRACTION), "--damaged-site", "--timeout", "180", "--result", str(result)]
    # nvflare's CLI keeps its config under ~/.nvflare
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # poc.py stops its server and clients on SIGTERM
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pids_file = ws / "pids.json"
        pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
        alive = []
        for name, pid in pids.items():
            try:
                os.killpg(pid, 0)
                alive.append(name)
            except ProcessLookupError:
                pass
        kill_groups(pids)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert alive == [], f"still running after the example ended: {alive}"
    res = json.loads(result.read_text())
    assert res["status"] == "FINISHED:COMPLETED"
    assert set(res["exit_codes"]) == {"server", "site-1", "site-2", "site-3", "site-4"}

    honest, damaged = ["site-1", "site-2", "site-3"], "site-4"
    sizes = res["sizes"]
    up = {(s["site"], s["round"]): s for s in sizes if s["label"] == "up"}
    assert set(up) == {(site, r) for site in [*honest, damaged] for r in range(ROUNDS)}
    server_in = {(s["peer"], s["round"]): s for s in sizes if s["label"] == "server_in"}
    for site in honest:
        for r in range(ROUNDS):
            assert server_in[(site, r)]["rc"] == "OK"
            assert server_in[(site, r)]["filters"][-1] == "UpdateDecompressor"
    # the damaged site is dropped every round, and each round goes on with the other three
    assert [server_in[(damaged, r)]["rc"] for r in range(ROUNDS)] == ["TASK_RESULT_FILTER_ERROR"] * ROUNDS
    log = pathlib.Path(res["server_log"]).read_text(encoding="utf-8")
    assert log.count(f"gpu_codec: rejected the train result of {damaged}") == ROUNDS
    assert log.count("Aggregated 3/4 results") == ROUNDS

    # the updates on the wire (serialized shareables, site to server) are a tenth of the dense fp32 update
    dense = 4 * (64 * 256 + 256 + 256 * 10 + 10)  # the digits MLP's 19,466 parameters
    on_wire = np.mean([up[(site, r)]["bytes"] for site in honest for r in range(ROUNDS)])
    assert on_wire * (1 / FRACTION) <= dense, (on_wire, dense)
    down = [s["bytes"] for s in sizes if s["label"] == "down"]
    assert len(down) == 4 * ROUNDS and max(down) * 1.8 <= dense  # fp16 + zstd on the way down
    assert res["accuracy"] >= 0.85
