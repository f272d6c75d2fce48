"""Bytes and wall time per round of the digits FedAvg job in NVIDIA FLARE's simulator, in one run:

* ``none``: no filter;
* ``fp16``: NVFlare's own ``ModelQuantizer`` / ``ModelDequantizer`` (float16), both directions;
* ``gpu_codec``: ``UpdateCompressor`` (top-k of each update, fp16 values, Rice indices, zstd; error feedback)
  with ``UpdateDecompressor``, and ``ModelCompressor`` / ``ModelDecompressor`` (fp16 + zstd) for the global model.

Bytes are the sizes of the serialized shareables (NVFlare's FOBS, measured by ``gpu_codec.nvflare.SizeMeter`` last
in each filter chain): ``up`` from each client to the server, ``down`` from the server to each client.
Wall time per round: from the first global model sent in a round to the first sent in the next (the first round
also holds each client's start-up: importing torch, loading the data); the job's whole simulator time besides.

    python benchmarks/bench_nvflare.py --rounds 5 --out benchmarks/results/nvflare.json

Needs the ``nvflare`` extra, torch, and bitsandbytes (for ``ModelQuantizer``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _job_module():
    spec = importlib.util.spec_from_file_location("gpu_codec_example_nvflare_job", ROOT / "examples/nvflare/job.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def round_times(sizes: list[dict], rounds: int) -> list[float]:
    """Seconds from the first model sent in round r to the first sent in round r + 1 (the last round: to its
    last update received), from the SizeMeter timestamps."""
    starts = [min(s["time"] for s in sizes if s["label"] == "down" and s["round"] == r) for r in range(rounds)]
    end = max(s["time"] for s in sizes if s["label"] == "server_in" and s["round"] == rounds - 1)
    return [b - a for a, b in zip(starts, [*starts[1:], end])]


def summarize(res: dict, rounds: int, n_sites: int) -> dict:
    up = [s["bytes"] for s in res["sizes"] if s["label"] == "up"]
    down = [s["bytes"] for s in res["sizes"] if s["label"] == "down"]
    per_round = round_times(res["sizes"], rounds)
    return {
        "accuracy": round(res["accuracy"], 4),
        "up_bytes_per_update": round(statistics.mean(up)),
        "down_bytes_per_model": round(statistics.mean(down)),
        "bytes_per_round": round((sum(up) + sum(down)) / rounds),
        "round_s": [round(t, 2) for t in per_round],
        "round_s_median_after_first": round(statistics.median(per_round[1:]), 2),
        "job_wall_s": round(res["wall_s"], 2),
        "updates": len(up),
        "expected_updates": rounds * n_sites,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--modes", default="none,fp16,gpu_codec")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/nvflare.json"))
    a = ap.parse_args()

    job = _job_module()
    results = {}
    with tempfile.TemporaryDirectory() as ws:
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            res = job.run(mode, os.path.join(ws, mode), n_sites=a.sites, rounds=a.rounds, fraction=a.fraction)
            results[mode] = summarize(res, a.rounds, a.sites)
            print(mode, results[mode], f"({time.perf_counter() - t0:.1f} s with job export)", flush=True)
    base = results.get("none")
    if base:
        for r in results.values():
            r["up_ratio_vs_none"] = round(base["up_bytes_per_update"] / r["up_bytes_per_update"], 2)
            r["down_ratio_vs_none"] = round(base["down_bytes_per_model"] / r["down_bytes_per_model"], 2)
    import nvflare
    import torch

    import gpu_codec

    out = {
        "job": "examples/nvflare/job.py: FedAvg, digits MLP 64-256-10 (19,466 fp32 parameters), "
        f"{a.sites} clients, {a.rounds} rounds, 2 local epochs",
        "gpu_codec_config": {"fraction": a.fraction, "up_pipeline": job.UP_PIPELINE, "down": "fp16 + zstd"},
        "backend": gpu_codec.backend_info() if hasattr(gpu_codec, "backend_info") else None,
        "versions": {"nvflare": nvflare.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "results": results,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2, default=str)
        f.write("\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
