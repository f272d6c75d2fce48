"""``gpu-codec bench``: the GPU-vs-CPU report.

Times the whole compress (delta -> scores -> exact threshold -> ordered COO) and decompress on every backend
present, against the NumPy pipeline (subtract, abs, argpartition, sort, gather) and the torch pipeline (sub,
abs, topk, sort, gather; on the CPU, and on CUDA where torch has it), over sizes and densities; measures the
bytes per kept parameter of the codec pipelines on a synthetic model; writes ``bench.json`` (with the machine:
CPU model, SIMD flags, core count) and PNG plots (throughput vs N, GPU speed-up where a GPU backend runs,
bytes per kept parameter per pipeline).

>>> rows = time_case("cpu", 4096, 0.01, repeat=1, torch_too=False)
>>> rows["n"], rows["k"], rows["ours_s"] > 0, rows["selection_matches_numpy"]
(4096, 41, True, True)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import gpu_codec

from ..errors import InvalidInputError
from ..synthetic import smallest_model_params
from .args import int_at_least, parse_count, parse_density, parse_pipeline
from .outputs import describe, resolve_output, write_output

PLOTS = ("throughput.png", "speedup.png", "bytes_per_param.png")
PLOT_EXTRA = (
    "matplotlib is not installed, so no plots were written (the 'plot' extra brings it: pip install 'matplotlib>=3.7')"
)
PIPELINES = (
    "raw",
    "fp16,rice",
    "fp16,rice,zstd",
    "bf16,rice,zstd",
    "int8,rice,zstd",
    "ternary,rice",
    "ternary,rice,zstd",
)
_SIMD = (
    "sse2",
    "ssse3",
    "sse4_1",
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "neon",
    "asimd",
    "asimdhp",
    "sve",
    "sve2",
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gpu-codec bench``."""

    p.add_argument(
        "--sizes",
        nargs="+",
        type=_positive_size,
        metavar="N",
        help="element counts, e.g. 4194304, 4e6 or 2^22 (default 2^20 2^22 2^24 2^26)",
    )
    p.add_argument("--fractions", nargs="+", type=parse_density, metavar="F", help="densities (default 0.001 0.01 0.1)")
    p.add_argument(
        "--repeat", type=int_at_least(1, "--repeat"), metavar="N", help="timed runs per case (median; default 3)"
    )
    p.add_argument(
        "--params",
        type=int_at_least(smallest_model_params(), "--params", 1 << 31),
        metavar="N",
        help="model size for the byte counts, e.g. 1e6 (the default)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["cpu", "gpu", "emulated"],
        help="backends to time (default: cpu, and gpu where usable)",
    )
    p.add_argument("--no-torch", action="store_true", help="leave out the torch baseline")
    p.add_argument("--no-plot", action="store_true", help="JSON only, no PNG")
    p.add_argument(
        "--out",
        default="gpu-codec-bench",
        help="folder for bench.json and the plots (files already there are replaced only with --force)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, one run each, the smallest model (a smoke test; options given explicitly still apply)",
    )


def _positive_size(text: str) -> int:

    try:
        v = parse_count(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 2**40:
        raise argparse.ArgumentTypeError(
            f"must be an element count from 1 to 2^40 such as 1e6, 4194304 or 2^22, got {describe(repr(text))}"
        )
    return v


def machine_info() -> dict[str, Any]:
    """CPU model, SIMD flags, core counts, memory and library versions of this machine.

    >>> info = machine_info()
    >>> info["cpu_count"] >= 1 and isinstance(info["simd"], list)
    True
    """
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and value.strip():
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": model,
        "machine": platform.machine(),
        "simd": [f for f in _SIMD if f in flags],
        "cpu_count": os.cpu_count() or 1,
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gpu_codec": gpu_codec.__version__,
    }
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    return info


