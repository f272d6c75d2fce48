"""The NumPy backend end to end with each pipeline, in ms: ``compress``, ``compress`` then ``to_bytes`` (what a
client sends), ``Payload.from_bytes``, ``decompress`` onto the base and an aggregator's ``add`` (what a server
does), on the zoo's ResNet-50 (320 tensors) and ``--elements`` fp32 elements split into 1,000 uneven tensors
(benchmarks/zoo.py), top-1% global, with the plain pipeline (u32 indices, fp32 values) and the default one
(fp16 values, Rice-coded indices, zstd).

Each figure is the median of ``--repeat`` calls in a child process, the processes of the checkout and (with
``--against REV``) of the package at git revision REV alternating ``--rounds`` times, so both see the same
machine load (the median over the rounds is kept); both read the same payloads, made by the checkout, and the
child checks that its package's payload bytes equal the checkout's.

    python benchmarks/bench_pipelines.py                     # writes benchmarks/results/pipelines_cpu.{json,md}
    python benchmarks/bench_pipelines.py --against 957d411   # and the same at that revision, in the same run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.bench_wire import alternating, result_doc

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPS = ("compress", "compress_to_bytes", "from_bytes", "decompress", "add")
PIPELINES = ("plain", "fp16+rice+zstd")
CASES = ("resnet-50", "split-1000")

# Run in a child whose sys.path starts with the package to time; argv: root, elements, samples, folder of bytes.
CHILD = r"""
import json, pathlib, statistics, sys, time
root, elements, samples, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4])
sys.path.append(root)
import numpy as np
import gpu_codec
from gpu_codec import Payload, Quantize, RiceIndices, Zstd
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from benchmarks.bench_zoo import scale_for
from benchmarks.zoo import ZOO, split_update

STAGES = {"plain": lambda: None, "fp16+rice+zstd": lambda: [Quantize("float16"), RiceIndices(), Zstd(level=3)]}

def median(fn):
    fn()
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)

rows = {"package": str(pathlib.Path(gpu_codec.__file__).parent)}
with using_backend(CpuBackend()):
    for case in ("resnet-50", "split-1000"):
        if case == "resnet-50":
            e = ZOO[case]
            u = e.build(scale_for(e, elements), 0)
        else:
            u = split_update(elements, 1000, 0)
        for name, stages in STAGES.items():
            blob = (folder / f"{case}-{name}.bin").read_bytes()
            compress = lambda: gpu_codec.compress(u.new, u.base, fraction=0.01, pipeline=stages())
            agg = gpu_codec.Aggregator(base=u.base)
            rows[f"{case} {name}"] = {
                "tensors": len(u.new),
                "bytes": len(blob),
                "same_bytes": compress().to_bytes() == blob,
                "compress": median(compress),
                "compress_to_bytes": median(lambda: compress().to_bytes()),
                "from_bytes": median(lambda: Payload.from_bytes(blob)),
                "decompress": median(lambda: gpu_codec.decompress(blob, base=u.base)),
                "add": median(lambda: agg.add(blob)),
            }
print(json.dumps(rows))
"""


def payloads(elements: int) -> dict[str, bytes]:
    """``case pipeline`` -> the payload the checkout makes (what every package reads)."""
    import gpu_codec
    from benchmarks.bench_zoo import scale_for
    from benchmarks.zoo import ZOO, split_update
    from gpu_codec.backends import using_backend
    from gpu_codec.backends.cpu import CpuBackend

    stages = {
        "plain": None,
        "fp16+rice+zstd": [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd(3)],
    }
    out = {}
    with using_backend(CpuBackend()):
        for case in CASES:
            if case == "resnet-50":
                u = ZOO[case].build(scale_for(ZOO[case], elements), 0)
            else:
                u = split_update(elements, 1000, 0)
            for name, pipe in stages.items():
                out[f"{case}-{name}"] = gpu_codec.compress(u.new, u.base, fraction=0.01, pipeline=pipe).to_bytes()
    return out


def run(elements: int, samples: int, rounds: int, against: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "payloads"
        folder.mkdir()
        for name, blob in payloads(elements).items():
            (folder / f"{name}.bin").write_bytes(blob)
        seen: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for label, got in alternating(tmp, against, rounds, CHILD, ROOT, elements, samples, folder):
            for case, row in got.items():
                if case != "package":
                    seen.setdefault(label, {}).setdefault(case, []).append(row)
    rows = []
    for case in seen["checkout"]:
        for label in seen:
            runs = seen[label][case]
            rows.append(
                {
                    "case": case,
                    "package": label,
                    "tensors": runs[0]["tensors"],
                    "bytes": runs[0]["bytes"],
                    "same_bytes": all(r["same_bytes"] for r in runs),
                    **{f"{op}_ms": 1e3 * statistics.median(r[op] for r in runs) for op in OPS},
                }
            )
    return result_doc("pipelines", against, elements=elements, samples=samples, rounds=rounds, rows=rows)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"Measured at commit {doc['commit']} on {m['cpu_model']} ({m['simd']}), {m['cpu_count']} cores shared with "
        f"other work (load average {', '.join(f'{x:.1f}' for x in m['load_average'])}), NumPy backend: ms per "
        f"call, the median of {doc['samples']} calls in each of {doc['rounds']} alternating rounds, then the median "
        "over the rounds. Updates: the zoo's ResNet-50 and "
        f"{doc['elements']:,} fp32 elements split into 1,000 uneven tensors, top-1% global; plain: u32 indices and "
        "fp32 values; fp16+rice+zstd: the default pipeline. Decompress and add: onto the base. Same bytes: the "
        "package writes the checkout's payload." + (f" Run: `{doc['command']}`." if doc.get("command") else ""),
        "",
        "| update | pipeline | package | compress | compress + to_bytes | from_bytes | decompress | add | same bytes |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    base = {(r["case"], r["package"]): r for r in doc["rows"]}
    for r in doc["rows"]:
        case, pipe = r["case"].split(" ", 1)
        cells = []
        for op in OPS:
            v = r[f"{op}_ms"]
            ref = base.get((r["case"], "checkout"))
            cells.append(
                f"{v:.2f}" if r["package"] == "checkout" or ref is None else f"{v:.2f} ({ref[f'{op}_ms'] / v:.2f}x)"
            )
        lines.append(
            f"| {case} | {pipe} | {r['package']} | {' | '.join(cells)} | {'yes' if r['same_bytes'] else 'no'} |"
        )
    if doc.get("against"):
        lines += ["", f"In brackets: the checkout's time over {doc['against']}'s (below 1: the checkout is faster)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 21, help="elements of the split (and ResNet-50's cap)")
    ap.add_argument("--repeat", type=int, default=9, help="calls per figure in each round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the packages")
    ap.add_argument("--against", help="also time the package at this git revision")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "pipelines_cpu.json", help="JSON output")
    a = ap.parse_args(argv)
    doc = run(a.elements, a.repeat, a.rounds, a.against)
    doc["command"] = "python benchmarks/bench_pipelines.py" + (f" --against {a.against}" if a.against else "")
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(doc)
    a.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
