"""The wire format's host cost per tensor: :meth:`gpu_codec.Payload.from_bytes` (parse and check a payload) and
:meth:`gpu_codec.Payload.to_bytes` (lay out and write one), in µs per tensor.

Updates: ``--elements`` fp32 elements split into 1, 100 and 1,000 uneven tensors (benchmarks/zoo.py
``split_update``) and the zoo's ResNet-50 (320 tensors with their real names), compressed top-1% global
(plain ``coo`` records); and the 1,000-tensor split with float16 values and Rice-coded indices (``sparse``
records, which the reader and writer take through the codecs' declarations). ``to_bytes`` writes records as a
compress leaves them (contiguous arrays of their own), on a fresh payload each time: with names the writer has
not seen before (its front-coded name entries forgotten first) and with names it has (every round after the
first of a federated run); and a payload read and written again as it was read (what a filter that passes it
on does, NVFlare's Clara processors' among them). Beside them, one copy of the payload's bytes (``np.copy``),
the floor of any reader or writer.

Each figure is the best of ``--repeat`` samples in a child process, the processes of the checkout and (with
``--against REV``) of the package at git revision REV alternating ``--rounds`` times, so both see the same
machine load; the child also checks that the package writes the very bytes it read.

    python benchmarks/bench_wire.py                     # writes benchmarks/results/wire_cpu.{json,md}
    python benchmarks/bench_wire.py --against d158447   # and the same at that revision, in the same run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import gpu_codec
from benchmarks.bench_topk import cpu_info
from benchmarks.bench_zoo import command_line, commit_label, scale_for, write_results
from benchmarks.zoo import ZOO, split_update

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TENSORS = (1, 100, 1000)
OPS = ("from_bytes", "from_bytes_table_seen", "to_bytes", "to_bytes_names_seen", "rewrite", "copy")

# FIXED_HEAP: the child fixes glibc's trim and mmap thresholds first, the same for every package timed. Left to
# themselves, whether a payload-sized buffer freed at the heap's top goes back to the system (and is faulted in
# again by the next call) turns on the heap's layout, which one small allocation elsewhere changes: at one tensor of
# 2^23 top-1%, to_bytes read 1.05 ms in one package's process and 0.30 ms in the other's, for the same code path.
# Run in a child whose sys.path starts with the package to time; argv: directory of payloads, samples.
CHILD = r"""
import ctypes, ctypes.util, json, pathlib, sys, time
import numpy as np
try:  # (glibc: a freed payload-sized buffer stays in the heap, as in a process that has run a while; see FIXED_HEAP)
    _libc = ctypes.CDLL(ctypes.util.find_library("c"))
    _libc.mallopt(-1, 1 << 28), _libc.mallopt(-3, 1 << 25)  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
except (OSError, AttributeError):
    pass
import gpu_codec
from gpu_codec import Payload
from gpu_codec.format import TensorRecord, v2

def own(records):
    return [TensorRecord(r.name, r.dtype, r.shape, r.encoding, r.nnz,
                         {k: np.array(v) for k, v in r.buffers.items()}, dict(r.codec), dict(r.buffer_dtypes))
            for r in records]

def best(fn, number, samples):
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return min(out)

