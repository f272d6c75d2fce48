"""The digits job in NVFlare's POC mode: a server and one process per site on this machine, talking over NVFlare's
own network transport (mutual TLS) on the loopback interface, the job submitted through the admin API.

    python examples/nvflare/poc.py --workspace /tmp/nvflare_poc [--mode gpu_codec] [--damaged-site] [--port 8002]

What it does, step by step (each step a function below, to copy into a deployment script):

1. ``prepare``: ``nvflare poc prepare`` with a project file naming the sites and the port, into
   ``NVFLARE_POC_WORKSPACE``; the server is then told to listen on 127.0.0.1 only.
2. ``allow``: each site's ``local/resources.json`` gets ``gpu_codec.nvflare`` in its ``class_allow_list``.
   A job that ships no custom code may only name allow-listed classes, and NVFlare's default list holds only
   NVFlare's own: without this step such a job fails at start with "Component 'gpu_codec.nvflare...' is not in
   allow_list". (This job ships its training script as custom code, which NVFlare checks by its BYOC
   authorization instead.)
3. ``start``: the server and each client as processes (each in its own process group), as their
   ``startup/start.sh`` would, logs in ``<site>/poc.log``.
4. ``submit``: the job (``job.py``'s ``build_job``, exported) submitted with the admin API, followed until it ends.
5. ``stop``: the system shut down through the admin API, then every process group still alive ended.

gpu_codec must be installed on every site (here: in the Python running this script).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import job as digits_job  # noqa: E402

ADMIN = "admin@nvidia.com"
ALLOW = "gpu_codec.nvflare"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Poc:
    """A prepared POC system: where each party's startup kit is, and the processes once started."""

    workspace: str
    prod_dir: str
    sites: list[str]
    port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def kit(self, name: str) -> str:
        return os.path.join(self.prod_dir, name)


