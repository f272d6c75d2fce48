"""The GPU path's host side, measured by the recording launcher (:mod:`gpu_codec.testing.recording`).

For 1, 10, 100 and 1,000 uneven tensors (the zoo's split of ``--elements`` fp32 elements, benchmarks/zoo.py
``split_update``), any zoo entries named (scaled to about ``--elements``; also with each of ``--pipelines``:
fp16 + Rice + zstd, dense int8) and any named with ``--full`` at their full size (whose launches must not grow with
it): one compress (top-k 1%, global, unless the pipeline says otherwise), one decompress of its bytes onto the
base, and one aggregator ``add`` of its bytes (an Aggregator over the base, made beforehand), each recorded once on
the emulator and replayed ``--repeat`` times with no kernel run. Reported per call: the replay's Python time (ms,
median; of which in the NumPy work standing for CuPy's array operations and copies), kernel launches,
array-module kernels, syncs (host waits on the device), host-to-device copies and allocations; against issue
26's targets (``HOST_MS`` and ``SYNCS`` of benchmarks/bench_zoo.py). Counts are deterministic; times are the
host's and noisy.

    python benchmarks/bench_host.py                   # writes benchmarks/results/host_recording.{json,md}
    python benchmarks/bench_host.py --tensors 1 10 --entries resnet-50 --full --pipelines --out /tmp/h.json
    python benchmarks/bench_host.py --check --from-json benchmarks/results/host_recording.json
    python benchmarks/bench_host.py --against 957d411  # and AGAINST_CASES timed against that revision

With ``--against REV``, the cases of AGAINST_CASES are also timed in child processes of this checkout and of the
package at git revision REV, alternating ``--rounds`` times (each the median of ``--repeat`` replays; the median
over the rounds kept), so that both see the same machine load: the host times of a single run drift with the
machine's load between runs, their ratio in one run far less.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.bench_topk import machine_info
from benchmarks.bench_zoo import (
    HOST_MS,
    SYNCS,
    TIMED,
    command_line,
    commit_label,
    host_columns,
    host_verdicts,
    scale_for,
    write_results,
)
from benchmarks.zoo import ZOO, split_update
from gpu_codec import Int8Blockwise, Quantize, RiceIndices, Zstd

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPS = ("compress", "decompress", "add")
TENSORS = (1, 10, 100, 1000)


FULL = " (full)"  # the suffix of a zoo entry's row at its full size
# the pipelines a zoo entry is measured with besides plain top-k 1% (--pipelines): (fraction, stages)
PIPELINES = {
    "fp16+rice+zstd": (0.01, lambda: [Quantize("float16"), RiceIndices(), Zstd(level=3)]),
    "dense-int8": (None, lambda: [Int8Blockwise()]),
}


def run(
    tensors: list[int],
    elements: int,
    entries: list[str],
    repeat: int,
    full: list[str] = (),
    pipelines: list[str] = (),
    seed: int = 0,
) -> dict[str, Any]:
    commit = commit_label()
    rows = []
    cases = [(f"split-{t}", lambda t=t: split_update(elements, t, seed), None) for t in tensors]
    for name in entries:
        e = ZOO[name]
        cases.append((name, lambda e=e: e.build(scale_for(e, elements), seed), None))
        cases += [(f"{name} {p}", lambda e=e: e.build(scale_for(e, elements), seed), p) for p in pipelines]
    for name in full:
        cases.append((name + FULL, lambda e=ZOO[name]: e.build(1.0, seed), None))
    for name, build, pipe in cases:
        t0 = time.perf_counter()
        update = build()
        row = {
            "entry": name,
            "tensors": len(update.new),
            "elements": sum(math.prod(a.shape) for a in update.new.values()),
        }
        fraction, stages = PIPELINES[pipe] if pipe else (0.01, list)
        row["pipeline"] = pipe or "top-k"
        row["ops"] = host_columns(update, fraction=fraction, repeat=repeat, pipeline=stages())
        row["seconds"] = time.perf_counter() - t0
        print(_line(row), flush=True)
        rows.append(row)
    info = machine_info()
    info["load_average"] = os.getloadavg()
    return {
        "benchmark": "host_recording",
        "commit": commit,
        "machine": info,
        "repeat": repeat,
        "fraction": 0.01,
        "scope": "global",
        "rows": rows,
    }


AGAINST_CASES = ("split-1000", "resnet-50", "resnet-50 fp16+rice+zstd")

# Run in a child whose sys.path starts with the package to time; argv: root, elements, repeat, seed.
CHILD = r"""
import json, pathlib, sys
root, elements, repeat, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.append(root)
import gpu_codec
from benchmarks.bench_host import AGAINST_CASES, OPS, PIPELINES
from benchmarks.bench_zoo import host_columns, scale_for
from benchmarks.zoo import ZOO, split_update

