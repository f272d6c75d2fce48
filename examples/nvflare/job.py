"""The digits FedAvg job with gpu_codec filters, run in NVFlare's simulator.

    python examples/nvflare/job.py --mode gpu_codec --workspace /tmp/nvflare_digits [--damaged-site]

``--mode``: ``none`` (no filter), ``gpu_codec`` (top-k of each client's update through fp16 + Rice + zstd, error
feedback, and the global model down as fp16 + zstd) or ``fp16`` (NVFlare's own ``ModelQuantizer`` /
``ModelDequantizer``, which import bitsandbytes: ``pip install bitsandbytes``). Every mode puts a
:class:`gpu_codec.nvflare.SizeMeter` last in each chain, writing ``sizes.jsonl`` in each site's run directory.
``--damaged-site`` adds one more site whose compressed updates ``faults.CorruptPayload`` damages every round.
The job holds no path of this machine: ``--export DIR`` writes it for ``nvflare job submit`` (see ``poc.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from digits_client import accuracy, load_split, make_model  # noqa: E402

UP_PIPELINE = [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}]
ROUNDS = 5  # the rounds of the README's table (benchmarks/bench_nvflare.py)
SIZES_FILE = "sizes.jsonl"  # relative: written in each site's run directory


@contextlib.contextmanager
def _here() -> Iterator[None]:
    """Build, export and run the job from this directory, so that the training script is named by a relative
    path (and copied into the job's custom code from here)."""
    cwd = os.getcwd()
    os.chdir(HERE)
    try:
        yield
    finally:
        os.chdir(cwd)


def check_mode(mode: str) -> None:
    if mode not in ("none", "gpu_codec", "fp16"):
        raise ValueError(f"mode must be none, gpu_codec or fp16, got {mode!r}")
    if mode == "fp16" and importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit(
            "--mode fp16 runs NVFlare's ModelQuantizer, which imports bitsandbytes: pip install bitsandbytes"
        )


def build_job(
    mode: str = "gpu_codec",
    *,
    n_sites: int = 3,
    rounds: int = ROUNDS,
    epochs: int = 2,
    fraction: float = 0.1,
    sizes_file: str | None = SIZES_FILE,
    damaged_site: bool = False,
    extra_sites: dict[str, list[Any]] | None = None,
) -> Any:
    """A FedJob: FedAvg over ``n_sites`` clients for ``rounds`` rounds, with the filters of ``mode``.

    ``damaged_site`` adds a site ``site-<n_sites + 1>`` whose compressed updates :class:`faults.CorruptPayload`
    damages (``gpu_codec`` mode only). ``extra_sites`` maps a further site name to extra task-result filters run
    after its compressor."""
    check_mode(mode)
    extra_sites = dict(extra_sites or {})
    if damaged_site:
        if mode != "gpu_codec":
            raise ValueError("damaged_site damages gpu_codec payloads: use it with mode='gpu_codec'")
        from faults import CorruptPayload

        extra_sites[f"site-{n_sites + 1}"] = [CorruptPayload()]
    with _here():
        return _build_job(mode, n_sites, rounds, epochs, fraction, sizes_file, extra_sites)


def _build_job(
    mode: str,
    n_sites: int,
    rounds: int,
    epochs: int,
    fraction: float,
    sizes_file: str | None,
    extra_sites: dict[str, list[Any]],
) -> Any:
    import torch
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.app_opt.pt.job_config.model import PTModel
    from nvflare.client.config import TransferType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType
    from nvflare.job_config.script_runner import ScriptRunner

    from gpu_codec import nvflare as gcf

    torch.manual_seed(0)
    sites = [f"site-{i + 1}" for i in range(n_sites)] + list(extra_sites)
    job = FedJob(name=f"digits_{mode}", min_clients=len(sites))
    if hasattr(job, "set_app_packages"):
        job.set_app_packages(["gpu_codec"])  # installed on every site: not copied into the job's custom code
    job.to_server(FedAvg(num_clients=len(sites), num_rounds=rounds, ignore_result_error=True))
    job.to_server(PTModel(make_model()))

    def meter(label: str) -> Any:
        return gcf.SizeMeter(output_file=sizes_file, label=label)

    if mode == "gpu_codec":
        job.to_server(gcf.ModelCompressor(), filter_type=FilterType.TASK_DATA, tasks=["train"])
        job.to_server(gcf.UpdateDecompressor(), filter_type=FilterType.TASK_RESULT, tasks=["train"])
    elif mode == "fp16":
        from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
        from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

        job.to_server(ModelQuantizer("float16"), filter_type=FilterType.TASK_DATA, tasks=["train"])
        job.to_server(ModelDequantizer(), filter_type=FilterType.TASK_RESULT, tasks=["train"])
    job.to_server(meter("down"), filter_type=FilterType.TASK_DATA, tasks=["train"])
    job.to_server(meter("server_in"), filter_type=FilterType.TASK_RESULT, tasks=["train"])

    for site in sites:
        runner = ScriptRunner(
            script="digits_client.py",  # relative: found in the job's custom code on each site
            script_args=f"--n-sites {n_sites} --epochs {epochs}",
            params_transfer_type=TransferType.DIFF,
        )
        job.to(runner, site)
        if mode == "gpu_codec":
            job.to(gcf.ModelDecompressor(), site, filter_type=FilterType.TASK_DATA, tasks=["train"])
            job.to(meter("client_in"), site, filter_type=FilterType.TASK_DATA, tasks=["train"])
            job.to(
                gcf.UpdateCompressor(fraction=fraction, pipeline=UP_PIPELINE),
                site,
                filter_type=FilterType.TASK_RESULT,
                tasks=["train"],
            )
        elif mode == "fp16":
            from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
            from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

            job.to(ModelDequantizer(), site, filter_type=FilterType.TASK_DATA, tasks=["train"])
            job.to(ModelQuantizer("float16"), site, filter_type=FilterType.TASK_RESULT, tasks=["train"])
        for f in extra_sites.get(site, []):
            job.to(f, site, filter_type=FilterType.TASK_RESULT, tasks=["train"])
        job.to(meter("up"), site, filter_type=FilterType.TASK_RESULT, tasks=["train"])
    return job


def export(job: Any, directory: str) -> None:
    """Write the job under ``directory`` (``<directory>/<job name>``), for ``nvflare job submit``."""
    directory = os.path.abspath(directory)
    with _here():
        job.export_job(directory)


def final_model_path(workspace: str) -> str:
    """Where the server's persistor saved the last global model (``torch.save`` of ``{"model": state_dict}``)."""
    for root, _, files in os.walk(workspace):
        if "FL_global_model.pt" in files and "server" in os.path.relpath(root, workspace):
            return os.path.join(root, "FL_global_model.pt")
    raise FileNotFoundError(f"no FL_global_model.pt of the server under {workspace}")


def final_accuracy(workspace: str) -> float:
    """Test accuracy of the final global model on the held-out digits."""
    import torch

    ckpt = torch.load(final_model_path(workspace), map_location="cpu", weights_only=True)
    model = make_model()
    model.load_state_dict(ckpt["model"])
    x, y = load_split(None, 1)
    return accuracy(model, x, y)


def read_sizes(root: str) -> list[dict]:
    """Every SizeMeter record under ``root`` (the ``sizes.jsonl`` of each site's run directory), oldest first."""
    out = []
    for where, _, files in os.walk(root):
        if SIZES_FILE in files:
            with open(os.path.join(where, SIZES_FILE), encoding="utf-8") as f:
                out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda r: r["time"])


