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

``--memory`` measures instead the Aggregator's peak against its cap: for each kind of payload, with and without a
base, the tightest ``max_output_bytes`` that admits it (:func:`gpu_codec.aggregate.held_bytes`), a few clients
added and the result read under that cap, the peak of NumPy allocations (``tracemalloc``; the caller's payload
bytes and base are not counted) over the cap; and a payload of a few hundred bytes declaring 8x the cap, refused.
Writes benchmarks/results/aggregate_memory_<backend>.json and .md.
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
from gpu_codec.aggregate import Aggregator, held_bytes

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


MEMORY_PAYLOADS = {
    "top-k 1%, fp32 values, raw indices": dict(fraction=0.01, pipeline=None),
    "top-k 1%, fp16 + Rice + zstd": dict(
        fraction=0.01, pipeline=[gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd(level=3)]
    ),
    "dense fp32 + zstd (a plain reply, lossless)": dict(fraction=None, pipeline=[gpu_codec.Zstd(level=3)]),
    "every entry as a sparse pair, raw": dict(fraction=1.0, pipeline=None),
}


def traced(fn) -> tuple[int, float]:
    """(peak NumPy allocations during ``fn()``, seconds)."""
    tracemalloc.start()
    try:
        t = time.perf_counter()
        fn()
        return tracemalloc.get_traced_memory()[1], time.perf_counter() - t
    finally:
        tracemalloc.stop()


def run_memory(n: int, clients: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    base = {"w": rng.standard_normal(n).astype(np.float32)}
    rows = []
    for label, kw in MEMORY_PAYLOADS.items():
        for with_base in (False, True):
            b = base if with_base else None
            blobs = []
            for i in range(2):
                new = base["w"] + (rng.standard_normal(n) * (i + 1)).astype(np.float32)
                blobs.append(gpu_codec.compress({"w": new}, b, **kw).to_bytes())
            cap = held_bytes(gpu_codec.Payload.from_bytes(blobs[0]).tensors, with_base)
            agg = Aggregator(base=b, max_output_bytes=cap)

            def aggregation(agg=agg, blobs=blobs) -> None:
                for c in range(clients):
                    agg.add(blobs[c % 2], 1.0 + c)
                agg.result()

            peak, secs = traced(aggregation)
            rows.append(
                {
                    "payload": label,
                    "with_base": with_base,
                    "payload_bytes": len(blobs[0]),
                    "cap_bytes": cap,
                    "peak_bytes": peak,
                    "ratio": round(peak / cap, 3),
                    "seconds": round(secs, 2),
                }
            )
            print(
                f"{label:45s} base={with_base!s:5s} cap {cap / 2**20:7.1f} MiB  peak/cap {peak / cap:.3f}", flush=True
            )
    # a few hundred bytes declaring 8x the cap: refused before anything is allocated
    one = gpu_codec.SparseEntries(np.array([5], np.uint64), np.ones(1, np.float32), (8 * n,), "float32")
    small = gpu_codec.encode_coo({"w": one}).to_bytes()
    cap = held_bytes(gpu_codec.Payload.from_bytes(small).tensors, False) // 8
    refused = []

    def hostile() -> None:
        try:
            Aggregator(max_output_bytes=cap).add(small)
        except gpu_codec.PayloadError as e:
            refused.append(type(e).__name__)

    peak, _ = traced(hostile)
    return {
        "n": n,
        "clients": clients,
        "backend": gpu_codec.backend_info()["backend"],
        "cpu": cpu_name(),
        "threads": parallel.thread_count(),
        "numpy": np.__version__,
        "max_ratio": max(r["ratio"] for r in rows),
        "rows": rows,
        "hostile": {"payload_bytes": len(small), "cap_bytes": cap, "refused_with": refused, "peak_bytes": peak},
    }


def memory_markdown(res: dict) -> str:
    mb = 1 / 2**20
    h = res["hostile"]
    lines = [
        f"Aggregator peak memory against its cap: one fp32 tensor of N = {res['n']:,}, {res['clients']} clients "
        f"added and the result read, backend {res['backend']}, CPU {res['cpu']}, {res['threads']} threads.",
        "",
        "| payload | base | payload size | cap (held_bytes) | peak | peak / cap |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['payload']} | {'yes' if r['with_base'] else 'no'} | {r['payload_bytes'] * mb:.2f} MiB | "
            f"{r['cap_bytes'] * mb:.0f} MiB | {r['peak_bytes'] * mb:.0f} MiB | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        f"Largest ratio: {res['max_ratio']:.3f} (target: at most 1.5). Cap: the least ``max_output_bytes`` that "
        "admits the payload (``gpu_codec.aggregate.held_bytes``: 12 bytes of accumulator per element with the "
        "mean and the result, or with the payload's decoded entries, 32 bytes per sparse pair). Peak: NumPy "
        "allocations (tracemalloc) while the clients are added and the result is made; the payload bytes and "
        "the base are the caller's and not counted.",
        "",
        f"A payload of {h['payload_bytes']} bytes declaring {8 * h['cap_bytes'] * mb:.0f} MiB of aggregation "
        f"under a cap of {h['cap_bytes'] * mb:.0f} MiB: refused ({', '.join(h['refused_with'])}) with a peak of "
        f"{h['peak_bytes'] / 1024:.0f} KiB.",
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
    ap.add_argument("--memory", action="store_true", help="measure the Aggregator's peak against its cap instead")
    args = ap.parse_args()
    if args.memory:
        res = run_memory(int(args.n), min(args.clients, 8))
        md = memory_markdown(res)
        print(md)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        if not args.no_write:
            RESULTS.mkdir(exist_ok=True)
            stem = f"aggregate_memory_{res['backend']}"
            (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
            (RESULTS / f"{stem}.md").write_text(md)
        return
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
