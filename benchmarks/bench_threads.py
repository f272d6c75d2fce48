"""What a second core gives the NumPy backend's compress on this machine, next to what it gives the simplest
parallel loads, all measured in one run.

1. Survey (``--seconds``): once a second, three gauges of the machine at that moment, each the speed-up of all
   threads over one on the backend's pool: the memory floor (``new`` and ``base`` read once, in blocks, as
   ``bench_topk.py``'s "(mem)"), short cache-resident NumPy calls (as its "(cpu)": each call is a turn at the
   interpreter lock) and the pool's wake-up time (submit to start of an empty task, median of 20). On a shared
   virtual machine these change from one second to the next.
2. Paired rounds (``--per-tick`` a second of the survey): compress of N fp32 at ``--fraction`` with all threads and
   with one, and the floor pass with all threads and with one, back to back in a shuffled order, so that the four
   see the machine in the same state. Prints the medians of the per-round speed-ups, and the compress's speed-up
   over the rounds where the floor pass scaled (at least ``--scaled``) and over the others.
3. Blocks: the whole compress with the selection's block forced to 2^15 .. 2^19 elements, with all threads and with
   one (round-robin, shuffled): fewer, longer NumPy calls mean fewer turns at the interpreter lock, but the
   block buffers are part of the peak memory, which bounds the block the backend chooses (``select.plan``).

Writes JSON (and a plot of the survey and the paired rounds).

    python benchmarks/bench_threads.py                  # N = 2^24, 60 s survey, 3 paired rounds a second
    python benchmarks/bench_threads.py --quick          # a smoke run (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_topk import RESULTS, compute_probe, cpu_info, floor_pass, machine_info, with_threads
from gpu_codec.cpu_fallback import parallel
from gpu_codec.cpu_fallback import select as _select

import gpu_codec


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def speedup(fn, one_first: bool) -> float:
    """One thread's time over all threads', taken back to back, one thread first or all first (callers take
    both in turn: the second of two runs can find the first one's data in cache)."""
    if one_first:
        one = timed(lambda: with_threads(1, fn))
        return one / timed(fn)
    every = timed(fn)
    return timed(lambda: with_threads(1, fn)) / every


def wake_us(samples: int = 20) -> float:
    """Median microseconds from handing the pool an empty task to its start, the pool idle before each."""
    pool = parallel._executor(max(1, parallel.thread_count() - 1))
    out = []
    for _ in range(samples):
        time.sleep(0.001)
        t0 = time.perf_counter()
        out.append(pool.submit(time.perf_counter).result() - t0)
    return statistics.median(out) * 1e6


def survey(new, base, fraction: float, seconds: float, per_tick: int) -> tuple[list[dict], list[dict]]:
    """Once a second for ``seconds``: the three gauges, then ``per_tick`` paired rounds (compress with all threads
    and with one, the floor pass with all threads and with one, back to back in a shuffled order, so that the four
    see the machine in the same state). Returns (gauges, rounds), each row stamped with its second."""
    upd, bas = {"w": new}, {"w": base}

    def ours():
        return gpu_codec.compress(upd, bas, fraction=fraction)

    def floor():
        return floor_pass(new, base)

    fns = {
        "ours_s": ours,
        "ours_1thread_s": lambda: with_threads(1, ours),
        "floor_s": floor,
        "floor_1thread_s": lambda: with_threads(1, floor),
    }
    for fn in fns.values():
        fn()
    order, shuffle = list(fns), random.Random(per_tick)
    gauges, rounds, start = [], [], time.monotonic()
    while not gauges or time.monotonic() - start < seconds:
        tick = time.monotonic() - start
        gauges.append(
            {
                "t": round(tick, 2),
                "floor_x": statistics.median(speedup(floor, i % 2 == 0) for i in range(5)),
                "short_x": statistics.median(speedup(compute_probe, i % 2 == 1) for i in range(3)),
                "wake_us": wake_us(),
            }
        )
        for _ in range(per_tick):
            shuffle.shuffle(order)
            r = {"t": round(time.monotonic() - start, 2)} | {key: timed(fns[key]) for key in order}
            r["ours_x"] = r["ours_1thread_s"] / r["ours_s"]
            r["floor_x"] = r["floor_1thread_s"] / r["floor_s"]
            rounds.append(r)
        left = seconds - (time.monotonic() - start)
        time.sleep(max(0.0, min(tick + 1.0 - (time.monotonic() - start), left)))
    return gauges, rounds


def blocks(new, base, fraction: float, repeat: int, sizes: list[int]) -> list[dict]:
    """The whole compress with the selection's block forced to each size (``select.plan`` replaced)."""
    upd, bas = {"w": new}, {"w": base}
    plan = _select.plan
    keys = [(b, t) for b in sizes for t in (None, 1)]
    samples = {key: [] for key in keys}

    def run(block: int, threads: int | None) -> float:
        _select.plan = lambda nbytes, n: (n, block)
        try:
            return timed(lambda: with_threads(threads, lambda: gpu_codec.compress(upd, bas, fraction=fraction)))
        finally:
            _select.plan = plan

    shuffle = random.Random(repeat)
    for key in keys:
        run(*key)
    for _ in range(repeat):
        shuffle.shuffle(keys)
        for key in keys:
            samples[key].append(run(*key))
    out = []
    for b in sizes:
        all_t, one_t = statistics.median(samples[(b, None)]), statistics.median(samples[(b, 1)])
        out.append({"block": b, "ours_s": all_t, "ours_1thread_s": one_t, "x_threads": one_t / all_t})
    return out


def summary(pairs: list[dict], scaled: float) -> dict:
    def med(rows, key):
        return statistics.median(r[key] for r in rows) if rows else None

    good = [r for r in pairs if r["floor_x"] >= scaled]
    bad = [r for r in pairs if r["floor_x"] < scaled]
    return {
        "rounds": len(pairs),
        "ours_x": med(pairs, "ours_x"),
        "floor_x": med(pairs, "floor_x"),
        "ours_ms": 1e3 * med(pairs, "ours_s"),
        "ours_1thread_ms": 1e3 * med(pairs, "ours_1thread_s"),
        "scaled_rounds": len(good),
        "ours_x_where_floor_scaled": med(good, "ours_x"),
        "ours_x_elsewhere": med(bad, "ours_x"),
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    sv = result["survey"]
    if sv:
        t = [r["t"] for r in sv]
        a.plot(t, [r["floor_x"] for r in sv], "o-", ms=3, label="memory floor pass")
        a.plot(t, [r["short_x"] for r in sv], "s-", ms=3, label="short cache-resident calls")
        w = a.twinx()
        w.plot(t, [r["wake_us"] for r in sv], "k:", lw=1, label="pool wake-up (us, right)")
        w.set_ylabel("pool wake-up, us")
        w.legend(loc="lower right", fontsize=7)
    a.axhline(result["target_x"], color="r", lw=0.8, ls="--")
    a.set_xlabel("seconds into the survey")
    a.set_ylabel(f"speed-up, {result['machine']['threads']} threads over 1")
    a.set_title("what a second core gives simple loads, by the second", fontsize=9)
    a.legend(loc="upper left", fontsize=7)
    pr = result["paired"]
    b.scatter([r["floor_x"] for r in pr], [r["ours_x"] for r in pr], s=8, alpha=0.6)
    b.axhline(result["target_x"], color="r", lw=0.8, ls="--", label=f"target {result['target_x']}x")
    b.plot([1, 2], [1, 2], "k:", lw=0.8, label="as much as the floor pass")
    b.set_xlabel("memory floor pass: speed-up in the round")
    b.set_ylabel(f"compress N = {result['n']:,}: speed-up in the round")
    b.set_title("paired rounds (the four timings back to back)", fontsize=9)
    b.legend(fontsize=7)
    info = result["machine"]
    fig.suptitle(f"{info['cpu_model']} ({info['simd'].split(' ')[0]}), {info['cpu_count']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=float, default=2**24, help="fp32 elements (default 2^24)")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--seconds", type=float, help="length of the survey (default 60)")
    ap.add_argument("--per-tick", type=int, help="paired rounds a second of the survey (default 3)")
    ap.add_argument("--repeat", type=int, help="rounds of the block sizes (default 11)")
    ap.add_argument("--scaled", type=float, default=1.6, help="a round where the floor pass gained this much")
    ap.add_argument("--quick", action="store_true", help="small N, short runs, no JSON unless --out")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/threads_cpu.json)")
    a = ap.parse_args(argv)
    if gpu_codec.get_backend().name != "cpu":
        print("this benchmark measures the NumPy backend's thread pool: run it where compress uses the CPU")
        return 2
    n, seconds, per_tick, repeat, sizes = int(a.n), 60.0, 3, 11, [1 << s for s in range(15, 20)]
    if a.quick:  # what is given on the command line still counts
        n, seconds, per_tick, repeat, sizes = 1 << 20, 0.5, 2, 1, [1 << 14, 1 << 16]
    seconds = seconds if a.seconds is None else a.seconds
    per_tick = per_tick if a.per_tick is None else a.per_tick
    repeat = repeat if a.repeat is None else a.repeat
    out = a.out if a.out is not None or a.quick else RESULTS / "threads_cpu.json"
    rng = np.random.default_rng(n)
    base = rng.standard_normal(n, dtype=np.float32)
    new = base + rng.standard_normal(n, dtype=np.float32)
    threads = parallel.thread_count()
    info = cpu_info()
    print(f"N = {n:,}, fraction {a.fraction}, {threads} threads; {info['cpu_model']}, {info['simd']}")
    print(f"survey, {seconds:g} s, {per_tick} paired rounds a second:")
    sv, pr = survey(new, base, a.fraction, seconds, per_tick)
    for key, label in (("floor_x", "memory floor pass x"), ("short_x", "short calls x"), ("wake_us", "wake-up us")):
        v = [r[key] for r in sv]
        print(f"  {label:<20} median {statistics.median(v):7.2f}  range {min(v):7.2f} .. {max(v):7.2f}")
    s = summary(pr, a.scaled)
    print(f"paired rounds: {s['rounds']}")
    print(
        f"  compress x {s['ours_x']:.2f} ({s['ours_1thread_ms']:.2f} -> {s['ours_ms']:.2f} ms); "
        f"floor pass x {s['floor_x']:.2f}"
    )

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    print(
        f"  compress x where the floor pass gained >= {a.scaled}: {fmt(s['ours_x_where_floor_scaled'])} "
        f"({s['scaled_rounds']} rounds); elsewhere {fmt(s['ours_x_elsewhere'])}"
    )
    bl = blocks(new, base, a.fraction, repeat, sizes)
    print(f"compress with the block forced (the backend's choice here: {_select.plan(4 * n, threads)[1]} elements):")
    for r in bl:
        print(
            f"  block 2^{r['block'].bit_length() - 1:<3} {1e3 * r['ours_1thread_s']:7.2f} ms on 1 thread, "
            f"{1e3 * r['ours_s']:7.2f} on {threads}: x {r['x_threads']:.2f}"
        )
    result = {
        "benchmark": "threads",
        "machine": {**machine_info(), "load_average": os.getloadavg()},
        "n": n,
        "fraction": a.fraction,
        "target_x": 1.6,
        "scaled": a.scaled,
        "backend_block": _select.plan(4 * n, threads)[1],
        "summary": s,
        "survey": sv,
        "paired": pr,
        "blocks": bl,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
        if not a.no_plot:
            try:
                plot(result, out.with_suffix(".png"))
            except ImportError:
                print("matplotlib is not installed: no plot (pip install 'gpu_codec[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
