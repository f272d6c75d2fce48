"""Issue 26's targets measured on the model zoo (benchmarks/zoo.py).

For each entry, on the NumPy backend (CPU): compress (top-k 1% global; also per-tensor, 0.1% and 1% with error
feedback after the entry's earlier rounds) as a multiple of one ``np.subtract`` pass over the same bytes (the
memory floor; and, beside it, one ``np.subtract`` call per tensor, the floor of any pass that takes the tensors one
by one), against the NumPy pipeline (concatenate, subtract, abs, argpartition, sort, gather) and torch's
(cat, sub, abs, topk, sort, gather), and decompress onto the base as a multiple of the subtract pass: medians of
``--repeat`` rounds, every timing of an entry once a round in a shuffled order (benchmarks/bench_topk.py's
``interleaved``). On the emulated backend (kernels/*.cu on the CPU, benchmarks/traffic.py's traffic count), for
1% and 0.1%, global and per-tensor, with and without error feedback: bytes per element and how often the fused
one-pass selection fell back to the exact passes (``KernelOps.fused_fallbacks``). The recording launcher's
columns (host time, launches and syncs of the GPU path) are ``None`` until :func:`recording_columns` measures
them.

    python benchmarks/bench_zoo.py                       # every entry: writes benchmarks/results/zoo_cpu.{json,md}
    python benchmarks/bench_zoo.py --entries resnet-50 char-transformer --no-emulated
    python benchmarks/bench_zoo.py --quick               # 4 entries, small scales, one repeat, no files unless --out
    python benchmarks/bench_zoo.py --check --from-json benchmarks/results/zoo_cpu.json   # PASS/FAIL per target
    python benchmarks/bench_zoo.py --readme --from-json benchmarks/results/zoo_cpu.json  # README's zoo section
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import gpu_codec
from benchmarks.bench_topk import interleaved, machine_info, with_threads
from benchmarks.traffic import TARGETS, _measured, _record, device_aligned, traced_backend
from benchmarks.zoo import ZOO, Entry, Update
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.cli.bench import numpy_topk, torch_topk
from gpu_codec.testing.recording import Measurement, measure

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
MARK_START, MARK_END = "<!-- zoo:start -->", "<!-- zoo:end -->"

# The CPU timings of one entry: key -> (fraction, scope, error feedback); "ours_s" is the headline.
CPU_CONFIGS = {
    "ours_s": (0.01, "global", False),
    "ours_per_tensor_s": (0.01, "per_tensor", False),
    "ours_0.1_s": (0.001, "global", False),
    "ours_ef_s": (0.01, "global", True),
}
EMU_CONFIGS = [(f, scope, ef) for f in (0.01, 0.001) for scope in ("global", "per_tensor") for ef in (False, True)]
# --quick without --entries: a trained model, two distributions and a split (an architecture's hundreds of tensors
# take the emulator half a minute even when small)
QUICK_ENTRIES = ["char-transformer", "zeros-99", "iid-2^24", "split-2^23-100"]
# Issue 26's CPU targets
SPLIT_X_SUBTRACT, SPLIT_X_NUMPY, DECOMPRESS_X_SUBTRACT = 3.0, 5.0, 2.0
DISTRIBUTION_X_IID, TRANSFORMER_X_SUBTRACT = 1.5, 5.0
# Targets of the recording launcher (GPU host side): ms at 1,000 tensors, syncs per call
HOST_MS = lambda tensors: 1.0 + 0.002 * tensors  # noqa: E731
SYNCS = {"compress": 4, "decompress": 2, "add": 2}
TIMED = ("compress", "decompress")  # the ops with a host-time target


def host_verdicts(entry: str, tensors: int, ops: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(PASS | FAIL, entry, what) for the GPU host side's targets, from the recording launcher's columns per op:
    syncs of each op, then host ms of compress and decompress against ``HOST_MS(tensors)``."""
    out = []
    for op, lim in SYNCS.items():
        if op in ops:
            out.append(
                ("PASS" if ops[op]["syncs"] <= lim else "FAIL", entry, f"{op} syncs {ops[op]['syncs']} <= {lim}")
            )
    for op in ("compress", "decompress"):
        if op in ops:
            ms, lim = ops[op]["host_ms"], HOST_MS(tensors)
            out.append(("PASS" if ms <= lim else "FAIL", entry, f"{op} host {ms:.2f} <= {lim:.2f} ms"))
    return out


