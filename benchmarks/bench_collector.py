"""What the interpreter's garbage collector costs the engine's calls, with the engine holding it off
(``gpu_codec.collector``, the default) and without (``set_paused(False)``), in one process, in the same run.

For zoo entries (benchmarks/zoo.py; entries above ``--max-params`` elements scaled down): one compress (top-k 1%
global), its payload's ``to_bytes``, one decompress onto the base and one aggregator ``add``, each called ``--calls``
times in a row in each mode, the two modes taking turns ``--rounds`` times (the one going first alternating). A
call's time includes any collection it set off. Mean: all of a mode's calls' time over their count (what a client
or server pays over many rounds: the rare full collection included); median and the slowest call beside it;
``full``: full (oldest-generation) collections over the mode's calls, and the collector's own seconds, counted by
``gc.callbacks``. The process holds what it holds (torch, where installed, and the updates): the count of objects
the collector tracks is recorded, since a full collection scans them all.

    python benchmarks/bench_collector.py                       # NumPy backend (torch imported where installed)
    python benchmarks/bench_collector.py --device cuda         # torch CUDA tensors, the GPU backend
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENTRIES = ["split-2^23-1000", "split-2^23-100", "resnet-50", "char-transformer", "iid-2^24"]
OPS = ("compress", "to_bytes", "decompress", "add")
MODES = ("held", "free")  # the collector held off during the calls (the default), or left alone
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "collector_cpu.json"


class Collections:
    """Full collections and the collector's seconds, counted while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.full, self.seconds, self._t0 = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t0
        self.full += info["generation"] == 2


def measure(fn, calls: int, sync) -> dict:
    """``fn`` called ``calls`` times: each call's seconds, and the collections among them."""
    counter = Collections()
    gc.callbacks.append(counter)
    try:
        ts = []
        for _ in range(calls):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(counter)
    return {"times": ts, "full": counter.full, "gc_s": counter.seconds}


def run(entries: list[str], calls: int, rounds: int, max_params: float, device: str | None) -> dict:
    import numpy as np

    import gpu_codec
    from benchmarks.bench_topk import machine_info
    from benchmarks.zoo import ZOO
    from gpu_codec import collector

    torch = None
    try:
        import torch
    except ImportError:
        if device:
            raise
    sync = torch.cuda.synchronize if device else (lambda: None)

    def placed(d: dict) -> dict:
        if not device:
            return d
        return {k: torch.from_numpy(np.asarray(v, order="C")).to(device) for k, v in d.items()}

    rows = []
    try:
        for name in entries:
            e = ZOO[name]
            full = e.params(1.0)
            u = e.build(1.0 if full <= max_params else max_params / full, 0)
            new, base = placed(u.new), placed(u.base)
            payload = gpu_codec.compress(new, base, fraction=0.01)
            blob = payload.to_bytes()
            agg = gpu_codec.Aggregator(base=base, max_output_bytes=None)
            fns = {
                "compress": lambda: gpu_codec.compress(new, base, fraction=0.01),  # noqa: B023
                "to_bytes": payload.to_bytes,
                "decompress": lambda: gpu_codec.decompress(blob, base=base, max_output_bytes=None),  # noqa: B023
                "add": lambda: agg.add(blob),  # noqa: B023
            }
            for op, fn in fns.items():
                got = {m: {"times": [], "full": 0, "gc_s": 0.0} for m in MODES}
                for _ in range(2):
                    fn()
                for r in range(rounds):
                    for mode in MODES if r % 2 == 0 else MODES[::-1]:
                        collector.set_paused(mode == "held")
                        m = measure(fn, calls, sync)
                        g = got[mode]
                        g["times"] += m["times"]
                        g["full"] += m["full"]
                        g["gc_s"] += m["gc_s"]
                elements = int(sum(v.size for v in u.new.values()))
                row = {"entry": name, "tensors": len(u.new), "elements": elements, "op": op}
                for mode, g in got.items():
                    ts = g["times"]
                    row[mode] = {
                        "calls": len(ts),
                        "mean_ms": 1e3 * sum(ts) / len(ts),
                        "median_ms": 1e3 * statistics.median(ts),
                        "max_ms": 1e3 * max(ts),
                        "full_collections": g["full"],
                        "collector_ms": 1e3 * g["gc_s"],
                    }
                row["mean_held_over_free"] = row["held"]["mean_ms"] / row["free"]["mean_ms"]
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        collector.set_paused(True)
    return {
        "machine": machine_info(),
        "device": device or "host",
        "tracked_objects": len(gc.get_objects()),
        "torch_imported": torch is not None,
        "calls": calls,
        "rounds": rounds,
        "rows": rows,
    }