folder, samples = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = {"package": str(pathlib.Path(gpu_codec.__file__).parent)}
for path in sorted(folder.glob("*.bin")):
    blob = path.read_bytes()
    p = Payload.from_bytes(blob)
    recs, n = own(p.tensors), len(p.tensors)
    write = lambda: Payload(recs, p.pipeline, p.metadata).to_bytes()
    remembered = getattr(v2, "_remembered_entries", None)  # the names' entries, remembered (where they are)
    def write_new_names():
        if remembered is not None:
            remembered.cache_clear()
        return write()
    def read_new_table():  # the tables the reader remembers (where it does) forgotten first
        if hasattr(v2, "_KNOWN"):
            v2._KNOWN = ()
        return Payload.from_bytes(blob)
    def rewrite():  # read, then written again as it was read (a filter that passes a payload on)
        return Payload.from_bytes(blob).to_bytes()
    same = write_new_names() == blob and write() == blob and rewrite() == blob
    number = max(1, 1000 // n)
    rows[path.stem] = {
        "tensors": n, "bytes": len(blob), "same_bytes": same,
        "from_bytes": best(read_new_table, number, samples),
        "from_bytes_table_seen": best(lambda: Payload.from_bytes(blob), number, samples),
        "to_bytes": best(write_new_names, number, samples),
        "to_bytes_names_seen": best(write, number, samples),
        "rewrite": best(rewrite, number, samples),
        "copy": best(lambda: np.frombuffer(blob, np.uint8).copy(), number, samples),
    }
print(json.dumps(rows))
"""


def payloads(elements: int, seed: int = 0) -> dict[str, bytes]:
    """Case name -> payload bytes (made by this checkout)."""
    out = {}
    for t in TENSORS:
        u = split_update(elements, t, seed)
        out[f"split-{t:04d}"] = gpu_codec.compress(u.new, u.base, fraction=0.01).to_bytes()
        if t == 1000:
            pipe = [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices()]
            p = gpu_codec.compress(u.new, u.base, fraction=0.01, pipeline=pipe)
            out[f"split-{t:04d}-fp16-rice"] = p.to_bytes()
    e = ZOO["resnet-50"]
    u = e.build(scale_for(e, elements), seed)
    out["resnet-50"] = gpu_codec.compress(u.new, u.base, fraction=0.01).to_bytes()
    return out


def package_at(rev: str, into: pathlib.Path) -> pathlib.Path:
    """The package as it was at git revision ``rev``, laid out under ``into`` as the wheel lays it out (kernels
    and the NumPy twins inside it)."""
    for src, dst in (
        ("gpu_codec", "gpu_codec"),
        ("kernels", "gpu_codec/kernels"),
        ("cpu_fallback", "gpu_codec/cpu_fallback"),
    ):
        tar = subprocess.run(["git", "archive", rev, src], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(tar)) as tf:
            tf.extractall(into / "_tmp", filter="data")
        (into / dst).parent.mkdir(parents=True, exist_ok=True)
        (into / "_tmp" / src).rename(into / dst)
    return into


def timed_child(src: pathlib.Path, code: str, *args: Any) -> dict[str, Any]:
    """The JSON that ``code`` prints last, run in a child process whose imports find the package under ``src``
    first (argv: ``args``); the benchmarks that time a checkout against an older revision run each in one."""
    code = f"import sys; sys.path.insert(0, {str(src)!r})\n" + code
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, "-c", code, *map(str, args)]
    out = subprocess.run(argv, cwd=src, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"the timing process for {src} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def alternating(tmp: str, against: str | None, rounds: int, *args: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, result) of :func:`timed_child` ``(src, *args)`` for this checkout ("checkout") and, where ``against``
    names a revision, for the package at it (laid out under ``tmp``), taking turns ``rounds`` times; a revision's
    process must have imported its own package (its result's ``package``)."""
    trees = {"checkout": ROOT}
    if against:
        trees[against] = package_at(against, pathlib.Path(tmp) / "at")
    for _ in range(rounds):
        for label, src in trees.items():
            got = timed_child(src, *args)
            if label != "checkout" and not got["package"].startswith(tmp):
                raise RuntimeError(f"the timing process for {label} imported {got['package']}")
            yield label, got


def run(elements: int, samples: int, rounds: int, against: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "payloads"
        folder.mkdir()
        for name, blob in payloads(elements).items():
            (folder / f"{name}.bin").write_bytes(blob)
        best: dict[str, dict[str, Any]] = {}
        for label, got in alternating(tmp, against, rounds, CHILD, folder, samples):
            for case, row in got.items():
                if case == "package":
                    continue
                old = best.setdefault(label, {}).get(case)
                best[label][case] = row if old is None else {**row, **{op: min(row[op], old[op]) for op in OPS}}
    rows = []
    for case in sorted(best["checkout"]):
        for label in best:
            r = best[label][case]
            rows.append(
                {
                    "case": case,
                    "package": label,
                    "tensors": r["tensors"],
                    "bytes": r["bytes"],
                    "same_bytes": r["same_bytes"],
                    **{f"{op}_us_per_tensor": r[op] * 1e6 / r["tensors"] for op in OPS},
                    **{f"{op}_ms": r[op] * 1e3 for op in OPS},
                }
            )
    return result_doc("wire", against, elements=elements, samples=samples, rounds=rounds, rows=rows)


def result_doc(benchmark: str, against: str | None, **fields: Any) -> dict[str, Any]:
    """The head the results of a benchmark that times a checkout against a revision share (its name, the commit,
    the revision, the machine), then ``fields``."""
    machine = {**cpu_info(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    return {"benchmark": benchmark, "commit": commit_label(), "against": against, "machine": machine, **fields}


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"Measured at commit {doc['commit']} on {m['cpu_model']} ({m['simd']}), {m['cpu_count']} cores shared with "
        f"other work (load average {', '.join(f'{x:.1f}' for x in m['load_average'])}): µs per tensor, the best of "
        f"{doc['samples']} samples in each of {doc['rounds']} alternating rounds, each process with glibc's trim and "
        "mmap thresholds fixed (the same for every package: a freed payload-sized buffer stays in the heap). "
        f"Payloads: top-1% global of "
        f"{doc['elements']:,} fp32 elements split into uneven tensors, and of the zoo's ResNet-50; copy: one "
        "np.copy of the payload's bytes. from_bytes: a table the reader has not read before (a first round); table "
        "seen: the same table again (every later round of a federated run, where only the nnz change; a package "
        "that remembers nothing times the same). to_bytes: names the writer has not seen (a first round); names "
        "seen: the same names again. Rewrite: from_bytes then to_bytes of what it read (a filter passing the payload "
        "on; the table seen). Same bytes: the package writes exactly the payload it read."
        + (f" Run: `{doc['command']}`." if doc.get("command") else ""),
        "",
        "| payload | package | tensors | bytes | from_bytes | from_bytes, table seen | to_bytes | to_bytes, names seen "
        "| rewrite | copy | same bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['case']} | {r['package']} | {r['tensors']:,} | {r['bytes']:,} | "
            f"{r['from_bytes_us_per_tensor']:.2f} | {r['from_bytes_table_seen_us_per_tensor']:.2f} | "
            f"{r['to_bytes_us_per_tensor']:.2f} | "
            f"{r['to_bytes_names_seen_us_per_tensor']:.2f} | {r.get('rewrite_us_per_tensor', float('nan')):.2f} | "
            f"{r['copy_us_per_tensor']:.3f} | "
            f"{'yes' if r['same_bytes'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 23, help="elements of each split (and ResNet-50's cap)")
    ap.add_argument("--repeat", type=int, default=7, help="samples per figure in each round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the packages")
    ap.add_argument("--against", metavar="REV", help="also time the package at this git revision")
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/wire_cpu.json)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    doc = run(a.elements, a.repeat, a.rounds, a.against)
    doc["command"] = command_line("bench_wire.py", argv)
    print(markdown(doc))
    print(f"({time.perf_counter() - t0:.1f} s)")
    out = a.out or RESULTS / "wire_cpu.json"
    write_results(doc, out, markdown)
    return 0 if all(r["same_bytes"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