def run(mode: str, workspace: str, **kw: Any) -> dict[str, Any]:
    """Build and run the job in the simulator (one thread per client); returns accuracy, wall time, sizes."""
    if os.path.exists(workspace) and os.listdir(workspace):
        raise SystemExit(f"{workspace} is not empty: give a new workspace (nothing there is overwritten)")
    os.makedirs(workspace, exist_ok=True)
    job = build_job(mode, **kw)
    n = len(job.clients) if hasattr(job, "clients") and job.clients else kw.get("n_sites", 3)
    t0 = time.perf_counter()
    workspace = os.path.abspath(workspace)
    with _here():
        job.simulator_run(workspace, threads=n)
    wall = time.perf_counter() - t0
    return {"mode": mode, "wall_s": wall, "accuracy": final_accuracy(workspace), "sizes": read_sizes(workspace)}


def summary(res: dict[str, Any]) -> str:
    up = [s["bytes"] for s in res["sizes"] if s["label"] == "up" and s["rc"] == "OK"]
    rejected = sorted({(s["peer"], s["round"]) for s in res["sizes"] if s["label"] == "server_in" and s["rc"] != "OK"})
    line = (
        f"{res['mode']}: accuracy {res['accuracy']:.4f}, {sum(up) / max(1, len(up)):.0f} bytes per client update, "
        f"{res['wall_s']:.1f} s"
    )
    if rejected:
        line += f"; rejected by the server: {', '.join(f'{p} round {r}' for p, r in rejected)}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="gpu_codec", choices=["none", "gpu_codec", "fp16"])
    ap.add_argument("--workspace", default="/tmp/nvflare_digits")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--damaged-site", action="store_true", help="one more site whose payloads are damaged")
    ap.add_argument("--export", metavar="DIR", help="write the job to DIR instead of running it")
    a = ap.parse_args()
    kw = {"n_sites": a.sites, "rounds": a.rounds, "fraction": a.fraction, "damaged_site": a.damaged_site}
    if a.export:
        export(build_job(a.mode, **kw), a.export)
        print(f"job written to {a.export}")
        return
    print(summary(run(a.mode, os.path.join(a.workspace, a.mode), **kw)))


if __name__ == "__main__":
    main()
