"""The model zoo on a GPU: issue 26's device-side figures, measured on a device.

For each zoo entry (benchmarks/zoo.py; larger entries scaled down to ``--max-params``), with the update as torch
CUDA tensors (one allocation per tensor, as a model's state holds them):

- **times**, medians of ``--repeat`` rounds taken round-robin in a shuffled order (benchmarks/bench_topk.py's
  ``interleaved``), each call followed by a device synchronize: one compress per configuration (top-k 1% global,
  1% per-tensor, 0.1% global, 1% global with error feedback after the entry's earlier rounds), a decompress of
  the 1% payload onto the base, an :class:`~gpu_codec.Aggregator` made on the base (a server's, once a round) and
  an ``add`` of the payload to one; and, in the same rounds, the baselines: one
  ``torch.sub`` over the whole update as one flat tensor (the memory floor of any pass), one ``torch.sub`` per
  tensor (the floor of a pass that launches per tensor), and torch's top-k pipeline (``cat``, ``sub``, ``abs``,
  ``topk``, ``sort``, gather: gpu_codec.cli.bench.torch_topk);
- **counts** of one call of each op: kernels of kernels/*.cu launched, read-backs to the host (``to_host``), and
  fused selections that fell back to the exact passes;
- **parity**: the payload of each configuration equals the NumPy backend's, to the byte, and the decompressed
  tensors equal the NumPy backend's.

    python benchmarks/bench_zoo_gpu.py --out benchmarks/results/zoo_gpu.json
    python benchmarks/bench_zoo_gpu.py --from-json benchmarks/results/zoo_gpu.json   # the table again

Without a CUDA device (``--dry-run``), the same code runs on the emulated backend with NumPy arrays and
wall-clock times: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.gpu_suite import CountingRunner, _ensure_importable  # (before gpu_codec: this runs from a checkout too)

_ensure_importable()

import gpu_codec  # noqa: E402
from benchmarks import tables  # noqa: E402
from benchmarks.bench_topk import interleaved, machine_info  # noqa: E402
from benchmarks.bench_zoo import CPU_CONFIGS, commit_label, scale_for, warm_residual, write_results  # noqa: E402
from benchmarks.zoo import ZOO, Update  # noqa: E402
from gpu_codec.backends import using_backend  # noqa: E402
from gpu_codec.backends.cpu import CpuBackend  # noqa: E402
from gpu_codec.cli.bench import torch_topk  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "zoo_gpu.json"
OPS = (*CPU_CONFIGS, "decompress_s", "aggregator_s", "add_s")


def make_backend(dry_run: bool) -> Any:
    if dry_run:
        from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

        return EmulatedBackend(CountingRunner(EmulatorRunner()))
    from gpu_codec.backends.gpu import CupyRunner, GpuBackend

    return GpuBackend(CountingRunner(CupyRunner()))


def on_device(arrays: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    """The arrays as torch CUDA tensors, one allocation each (NumPy arrays as they are for a dry run)."""
    if dry_run:
        return dict(arrays)
    import torch

    as_torch = lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a, order="C"))  # noqa: E731
    return {k: as_torch(a).cuda() for k, a in arrays.items()}


def host_bytes(a: Any) -> bytes:
    if _is_torch(a):
        import torch

        a = a.detach().reshape(-1)
        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        return a.cpu().numpy().tobytes()
    return np.asarray(a).tobytes()


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def flat(arrays: dict[str, Any]) -> Any:
    """The arrays as one flat array (torch tensors: one torch tensor)."""
    parts = [a.reshape(-1) for a in arrays.values()]
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)


def device_row(update: Update, backend: Any, repeat: int, seed: int, dry_run: bool) -> dict[str, Any]:
    """Times, counts and parity of one update on ``backend``."""
    rounds = [(on_device(b, dry_run), on_device(n, dry_run)) for b, n in update.rounds]
    base, new = rounds[-1]
    dev_update = Update(base, new, rounds)
    n = sum(int(np.prod(tuple(a.shape))) for a in new.values())
    k = gpu_codec.kept_count(0.01, n)
    runner, ops = backend.runner, backend.ops
    row: dict[str, Any] = {"n": n, "k": k}
    with using_backend(backend):
        # parity first (untimed): every configuration's bytes, and the decompressed tensors, against NumPy's
        mismatches = []
        residuals = {}
        for key, (fraction, scope, ef) in CPU_CONFIGS.items():
            kw = {"fraction": fraction, "scope": scope}
            if ef:
                with using_backend(CpuBackend()):
                    cpu_res = warm_residual(update, fraction, scope)
                    want = gpu_codec.compress(update.new, update.base, residual=cpu_res, **kw).to_bytes()
                dev_res = warm_residual(dev_update, fraction, scope)
                got = gpu_codec.compress(new, base, residual=dev_res, **kw).to_bytes()
                residuals[key] = warm_residual(dev_update, fraction, scope)  # a fresh one for the timings
            else:
                with using_backend(CpuBackend()):
                    want = gpu_codec.compress(update.new, update.base, **kw).to_bytes()
                got = gpu_codec.compress(new, base, **kw).to_bytes()
            if got != want:
                mismatches.append(f"{key}: payload differs from the NumPy backend's")
        blob = gpu_codec.compress(new, base, fraction=0.01).to_bytes()
        with using_backend(CpuBackend()):
            want_out = gpu_codec.decompress(blob, base=update.base)
        got_out = gpu_codec.decompress(blob, base=base)
        for name in want_out:
            if host_bytes(got_out[name]) != host_bytes(want_out[name]):
                mismatches.append(f"decompress: {name} differs from the NumPy backend's")
        del got_out, want_out
        row["parity"] = mismatches or "equal"

        timed: dict[str, Any] = {}
        for key, (fraction, scope, _) in CPU_CONFIGS.items():
            res = residuals.get(key)
            timed[key] = lambda f=fraction, s=scope, r=res: gpu_codec.compress(
                new, base, fraction=f, scope=s, residual=r
            )
        timed["decompress_s"] = lambda: gpu_codec.decompress(blob, base=base)
        # (a server's, once a round; no output cap: the largest entries' accumulators are over the default's 4 GiB)
        timed["aggregator_s"] = lambda: gpu_codec.Aggregator(base=base, max_output_bytes=None)
        agg = gpu_codec.Aggregator(base=base, max_output_bytes=None)
        timed["add_s"] = lambda: agg.add(blob)  # (each client's payload)
        # counts of one call each
        counts = {}
        for key, fn in timed.items():
            l0, r0, f0, s0 = runner.launches, runner.reads, ops.fused_fallbacks, ops.fused_selections
            fn()
            counts[key] = {
                "launches": runner.launches - l0,
                "reads": runner.reads - r0,
                "fallbacks": ops.fused_fallbacks - f0,
                "fused": ops.fused_selections - s0,
            }
        row["counts"] = counts

        # baselines in the same rounds
        new_flat, base_flat = flat(new), flat(base)
        if not _is_torch(new_flat):
            scratch = np.empty_like(new_flat)
            timed["subtract_s"] = lambda: np.subtract(new_flat, base_flat, out=scratch)
        else:
            import torch

            scratch = torch.empty_like(new_flat)
            timed["subtract_s"] = lambda: torch.sub(new_flat, base_flat, out=scratch)
        sync = lambda: None  # noqa: E731
        if not dry_run:
            import torch

            pairs, at = [], 0
            for a, b in zip(new.values(), base.values()):
                m = a.numel()
                pairs.append((a.reshape(-1), b.reshape(-1), scratch[at : at + m]))
                at += m
            timed["subtract_tensors_s"] = lambda: [torch.sub(a, b, out=o) for a, b, o in pairs]
            tn, tb = [a.reshape(-1) for a in new.values()], [b.reshape(-1) for b in base.values()]
            timed["torch_s"] = lambda: torch_topk(torch.cat(tn), torch.cat(tb), k)
            sync = torch.cuda.synchronize
        samples = interleaved(timed, repeat, seed, sync=sync)
    row.update({key: statistics.median(v) for key, v in samples.items()})
    row["min"] = {key: min(v) for key, v in samples.items()}
    sub = row["subtract_s"]
    for key in OPS:
        row["x_subtract_" + key[:-2]] = row[key] / sub
    if "torch_s" in row:
        row["x_torch"] = row["torch_s"] / row["ours_s"]
    return row


def run(
    names: list[str],
    *,
    repeat: int,
    max_params: int,
    seed: int,
    dry_run: bool,
    commit: str | None = None,
    out: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Every entry's :func:`device_row`; the results so far written to ``out`` (and its .md) after each."""
    commit = commit or commit_label()
    backend = make_backend(dry_run)
    rows: list[dict[str, Any]] = []
    info = machine_info()
    if not dry_run:
        import torch

        info["cuda_device"] = torch.cuda.get_device_name()
    doc = {
        "benchmark": "zoo_gpu",
        "dry_run": dry_run,
        "commit": commit,
        "machine": info,
        "repeat": repeat,
        "max_params": max_params,
        "rows": rows,
    }
    for name in names:
        entry = ZOO[name]
        s = scale_for(entry, max_params)
        t0 = time.perf_counter()
        update = entry.build(s, seed)
        row: dict[str, Any] = {"entry": name, "kind": entry.kind, "dtype": entry.dtype, "tensors": entry.tensors()}
        row.update(scale=s, params=entry.params(s), params_full=entry.params(1.0))
        try:
            row.update(device_row(update, backend, repeat, seed, dry_run))
        except Exception as e:  # recorded, and the run goes on to the next entry
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()
        row["seconds"] = time.perf_counter() - t0
        del update
        print(_line(row) if "error" not in row else f"{name}: {row['error']}", flush=True)
        rows.append(row)
        if out is not None:  # after each entry: a run stopped at a time limit keeps what it measured
            save(doc, out)
    return doc