def timeit(fn: Callable[[], Any], repeat: int, sync: Callable[[], Any] = lambda: None) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` (``sync`` after each, e.g. a device synchronize), after one
    warm-up call."""
    fn()
    sync()  # warm-up: the first GPU call compiles kernels
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def numpy_topk(new: np.ndarray, base: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy baseline: subtract, abs, argpartition, sort the indices, gather."""
    d = new - base
    s = np.abs(d)
    idx = np.argpartition(s, s.size - k)[s.size - k :]
    idx.sort()
    return idx, d[idx]


def torch_topk(new: Any, base: Any, k: int) -> tuple[Any, Any]:
    """The torch baseline: sub, abs, topk, sort the indices, gather."""
    import torch

    d = torch.sub(new, base)
    s = torch.abs(d)
    _, idx = torch.topk(s, k, sorted=False)
    idx, _ = torch.sort(idx)
    return idx, d[idx]


def _inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    base = rng.standard_normal(n, dtype=np.float32)
    return base + rng.standard_normal(n, dtype=np.float32), base


def time_case(backend: str, n: int, fraction: float, *, repeat: int, torch_too: bool) -> dict[str, Any]:
    """Time one (size, density) on the backend in use (named ``backend``): ours, and the baselines that run on
    the same kind of device. Checks our selection against NumPy's where no tie blurs it."""
    new, base = _inputs(n)
    k = gpu_codec.kept_count(fraction, n)
    on_gpu = backend == "gpu"
    sync: Callable[[], Any] = lambda: None  # noqa: E731
    upd, bas = {"w": new}, {"w": base}
    if on_gpu:
        import cupy

        upd, bas = {"w": cupy.asarray(new)}, {"w": cupy.asarray(base)}
        sync = cupy.cuda.Device().synchronize
    row: dict[str, Any] = {"backend": backend, "n": n, "k": k, "fraction": fraction}
    row["ours_s"] = timeit(lambda: gpu_codec.compress(upd, bas, fraction=fraction), repeat, sync)
    payload = gpu_codec.compress(upd, bas, fraction=fraction)
    row["decompress_s"] = timeit(lambda: gpu_codec.decompress(payload), repeat, sync)
    got = payload.tensors[0].buffers["indices"]
    got = np.asarray(got.get() if hasattr(got, "get") else got).astype(np.int64)
    idx, vals = numpy_topk(new, base, k)
    row["selection_matches_numpy"] = bool(np.array_equal(idx, got))
    if not row["selection_matches_numpy"] and np.unique(np.abs(vals)).size == vals.size:
        raise AssertionError(f"selection differs from the NumPy baseline at N={n}, fraction={fraction}")
    if backend == "cpu":
        row["numpy_s"] = timeit(lambda: numpy_topk(new, base, k), repeat)
    if torch_too:
        import torch

        if on_gpu and torch.cuda.is_available():
            tn, tb = torch.from_dlpack(upd["w"]), torch.from_dlpack(bas["w"])
            row["torch_cuda_s"] = timeit(lambda: torch_topk(tn, tb, k), repeat, torch.cuda.synchronize)
        elif backend == "cpu":
            tn, tb = torch.from_numpy(new), torch.from_numpy(base)
            row["torch_s"] = timeit(lambda: torch_topk(tn, tb, k), repeat)
    return row


def size_table(params: int, fractions: list[float | None]) -> list[dict[str, Any]]:
    """Bytes per kept parameter and relative L2 error of each pipeline in :data:`PIPELINES` on a synthetic update.

    >>> rows = size_table(smallest_model_params(), [0.1])
    >>> [r["pipeline"] for r in rows][:2], rows[0]["rel_l2_error"] > 0
    (['raw', 'fp16,rice'], True)
    """
    from gpu_codec.synthetic import synthetic_model, synthetic_update

    base = synthetic_model(params, seed=0)
    new = synthetic_update(base, seed=1)
    delta = np.concatenate([(new[k].astype(np.float64) - base[k]).ravel() for k in base])
    n = delta.size
    dense = sum(v.nbytes for v in base.values())
    rows = []
    for f in fractions:
        for spec in PIPELINES:
            blob = gpu_codec.compress(new, base, fraction=f, pipeline=parse_pipeline(spec) or None).to_bytes()
            dec = gpu_codec.decompress(blob)
            got = np.concatenate([np.asarray(dec[k], np.float64).ravel() for k in base])
            kept = n if f is None else gpu_codec.kept_count(f, n)
            rows.append(
                {
                    "fraction": f,
                    "pipeline": spec,
                    "bytes": len(blob),
                    "kept": kept,
                    "bytes_per_kept_parameter": len(blob) / kept,
                    "ratio": dense / len(blob),
                    "rel_l2_error": float(np.linalg.norm(got - delta) / np.linalg.norm(delta)),
                }
            )
    return rows


def _gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean no GPU here
        return False


def plot_report(report: dict[str, Any], out: str, force: bool = False) -> list[str]:
    """Write the PNG plots of a bench report into ``out`` (replacing existing ones only with ``force``); returns
    their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, paths = report["timings"], []
    fractions = sorted({r["fraction"] for r in rows})
    series = [
        ("ours_s", "gpu_codec"),
        ("numpy_s", "NumPy argpartition"),
        ("torch_s", "torch.topk (CPU)"),
        ("torch_cuda_s", "torch.topk (CUDA)"),
    ]

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out, name)
        fig.tight_layout()
        write_output(resolve_output(path, force=force), lambda f: fig.savefig(f, format="png"))
        plt.close(fig)
        paths.append(path)

    if rows:
        fig, axes = plt.subplots(1, len(fractions), figsize=(4.2 * len(fractions), 3.8), dpi=110, squeeze=False)
        for ax, frac in zip(axes[0], fractions):
            for be in sorted({r["backend"] for r in rows}):
                for key, label in series:
                    pts = [r for r in rows if r["fraction"] == frac and r["backend"] == be and r.get(key)]
                    if pts:
                        name = f"{label} [{be}]" if key == "ours_s" else label
                        ax.plot([r["n"] for r in pts], [r["n"] / r[key] / 1e9 for r in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("elements N (fp32)")
            ax.set_title(f"fraction {frac}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("compress throughput (G elements/s)")
        axes[0][0].legend(fontsize=7)
        save(fig, "throughput.png")

    gpu = [r for r in rows if r["backend"] == "gpu"]
    if gpu:
        cpu = {(r["n"], r["fraction"]): r for r in rows if r["backend"] == "cpu"}
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for key, label in (("ours_s", "vs gpu_codec CPU"), ("numpy_s", "vs NumPy"), ("torch_s", "vs torch CPU")):
            for frac in fractions:
                pts = []
                for r in gpu:
                    c = cpu.get((r["n"], frac)) if r["fraction"] == frac else None
                    if c and c.get(key):
                        pts.append((r["n"], c[key] / r["ours_s"]))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{label}, fraction {frac}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements N (fp32)")
        ax.set_ylabel("GPU speed-up (x)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "speedup.png")

    sizes = report["sizes"]
    if sizes:
        pipes = list(dict.fromkeys(r["pipeline"] for r in sizes))
        fracs = list(dict.fromkeys(r["fraction"] for r in sizes))
        fig, ax = plt.subplots(figsize=(7.2, 4.0), dpi=110)
        width = 0.8 / len(fracs)
        for j, frac in enumerate(fracs):
            vals = [
                next(r["bytes_per_kept_parameter"] for r in sizes if r["pipeline"] == p and r["fraction"] == frac)
                for p in pipes
            ]
            ax.bar([i + j * width for i in range(len(pipes))], vals, width, label=f"fraction {frac}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(pipes))], pipes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("bytes per kept parameter")
        ax.set_title(f"payload size, {report['settings']['params']:,}-parameter synthetic update")
        ax.legend(fontsize=7)
        save(fig, "bytes_per_param.png")
    return paths


def bench_command(a: argparse.Namespace, emit: Callable, progress: Callable, backend_ctx: Callable) -> int:
    """Run ``gpu-codec bench`` (called by the command-line entry point with its output helpers)."""
    import json

    if a.quick:  # (what the options say, where given)
        sizes, fractions = a.sizes or [1 << 14, 1 << 16], a.fractions or [0.01, 0.1]
        repeat, params = a.repeat or 1, a.params or smallest_model_params()
    else:
        sizes = a.sizes or [1 << 20, 1 << 22, 1 << 24, 1 << 26]
        fractions, repeat, params = a.fractions or [0.001, 0.01, 0.1], a.repeat or 3, a.params or 1_000_000
    backends = a.backends or (["cpu", "gpu"] if _gpu_usable() else ["cpu"])
    torch_too = not a.no_torch
    if torch_too:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch_too = False
    for be in backends:  # one that is not there is refused before the folder is made
        with backend_ctx(be, "--backends"):
            pass
    if not a.out:
        raise InvalidInputError("--out is empty; name a folder for bench.json and the plots")
    if a.out == "-":
        raise InvalidInputError("--out - would be a folder named '-' (bench writes a folder, not stdout); name one")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise InvalidInputError(f"--out {describe(a.out)} is a file; name a folder")
    os.makedirs(a.out, exist_ok=True)
    json_path = os.path.join(a.out, "bench.json")
    for name in ["bench.json"] + ([] if a.no_plot else list(PLOTS)):  # refused before an hour of timing, not after
        resolve_output(os.path.join(a.out, name), force=a.force)
    timings = []
    cases = [(be, n, f) for be in backends for n in sizes for f in fractions]
    with progress(a, len(cases) + 1, "bench", "case") as bar:
        for be in backends:
            with backend_ctx(be):
                for n in sizes:
                    for f in fractions:
                        bar.set_postfix_str(f"{be} N={n:,} fraction={f}")
                        timings.append(time_case(be, n, f, repeat=repeat, torch_too=torch_too))
                        bar.update()
        size_rows = size_table(params, list(fractions))
        bar.update()
    report: dict[str, Any] = {
        "benchmark": "gpu-codec bench",
        "machine": machine_info(),
        "backend_default": gpu_codec.backend_info(),
        "settings": {
            "sizes": sizes,
            "fractions": fractions,
            "repeat": repeat,
            "params": params,
            "backends": backends,
            "torch": torch_too,
        },
        "timings": timings,
        "sizes": size_rows,
        "plots": [],
    }
    if not a.no_plot:
        try:
            report["plots"] = plot_report(report, a.out, force=a.force)
        except ImportError:
            report["plots_skipped"] = PLOT_EXTRA
            print(f"gpu-codec: {PLOT_EXTRA}", file=sys.stderr)
    path = json_path
    text = json.dumps(report, indent=2, ensure_ascii=True, default=str)
    write_output(resolve_output(path, force=a.force), lambda f: f.write(text.encode()))
    report["json"] = path
    m = report["machine"]
    lines = [
        f"machine: {describe(m['cpu_model'])}, {m['cpu_usable']} of {m['cpu_count']} cores usable, "
        f"SIMD {' '.join(m['simd']) or 'none listed'}",
        f"{'backend':<8} {'N':>12} {'fraction':>8} {'ours ms':>9} {'numpy ms':>9} {'torch ms':>9} {'decomp ms':>9}",
    ]

    def ms(v: float | None) -> str:
        return f"{v * 1e3:9.2f}" if v else f"{'-':>9}"

    for r in timings:
        torch_s = r.get("torch_s") or r.get("torch_cuda_s")
        lines.append(
            f"{r['backend']:<8} {r['n']:>12,} {r['fraction']:>8} {ms(r['ours_s'])} {ms(r.get('numpy_s'))} "
            f"{ms(torch_s)} {ms(r['decompress_s'])}"
        )
    lines.append(f"{'pipeline':<20} {'fraction':>8} {'B/kept':>8} {'ratio':>8} {'rel L2':>7}")
    for r in size_rows:
        lines.append(
            f"{r['pipeline']:<20} {r['fraction']:>8} {r['bytes_per_kept_parameter']:8.2f} {r['ratio']:8.1f} "
            f"{r['rel_l2_error']:7.3f}"
        )
    lines.append(f"wrote {describe(path)}" + "".join(f", {describe(p)}" for p in report["plots"]))
    emit(a, report, lines)
    return 0
