"""Where the CPU's split rows of the model zoo lose against one tensor: the memory the caller's tensors lie in.

The zoo's split entries (N = 2^23 fp32 in 1, 100 and 1,000 tensors) hold each tensor in an allocation of its own,
as a model's parameters are held. This benchmark takes the same update twice, as those separate arrays and as
views of one allocation each for ``new`` and ``base`` (the same values, the same tensor table), and measures in one
run, the two alternating in each round:

- compress (top-1 %, global) and decompress onto the base, each against one ``np.subtract`` pass over the same
  bytes laid flat (the zoo's yardstick);
- a copy of the base's tensors end to end into one warm buffer, from the separate arrays and from the views (the
  read the decompress onto the base makes);
- writing 2^23 fp32 into pages mapped for the call (faulted in and zeroed by the kernel, as a decompress's output
  is wherever the allocator hands back new pages) against writing into a buffer already written.

Writes ``results/layout_cpu.json`` and ``results/layout_cpu.md``.

    python benchmarks/bench_layout.py                   # 15 rounds (--force replaces an existing result)
    python benchmarks/bench_layout.py --quick           # a smoke run (CI): 2^16 elements, 2 rounds, no files
"""

from __future__ import annotations

import argparse
import json
import mmap
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import gpu_codec
from benchmarks.bench_topk import RESULTS, machine_info
from benchmarks.bench_zoo import commit_label
from benchmarks.zoo import split_update

COUNTS = (1, 100, 1000)


def one_allocation(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same tensors as views of one new allocation, in the same order and shapes."""
    flat = np.concatenate([a.reshape(-1) for a in tensors.values()])
    out, at = {}, 0
    for name, a in tensors.items():
        out[name] = flat[at : at + a.size].reshape(a.shape)
        at += a.size
    return out


def _write_fresh(src: np.ndarray) -> None:
    """``src`` copied into pages the kernel maps for the call (faulted in and zeroed as they are first written),
    advised huge as NumPy advises its large allocations, then unmapped: what an output costs where the allocator
    hands back new pages (glibc maps every allocation of 32 MiB or more anew)."""
    m = mmap.mmap(-1, src.nbytes)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, src.dtype)
    np.copyto(a, src)
    del a
    m.close()


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(n: int, tensors: int, rounds: int, fraction: float = 0.01) -> dict[str, Any]:
    """One row: medians (ms) of each measurement over ``rounds`` rounds, and their ratios."""
    u = split_update(n, tensors, 0)
    layouts = {"separate": (u.new, u.base), "one": (one_allocation(u.new), one_allocation(u.base))}
    blob = gpu_codec.compress(u.new, u.base, fraction=fraction).to_bytes()
    for new, base in layouts.values():  # (the same bytes either way; and a warm-up)
        assert gpu_codec.compress(new, base, fraction=fraction).to_bytes() == blob
        gpu_codec.decompress(blob, base)
    flat_new, flat_base = (np.concatenate([a.reshape(-1) for a in d.values()]) for d in (u.new, u.base))
    out = np.empty_like(flat_new)
    times: dict[str, list[float]] = {}

    def keep(key: str, ms: float) -> None:
        times.setdefault(key, []).append(ms)

    for r in range(rounds):
        keep("subtract", _ms(lambda: np.subtract(flat_new, flat_base, out=out)))
        for name in ("separate", "one") if r % 2 else ("one", "separate"):
            new, base = layouts[name]
            parts = list(base.values())
            keep(f"compress_{name}", _ms(lambda new=new, base=base: gpu_codec.compress(new, base, fraction=fraction)))
            keep(f"decompress_{name}", _ms(lambda base=base: gpu_codec.decompress(blob, base)))
            keep(f"copy_{name}", _ms(lambda parts=parts: np.concatenate([p.reshape(-1) for p in parts], out=out)))
        keep("write_fresh", _ms(lambda: _write_fresh(flat_base)))
        keep("write_warm", _ms(lambda: np.copyto(out, flat_base)))
    med = {k: statistics.median(v) for k, v in times.items()}
    sub = med["subtract"]
    row: dict[str, Any] = {"tensors": tensors, "n": n, "ms": med}
    for op in ("compress", "decompress"):
        for name in ("separate", "one"):
            row[f"{op}_{name}_x_subtract"] = med[f"{op}_{name}"] / sub
    row["copy_separate_x_one"] = med["copy_separate"] / med["copy_one"]
    row["copy_one_x_subtract"] = med["copy_one"] / sub
    row["write_fresh_x_warm"] = med["write_fresh"] / med["write_warm"]
    return row


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Measured at commit {result['commit']} on {m['cpu_model']} ({m['simd']}), {m['threads']} threads, "
        f"N = {result['rows'][0]['n']:,} fp32, top-1 % global, median of {result['rounds']} rounds; ratios to one "
        "`np.subtract` pass over the same bytes laid flat, measured in the same run; the copy and the fresh "
        f"output as ratios of their twins. Run: `{result['command']}`.",
        "",
        "| tensors | compress, separate | compress, one allocation | decompress, separate | "
        "decompress, one allocation | copy of the base, separate / one | fresh output / warm |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['tensors']:,} | {r['compress_separate_x_subtract']:.2f}x | {r['compress_one_x_subtract']:.2f}x | "
            f"{r['decompress_separate_x_subtract']:.2f}x | {r['decompress_one_x_subtract']:.2f}x | "
            f"{r['copy_separate_x_one']:.2f}x | {r['write_fresh_x_warm']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=1 << 23)
    ap.add_argument("--quick", action="store_true", help="2^16 elements, 2 rounds, nothing written")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "layout_cpu.json")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    a = ap.parse_args(argv)
    if not a.quick and (a.out.exists() or a.out.with_suffix(".md").exists()) and not a.force:
        ap.error(f"{a.out} or its .md exists (--force to replace them)")
    n, rounds = (1 << 16, 2) if a.quick else (a.n, a.rounds)
    rows = []
    for tensors in COUNTS:
        row = measure(n, tensors, rounds)
        rows.append(row)
        print(
            f"{tensors:>5} tensors: compress {row['compress_separate_x_subtract']:.2f}x separate, "
            f"{row['compress_one_x_subtract']:.2f}x one allocation; decompress "
            f"{row['decompress_separate_x_subtract']:.2f}x / {row['decompress_one_x_subtract']:.2f}x; copy of the "
            f"base {row['copy_separate_x_one']:.2f}x; fresh output {row['write_fresh_x_warm']:.2f}x warm",
            flush=True,
        )
    result = {
        "benchmark": "layout",
        "commit": commit_label(),
        "machine": machine_info(),
        "rounds": rounds,
        "rows": rows,
        "command": " ".join(["python", "benchmarks/bench_layout.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    if not a.quick:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {a.out} and {a.out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
