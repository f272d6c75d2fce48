"""Server-side aggregation of many clients' compressed updates: sparse (gpu_codec.aggregate) against
densify-then-average.

Each client's update is a top-k payload of one N-element tensor (default N = 1e7, 1 % kept). Two ways to get the
weighted mean, measured in the same run on the same payload bytes:

* **sparse**: :class:`gpu_codec.Aggregator`: decode each payload by its pipeline, scatter-add its (index, value)
  pairs into one accumulator (three int32 limbs per element, exact, so the result is the same in any order).
* **densify-then-average**: what fl4health's sparse FedAvg does: decode each client to a dense tensor
  (``gpu_codec.decompress``), then ``acc += w * dense`` into an fp64 accumulator; one dense client at a time
  (collecting every client dense first, as Flower's stock FedAvg does, would need clients x N x 4 bytes).

Reported per method: time per client (mean over clients, after one warm-up), the time of the weighted mean at the
round's end, and the peak of NumPy allocations during the whole aggregation (``tracemalloc``), next to the bound
"one accumulator plus one client's payload".
Payloads are made once up front (``--distinct`` different updates, sent by the clients in turn, each with its
own weight), so the aggregation timing does not include compression.

Run: ``python benchmarks/bench_aggregate.py [--clients 100 --n 10000000 --fraction 0.01]``; writes
benchmarks/results/aggregate_<backend>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from gpu_codec.cpu_fallback import parallel

import gpu_codec
from gpu_codec.aggregate import Aggregator

RESULTS = Path(__file__).resolve().parent / "results"
PIPELINES = {
    "fp32 values, raw indices": None,
    "fp16 + Rice + zstd": [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd(level=3)],
}


def cpu_name() -> str:
    """The CPU model and its widest SIMD level (as bench_topk reports them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_topk import cpu_info

    info = cpu_info()
    return f"{info['cpu_model']}, {info['simd']}"


def make_payloads(n: int, fraction: float, distinct: int, pipeline, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(distinct):
        u = (rng.standard_normal(n) * rng.uniform(0.5, 2.0)).astype(np.float32)
        out.append(gpu_codec.compress({"w": u}, fraction=fraction, pipeline=pipeline).to_bytes())
    return out


def sparse(blobs: list[bytes], weights: list[float]) -> tuple[dict, list[float], int]:
    agg, times = Aggregator(), []
    for b, w in zip(blobs, weights):
        t = time.perf_counter()
        agg.add(b, w)
        times.append(time.perf_counter() - t)
    peak = tracemalloc.get_traced_memory()[1]
    out, times = _timed_result(agg.result, times)  # the last one: the weighted mean, once per round
    return out, times, peak


def densify(blobs: list[bytes], weights: list[float]) -> tuple[dict, list[float], int]:
    acc, times = None, []
    for b, w in zip(blobs, weights):
        t = time.perf_counter()
        dense = gpu_codec.decompress(b)["w"]
        if acc is None:
            acc = np.zeros(dense.shape, np.float64)
        np.add(acc, np.multiply(dense, w, dtype=np.float64), out=acc)
        del dense
        times.append(time.perf_counter() - t)
    peak = tracemalloc.get_traced_memory()[1]
    out, times = _timed_result(lambda: {"w": (acc / math.fsum(weights)).astype(np.float32)}, times)
    return out, times, peak


def _timed_result(fn, times: list[float], repeat: int = 7) -> tuple[dict, list[float]]:
    """``fn()`` and ``times`` with the least time of ``repeat`` calls appended: the round's end in a server that
    has run a few rounds (the first calls in a process take up to four times as long, while the allocator faults
    in fresh pages for the output)."""
    runs, out = [], None
    for _ in range(repeat):
        out = None  # the last call's output is freed first: one is held at a time
        t = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t)
    return out, times + [min(runs)]


def decode_peak(blob: bytes) -> int:
    """Peak NumPy allocations of decoding one payload to (index, value) pairs, on its own."""
    from gpu_codec.engine import Payload, decoded_records

    tracemalloc.start()
    try:
        recs = decoded_records(Payload.from_bytes(blob), gpu_codec.get_backend())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del recs
    return peak


def measure(fn, blobs, weights) -> dict:
    tracemalloc.start()
    try:
        t = time.perf_counter()
        out, times, add_peak = fn(blobs, weights)
        total = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per = times[1:-1] or times[:-1]
    return {
        "out": out,
        "per_client_ms": 1e3 * float(np.mean(per)),
        "result_ms": 1e3 * times[-1],
        "total_s": total,
        "add_peak_bytes": add_peak,
        "peak_bytes": peak,
    }


def run(clients: int, n: int, fraction: float, distinct: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + 1)
    weights = [float(w) for w in rng.integers(50, 500, clients)]
    rows = []
    for label, pipe in PIPELINES.items():
        payloads = make_payloads(n, fraction, min(distinct, clients), pipe, seed)
        blobs = [payloads[i % len(payloads)] for i in range(clients)]
        s = measure(sparse, blobs, weights)
        d = measure(densify, blobs, weights)
        diff = float(np.max(np.abs(np.asarray(s["out"]["w"]) - d["out"]["w"])))
        scale = float(np.max(np.abs(d["out"]["w"])))
        rows.append(
            {
                "pipeline": label,
                "payload_bytes": len(payloads[0]),
                "sparse_per_client_ms": s["per_client_ms"],
                "sparse_result_ms": s["result_ms"],
                "sparse_add_peak_bytes": s["add_peak_bytes"],
                "sparse_peak_bytes": s["peak_bytes"],
                "dense_per_client_ms": d["per_client_ms"],
                "dense_result_ms": d["result_ms"],
                "dense_add_peak_bytes": d["add_peak_bytes"],
                "dense_peak_bytes": d["peak_bytes"],
                "decode_peak_bytes": decode_peak(payloads[0]),
                "bound_bytes": 12 * n + decode_peak(payloads[0]) + 64 * gpu_codec.kept_count(fraction, n),
                "max_abs_difference": diff,
                "max_abs_mean": scale,
            }
        )
    return {
        "clients": clients,
        "n": n,
        "fraction": fraction,
        "distinct_payloads": min(distinct, clients),
        "backend": gpu_codec.backend_info()["backend"],
        "cpu": cpu_name(),
        "threads": parallel.thread_count(),
        "numpy": np.__version__,
        "rows": rows,
    }


def to_markdown(res: dict) -> str:
    mb = 1 / 2**20
    lines = [
        f"Aggregation of {res['clients']} clients, N = {res['n']:,}, {res['fraction']:.0%} kept "
        f"({res['distinct_payloads']} distinct payloads), backend {res['backend']}, CPU {res['cpu']}, "
        f"{res['threads']} threads.",
        "",
        "| pipeline | payload | ms/client sparse | ms/client densify | result ms sparse | result ms densify "
        "| peak sparse: adding (with result) | peak densify: adding (with result) | bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['pipeline']} | {r['payload_bytes'] * mb:.2f} MiB | {r['sparse_per_client_ms']:.1f} | "
            f"{r['dense_per_client_ms']:.1f} | {r['sparse_result_ms']:.1f} | {r['dense_result_ms']:.1f} | "
            f"{r['sparse_add_peak_bytes'] * mb:.0f} "
            f"({r['sparse_peak_bytes'] * mb:.0f}) MiB | {r['dense_add_peak_bytes'] * mb:.0f} "
            f"({r['dense_peak_bytes'] * mb:.0f}) MiB | {r['bound_bytes'] * mb:.0f} MiB |"
        )
    lines += [
        "",
        "Result: the weighted mean (sparse: from the accumulator's limbs, on the thread pool; densify: the "
        "fp64 accumulator divided and cast), once per round; the least of seven calls (the first calls in a "
        "process take up to four times as long, while the allocator faults in fresh pages for the output). "
        "Peak: NumPy allocations (tracemalloc) while the clients are added, and in brackets including the "
        "final result (an fp32 output of N elements). Bound: the sparse accumulator (12 bytes per element) plus "
        "one client's payload: the peak of decoding it on its own (bytes, decoder scratch, pairs) and 64 bytes "
        "per kept entry for the limb arithmetic. Densify keeps an fp64 accumulator and one dense client at "
        "a time (fl4health's FedAvgSparseCooTensor makes every client's tensors dense before averaging).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--n", type=float, default=1e7)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--distinct", type=int, default=20)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args()
    res = run(args.clients, int(args.n), args.fraction, args.distinct)
    md = to_markdown(res)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        stem = f"aggregate_{res['backend']}"
        (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
        (RESULTS / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