out = {"package": str(pathlib.Path(gpu_codec.__file__).parent)}
for case in AGAINST_CASES:
    name, _, pipe = case.partition(" ")
    if name.startswith("split-"):
        update = split_update(elements, int(name[6:]), seed)
    else:
        update = ZOO[name].build(scale_for(ZOO[name], elements), seed)
    fraction, stages = PIPELINES[pipe] if pipe else (0.01, list)
    cols = host_columns(update, fraction=fraction, repeat=repeat, pipeline=stages())
    out[case] = {op: cols[op]["host_ms"] for op in OPS}
print(json.dumps(out))
"""


def against(rev: str, elements: int, repeat: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """AGAINST_CASES' host ms, this checkout's and revision ``rev``'s, in alternating child processes."""
    from benchmarks.bench_wire import alternating

    seen: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, row in alternating(tmp, rev, rounds, CHILD, ROOT, elements, repeat, seed):
            for case in AGAINST_CASES:
                for op in OPS:
                    seen.setdefault(f"{case}|{op}", {}).setdefault(label, []).append(row[case][op])
    rows = []
    for key, by in seen.items():
        case, op = key.split("|")
        mine, theirs = statistics.median(by["checkout"]), statistics.median(by[rev])
        rows.append({"case": case, "op": op, "checkout_ms": mine, "against_ms": theirs, "ratio": mine / theirs})
    return {"revision": rev, "rounds": rounds, "repeat": repeat, "rows": rows}


def _line(row: dict[str, Any]) -> str:
    cells = [
        f"{op} {c['host_ms']:.2f} ms {c['launches']}L {c['array_ops']}A {c['syncs']}S" for op, c in row["ops"].items()
    ]
    return f"{row['entry']:<14} {row['tensors']:>5} tensors  " + "  |  ".join(cells)


