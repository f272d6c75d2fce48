"""The digits FedAvg job with gpu_codec filters, run in NVFlare's simulator.

    python examples/nvflare/job.py --mode gpu_codec --workspace /tmp/nvflare_digits

``--mode``: ``none`` (no filter), ``gpu_codec`` (top-k of each client's update through fp16 + Rice + zstd, error
feedback, and the global model down as fp16 + zstd) or ``fp16`` (NVFlare's own ``ModelQuantizer`` /
``ModelDequantizer``, which import bitsandbytes). Every mode puts a :class:`gpu_codec.nvflare.SizeMeter` last in
each chain, so the sizes of the serialized shareables land in ``<workspace>/sizes.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from digits_client import accuracy, load_split, make_model  # noqa: E402

UP_PIPELINE = [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}]


def build_job(
    mode: str = "gpu_codec",
    *,
    n_sites: int = 3,
    rounds: int = 3,
    epochs: int = 2,
    fraction: float = 0.1,
    sizes_path: str | None = None,
    extra_sites: dict[str, list[Any]] | None = None,
) -> Any:
    """A FedJob: FedAvg over ``n_sites`` clients for ``rounds`` rounds, with the filters of ``mode``.

    ``extra_sites`` maps a further site name to extra task-result filters run after its compressor (the
    tests use it for a site that sends a corrupt payload)."""
    import torch
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.app_opt.pt.job_config.model import PTModel
    from nvflare.client.config import TransferType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType
    from nvflare.job_config.script_runner import ScriptRunner

    from gpu_codec import nvflare as gcf

    torch.manual_seed(0)
    sites = [f"site-{i + 1}" for i in range(n_sites)] + list(extra_sites or {})
    job = FedJob(name=f"digits_{mode}", min_clients=len(sites))
    if hasattr(job, "set_app_packages"):
        job.set_app_packages(["gpu_codec"])  # installed on every site: not copied into the job's custom code
    job.to_server(FedAvg(num_clients=len(sites), num_rounds=rounds, ignore_result_error=True))
    job.to_server(PTModel(make_model()))

    def meter(label: str) -> Any:
        return gcf.SizeMeter(path=sizes_path, label=label)

    if mode == "gpu_codec":
        job.to_server(gcf.ModelCompressor(), filter_type=FilterType.TASK_DATA, tasks=["train"])
        job.to_server(gcf.UpdateDecompressor(), filter_type=FilterType.TASK_RESULT, tasks=["train"])
    elif mode == "fp16":
        from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
        from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

        job.to_server(ModelQuantizer("float16"), filter_type=FilterType.TASK_DATA, tasks=["train"])
        job.to_server(ModelDequantizer(), filter_type=FilterType.TASK_RESULT, tasks=["train"])
    elif mode != "none":
        raise ValueError(f"mode must be none, gpu_codec or fp16, got {mode!r}")
    job.to_server(meter("down"), filter_type=FilterType.TASK_DATA, tasks=["train"])
    job.to_server(meter("server_in"), filter_type=FilterType.TASK_RESULT, tasks=["train"])

    for site in sites:
        runner = ScriptRunner(
            script=os.path.join(HERE, "digits_client.py"),
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
        for f in (extra_sites or {}).get(site, []):
            job.to(f, site, filter_type=FilterType.TASK_RESULT, tasks=["train"])
        job.to(meter("up"), site, filter_type=FilterType.TASK_RESULT, tasks=["train"])
    return job


def final_model_path(workspace: str) -> str:
    """Where the server's persistor saved the last global model (``torch.save`` of ``{"model": state_dict}``)."""
    for root, _, files in os.walk(workspace):
        if "FL_global_model.pt" in files and os.sep + "server" in root:
            return os.path.join(root, "FL_global_model.pt")
    raise FileNotFoundError(f"no FL_global_model.pt under {workspace}/server")


def final_accuracy(workspace: str) -> float:
    """Test accuracy of the final global model on the held-out digits."""
    import torch

    ckpt = torch.load(final_model_path(workspace), map_location="cpu", weights_only=True)
    model = make_model()
    model.load_state_dict(ckpt["model"])
    x, y = load_split(None, 1)
    return accuracy(model, x, y)


def read_sizes(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run(mode: str, workspace: str, **kw: Any) -> dict[str, Any]:
    """Build and run the job in the simulator (one thread per client); returns accuracy, wall time, sizes."""
    os.makedirs(workspace, exist_ok=True)
    sizes_path = os.path.join(workspace, "sizes.jsonl")
    if os.path.exists(sizes_path):
        os.remove(sizes_path)
    job = build_job(mode, sizes_path=sizes_path, **kw)
    n = len(job.clients) if hasattr(job, "clients") and job.clients else kw.get("n_sites", 3)
    t0 = time.perf_counter()
    job.simulator_run(workspace, threads=n)
    wall = time.perf_counter() - t0
    return {"mode": mode, "wall_s": wall, "accuracy": final_accuracy(workspace), "sizes": read_sizes(sizes_path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="gpu_codec", choices=["none", "gpu_codec", "fp16"])
    ap.add_argument("--workspace", default="/tmp/nvflare_digits")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.1)
    a = ap.parse_args()
    res = run(a.mode, os.path.join(a.workspace, a.mode), n_sites=a.sites, rounds=a.rounds, fraction=a.fraction)
    up = [s["bytes"] for s in res["sizes"] if s["label"] == "up"]
    print(
        f"{a.mode}: accuracy {res['accuracy']:.4f}, {sum(up) / max(1, len(up)):.0f} bytes per client update, "
        f"{res['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
