"""The host's cost of handing a model's CUDA tensors to the kernels, timed on the CPU (CuPy's objects over device
addresses are made without touching a device, so no GPU is needed): per call, a compress reads the update's and
the base's tensors, a decompress and an ``Aggregator`` the base's.

For the tensors of N = 2^23 fp32 elements split into 100 and 1,000 uneven tensors (benchmarks/zoo.py
``split_update``'s sizes), the median of ``--repeat`` calls of:

- ``wrap``: the loop every call ran before the tensors were given by address (up to cd5c2c3's
  ``arrays.device_views``, copied here as the baseline): a CuPy array made a tensor (``UnownedMemory``,
  ``MemoryPointer``, ``ndarray``);
- ``table``: :class:`~gpu_codec.backends.base.DeviceViews` of the same columns (what ``torch_tensors`` makes now);
- ``addresses``: its device table of addresses as the kernel backends build it (``KernelOps._ptrs``, uploaded to a
  NumPy array here);
- ``iterate``: every item of a new table made (what reading a whole table costs, as ``Aggregator(base)``'s check
  of the base does).

Each is printed beside its ratio to ``wrap`` measured in the same run. Then CuPy inputs (arrays over addresses
nothing reads, in the split's sizes): compress's checks of an update and a base of them (``encode._check_tensors``)
as ``cupy_each``, one tensor at a time (``to_tensor``, the path CuPy inputs took before :func:`cupy_tensors`; the
table wrappers turned off for it), and ``cupy_table``, read as two tables. Needs CuPy importable (no device).

    python benchmarks/bench_device_views.py     # writes benchmarks/results/device_views_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.bench_topk import cpu_info
from benchmarks.bench_zoo import command_line, commit_label, write_results
from benchmarks.zoo import split_update
from gpu_codec import encode

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPS = ("wrap", "table", "addresses", "iterate")
CUPY_OPS = ("cupy_each", "cupy_table")
BASE_ADDRESS = 1 << 40  # (an address no call dereferences: CuPy's objects only hold it)


def wrap(cupy: Any, ptrs: list[int], numels: list[int], storage: list[Any], owners: list[Any], device_id: int):
    """The baseline: cd5c2c3's ``arrays.device_views``, a CuPy array made a tensor on every call."""
    unowned, pointer, ndarray = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, cupy.ndarray
    sizes = {dt: np.dtype(dt).itemsize for dt in set(storage)}
    out = []
    for p, n, dt, owner in zip(ptrs, numels, storage, owners):
        if n:
            out.append(ndarray((n,), dt, pointer(unowned(p, n * sizes[dt], owner, device_id), 0)))
        else:
            out.append(ndarray((0,), dt))
    return out


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def row(cupy: Any, tensors: int, elements: int, repeat: int) -> dict[str, Any]:
    """One tensor count's timings (ms) and their ratios to ``wrap``."""
    from gpu_codec.backends.base import DeviceViews
    from gpu_codec.backends.kernels import KernelOps

    numels = [int(a.size) for a in split_update(elements, tensors, 0).new.values()]
    ptrs = np.cumsum([BASE_ADDRESS] + [4 * n for n in numels[:-1]]).tolist()
    storage, owners, devs = [np.float32] * tensors, [object()] * tensors, [0] * tensors
    ops = KernelOps(types.SimpleNamespace(xp=np))
    fns = {
        "wrap": lambda: wrap(cupy, ptrs, numels, storage, owners, 0),
        "table": lambda: DeviceViews(cupy, ptrs, numels, storage, owners, devs),
        "addresses": lambda: ops._ptrs(DeviceViews(cupy, ptrs, numels, storage, owners, devs)),
        "iterate": lambda: list(DeviceViews(cupy, ptrs, numels, storage, owners, devs)),
    }
    got = list(DeviceViews(cupy, ptrs, numels, storage, owners, devs))
    want = wrap(cupy, ptrs, numels, storage, owners, 0)
    assert [(a.data.ptr, a.size) for a in got] == [(a.data.ptr, a.size) for a in want]  # (the same arrays)
    update, base = _cupy_update(cupy, numels, 0), _cupy_update(cupy, numels, len(numels))
    fns["cupy_each"] = lambda: _checked_each(update, base)
    fns["cupy_table"] = lambda: encode._check_tensors(update, base)
    assert [t.data.data.ptr for t in _checked_each(update, base)[1]] == encode._check_tensors(update, base)[1].data.ptrs
    ms = {op: [] for op in fns}
    for _ in range(3):  # (the ops take turns, so that each sees the same machine load)
        for op in fns:
            ms[op].append(_median_ms(fns[op], repeat))
    out: dict[str, Any] = {"tensors": tensors, "elements": elements}
    for op in fns:
        out[f"{op}_ms"] = min(ms[op])
    for op in OPS:
        out[f"x_{op}"] = out[f"{op}_ms"] / out["wrap_ms"]
    out["x_cupy_table"] = out["cupy_table_ms"] / out["cupy_each_ms"]
    return out