def check(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(PASS | FAIL, row, what) per target: syncs at every count, host time at 1,000 tensors (and, reported
    against the same formula, at every other count); and for an entry measured at its full size too, launches that
    do not grow with it (its tensors above the size the capped row gives them are not launched for one by one)."""
    out = [v for r in doc["rows"] for v in host_verdicts(r["entry"], r["tensors"], r["ops"])]
    capped = {r["entry"]: r for r in doc["rows"]}
    for r in doc["rows"]:
        small = capped.get(r["entry"].removesuffix(FULL)) if r["entry"].endswith(FULL) else None
        for op in OPS if small is not None else ():
            a, b = small["ops"][op]["launches"], r["ops"][op]["launches"]
            what = f"{op} launches {b} at {r['elements']:,} elements = {a} at {small['elements']:,}"
            out.append(("PASS" if a == b else "FAIL", r["entry"], what))
    return out


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"Measured at commit {doc['commit']} by the recording launcher (gpu_codec/testing/recording.py) on "
        f"{m['cpu_model']} ({m['simd']}), {m['cpu_count']} cores shared with other work (load average "
        f"{', '.join(f'{x:.1f}' for x in m['load_average'])}): the GPU path's code with no kernel run, median of "
        f"{doc['repeat']} replays. Top-k {doc['fraction']:g} {doc['scope']}, or the row's pipeline "
        "(fp16 + Rice + zstd: top-k 1% with fp16 values, Rice-coded indices and zstd; dense-int8: every "
        "entry, int8 blockwise); decompress and add take the payload's bytes onto the base. Host ms: the "
        "replay's Python time (of which the NumPy work that stands for the device's, CuPy's array operations "
        "and the copies, in brackets), without the driver's cost per launch or copy. Launches: our kernels; "
        "array ops: the array module's kernels; syncs: host waits on the device; H2D: host-to-device copies. "
        "Targets (issue 26): compress and decompress <= 1 ms + 2 us a tensor at 1,000 tensors; syncs <= 4 a "
        "compress, <= 2 a decompress or add." + (f" Run: `{doc['command']}`." if doc.get("command") else ""),
        "",
        "| update | tensors | elements | op | host ms | target ms | launches | array ops | syncs | target | H2D |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        for op in OPS:
            c = r["ops"][op]
            target = f"{HOST_MS(r['tensors']):.2f}" if op in TIMED else "–"
            lines.append(
                f"| {r['entry']} | {r['tensors']:,} | {r['elements']:,} | {op} | {c['host_ms']:.2f} "
                f"({c['array_ms']:.2f}) | {target} | {c['launches']} | {c['array_ops']} | {c['syncs']} | "
                f"{SYNCS[op]} | {c['h2d']} |"
            )
    ab = doc.get("against")
    if ab:
        lines += [
            "",
            f"Against {ab['revision']} in the same run: host ms, the median over {ab['rounds']} alternating rounds "
            f"of child processes (each the median of {ab['repeat']} replays); ratio: this checkout's over "
            f"{ab['revision']}'s (below 1: faster).",
            "",
            f"| update | op | this checkout | {ab['revision']} | ratio |",
            "|---|---|---:|---:|---:|",
        ]
        for r in ab["rows"]:
            lines.append(
                f"| {r['case']} | {r['op']} | {r['checkout_ms']:.2f} | {r['against_ms']:.2f} | {r['ratio']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", nargs="*", type=int, default=list(TENSORS), help="split counts")
    ap.add_argument("--elements", type=int, default=1 << 21, help="elements of each split (and zoo entries' cap)")
    ap.add_argument("--entries", nargs="*", default=["resnet-50"], choices=sorted(ZOO), help="zoo entries too")
    ap.add_argument(
        "--full", nargs="*", default=["resnet-50"], choices=sorted(ZOO), help="zoo entries at their full size too"
    )
    ap.add_argument(
        "--pipelines",
        nargs="*",
        default=list(PIPELINES),
        choices=sorted(PIPELINES),
        help="the named entries with these pipelines too",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/host_recording.json)")
    ap.add_argument("--from-json", type=pathlib.Path, help="no run: read these results")
    ap.add_argument("--check", action="store_true", help="PASS/FAIL per target; exit 1 on a FAIL")
    ap.add_argument("--against", metavar="REV", help="also time AGAINST_CASES against the package at this revision")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds with --against")
    a = ap.parse_args(argv)
    if a.from_json:
        doc = json.loads(a.from_json.read_text())
    else:
        t0 = time.perf_counter()
        doc = run(a.tensors, a.elements, a.entries, a.repeat, a.full, a.pipelines)
        if a.against:
            doc["against"] = against(a.against, a.elements, a.repeat, a.rounds)
        doc["command"] = command_line("bench_host.py", argv)
        print(f"({time.perf_counter() - t0:.1f} s)")
        out = a.out or RESULTS / "host_recording.json"
        write_results(doc, out, markdown)
    if a.check:
        verdicts = check(doc)
        for v, entry, text in verdicts:
            print(f"{v:<4} {entry:<14} {text}")
        return 1 if any(v == "FAIL" for v, _, _ in verdicts) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
