"""Time the whole compress (delta -> scores -> exact threshold -> ordered COO) and decompress, against the
NumPy pipeline (subtract, abs, argpartition, sort indices, gather) and the torch pipeline (sub, abs, topk, sort,
gather), all measured in the same run on the same inputs. Prints ratios and writes JSON.

    python benchmarks/bench_topk.py                       # CPU: N = 1e6 .. 2^26
    python benchmarks/bench_topk.py --sizes 1e8 1e9       # on a GPU (inputs live on the device)
    python benchmarks/bench_topk.py --quick               # a smoke run (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import gpu_codec

RESULTS = pathlib.Path(__file__).parent / "results"


def timeit(fn, repeat: int, sync=lambda: None) -> float:
    fn()
    sync()  # warm-up (compiles kernels on first GPU use)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def numpy_pipeline(new, base, k):
    d = new - base
    s = np.abs(d)
    idx = np.argpartition(s, s.size - k)[s.size - k :]
    idx.sort()
    return idx, d[idx]


def torch_pipeline(new, base, k):
    import torch

    d = torch.sub(new, base)
    s = torch.abs(d)
    _, idx = torch.topk(s, k, sorted=False)
    idx, _ = torch.sort(idx)
    return idx, d[idx]


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "backend": gpu_codec.backend_info(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def run(sizes: list[int], fraction: float, repeat: int, out: pathlib.Path | None, torch_too: bool) -> list[dict]:
    be = gpu_codec.get_backend()
    on_gpu = be.name == "gpu"
    rows = []
    print(f"backend {be.name}; fraction {fraction}; median of {repeat}")
    print(
        f"{'N':>12} {'ours ms':>9} {'numpy ms':>9} {'torch ms':>9} {'x numpy':>8} {'x torch':>8} "
        f"{'decomp ms':>9} {'GB/s':>7}"
    )
    for n in sizes:
        rng = np.random.default_rng(n)
        base = rng.standard_normal(n, dtype=np.float32)
        new = base + rng.standard_normal(n, dtype=np.float32)
        k = gpu_codec.kept_count(fraction, n)
        sync = lambda: None  # noqa: E731
        if on_gpu:
            import cupy

            new, base = cupy.asarray(new), cupy.asarray(base)
            sync = cupy.cuda.Device().synchronize
        upd, bas = {"w": new}, {"w": base}
        t_ours = timeit(lambda: gpu_codec.compress(upd, bas, fraction=fraction), repeat, sync)
        payload = gpu_codec.compress(upd, bas, fraction=fraction)
        t_dec = timeit(lambda: gpu_codec.decompress(payload), repeat, sync)
        row = {
            "n": n,
            "k": k,
            "fraction": fraction,
            "ours_s": t_ours,
            "decompress_s": t_dec,
            "ours_gb_per_s": 8 * n / t_ours / 1e9,
        }
        # correctness against the baseline before timing it
        idx, vals = numpy_pipeline(
            np.asarray(new.get() if on_gpu else new), np.asarray(base.get() if on_gpu else base), k
        )
        got = payload.tensors[0].buffers["indices"]
        got = got.get() if on_gpu else got
        ties = np.unique(np.abs(vals)).size < vals.size
        if not ties:
            assert np.array_equal(np.sort(idx), got.astype(np.int64)), "selection differs from the baseline"
        if not on_gpu:
            row["numpy_s"] = timeit(lambda: numpy_pipeline(new, base, k), repeat)
        if torch_too:
            import torch

            if on_gpu:
                tn, tb = torch.from_dlpack(new), torch.from_dlpack(base)
                tsync = torch.cuda.synchronize
            else:
                tn, tb = torch.from_numpy(new), torch.from_numpy(base)
                tsync = sync
            row["torch_s"] = timeit(lambda: torch_pipeline(tn, tb, k), repeat, tsync)
        row["x_numpy"] = row["numpy_s"] / t_ours if "numpy_s" in row else None
        row["x_torch"] = row["torch_s"] / t_ours if "torch_s" in row else None
        rows.append(row)

        def f(v, scale=1e3, fmt="9.1f"):
            return format(v * scale, fmt) if v is not None else f"{'-':>9}"

        print(
            f"{n:>12,} {f(t_ours)} {f(row.get('numpy_s'))} {f(row.get('torch_s'))} "
            f"{f(row['x_numpy'], 1, '8.2f')} {f(row['x_torch'], 1, '8.2f')} {f(t_dec)} "
            f"{row['ours_gb_per_s']:7.2f}"
        )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"benchmark": "topk", "machine": machine_info(), "rows": rows}, indent=2, default=str)
        )
        print(f"wrote {out}")
    return rows


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """Time per element against N, ours and the baselines, on log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ns = [r["n"] for r in rows]
    for key, label in (("ours_s", "gpu_codec"), ("numpy_s", "NumPy argpartition"), ("torch_s", "torch.topk")):
        if all(r.get(key) for r in rows):
            ax.plot(ns, [r[key] / r["n"] * 1e9 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("elements N (fp32)")
    ax.set_ylabel("ns per element (lower is better)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", type=float, help="element counts (default 1e6, 2^22, 2^24, 2^26)")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="no PNG beside the JSON")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat, no JSON unless --out")
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/topk_<backend>.json)")
    a = ap.parse_args(argv)
    if a.quick:
        sizes, repeat = [100_000, 1 << 20], 1
    else:
        sizes, repeat = [int(s) for s in (a.sizes or [1e6, 2**22, 2**24, 2**26])], a.repeat
    torch_too = not a.no_torch
    if torch_too:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch_too = False
    out = a.out
    if out is None and not a.quick:
        out = RESULTS / f"topk_{gpu_codec.get_backend().name}.json"
    rows = run(sizes, a.fraction, repeat, out, torch_too)
    if out is not None and not a.no_plot:
        try:
            plot(
                rows,
                out.with_suffix(".png"),
                f"exact top-k compress, fraction {a.fraction}, {gpu_codec.get_backend().name} backend",
            )
        except ImportError:
            print("matplotlib is not installed: no plot (pip install 'gpu_codec[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