def save(doc: dict[str, Any], out: pathlib.Path) -> None:
    write_results(doc, out, markdown, say=False)  # (after each entry: quietly)


def _line(row: dict[str, Any]) -> str:
    ms = lambda key: f"{row[key] * 1e3:.2f}" if key in row else "-"  # noqa: E731
    c = row["counts"]
    return (
        f"{row['entry']:<18} {row['tensors']:>5} t {row['n']:>11,} e  sub {ms('subtract_s')} ms  "
        f"compress {ms('ours_s')} ({row['x_subtract_ours']:.1f}x sub, torch {ms('torch_s')})  "
        f"decompress {ms('decompress_s')}  aggregator {ms('aggregator_s')}  add {ms('add_s')}  launches c/d/a "
        f"{c['ours_s']['launches']}/{c['decompress_s']['launches']}/{c['add_s']['launches']}  reads "
        f"{c['ours_s']['reads']}/{c['decompress_s']['reads']}/{c['add_s']['reads']}  fallbacks "
        f"{sum(v['fallbacks'] for v in c.values())}  parity {'equal' if row['parity'] == 'equal' else 'DIFFERS'}"
    )


def markdown(doc: dict[str, Any]) -> str:
    """The results as a page: what was measured, then the table README.md shows (benchmarks/tables.py)."""
    head = [
        "# The model zoo on a GPU (benchmarks/bench_zoo_gpu.py)",
        "",
        "Each call followed by a device synchronize. `torch.sub`: one torch.sub over the whole update as one flat "
        "tensor; `torch top-k`: cat, sub, abs, topk, sort, gather. Compress: top-k 1% global unless named "
        "(per-tensor: 1% of each tensor; EF: with error feedback after the entry's earlier rounds). Launches and "
        "reads: one call's kernels of kernels/*.cu and read-backs to the host (compress / decompress / add). "
        "Fallbacks: fused selections that ran the exact passes, over the four compress configurations. Bytes: every "
        "payload and the decompressed tensors against the NumPy backend's. `Aggregator(base)`: one made on the "
        "base (its checks of the base); `add`: one payload added to it.",
        "",
    ]
    return "\n".join(head) + tables.zoo_gpu(doc) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", nargs="*", default=list(ZOO), choices=sorted(ZOO))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--max-params", type=float, default=2.6e8, help="larger entries are scaled down to this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    ap.add_argument("--from-json", type=pathlib.Path, help="no run: print the table of these results")
    ap.add_argument("--commit", help="the commit of the tree, where it is not a git checkout")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the emulated backend (checks the script)")
    args = ap.parse_args(argv)
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())), end="")
        return 0
    out = args.out or DEFAULT_OUT
    if (out.exists() or out.with_suffix(".md").exists()) and not args.force:
        ap.error(f"{out} or its .md exists (--force to replace them)")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device (use --dry-run to check the script on the emulator)")
    doc = run(
        args.entries,
        repeat=args.repeat,
        max_params=int(args.max_params),
        seed=args.seed,
        dry_run=args.dry_run,
        commit=args.commit,
        out=out,
    )
    print(markdown(doc), end="")
    bad = [r["entry"] for r in doc["rows"] if r.get("parity") != "equal"]
    if bad:
        print(f"FAILED (an error, or bytes that differ from the NumPy backend's): {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