def _columns(m: Measurement) -> dict[str, Any]:
    c = m.counts
    return {
        "host_ms": m.ms,
        "array_ms": sorted(m.array_ms)[len(m.array_ms) // 2],
        "replay_ms": m.replay_ms,
        **c.totals(),
        "kernels": dict(c.kernels),
        "array_ops_by_op": dict(c.ops),
        "sync_sites": dict(c.sync_sites),
        "host_numpy": dict(c.host_numpy),
    }


def host_columns(
    update: Update, fraction: float | None = 0.01, scope: str = "global", repeat: int = 5, pipeline: Any = None
) -> dict[str, Any]:
    """The recording launcher's figures for one compress (with ``pipeline``'s stages, a list of codecs), one
    decompress of its bytes onto the base and one aggregator ``add`` of them, of ``update`` (NumPy arrays or torch
    CPU tensors, standing for tensors already on the device): op -> columns (``host_ms``, ``launches``, ``syncs``,
    ...), as :func:`recording_columns` reports them."""
    new, base = update.new, update.base
    kw = {"fraction": fraction, "scope": scope, "pipeline": pipeline}
    with using_backend(CpuBackend()):  # the same bytes as the GPU path's (tests/test_codecs_parity.py)
        blob = gpu_codec.compress(new, base, **kw).to_bytes()
    calls = {
        "compress": (None, lambda _: gpu_codec.compress(new, base, **kw), [new, base]),
        "decompress": (None, lambda _: gpu_codec.decompress(blob, base=base), [base]),
        "add": (lambda: gpu_codec.Aggregator(base=base), lambda agg: agg.add(blob), [base]),
    }
    return {
        op: _columns(measure(call, setup=setup, resident=resident, repeat=repeat))
        for op, (setup, call, resident) in calls.items()
    }


def recording_columns(update: Update, fraction: float, scope: str, repeat: int = 5) -> dict[str, Any]:
    """The recording launcher's figures (:mod:`gpu_codec.testing.recording`) for one compress, one decompress onto
    the base and one aggregator ``add`` of ``update``: op -> host ms, launches, array ops, syncs (the GPU path's
    host side, measured without a GPU; :func:`host_columns`, which benchmarks/bench_host.py reports whole)."""
    cols = host_columns(update, fraction, scope, repeat)
    keep = ("host_ms", "array_ms", "launches", "array_ops", "syncs", "h2d")
    return {op: {k: c[k] for k in keep if k in c} for op, c in cols.items()}


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def _raw(a: Any) -> np.ndarray:
    """A tensor's bytes as a flat NumPy array of its storage dtype (bfloat16: uint16), no copy."""
    if _is_torch(a):
        import torch

        return a.reshape(-1).view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()
    return np.asarray(a).reshape(-1)


def _f32(a: Any) -> np.ndarray:
    return a.reshape(-1).float().numpy() if _is_torch(a) else np.asarray(a).reshape(-1)


def _torch_flat(a: Any):
    import torch

    return a.reshape(-1) if _is_torch(a) else torch.from_numpy(np.asarray(a).reshape(-1))


def scale_for(entry: Entry, max_params: int | None) -> float:
    """The entry's scale that keeps it within ``max_params`` elements (1.0: all of it)."""
    full = entry.params(1.0)
    return 1.0 if not max_params or full <= max_params else max_params / full


def warm_residual(update: Update, fraction: float, scope: str) -> gpu_codec.ErrorFeedback:
    """An error-feedback state after the update's earlier rounds (or after one call on it where it has one round):
    the residual a client holds when it compresses ``update.new``."""
    ef = gpu_codec.ErrorFeedback()
    for base, new in update.rounds[:-1] or update.rounds:
        gpu_codec.compress(new, base, fraction=fraction, scope=scope, residual=ef)
    return ef


def cpu_row(update: Update, repeat: int, seed: int, torch_too: bool) -> dict[str, Any]:
    """Every CPU timing of one update, interleaved, and their ratios."""
    new, base = update.new, update.base
    n = sum(int(np.prod(a.shape)) for a in new.values())
    new_raw, base_raw = (
        np.concatenate([_raw(a) for a in new.values()]),
        np.concatenate([_raw(a) for a in base.values()]),
    )
    scratch = np.empty_like(new_raw)
    k = gpu_codec.kept_count(0.01, n)
    timed = {"subtract_s": lambda: np.subtract(new_raw, base_raw, out=scratch)}
    # the floor of any pass that takes the tensors one by one: one subtract call a tensor, into the same scratch
    pairs, at = [], 0
    for a, b in zip(new.values(), base.values()):
        ra, rb = _raw(a), _raw(b)
        pairs.append((ra, rb, scratch[at : at + ra.size]))
        at += ra.size
    timed["subtract_tensors_s"] = lambda: [np.subtract(a, b, out=o) for a, b, o in pairs]
    misses, backend = {}, gpu_codec.get_backend()
    for key, (fraction, scope, ef) in CPU_CONFIGS.items():
        res = warm_residual(update, fraction, scope) if ef else None
        timed[key] = lambda f=fraction, s=scope, r=res: gpu_codec.compress(new, base, fraction=f, scope=s, residual=r)
        before = getattr(backend, "bracket_misses", None)
        timed[key]()  # (untimed: the scans the NumPy selection ran again after its sample's bracket missed)
        misses[key] = backend.bracket_misses - before if before is not None else None
    # (the same compress on one thread: what the second core gives it, beside the floor pass's one thread)
    timed["ours_1t_s"] = lambda: with_threads(1, lambda: gpu_codec.compress(new, base, fraction=0.01))
    bf16 = any(_is_torch(a) for a in new.values())
    timed["numpy_s"] = lambda: numpy_topk(
        np.concatenate([_f32(a) for a in new.values()]), np.concatenate([_f32(a) for a in base.values()]), k
    )  # bfloat16: the upcast to fp32 is part of NumPy's pipeline
    if torch_too:
        import torch

        tn, tb = [_torch_flat(a) for a in new.values()], [_torch_flat(a) for a in base.values()]
        timed["torch_s"] = lambda: torch_topk(torch.cat(tn), torch.cat(tb), k)
    payload = gpu_codec.compress(new, base, fraction=0.01)
    timed["decompress_s"] = lambda: gpu_codec.decompress(payload, base=base)
    blob = payload.to_bytes()  # (what a server decompresses: the payload's bytes, read and checked as well)
    timed["decompress_bytes_s"] = lambda: gpu_codec.decompress(blob, base=base)
    samples = interleaved(timed, repeat, seed)
    row: dict[str, Any] = {key: statistics.median(v) for key, v in samples.items()}
    row["min"] = {key: min(v) for key, v in samples.items()}
    sub = row["subtract_s"]
    for key in CPU_CONFIGS:
        row["x_subtract" + key[4:-2]] = row[key] / sub
    row["x_subtract_1t"] = row["ours_1t_s"] / sub
    row["x_numpy"] = row["numpy_s"] / row["ours_s"]
    row["x_torch"] = row["torch_s"] / row["ours_s"] if torch_too else None
    row["decompress_x_subtract"] = row["decompress_s"] / sub
    row["decompress_bytes_x_subtract"] = row["decompress_bytes_s"] / sub
    row["tensors_x_subtract"] = row["subtract_tensors_s"] / sub
    row.update(n=n, k=k, bytes=int(new_raw.nbytes), bf16=bf16, bracket_misses=misses)
    return row


def _aligned(arrays: dict[str, Any]) -> dict[str, Any]:
    """Copies on 256-byte boundaries, as a GPU allocator places tensors (the traffic count is in 32-byte
    sectors)."""
    out = {}
    for name, a in arrays.items():
        if _is_torch(a):
            import torch

            out[name] = torch.from_numpy(device_aligned(_raw(a))).view(a.dtype).reshape(a.shape)
        else:
            out[name] = device_aligned(np.asarray(a).reshape(-1)).reshape(a.shape)
    return out


def emulated_rows(update: Update, backend=None) -> list[dict[str, Any]]:
    """Traffic (B/elem, the emulator's count) and fused-selection fallbacks of one compress of ``update.new`` per
    configuration; with error feedback after the earlier rounds (benchmarks/traffic.py's steady state)."""
    backend = backend or traced_backend()
    rounds = [(_aligned(b), _aligned(nw)) for b, nw in update.rounds]
    base, new = rounds[-1]
    n = sum(int(np.prod(a.shape)) for a in new.values())
    ops = backend.ops
    rows = []
    for fraction, scope, ef in EMU_CONFIGS:
        res = None
        if ef:
            with using_backend(backend):
                res = warm_residual(Update(base, new, rounds), fraction, scope)
        f0, s0 = ops.fused_fallbacks, ops.fused_selections
        _, launches = _measured(
            backend, lambda f=fraction, s=scope, r=res: gpu_codec.compress(new, base, fraction=f, scope=s, residual=r)
        )
        rec = _record("compress", launches, n, fraction=fraction, residual=ef, tensors=len(new), scope=scope)
        rec["fallbacks"] = ops.fused_fallbacks - f0
        rec["fused"] = ops.fused_selections - s0
        rec.pop("kernels")
        rows.append(rec)
    return rows


def write_results(
    doc: dict[str, Any], out: pathlib.Path, page: Callable[[dict[str, Any]], str], say: bool = True
) -> None:
    """A benchmark's results written as ``out`` (JSON) and, beside it, its page (``page(doc)``, Markdown); where
    they went printed, with ``say``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(page(doc))
    if say:
        print(f"wrote {out} and {out.with_suffix('.md')}")


def command_line(script: str, argv: list[str] | None) -> str:
    """How a benchmark was run, for its results: ``python benchmarks/<script>`` and its arguments (``argv``, or the
    process's own where None)."""
    return " ".join([f"python benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def commit_label() -> str:
    """The checkout's commit, and whether its code differs from it (changes to benchmarks/results/ aside: a
    benchmark's own earlier outputs are not the code it measures)."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)  # noqa: E731
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
        return head.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def run(
    names: list[str],
    *,
    repeat: int,
    max_params: int | None,
    emu_max_params: int | None,
    cpu: bool = True,
    emulated: bool = True,
    torch_too: bool = True,
    seed: int = 0,
    traffic_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    commit = commit_label()  # the code as it was when the run began
    rows = []
    backend = traced_backend() if emulated else None
    earlier = {r["entry"]: r for r in traffic_from["rows"] if r.get("emulated")} if traffic_from else None
    for name in names:
        entry = ZOO[name]
        row: dict[str, Any] = {"entry": name, "kind": entry.kind, "dtype": entry.dtype, "tensors": entry.tensors()}
        row["params_full"] = entry.params(1.0)
        t0 = time.perf_counter()
        if cpu:
            s = scale_for(entry, max_params)
            update = entry.build(s, seed)
            row["scale"], row["params"] = s, entry.params(s)
            row["cpu"] = cpu_row(update, repeat, seed, torch_too)
            del update
        if emulated:
            s = scale_for(entry, emu_max_params)
            row["emulated_scale"], row["emulated_params"] = s, entry.params(s)
            update = entry.build(s, seed)
            if earlier is None:
                row["emulated"] = emulated_rows(update, backend)
            else:  # the traffic of an earlier run at the same scale (the kernels unchanged since: the caller's word)
                old = earlier.get(name)
                if old is None or old["emulated_params"] != row["emulated_params"]:
                    raise SystemExit(f"--traffic-from: no traffic of {name} at {row['emulated_params']:,} elements")
                row["emulated"], row["emulated_commit"] = old["emulated"], traffic_from["commit"]
            # the host side's cost follows the tensor count, not the elements: measured at the emulator's scale
            row["recording"] = recording_columns(update, 0.01, "global", repeat)
            del update
        row["seconds"] = time.perf_counter() - t0
        print(_line(row), flush=True)
        rows.append(row)
    info = machine_info()
    info["load_average"] = os.getloadavg()
    return {"benchmark": "zoo", "commit": commit, "machine": info, "repeat": repeat, "rows": rows}


def _line(row: dict[str, Any]) -> str:
    out = f"{row['entry']:<18} {row['tensors']:>5} tensors"
    c = row.get("cpu")
    if c:
        out += (
            f"  {c['n']:>11,} elem: x sub {c['x_subtract']:.2f} (1 thread {_one_thread(c)}, "
            f"per-tensor {c['x_subtract_per_tensor']:.2f}, "
            f"0.1% {c['x_subtract_0.1']:.2f}, EF {c['x_subtract_ef']:.2f}), x numpy {c['x_numpy']:.2f}, "
            f"dec/sub {c['decompress_x_subtract']:.2f} (bytes {_dec_bytes(c)}), sub a tensor "
            f"{c['tensors_x_subtract']:.2f}" + (f", rescans {_misses(c)}" if c.get("bracket_misses") else "")
        )
    e = row.get("emulated")
    if e:
        out += f"  | B/elem {min(r['bytes_per_element'] for r in e):.1f}-{max(r['bytes_per_element'] for r in e):.1f}"
        out += f", fallbacks {sum(r['fallbacks'] for r in e)}/{len(e)}"
    return out + f"  ({row['seconds']:.1f} s)"


def check(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(PASS | FAIL | N/A, row, what) for each target of issue 26 that applies to a row of ``doc``."""
    out = []
    rows = {r["entry"]: r for r in doc["rows"]}

    def verdict(ok: bool, entry: str, text: str) -> None:
        out.append(("PASS" if ok else "FAIL", entry, text))

    for name, r in rows.items():
        for e in r.get("emulated") or []:
            lim = TARGETS["compress_residual" if e["residual"] else "compress"]
            cfg = f"{e['fraction']:g} {e['scope']}{' EF' if e['residual'] else ''}"
            verdict(e["bytes_per_element"] <= lim, name, f"traffic {cfg}: {e['bytes_per_element']:.2f} <= {lim} B/elem")
            verdict(e["fallbacks"] == 0, name, f"fallbacks {cfg}: {e['fallbacks']} == 0")
        if "recording" in r:
            rec = r["recording"]
            if rec is None:
                out.append(("N/A", name, "GPU host side: not measured in this run"))
            else:
                out += host_verdicts(name, r["tensors"], rec)
        c = r.get("cpu")
        if not c:
            continue
        if name.startswith("split-2^23-"):
            verdict(c["x_subtract"] <= SPLIT_X_SUBTRACT, name, f"compress {c['x_subtract']:.2f}x <= 3x subtract")
            verdict(c["x_numpy"] >= SPLIT_X_NUMPY, name, f"compress {c['x_numpy']:.2f}x >= 5x the NumPy pipeline")
            d = c["decompress_x_subtract"]
            verdict(d <= DECOMPRESS_X_SUBTRACT, name, f"decompress {d:.2f}x <= 2x subtract")
        if name in ("zeros-99", "zeros-100", "three-level"):
            iid = rows.get("iid-2^24", {}).get("cpu")
            if iid is None or iid["n"] != c["n"]:
                out.append(("N/A", name, "no iid-2^24 row of the same size in this run"))
            else:
                x = c["ours_s"] / iid["ours_s"]
                verdict(x <= DISTRIBUTION_X_IID, name, f"compress {x:.2f}x the i.i.d. time <= 1.5x")
        if name == "char-transformer":
            verdict(c["x_subtract"] <= TRANSFORMER_X_SUBTRACT, name, f"compress {c['x_subtract']:.2f}x <= 5x subtract")
    return out


def _dec_bytes(c: dict[str, Any]) -> str:
    """The decompress of the payload's bytes, in x sub ("–" in results from before it was measured)."""
    x = c.get("decompress_bytes_x_subtract")
    return "–" if x is None else f"{x:.2f}"


def _one_thread(c: dict[str, Any]) -> str:
    """The compress on one thread, in x sub ("–" in results from before it was measured)."""
    x = c.get("x_subtract_1t")
    return "–" if x is None else f"{x:.2f}"


def _misses(c: dict[str, Any]) -> str:
    """The NumPy selection's scans run again after a missed bracket, per CPU configuration (x sub, per-tensor,
    0.1%, 1% + EF), as ``a/b/c/d``."""
    return "/".join("–" if v is None else str(v) for v in c["bracket_misses"].values())


def markdown(doc: dict[str, Any]) -> str:
    """The results as Markdown: the CPU table and the emulated traffic table."""
    m = doc["machine"]
    lines = [
        f"Measured at commit {doc['commit']} on {m['cpu_model']} ({m['simd']}), {m['threads']} threads, "
        f"median of {doc['repeat']} interleaved rounds. Ratios to one `np.subtract` pass over the same bytes "
        "(x sub; lower is better) and speed-ups over the NumPy and torch pipelines (higher is better); top-k 1% "
        "global unless named. Sub a tensor: one `np.subtract` call per tensor over the same bytes, in x sub (the "
        "floor of any pass that takes the tensors one by one). 1 thread: the x sub compress on one thread "
        "(`GPU_CODEC_THREADS=1`; the subtract pass is one call on one thread either way). Rescans: the scans "
        "the NumPy selection ran again after its sample's bracket missed (its exact fallback), in the x sub, "
        "per-tensor, 0.1% and 1% + EF configurations. Decompress: onto the base, of the compressed payload as it "
        "is, and (from bytes) of its bytes, read and checked too, as a server receives them; the target is judged "
        "on the first." + (f" Run: `{doc['command']}`." if doc.get("command") else ""),
        "",
        "| entry | dtype | tensors | elements | sub a tensor | x sub | 1 thread | per-tensor | 0.1% | 1% + EF | "
        "x NumPy | x torch | decompress x sub | from bytes | rescans |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        c = r.get("cpu")
        if not c:
            continue
        tt = f"{c['x_torch']:.2f}" if c.get("x_torch") else "–"
        st = f"{c['tensors_x_subtract']:.2f}" if c.get("tensors_x_subtract") else "–"
        lines.append(
            f"| {r['entry']} | {r['dtype']} | {r['tensors']} | {c['n']:,} | {st} | {c['x_subtract']:.2f} | "
            f"{_one_thread(c)} | {c['x_subtract_per_tensor']:.2f} | {c['x_subtract_0.1']:.2f} | "
            f"{c['x_subtract_ef']:.2f} | {c['x_numpy']:.2f} | {tt} | {c['decompress_x_subtract']:.2f} | "
            f"{_dec_bytes(c)} | {_misses(c) if c.get('bracket_misses') else '–'} |"
        )
    emu = [r for r in doc["rows"] if r.get("emulated")]
    if emu:
        head = " | ".join(
            f"{f:g} {'glob' if s == 'global' else 'per-t'}{' EF' if ef else ''}" for f, s, ef in EMU_CONFIGS
        )
        lines += [
            "",
            "Emulated GPU path: bytes per element of one compress (the emulator's count) and, marked *, the "
            "configurations where the fused selection fell back to the exact passes"
            + "".join(sorted({f" (measured at commit {r['emulated_commit']})" for r in emu if "emulated_commit" in r}))
            + ".",
            "",
            f"| entry | elements | {head} |",
            "|---|---:|" + "---:|" * len(EMU_CONFIGS),
        ]
        for r in emu:
            cells = " | ".join(f"{e['bytes_per_element']:.1f}{'*' if e['fallbacks'] else ''}" for e in r["emulated"])
            lines.append(f"| {r['entry']} | {r['emulated_params']:,} | {cells} |")
    recs = [r for r in doc["rows"] if r.get("recording")]
    if recs:
        lines += [
            "",
            "GPU host side, by the recording launcher (the GPU path's code with no kernel run, at the emulated "
            "scale; top-k 1% global): host ms of the replay (median; in brackets, the share of it in the NumPy work "
            "that stands for the device's: the array module's kernels and the copies, which a GPU runs "
            "asynchronously), our kernel launches + the array module's kernels, and host waits (syncs), per call. "
            "Targets, judged on the whole replay: ≤ 1 ms + 2 µs a tensor for compress and decompress, ≤ 4 syncs a "
            "compress, ≤ 2 a decompress or add.",
            "",
            "| entry | tensors | compress ms | launches | syncs | decompress ms | launches | syncs | add ms | syncs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in recs:
            c, d, a = (r["recording"][op] for op in ("compress", "decompress", "add"))
            ms = [f"{x['host_ms']:.2f}" + (f" ({x['array_ms']:.2f})" if "array_ms" in x else "") for x in (c, d, a)]
            lines.append(
                f"| {r['entry']} | {r['tensors']} | {ms[0]} | {c['launches']} + {c['array_ops']} | "
                f"{c['syncs']} | {ms[1]} | {d['launches']} + {d['array_ops']} | {d['syncs']} | "
                f"{ms[2]} | {a['syncs']} |"
            )
    return "\n".join(lines) + "\n"


def update_readme(doc: dict[str, Any], path: pathlib.Path = README) -> None:
    text = path.read_text()
    a, b = text.index(MARK_START) + len(MARK_START), text.index(MARK_END)
    path.write_text(text[:a] + "\n" + markdown(doc) + text[b:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", nargs="*", choices=sorted(ZOO), help="zoo entries (default: all)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-params", type=float, default=1.3e8, help="CPU: larger entries are scaled down to this")
    ap.add_argument("--emulated-max-params", type=float, default=float(1 << 20), help="the same for the emulator")
    ap.add_argument("--no-emulated", action="store_true")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small scales, one repeat, 4 entries, no files unless --out")
    ap.add_argument("--out", type=pathlib.Path, help="JSON output (default benchmarks/results/zoo_cpu.json)")
    ap.add_argument("--from-json", type=pathlib.Path, help="no run: read these results")
    ap.add_argument("--check", action="store_true", help="PASS/FAIL per target; exit 1 on a FAIL")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's zoo section from the results")
    ap.add_argument(
        "--traffic-from",
        type=pathlib.Path,
        help="take the emulated traffic from this earlier run (same --emulated-max-params) instead of measuring it "
        "again: for a rerun whose kernels and selection are those of that run; the rows name its commit",
    )
    a = ap.parse_args(argv)
    if a.from_json:
        doc = json.loads(a.from_json.read_text())
    else:
        names = a.entries or (QUICK_ENTRIES if a.quick else list(ZOO))
        max_p, emu_p, repeat = int(a.max_params), int(a.emulated_max_params), a.repeat
        if a.quick:
            max_p, emu_p, repeat = 1 << 15, 1 << 13, 1
        t0 = time.perf_counter()
        with using_backend(_numpy_backend()):
            doc = run(
                names,
                repeat=repeat,
                max_params=max_p,
                emu_max_params=emu_p,
                cpu=not a.no_cpu,
                emulated=not a.no_emulated,
                torch_too=not a.no_torch,
                traffic_from=json.loads(a.traffic_from.read_text()) if a.traffic_from else None,
            )
        doc["command"] = command_line("bench_zoo.py", argv)
        print(f"({time.perf_counter() - t0:.1f} s)")
        out = a.out or (None if a.quick else RESULTS / "zoo_cpu.json")
        if out is not None:
            write_results(doc, out, markdown)
    if a.readme:
        update_readme(doc)
        print(f"rewrote the zoo section of {README}")
    if a.check:
        verdicts = check(doc)
        for v, entry, text in verdicts:
            print(f"{v:<4} {entry:<18} {text}")
        return 1 if any(v == "FAIL" for v, _, _ in verdicts) else 0
    return 0


def _numpy_backend():
    return CpuBackend()


if __name__ == "__main__":
    sys.exit(main())