def _cupy_update(cupy: Any, numels: list[int], first: int) -> dict[str, Any]:
    """name -> a CuPy fp32 array of each size, over addresses nothing reads (made without a device; ``first``
    sets them apart from another update's)."""
    out, addr = {}, BASE_ADDRESS + (first << 30)
    for i, n in enumerate(numels):
        mem = cupy.cuda.UnownedMemory(addr, 4 * n, None, 0)
        out[f"t{i}"] = cupy.ndarray((n,), np.float32, cupy.cuda.MemoryPointer(mem, 0))
        addr += (4 * n + 511) // 512 * 512
    return out


def _checked_each(update: dict[str, Any], base: dict[str, Any]):
    """compress's checks with the table wrappers off: every tensor wrapped and checked alone (``to_tensor``)."""
    table, encode.tensor_table = encode.tensor_table, lambda xs: None
    try:
        return encode._check_tensors(update, base)
    finally:
        encode.tensor_table = table


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# Handing CUDA tensors to the kernels, on the host (benchmarks/bench_device_views.py)",
        "",
        f"{m['cpu_model']} ({m['simd']}), Python {m['python']}, CuPy {m['cupy']}; commit {doc['commit']}; the best of "
        f"three medians of {doc['repeat']} calls, ms (in brackets: over `wrap`, the loop every call ran before).",
        "",
        "| tensors | wrap | table | addresses | iterate |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        cells = [f"{r['wrap_ms']:.3f}"] + [f"{r[f'{op}_ms']:.4f} ({r[f'x_{op}']:.3g}×)" for op in OPS[1:]]
        lines.append(f"| {r['tensors']:,} | {' | '.join(cells)} |")
    lines += [
        "",
        "CuPy inputs: compress's checks of an update and a base, ms (in brackets: over `cupy_each`, a tensor at a "
        "time, the path they took before).",
        "",
        "| tensors | cupy_each | cupy_table |",
        "| ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        if "cupy_each_ms" in r:
            lines.append(
                f"| {r['tensors']:,} | {r['cupy_each_ms']:.3f} | {r['cupy_table_ms']:.3f} ({r['x_cupy_table']:.3g}×) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--elements", type=int, default=1 << 23)
    ap.add_argument("--repeat", type=int, default=201)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "device_views_cpu.json")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    args = ap.parse_args(argv)
    if (args.out.exists() or args.out.with_suffix(".md").exists()) and not args.force:
        ap.error(f"{args.out} or its .md exists (--force to replace them)")
    try:
        import cupy
    except ImportError:
        ap.error("CuPy is not importable here (pip install -e '.[nvrtc]' or a cupy-cuda wheel)")
    doc = {
        "benchmark": "device_views",
        "command": command_line("bench_device_views.py", argv),
        "commit": commit_label(),
        "repeat": args.repeat,
        "machine": {**cpu_info(), "python": platform.python_version(), "cupy": cupy.__version__},
        "rows": [],
    }
    for n in args.tensors:
        doc["rows"].append(row(cupy, n, args.elements, args.repeat))
        print(json.dumps(doc["rows"][-1]))
    write_results(doc, args.out, markdown)
    print(markdown(doc), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
