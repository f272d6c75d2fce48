"""``Aggregator(base)`` on a GPU, and its parts, against another revision's, in alternating processes.

For split-2^23-1000 and split-2^23-100 as torch CUDA tensors, each figure the median of 21 calls after 3 warm-up
calls, each call followed by a device synchronize: ``agg`` one ``Aggregator(base=...)``, ``agg_gc_free`` the same
with the collector left alone (where the tree has ``gpu_codec.collector``), ``table`` the base's tensor table
(``tensor_table``), ``list`` that table made a list, ``finite`` the base's inf/NaN check (``first_nonfinite`` on the
call's stream). Each tree runs in its own process, the two taking turns ``ROUNDS`` times; the summary is the median
of the rounds, and new over old.

    python benchmarks/bench_gpu_aggregator.py OLD_TREE NEW_TREE ROUNDS     # OLD_TREE: git archive REV | tar x
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys

ENTRIES = ("split-2^23-1000", "split-2^23-100")
PARTS = ("agg", "agg_gc_free", "table", "list", "finite")


def _against():
    """This checkout's bench_gpu_against, loaded from its file: the child's imports resolve in the other tree."""
    spec = importlib.util.spec_from_file_location(
        "_gpu_against", pathlib.Path(__file__).with_name("bench_gpu_against.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child(root: str) -> dict:
    """The figures of the tree at ``root`` (run in a process of its own)."""
    timer = _against().device_median  # (this checkout's, loaded before the other tree leads the imports)
    sys.path.insert(0, root)
    from benchmarks.gpu_suite import _ensure_importable

    _ensure_importable()
    import numpy as np
    import torch

    import gpu_codec
    from benchmarks.zoo import ZOO
    from gpu_codec import dtypes
    from gpu_codec.arrays import tensor_table
    from gpu_codec.backends import get_backend
    from gpu_codec.xp.finite import first_nonfinite

    def med(fn):
        return timer(fn, 21, 3)

    out = {}
    for name in ENTRIES:
        u = ZOO[name].build(1.0, 0)
        base = {k: torch.from_numpy(np.asarray(v, order="C")).cuda() for k, v in u.base.items()}
        arrays = list(base.values())
        make = lambda: gpu_codec.Aggregator(base=base, max_output_bytes=None)  # noqa: E731, B023
        r = {"agg": med(make)}
        try:
            from gpu_codec import collector
        except ImportError:  # (a revision before the collector's hold)
            collector = None
        if collector is not None:
            collector.set_paused(False)
            r["agg_gc_free"] = med(make)
            collector.set_paused(True)
        r["table"] = med(lambda: tensor_table(arrays))  # noqa: B023
        tb = tensor_table(arrays)
        r["list"] = med(lambda: list(tb))  # noqa: B023
        be, ts = get_backend(), list(tb)
        codes = [dtypes.code(t.dtype) for t in ts]

        def finite(be=be, ts=ts, codes=codes):
            with be.stream(ts):
                first_nonfinite(be.asarrays([t.data for t in ts]), codes, be.xp, be.to_host)

        r["finite"] = med(finite)
        out[name] = r
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        print("JSON" + json.dumps(child(argv[1])))
        return 0
    trees, rounds = argv[:2], int(argv[2])
    res: dict[str, list] = {t: [] for t in trees}
    for i in range(rounds):
        for t in trees if i % 2 == 0 else trees[::-1]:
            argv = [sys.executable, "-P", __file__, "--child", t]
            p = subprocess.run(argv, capture_output=True, text=True, cwd=t, check=False)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON")]
            if p.returncode or not lines:
                raise SystemExit(f"the process for {t} failed:\n{p.stderr[-3000:]}")
            res[t].append(json.loads(lines[-1][4:]))
            print(t, res[t][-1], flush=True)
    for e in ENTRIES:
        for k in PARTS:
            if k not in res[trees[0]][0][e] or k not in res[trees[1]][0][e]:
                continue
            o, n = (statistics.median(r[e][k] for r in res[t]) for t in trees)
            print(f"{e:16} {k:12} old {o:7.3f} new {n:7.3f} new/old {n / o:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
