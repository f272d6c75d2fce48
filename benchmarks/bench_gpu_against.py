"""This checkout's GPU path against another revision's, on one GPU, in the same run.

For zoo entries (benchmarks/zoo.py; entries above 3e7 elements scaled down), as torch CUDA tensors: one compress
(top-k 1% global), its payload's ``to_bytes`` (the copy off the device and the writer), one decompress onto the
base, one :class:`~gpu_codec.Aggregator` made on the base and one ``add`` of the payload to it, each the median
of 9 calls after 2 warm-up calls, each call followed by a device synchronize. Each tree runs in its own process,
the two taking turns ``--rounds`` times (the one going first alternating); a figure is the median of its rounds,
and ``new_over_old`` the checkout's over the revision's (below 1: the checkout is faster).

    python benchmarks/bench_gpu_against.py --against 7bf9fcc --out benchmarks/results/gpu_against.json
    python benchmarks/bench_gpu_against.py --tree /tmp/old   # a tree of that revision (git archive REV | tar x),
                                                             # where the GPU machine has no git
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRIES = ["split-2^23-1000", "split-2^23-100", "resnet-50", "char-transformer", "iid-2^24"]
OPS = ("compress", "to_bytes", "decompress", "aggregator", "add")
MAX_PARAMS = 3e7


def device_median(fn, n: int = 9, warmup: int = 2) -> float:
    """The median of ``n`` calls of ``fn`` in ms, after ``warmup`` calls, each call between two device
    synchronizes (torch's: the calls' work on the device is in the time)."""
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def child(root: str, entries: list[str]) -> dict:
    """The timings of the tree at ``root`` (run in a process of its own, from that tree's benchmarks)."""
    sys.path.insert(0, root)
    from benchmarks.gpu_suite import _ensure_importable

    _ensure_importable()
    import numpy as np
    import torch

    import gpu_codec
    from benchmarks.zoo import ZOO

    def dev(d):
        as_torch = lambda v: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v, order="C"))  # noqa: E731
        return {k: as_torch(v).cuda() for k, v in d.items()}

    med = device_median

    out = {"package": gpu_codec.__file__}
    for name in entries:
        e = ZOO[name]
        u = e.build(1.0 if e.params(1.0) <= MAX_PARAMS else MAX_PARAMS / e.params(1.0), 0)
        new, base = dev(u.new), dev(u.base)
        payload = gpu_codec.compress(new, base, fraction=0.01)
        blob = payload.to_bytes()
        agg = gpu_codec.Aggregator(base=base, max_output_bytes=None)
        out[name] = {
            "compress": med(lambda: gpu_codec.compress(new, base, fraction=0.01)),  # noqa: B023
            "to_bytes": med(payload.to_bytes),
            "decompress": med(lambda: gpu_codec.decompress(blob, base=base)),  # noqa: B023
            "aggregator": med(lambda: gpu_codec.Aggregator(base=base, max_output_bytes=None)),  # noqa: B023
            "add": med(lambda: agg.add(blob)),  # noqa: B023
        }
    return out


def _timed(root: pathlib.Path, entries: list[str]) -> dict:
    argv = [sys.executable, "-P", __file__, "--child", str(root), "--entries", *entries]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")]
    if p.returncode or not lines:
        raise SystemExit(f"the timing process for {root} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def run(old_tree: pathlib.Path, against: str, entries: list[str], rounds: int, commit: str | None = None) -> dict:
    trees = {"old": old_tree, "new": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(rounds):  # (the trees take turns going first: a process's place in the round is no bias)
        for label, tree in list(trees.items())[:: 1 if i % 2 == 0 else -1]:
            runs[label].append(_timed(tree, entries))
    result: dict[str, dict] = {}
    for e in entries:
        for op in OPS:
            o = statistics.median(r[e][op] for r in runs["old"])
            n = statistics.median(r[e][op] for r in runs["new"])
            result.setdefault(e, {})[op] = {"old_ms": o, "new_ms": n, "new_over_old": n / o}
            print(f"{e:<18} {op:<11} old {o:8.2f} ms  new {n:8.2f} ms  new/old {n / o:.2f}", flush=True)
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_suite import _ensure_importable

    _ensure_importable()
    # gpu_codec is bound first: bench_topk puts the checkout ahead on sys.path, where an uninstalled package lacks
    # its mapped kernels/ and cpu_fallback/
    import gpu_codec  # noqa: F401
    from benchmarks.bench_topk import machine_info  # (this checkout's backend, and the device's NVML record)

    try:  # (a GPU machine may have the tree without git: then --commit names it)
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = commit or subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {
        "benchmark": "gpu_against",
        "commit": commit or "unknown",
        "against": against,
        "device": torch.cuda.get_device_name(),
        "machine": machine_info(),
        "torch": torch.__version__,
        "rounds": rounds,
        "runs": runs,
        "result": result,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="the git revision to time against")
    ap.add_argument("--tree", type=pathlib.Path, help="a tree of that revision, already laid out")
    ap.add_argument("--entries", nargs="*", default=ENTRIES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, help="JSON output")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    ap.add_argument("--commit", help="this tree's commit, where it is not a git checkout")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("JSON" + json.dumps(child(args.child, args.entries)))
        return 0
    if not (args.against or args.tree):
        ap.error("name the revision (--against REV) or a tree of it (--tree DIR)")
    if args.out and args.out.exists() and not args.force:
        ap.error(f"{args.out} exists (--force to replace it)")
    with tempfile.TemporaryDirectory() as tmp:
        tree = args.tree
        if tree is None:
            tree = pathlib.Path(tmp) / "old"
            tree.mkdir()
            tar = subprocess.run(["git", "archive", args.against], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "x", "-C", str(tree)], input=tar, check=True)
        doc = run(tree.resolve(), args.against or str(args.tree), args.entries, args.rounds, args.commit)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
