"""Time the whole compress (delta -> scores -> exact threshold -> ordered COO) and decompress, against one
``np.subtract(new, base, out=)`` pass (the memory floor's yardstick), the NumPy pipeline (subtract, abs,
argpartition, sort indices, gather) and the torch pipeline (sub, abs, topk, sort, gather), all measured in the same
run on the same inputs, round-robin (each round in a new order). On the NumPy backend also: compress with one thread
("x thr" is the speed-up of all threads over one); the same speed-up for two trivially parallel loads on the same
pool, gauges of what the machine gives at that moment: the memory floor itself, new and base read once in blocks into
a cache-resident buffer ("(mem)", bound by memory bandwidth: where one core already draws most of it, no pass at the
floor can gain much from the others) and cache-resident NumPy calls ("(cpu)", bound by the cores and the interpreter
lock); decompress onto the base, also as a multiple of the subtract pass ("dec/sub"); the peak extra memory
(tracemalloc, % of the dense update); and the throughput of the value codecs and of Rice coding. Prints ratios of
medians, and "x sub" and "x thr" again from each timing's least disturbed sample ("min"; the JSON has every
timing's), and writes JSON (and a plot).

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
import random
import statistics
import sys
import threading
import time
import tracemalloc

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from gpu_codec.cpu_fallback import parallel
from gpu_codec.cpu_fallback import quantize as _q
from gpu_codec.cpu_fallback import rice as _rice

import gpu_codec
from gpu_codec.cli.bench import numpy_topk, timeit, torch_topk
from gpu_codec.xp.rice import rice_decode

RESULTS = pathlib.Path(__file__).parent / "results"


def cpu_info() -> dict:
    """CPU model and the widest SIMD level its flags announce (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    simd = next(
        (
            name
            for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"))
            if flag in flags
        ),
        "unknown",
    )
    if simd == "AVX-512":
        simd += " (" + ", ".join(f for f in ("avx512bw", "avx512vl", "avx512_vbmi2") if f in flags) + ")"
    return {"cpu_model": model, "simd": simd}


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        **cpu_info(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "threads": parallel.thread_count(),
        "backend": gpu_codec.backend_info(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def with_threads(n: int | None, fn):
    """Run ``fn`` with GPU_CODEC_THREADS set to ``n`` (None: as the environment has it)."""
    old = os.environ.get(parallel.ENV)
    if n is not None:
        os.environ[parallel.ENV] = str(n)
    try:
        return fn()
    finally:
        if n is not None:
            if old is None:
                os.environ.pop(parallel.ENV, None)
            else:
                os.environ[parallel.ENV] = old


def peak_extra_bytes(fn) -> int:
    """Peak bytes allocated (NumPy reports to tracemalloc) while ``fn`` runs, above what was live before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


_thread_buffers = threading.local()


def floor_pass(new, base) -> None:
    """The memory floor as the selection meets it, on the thread pool: ``new`` and ``base`` read once, in blocks of
    2^17 elements subtracted into a buffer each thread keeps (nothing of the tensor's size is written, no page is
    touched for the first time). Its speed-up from one thread to all is what a second core adds to a pass bound by
    memory bandwidth on this machine at this moment."""
    step, block = 1 << 20, 1 << 17

    def part(a: int) -> None:
        buf = getattr(_thread_buffers, "d", None)
        if buf is None or buf.dtype != new.dtype:
            buf = _thread_buffers.d = np.empty(block, new.dtype)
        end = min(new.size, a + step)
        for s in range(a, end, block):
            e = min(end, s + block)
            np.subtract(new[s:e], base[s:e], out=buf[: e - s])

    parallel.parallel_map(part, range(0, new.size, step))


def compute_probe() -> None:
    """A fixed amount of cache-resident NumPy work (a few calls per 32K elements, like the selection's blocks) in
    items on the pool: its speed-up from one thread to all shows how much parallel compute the machine gives at
    that moment, apart from memory bandwidth."""

    def item(_: int) -> None:
        x = np.linspace(1.0, 2.0, 1 << 15, dtype=np.float32)
        m = np.empty(x.size, np.bool_)
        for _ in range(8):
            np.sqrt(x, out=x)
            np.greater_equal(x, np.float32(1.5), out=m)
            m.nonzero()

    parallel.parallel_map(item, range(64))


def codec_rates(idx: np.ndarray, vals: np.ndarray, numel: int, repeat: int) -> dict:
    """GB/s of each value codec (fp32 values in) and of Rice coding (uint32 indices in, or decoded out), as the NumPy
    backend runs them (encoders in chunks on the pool)."""
    nb_v, nb_i = vals.nbytes, idx.size * 4
    k = _rice.rice_param(idx.size, numel)
    stream, bits = _rice.rice_encode(idx, k)
    f16 = _q.cast_f16(vals)
    q8, sc = _q.int8_absmax(vals, 256)
    cases = {
        "float16 encode": (lambda: _q.encode_cast16(vals, "float16", None, None), nb_v),
        "float16 decode": (lambda: _q.decode_f16(f16), nb_v),
        "bfloat16 encode": (lambda: _q.encode_cast16(vals, "bfloat16", None, None), nb_v),
        "int8 encode": (lambda: _q.encode_int8(vals, 256, None, None), nb_v),
        "int8 decode": (lambda: _q.int8_decode(q8, sc, 256), nb_v),
        "ternary encode": (lambda: _q.encode_ternary(vals, None, None), nb_v),
        "rice encode": (lambda: _rice.rice_encode(idx, k), nb_i),
        "rice decode": (lambda: rice_decode(stream, bits, k, idx.size, numel), nb_i),
    }
    return {name: nbytes / timeit(fn, repeat) / 1e9 for name, (fn, nbytes) in cases.items()}


def interleaved(timed: dict, repeat: int, seed: int, sync=lambda: None) -> dict[str, list[float]]:
    """Seconds of each of ``timed``'s calls, ``repeat`` rounds after one warm-up round: the same round of each
    measurement, repeated, so that drifts in the machine's load hit all of them alike."""
    samples = {key: [] for key in timed}
    for fn in timed.values():
        fn()
    sync()
    order = list(timed)
    shuffle = random.Random(seed)  # each round in a new order: no timing always follows the same one (a timing run
    for _ in range(repeat):  # right after another on the same inputs found them in cache, and ran up to 25 % faster)
        shuffle.shuffle(order)
        for key in order:
            t0 = time.perf_counter()
            timed[key]()
            sync()
            samples[key].append(time.perf_counter() - t0)
    return samples


def measure(n: int, fraction: float, repeat: int, torch_too: bool, be_name: str) -> dict:
    """One row: every timing of size ``n``, taken round-robin so that load drifts hit all of them alike, each round
    in a shuffled order so that none always follows the same timing."""
    on_gpu, on_cpu = be_name == "gpu", be_name == "cpu"
    rng = np.random.default_rng(n)
    base = rng.standard_normal(n, dtype=np.float32)
    new = base + rng.standard_normal(n, dtype=np.float32)
    k = gpu_codec.kept_count(fraction, n)
    sync = lambda: None  # noqa: E731
    xp = np
    if on_gpu:
        import cupy

        new, base, xp = cupy.asarray(new), cupy.asarray(base), cupy
        sync = cupy.cuda.Device().synchronize
    upd, bas = {"w": new}, {"w": base}
    scratch = xp.empty_like(new)
    row = {"n": n, "k": k, "fraction": fraction, "load_before": os.getloadavg()[0]}

    def ours():
        return gpu_codec.compress(upd, bas, fraction=fraction)

    timed = {"subtract_s": lambda: xp.subtract(new, base, out=scratch), "ours_s": ours}
    if on_cpu:
        timed["ours_1thread_s"] = lambda: with_threads(1, ours)
        timed["numpy_s"] = lambda: numpy_topk(new, base, k)
        timed["probe_s"] = lambda: floor_pass(new, base)
        timed["probe_1thread_s"] = lambda: with_threads(1, lambda: floor_pass(new, base))
        timed["probe_compute_s"] = compute_probe
        timed["probe_compute_1thread_s"] = lambda: with_threads(1, compute_probe)
    payload = ours()
    timed["decompress_s"] = lambda: gpu_codec.decompress(payload, base=bas)
    if torch_too:
        import torch

        if on_gpu:
            tn, tb = torch.from_dlpack(new), torch.from_dlpack(base)
            timed["torch_s"] = lambda: (torch_topk(tn, tb, k), torch.cuda.synchronize())
        else:
            tn, tb = torch.from_numpy(new), torch.from_numpy(base)
            timed["torch_s"] = lambda: torch_topk(tn, tb, k)
    # correctness against the baseline before timing it
    idx, vals = numpy_topk(np.asarray(new.get() if on_gpu else new), np.asarray(base.get() if on_gpu else base), k)
    got = payload.tensors[0].buffers["indices"]
    got = got.get() if on_gpu else got
    if np.unique(np.abs(vals)).size == vals.size:  # no ties at the threshold: the index sets must agree
        assert np.array_equal(np.sort(idx), got.astype(np.int64)), "selection differs from the baseline"
    samples = interleaved(timed, repeat, n, sync)
    row.update({key: statistics.median(v) for key, v in samples.items()})
    row["min"] = {key: min(v) for key, v in samples.items()}  # the least disturbed sample of each
    t_ours = row["ours_s"]
    row["ours_gb_per_s"] = 8 * n / t_ours / 1e9
    row["x_subtract"] = t_ours / row["subtract_s"]
    row["x_numpy"] = row["numpy_s"] / t_ours if "numpy_s" in row else None
    row["x_torch"] = row["torch_s"] / t_ours if "torch_s" in row else None
    row["x_threads"] = row["ours_1thread_s"] / t_ours if "ours_1thread_s" in row else None
    row["decompress_x_subtract"] = row["decompress_s"] / row["subtract_s"]
    mins = row["min"]  # the same two ratios from each timing's least disturbed sample: a slow outlier in one
    row["x_subtract_min"] = mins["ours_s"] / mins["subtract_s"]  # timing's median moves them less
    row["x_threads_min"] = mins["ours_1thread_s"] / mins["ours_s"] if "ours_1thread_s" in mins else None
    row["x_threads_probe"] = row["probe_1thread_s"] / row["probe_s"] if "probe_s" in row else None
    row["x_threads_compute"] = (
        row["probe_compute_1thread_s"] / row["probe_compute_s"] if "probe_compute_s" in row else None
    )
    if on_cpu:
        row["peak_extra_bytes"] = peak_extra_bytes(ours)
        row["peak_extra_pct"] = 100.0 * row["peak_extra_bytes"] / new.nbytes
        row["codec_gb_per_s"] = codec_rates(got, payload.tensors[0].buffers["values"], n, repeat)
    row["load_after"] = os.getloadavg()[0]

    return row


def run(sizes: list[int], fraction: float, repeat: int, out: pathlib.Path | None, torch_too: bool) -> list[dict]:
    be = gpu_codec.get_backend()
    on_cpu = be.name == "cpu"
    threads = parallel.thread_count()
    rows = []
    load0 = os.getloadavg()
    print(f"backend {be.name}; {threads} threads; fraction {fraction}; median of {repeat}; load {load0[0]:.2f}")
    print(
        f"{'N':>12} {'sub ms':>8} {'ours ms':>8} {'1 thr ms':>8} {'numpy ms':>9} {'torch ms':>9} {'x sub':>6} "
        f"{'x numpy':>7} {'x torch':>7} {'x thr':>6} {'(mem)':>6} {'(cpu)':>6} {'decomp ms':>9} {'peak %':>6} "
        f"{'x sub min':>9} {'x thr min':>9} {'dec/sub':>7}"
    )
    for n in sizes:
        row = measure(n, fraction, repeat, torch_too, be.name)
        t_ours = row["ours_s"]
        rows.append(row)

        def f(v, scale=1e3, fmt="8.1f"):
            return format(v * scale, fmt) if v is not None else format("-", ">" + fmt.split(".")[0])

        print(
            f"{n:>12,} {f(row['subtract_s'])} {f(t_ours)} {f(row.get('ours_1thread_s'))} "
            f"{f(row.get('numpy_s'), fmt='9.1f')} {f(row.get('torch_s'), fmt='9.1f')} "
            f"{f(row['x_subtract'], 1, '6.2f')} {f(row['x_numpy'], 1, '7.2f')} {f(row['x_torch'], 1, '7.2f')} "
            f"{f(row['x_threads'], 1, '6.2f')} {f(row['x_threads_probe'], 1, '6.2f')} "
            f"{f(row['x_threads_compute'], 1, '6.2f')} "
            f"{f(row['decompress_s'], fmt='9.1f')} "
            f"{f(row.get('peak_extra_pct'), 1, '6.2f')} "
            f"{f(row['x_subtract_min'], 1, '9.2f')} {f(row['x_threads_min'], 1, '9.2f')} "
            f"{f(row['decompress_x_subtract'], 1, '7.2f')}"
        )
    if on_cpu and rows:
        print(f"codecs at N = {rows[-1]['n']:,} (k = {rows[-1]['k']:,}), GB/s of fp32 values or uint32 indices:")
        print("  " + "; ".join(f"{name} {v:.2f}" for name, v in rows[-1]["codec_gb_per_s"].items()))
    info = machine_info()
    info["load_average"] = {"before": load0, "after": os.getloadavg()}
    print(
        f"{info['cpu_model']}, {info['simd']}, {info['cpu_count']} cores; load {info['load_average']['after'][0]:.2f}"
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "topk", "machine": info, "rows": rows}, indent=2, default=str))
        print(f"wrote {out}")
    return rows


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """Time per element against N, ours and the baselines, on log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ns = [r["n"] for r in rows]
    series = (
        ("ours_s", "gpu_codec", "o-"),
        ("ours_1thread_s", "gpu_codec, 1 thread", "o--"),
        ("numpy_s", "NumPy argpartition", "s-"),
        ("torch_s", "torch.topk", "^-"),
        ("subtract_s", "one np.subtract pass", "k:"),
    )
    for key, label, style in series:
        if all(r.get(key) for r in rows):
            ax.plot(ns, [r[key] / r["n"] * 1e9 for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("elements N (fp32)")
    ax.set_ylabel("ns per element (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", type=float, help="element counts (default 1e6, 2^22, 2^24, 2^26)")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=7)
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
        info = cpu_info()
        try:
            plot(
                rows,
                out.with_suffix(".png"),
                f"exact top-k compress, fraction {a.fraction}, {gpu_codec.get_backend().name} backend, "
                f"{parallel.thread_count()} threads\n{info['cpu_model']} ({info['simd'].split(' ')[0]})",
            )
        except ImportError:
            print("matplotlib is not installed: no plot (pip install 'gpu_codec[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