def _line(r: dict) -> str:
    h, f = r["held"], r["free"]
    return (
        f"{r['entry']:18s} {r['op']:10s} mean {f['mean_ms']:7.2f} -> {h['mean_ms']:7.2f} ms "
        f"({r['mean_held_over_free']:.2f}x)  median {f['median_ms']:7.2f} -> {h['median_ms']:7.2f}  "
        f"slowest {f['max_ms']:7.1f} -> {h['max_ms']:7.1f}  full collections {f['full_collections']} -> "
        f"{h['full_collections']}"
    )


def table(doc: dict) -> str:
    """The results as a markdown table."""
    m = doc["machine"]
    simd = m.get("simd")
    where = f"{m.get('cpu_model')} ({simd})" if doc["device"] == "host" else doc["device"]
    backend = m.get("backend") if isinstance(m.get("backend"), dict) else {}
    gpu = (backend.get("device") or {}).get("name") if doc["device"] != "host" else None
    if gpu:
        where = f"{gpu} (host {m.get('cpu_model')}), torch {m.get('torch')}"
    head = (
        f"{where}; {doc['tracked_objects']:,} objects "
        f"tracked by the collector{' (torch imported)' if doc['torch_imported'] else ''}; {doc['rounds']} rounds of "
        f"{doc['calls']} calls a mode; ms. Free: the collector left alone; held: held off during each call (the "
        "default)."
    )
    lines = [
        head,
        "",
        "| entry | tensors | op | mean free | mean held | held ÷ free | median free | median held | slowest free "
        "| slowest held | full collections free / held |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        f, h = r["free"], r["held"]
        lines.append(
            f"| {r['entry']} | {r['tensors']:,} | {r['op']} | {f['mean_ms']:.2f} | {h['mean_ms']:.2f} | "
            f"{r['mean_held_over_free']:.2f} | {f['median_ms']:.2f} | {h['median_ms']:.2f} | {f['max_ms']:.1f} | "
            f"{h['max_ms']:.1f} | {f['full_collections']} / {h['full_collections']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", nargs="+", default=ENTRIES)
    ap.add_argument("--calls", type=int, default=10, help="calls in a row a mode and round (10)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds, the mode going first alternating (12)")
    ap.add_argument("--max-params", type=float, default=3e7, help="larger entries are scaled down to this")
    ap.add_argument("--device", choices=["cuda"], help="torch CUDA tensors (default: NumPy arrays)")
    ap.add_argument("--out", type=pathlib.Path, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    ap.add_argument("--from-json", type=pathlib.Path, help="no run: print the table of these results")
    args = ap.parse_args(argv)
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return 0
    out = args.out or DEFAULT_OUT
    if out.exists() and not args.force:
        ap.error(f"{out} exists: pass --force to replace it, or --out elsewhere")
    from benchmarks.gpu_suite import _ensure_importable

    _ensure_importable()  # (a checkout not installed, as on a GPU machine without network)
    from benchmarks.zoo import ZOO

    unknown = [e for e in args.entries if e not in ZOO]
    if unknown:
        ap.error(f"unknown entries {unknown}; the zoo has {sorted(ZOO)}")
    if args.calls < 1 or args.rounds < 1:
        ap.error("--calls and --rounds must be at least 1")
    doc = run(args.entries, args.calls, args.rounds, args.max_params, args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(table(doc) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
