"""The server's side on the CPU: an :class:`gpu_codec.Aggregator` made on the base, one ``add`` of a client's payload
and the ``result`` (base + weighted mean delta), in ms, on zoo entries of many tensors and of one.

Entries: 2^23 fp32 elements split into 1, 100 and 1,000 uneven tensors (benchmarks/zoo.py ``split_update``), the
zoo's ResNet-50 (320 tensors), its Llama-style model in bf16 (291 tensors, scaled down to ``--elements``) and its
character transformer (54 tensors, an update really trained); each compressed top-1% global by this checkout.
``aggregator``: ``Aggregator(base=...)`` (its checks of the base); ``add``: the payload's bytes added to one
aggregator (the median of ``--repeat`` calls after two); ``result``: after two adds (weights 1 and 2). Each figure is
the median over ``--rounds`` child processes of the checkout and (with ``--against REV``) of the package at git
revision REV, taking turns, so both see the same machine load; the child also returns a digest of the result's
bytes, which both packages must give alike.

    python benchmarks/bench_server.py                     # writes benchmarks/results/server_cpu.{json,md}
    python benchmarks/bench_server.py --against 67e27e2   # and the same at that revision, in the same run
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import gpu_codec
from benchmarks.bench_wire import alternating, result_doc
from benchmarks.bench_zoo import command_line, scale_for, write_results
from benchmarks.zoo import ZOO, split_update

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENTRIES = ("split-1", "split-100", "split-1000", "resnet-50", "llama-1b", "char-transformer")
OPS = ("aggregator", "add", "result")

# Run in a child whose sys.path starts with the package to time (the zoo from this checkout, last on the path);
# argv: the checkout's root, the folder of payloads, elements, repeat.
CHILD = r"""
import hashlib, json, pathlib, sys, time
root, folder, elements, repeat = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.append(root)
import numpy as np
import gpu_codec
from benchmarks.bench_server import update_of

def median(fn, n):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]

def digest(out):
    h = hashlib.sha256()
    for k in sorted(out):
        v = out[k]
        if type(v).__module__.startswith("torch"):
            v = v.view(__import__("torch").int16).numpy() if str(v.dtype) == "torch.bfloat16" else v.numpy()
        h.update(k.encode() + np.ascontiguousarray(v).tobytes())
    return h.hexdigest()

rows = {"package": str(pathlib.Path(gpu_codec.__file__).parent)}
for path in sorted(folder.glob("*.bin")):
    blob = path.read_bytes()
    base = update_of(path.stem, elements).base
    make = lambda: gpu_codec.Aggregator(base=base, max_output_bytes=None)
    agg = make()
    add = median(lambda: agg.add(blob), repeat)
    two = make()
    two.add(blob, 1.0)
    two.add(blob, 2.0)
    rows[path.stem] = {
        "tensors": len(base), "aggregator": median(make, repeat), "add": add,
        "result": median(two.result, max(3, repeat // 2)), "digest": digest(two.result()),
    }
print(json.dumps(rows))
"""


def update_of(entry: str, elements: int, seed: int = 0) -> Any:
    """The zoo update an entry names (``split-N``: ``elements`` split into N tensors; a zoo entry scaled down to
    ``elements`` where it is larger)."""
    if entry.startswith("split-"):
        return split_update(elements, int(entry.removeprefix("split-")), seed)
    e = ZOO[entry]
    return e.build(scale_for(e, elements), seed)


def run(elements: int, repeat: int, rounds: int, against: str | None, entries: tuple[str, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "payloads"
        folder.mkdir()
        for name in entries:
            u = update_of(name, elements)
            (folder / f"{name}.bin").write_bytes(gpu_codec.compress(u.new, u.base, fraction=0.01).to_bytes())
        got: dict[str, list[dict[str, Any]]] = {}
        for label, res in alternating(tmp, against, rounds, CHILD, ROOT, folder, elements, repeat):
            got.setdefault(label, []).append(res)
    rows = []
    for name in entries:
        digests = {label: {r[name]["digest"] for r in runs} for label, runs in got.items()}
        row: dict[str, Any] = {
            "entry": name,
            "tensors": got["checkout"][0][name]["tensors"],
            "same_result": len(set().union(*digests.values())) == 1,
        }
        for label, runs in got.items():
            for op in OPS:
                row[f"{op}_ms"] = row.get(f"{op}_ms", {})
                row[f"{op}_ms"][label] = statistics.median(r[name][op] for r in runs) * 1e3
        rows.append(row)
    return result_doc("server", against, elements=elements, repeat=repeat, rounds=rounds, rows=rows)


def markdown(doc: dict[str, Any]) -> str:
    m, against = doc["machine"], doc["against"]
    head = (
        f"Measured at commit {doc['commit']} on {m['cpu_model']} ({m['simd']}), {m['cpu_count']} cores, ms: the "
        f"median of {doc['repeat']} calls in each of {doc['rounds']} processes"
        + (
            f" of the checkout and of {against}, taking turns; in brackets the checkout over {against}"
            if against
            else ""
        )
        + ". Aggregator(base): one made on the base; add: one payload's bytes added; result: base + the weighted mean "
        "of two adds. Same result: every process gave the result's bytes alike."
        + (f" Run: `{doc['command']}`." if doc.get("command") else "")
    )
    lines = [
        head,
        "",
        "| entry | tensors | Aggregator(base) | add | result | same result |",
        "|---|---:|---:|---:|---:|---|",
    ]

    def cell(r: dict[str, Any], op: str) -> str:
        v = r[f"{op}_ms"]
        if against and against in v:
            return f"{v[against]:.2f} → {v['checkout']:.2f} ({v['checkout'] / v[against]:.2f}×)"
        return f"{v['checkout']:.2f}"

    for r in doc["rows"]:
        ops = " | ".join(cell(r, op) for op in OPS)
        lines.append(f"| {r['entry']} | {r['tensors']:,} | {ops} | {'yes' if r['same_result'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 23, help="elements of each split (and the zoo entries' cap)")
    ap.add_argument("--repeat", type=int, default=7, help="calls per figure in each process")
    ap.add_argument("--rounds", type=int, default=3, help="processes of each package, taking turns")
    ap.add_argument("--against", metavar="REV", help="also time the package at this git revision")
    ap.add_argument("--entries", nargs="+", default=list(ENTRIES), choices=ENTRIES)
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/server_cpu.json)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    doc = run(a.elements, a.repeat, a.rounds, a.against, tuple(a.entries))
    doc["command"] = command_line("bench_server.py", argv)
    print(markdown(doc))
    print(f"({time.perf_counter() - t0:.1f} s)")
    out = a.out or RESULTS / "server_cpu.json"
    write_results(doc, out, markdown)
    return 0 if all(r["same_result"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