def prepare(workspace: str, sites: list[str], port: int, env: dict[str, str] | None = None) -> Poc:
    """``nvflare poc prepare`` for ``sites``, the server on ``port`` of 127.0.0.1, ``gpu_codec.nvflare``
    allow-listed on every site, in ``<workspace>/poc`` (which must not exist)."""
    if os.path.exists(os.path.join(workspace, "poc")):
        raise SystemExit(f"{workspace}/poc exists: give a new workspace (nothing there is overwritten)")
    os.makedirs(workspace, exist_ok=True)
    project = {
        "api_version": 3,
        "name": "digits",
        "description": "gpu_codec digits job, POC",
        "participants": [
            {"name": "server", "type": "server", "org": "nvidia", "fed_learn_port": port, "admin_port": port},
            {"name": ADMIN, "type": "admin", "org": "nvidia", "role": "project_admin"},
            *({"name": s, "type": "client", "org": "nvidia"} for s in sites),
        ],
        "builders": [
            {"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder"},
            {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
            {"path": "nvflare.lighter.impl.cert.CertBuilder"},
            {"path": "nvflare.lighter.impl.signature.SignatureBuilder"},
        ],
    }
    project_file = os.path.join(workspace, "project_input.yml")
    with open(project_file, "w", encoding="utf-8") as f:
        json.dump(project, f)  # JSON is YAML
    poc_dir = os.path.join(workspace, "poc")
    env = {**os.environ, **(env or {}), "NVFLARE_POC_WORKSPACE": poc_dir}
    subprocess.run(
        [sys.executable, "-m", "nvflare.cli", "poc", "prepare", "-i", project_file, "--force"],  # nvflare poc prepare
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=120,
    )
    poc = Poc(workspace, os.path.join(poc_dir, "digits", "prod_00"), list(sites), port)
    server_conf = os.path.join(poc.kit("server"), "startup", "fed_server.json")
    with open(server_conf, encoding="utf-8") as f:
        conf = json.load(f)
    for server in conf["servers"]:  # listen on the loopback interface only (the kit names the host "server")
        server["service"]["target"] = f"127.0.0.1:{port}"
        server["admin_server"] = "127.0.0.1"
    with open(server_conf, "w", encoding="utf-8") as f:
        json.dump(conf, f, indent=2)
    for name in ["server", *sites]:
        allow(poc.kit(name), [ALLOW])
    return poc


def allow(kit_dir: str, classes: list[str]) -> None:
    """Add ``classes`` (class paths or module prefixes) to the ``class_allow_list`` of
    ``<kit_dir>/local/resources.json`` (made from ``resources.json.default`` when it does not exist yet)."""
    local = os.path.join(kit_dir, "local")
    path = os.path.join(local, "resources.json")
    source = path if os.path.exists(path) else path + ".default"
    with open(source, encoding="utf-8") as f:
        resources = json.load(f)
    allowed = resources.setdefault("class_allow_list", [])
    allowed += [c for c in classes if c not in allowed]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(resources, f, indent=2)


def start(poc: Poc, env: dict[str, str] | None = None) -> None:
    """The server, then each client, as processes in their own process groups."""
    env = {**os.environ, **(env or {})}

    def launch(name: str, module: str, conf: str, extra: list[str]) -> None:
        kit = poc.kit(name)
        log = open(os.path.join(kit, "poc.log"), "ab")  # noqa: SIM115 - the process owns it
        cmd = [sys.executable, "-u", "-m", module, "-m", kit, "-s", conf, "--set", "secure_train=true"]
        cmd += [*extra, "org=nvidia", "config_folder=config"]
        poc.procs[name] = subprocess.Popen(
            cmd, cwd=kit, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    launch("server", "nvflare.private.fed.app.server.server_train", "fed_server.json", [])
    for site in poc.sites:
        launch(site, "nvflare.private.fed.app.client.client_train", "fed_client.json", [f"uid={site}"])
    with open(os.path.join(poc.workspace, "pids.json"), "w", encoding="utf-8") as f:  # each a process group
        json.dump({name: p.pid for name, p in poc.procs.items()}, f)


def connect_admin(poc: Poc, timeout: float = 90.0) -> Any:
    """An admin connection, once the server listens and every client has registered."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    deadline = time.monotonic() + timeout

    def check_alive() -> None:
        for name, p in poc.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; see {poc.kit(name)}/poc.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the POC system did not come up in {timeout:.0f} s; see {poc.prod_dir}/*/poc.log")

    while True:  # one admin connection attempt only once the port answers: a failed one leaves state behind
        check_alive()
        try:
            socket.create_connection(("127.0.0.1", poc.port), timeout=1.0).close()
            break
        except OSError:
            time.sleep(0.5)
    sess = new_secure_session(ADMIN, poc.kit(ADMIN), timeout=max(5.0, deadline - time.monotonic()))
    while True:
        if set(poc.sites) <= {c.name for c in sess.get_system_info().client_info}:
            return sess
        try:
            check_alive()
        except BaseException:
            sess.close()
            raise
        time.sleep(1.0)


def submit(sess: Any, job_dir: str, timeout: float) -> tuple[str, dict]:
    """Submit the job in ``job_dir``, wait until it ends (at most ``timeout`` seconds); its id and meta."""
    from nvflare.fuel.flare_api.api_spec import MonitorReturnCode

    job_id = sess.submit_job(job_dir)
    rc, meta = sess.monitor_job_and_return_job_meta(job_id, timeout=timeout, poll_interval=1.0)
    if rc != MonitorReturnCode.JOB_FINISHED:
        raise TimeoutError(f"job {job_id} did not finish in {timeout:.0f} s ({rc})")
    return job_id, meta or {}


def stop(poc: Poc, sess: Any = None, grace: float = 20.0) -> None:
    """Shut the system down (through the admin API when connected), then end every process group still alive."""
    if sess is not None:
        with contextlib.suppress(Exception):
            sess.shutdown_system()
        with contextlib.suppress(Exception):
            sess.close()
    deadline = time.monotonic() + grace
    for p in poc.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for p in poc.procs.values():  # the job processes each site started are in the same group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                continue


def run(
    mode: str,
    workspace: str,
    *,
    port: int | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **job_kw: Any,
) -> dict[str, Any]:
    """Prepare, start, run the job, stop; returns the job's status, accuracy, sizes and wall time."""
    built = digits_job.build_job(mode, **job_kw)
    sites = sorted(built.clients) if getattr(built, "clients", None) else None
    n_sites = job_kw.get("n_sites", 3)
    sites = sites or [f"site-{i + 1}" for i in range(n_sites + (1 if job_kw.get("damaged_site") else 0))]
    if os.path.exists(workspace):
        raise SystemExit(f"{workspace} exists: give a new workspace (nothing there is overwritten)")
    jobs_dir = os.path.join(workspace, "jobs")
    digits_job.export(built, jobs_dir)
    job_dir = os.path.join(jobs_dir, built.name)
    poc = prepare(workspace, sites, port or free_port(), env)
    sess = None
    try:
        start(poc, env)
        sess = connect_admin(poc)
        t0 = time.perf_counter()
        job_id, meta = submit(sess, job_dir, timeout)
        wall = time.perf_counter() - t0
        result = server_result(sess, job_id, os.path.join(workspace, "results"))
    finally:
        stop(poc, sess)
    return {
        "mode": mode,
        "job_id": job_id,
        "status": meta.get("status"),
        "wall_s": wall,
        "accuracy": digits_job.final_accuracy(result),
        "sizes": digits_job.read_sizes(poc.prod_dir) + digits_job.read_sizes(result),
        "server_log": os.path.join(result, "log.txt"),
        "poc": poc,
    }


def server_result(sess: Any, job_id: str, destination: str) -> str:
    """The server's workspace of the job (its log, the final model, the server's size records), downloaded
    through the admin API into ``destination`` and unpacked; returns its directory."""
    import zipfile

    where = sess.download_job_result(job_id, destination=destination)
    out = os.path.join(destination, f"{job_id}_server")
    ws = os.path.join(where, "workspace")
    if os.path.isdir(ws):
        return ws
    if zipfile.is_zipfile(ws):  # some versions leave it packed
        with zipfile.ZipFile(ws) as z:
            z.extractall(out)
        return out
    raise FileNotFoundError(f"no server workspace in the job result {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="gpu_codec", choices=["none", "gpu_codec", "fp16"])
    ap.add_argument("--workspace", default="/tmp/nvflare_poc")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=digits_job.ROUNDS)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--damaged-site", action="store_true", help="one more site whose payloads are damaged")
    ap.add_argument("--port", type=int, default=None, help="the server's port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the job may take")
    ap.add_argument("--result", metavar="FILE", help="also write the outcome as JSON to FILE")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM still stops every process (finally)
    res = run(
        a.mode,
        a.workspace,
        port=a.port,
        n_sites=a.sites,
        rounds=a.rounds,
        fraction=a.fraction,
        damaged_site=a.damaged_site,
        timeout=a.timeout,
    )
    if a.result:
        out = {k: v for k, v in res.items() if k != "poc"}
        out["exit_codes"] = {name: p.returncode for name, p in res["poc"].procs.items()}
        with open(a.result, "x", encoding="utf-8") as f:
            json.dump(out, f)
    print(f"job {res['job_id']}: {res['status']}")
    print(digits_job.summary(res))


if __name__ == "__main__":
    main()
