"""The number tables of the README and the examples' READMEs, generated from the committed results in
``benchmarks/results/``.

    python benchmarks/tables.py            # rewrite every generated region from the results
    python benchmarks/tables.py --check    # exit 1, naming the regions, when a doc differs from the results

A generated region sits between ``<!-- tables:NAME -->`` and ``<!-- /tables:NAME -->``; everything outside the
markers is prose, kept as it is. ``tests/test_tables.py`` checks that the docs agree with the results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ["README.md", "examples/nvflare/README.md", "examples/flower/README.md"]

# Rows of the convergence table measured with wire format v1 (their bytes are a few percent above v2's); a fact
# about how those results were produced, which the results file does not record.
V1_ROWS = {
    ("wide", "top-1%"),
    ("wide", "top-1% + EF"),
    ("wide", "top-10% + EF + fp16 + Rice + zstd"),
    ("wide", "dense int8/256 + zstd"),
}


def _load(name: str) -> dict:
    with open(RESULTS / name, encoding="utf-8") as f:
        return json.load(f)


def _gap(g: float) -> str:
    if abs(g) < 0.05:
        return "0.0"
    return f"{g:+.1f}".replace("-", "−").lstrip("+")


def nvflare() -> str:
    """``benchmarks/results/nvflare.json`` (``benchmarks/bench_nvflare.py``)."""
    res = _load("nvflare.json")["results"]
    labels = {
        "none": "none",
        "fp16": "NVFlare `ModelQuantizer` fp16",
        "gpu_codec": "gpu_codec (top-10% + fp16 + Rice + zstd; down fp16 + zstd)",
    }
    none = res["none"]
    lines = [
        "| filter | client update on the wire | global model on the wire | bytes per round | round time "
        "(median, rounds 2-5) | final accuracy |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, label in labels.items():
        r = res[mode]
        up = none["up_bytes_per_update"] / r["up_bytes_per_update"]
        down = none["down_bytes_per_model"] / r["down_bytes_per_model"]
        lines.append(
            f"| {label} | {r['up_bytes_per_update']:,} B ({up:.2f}×) | {r['down_bytes_per_model']:,} B ({down:.2f}×) "
            f"| {r['bytes_per_round']:,} B | {r['round_s_median_after_first']:.2f} s | {r['accuracy']:.3f} |"
        )
    return "\n".join(lines)


def convergence() -> str:
    """The main configurations of ``benchmarks/results/fl_convergence.json`` (``benchmarks/fl_convergence.py``)."""
    rows = [s for s in _load("fl_convergence.json")["summary"] if ", " not in s["label"]]
    lines = [
        "| model | upload | acc @30 (%) | Δ dense | × fewer bytes | acc @60 (%) | Δ dense |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in rows:
        base = s["config"] == s["baseline"]
        mark = " †" if (s["model"], s["label"]) in V1_ROWS else ""
        lines.append(
            f"| {s['model']} | {s['label']}{mark} | {s['acc@30']:.1f} ± {s['acc_std@30']:.1f} | "
            f"{'–' if base else _gap(s['gap@30'])} | {s['ratio@30']:.0f}× | {s['acc@60']:.1f} ± {s['acc_std@60']:.1f} "
            f"| {'–' if base else _gap(s['gap@60'])} |"
        )
    return "\n".join(lines)


def headline() -> str:
    """The small-model ratios the README's format section quotes, from ``fl_convergence.json``."""
    ratio = {s["label"]: s["ratio@30"] for s in _load("fl_convergence.json")["summary"] if s["model"] == "small"}
    fp16, ternary = "top-1% + EF + fp16 + Rice + zstd", "top-1% + EF + ternary + Rice + zstd"
    return (
        f"On a 17k-parameter MLP (64-128-64-10), top-1% with error feedback over 30 rounds: fp16 + Rice + zstd "
        f"{ratio[fp16]:.0f}× fewer bytes than dense fp32, ternary + Rice + zstd {ratio[ternary]:.0f}× "
        "(`benchmarks/results/fl_convergence.json`)."
    )


def flower() -> str:
    """``benchmarks/results/flower_app.json`` (``python examples/flower/app.py --out ...``)."""
    d = _load("flower_app.json")
    lines = ["```"]
    for name in ("compressed", "uncompressed"):
        r = d["results"][name]
        lines.append(
            f"{name:<12}: accuracy {r['accuracy']:.3f} (per round {', '.join(f'{a:.3f}' for a in r['history'])}), "
            f"train traffic up {r['up_bytes']} B, down {r['down_bytes']} B"
        )
    c, u = d["results"]["compressed"], d["results"]["uncompressed"]
    lines += [f"uplink bytes: {c['up_bytes'] / u['up_bytes']:.3f} of uncompressed", "```"]
    return "\n".join(lines)


def _n(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


def topk() -> str:
    """The CPU sweep of ``benchmarks/results/topk_cpu.json`` (``benchmarks/bench_topk.py``)."""
    cols = [
        ("N", lambda r: _n(r["n"])),
        ("subtract (ms)", lambda r: f"{r['subtract_s'] * 1e3:.1f}"),
        ("ours (ms)", lambda r: f"{r['ours_s'] * 1e3:.1f}"),
        ("ours, 1 thread (ms)", lambda r: f"{r['ours_1thread_s'] * 1e3:.1f}"),
        ("NumPy (ms)", lambda r: f"{r['numpy_s'] * 1e3:.1f}"),
        ("torch (ms)", lambda r: f"{r['torch_s'] * 1e3:.1f}"),
        ("ours / subtract", lambda r: f"{r['x_subtract']:.2f}"),
        ("same, least samples", lambda r: f"{r['x_subtract_min']:.2f}"),
        ("× NumPy", lambda r: f"{r['x_numpy']:.1f}"),
        ("× torch", lambda r: f"{r['x_torch']:.1f}"),
        ("× threads", lambda r: f"{r['x_threads']:.2f}"),
        ("same, least samples", lambda r: f"{r['x_threads_min']:.2f}"),
        ("(mem)", lambda r: f"{r['x_threads_probe']:.2f}"),
        ("(cpu)", lambda r: f"{r['x_threads_compute']:.2f}"),
        ("decompress (ms)", lambda r: f"{r['decompress_s'] * 1e3:.1f}"),
        ("decompress / subtract", lambda r: f"{r['decompress_x_subtract']:.2f}"),
        ("peak extra memory", lambda r: f"{r['peak_extra_pct']:.1f} %"),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "| --- |" + " ---: |" * (len(cols) - 1)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in _load("topk_cpu.json")["rows"]]
    return "\n".join(lines)


def traffic() -> str:
    """GPU memory traffic per call, B per dense element, of ``benchmarks/results/traffic.json``
    (``benchmarks/traffic.py``): one tensor and 300, against the floor and the target."""
    recs = [r for r in _load("traffic.json") if "bytes_per_element" in r]
    rows = [  # (label, op, fraction, residual, floor, target)
        ("compress, top-k 1%", "compress", 0.01, False, 8, "≤ 10"),
        ("compress, top-k 0.1%", "compress", 0.001, False, 8, "≤ 10"),
        ("compress, top-k 1%, error feedback", "compress", 0.01, True, 16, "≤ 18"),
        ("compress, top-k 0.1%, error feedback", "compress", 0.001, True, 16, "≤ 18"),
        ("compress, dense (`fraction=None`)", "compress_dense", None, False, 12, "—"),
        ("decompress, top-k 1%, onto a base", "decompress", 0.01, False, 8, "—"),
        ("decompress, dense, onto a base", "decompress_dense", None, False, 12, "≤ 14.4"),
    ]

    def cell(op, fraction, residual, tensors) -> str:
        hit = [
            r
            for r in recs
            if (r["op"], r["fraction"], r["residual"], r["tensors"]) == (op, fraction, residual, tensors)
        ]
        return f"{hit[0]['bytes_per_element']:.2f}" if hit else "—"

    lines = ["| call | 1 tensor | 300 tensors | floor | target |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, op, fraction, residual, floor, target in rows:
        lines.append(
            f"| {label} | {cell(op, fraction, residual, 1)} | {cell(op, fraction, residual, 300)} | {floor} | "
            f"{target} |"
        )
    return "\n".join(lines)


def pipelines() -> str:
    """``benchmarks/results/pipelines_cpu.json`` (``benchmarks/bench_pipelines.py``): ms per call of this
    checkout, and in brackets its time over the older revision's, measured in the same run."""
    doc = _load("pipelines_cpu.json")
    ops = ("compress", "compress_to_bytes", "from_bytes", "decompress", "add")
    rows = {(r["case"], r["package"]): r for r in doc["rows"]}
    lines = [
        "| update | pipeline | compress | compress + to_bytes | from_bytes | decompress | add |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        if r["package"] != "checkout":
            continue
        old = rows.get((r["case"], doc.get("against")))
        case, pipe = r["case"].split(" ", 1)
        cells = [f"{r[f'{op}_ms']:.1f}" + (f" ({r[f'{op}_ms'] / old[f'{op}_ms']:.2f}×)" if old else "") for op in ops]
        lines.append(f"| {case} | {pipe} | {' | '.join(cells)} |")
    return "\n".join(lines)


def zoo_gpu(doc: dict | None = None) -> str:
    """The model zoo on a GPU, ``benchmarks/results/zoo_gpu.json`` or ``doc`` (``benchmarks/bench_zoo_gpu.py``
    writes its results' table with this too)."""
    doc = doc or _load("zoo_gpu.json")
    ms = lambda key: lambda r: f"{r[key] * 1e3:.2f}" if key in r else "-"  # noqa: E731  (a dry run: no torch)
    three = lambda key: lambda r: " / ".join(str(r["counts"][op][key]) for op in ("ours_s", "decompress_s", "add_s"))  # noqa: E731
    cols = [
        ("entry", lambda r: r["entry"]),
        ("tensors", lambda r: str(r["tensors"])),
        ("elements", lambda r: f"{r['n']:,}"),
        ("torch.sub", ms("subtract_s")),
        ("torch top-k", ms("torch_s")),
        ("compress", ms("ours_s")),
        ("torch top-k ÷ compress", lambda r: f"{r['x_torch']:.2f}" if "x_torch" in r else "-"),
        ("per-tensor", ms("ours_per_tensor_s")),
        ("with EF", ms("ours_ef_s")),
        ("decompress", ms("decompress_s")),
        ("Aggregator(base)", ms("aggregator_s")),
        ("add", ms("add_s")),
        ("launches c / d / a", three("launches")),
        ("reads c / d / a", three("reads")),
        ("fallbacks", lambda r: str(sum(v["fallbacks"] for v in r["counts"].values()))),
        ("bytes = NumPy's", lambda r: "yes" if r["parity"] == "equal" else "NO"),
    ]
    m = doc["machine"]
    dev = m["backend"].get("device") or {}
    lines = [
        f"{m.get('cuda_device', 'no GPU (a dry run)')} (driver {dev.get('driver', '-')}), torch {m['torch']}, "
        f"CuPy {m['backend']['cupy']}, host {m['cpu_model']}; commit {doc['commit']}; median of {doc['repeat']} "
        f"rounds, ms. Entries above {doc['max_params']:,} elements scaled down.",
        "",
        "| " + " | ".join(c for c, _ in cols) + " |",
        "| --- |" + " ---: |" * (len(cols) - 1),
    ]
    for r in doc["rows"]:
        cells = [f(r) for _, f in cols] if "error" not in r else [r["entry"], str(r["tensors"]), f"{r['params']:,}"]
        lines.append("| " + " | ".join(cells + ["ERROR"] * (len(cols) - len(cells))) + " |")
    return "\n".join(lines)


def gpu_against(name: str = "gpu_against_h100.json") -> str:
    """A checkout's GPU path against an earlier revision's, ``benchmarks/results/<name>``
    (``benchmarks/bench_gpu_against.py``)."""
    doc = _load(name)
    heads = {"compress": "compress", "to_bytes": "to_bytes", "decompress": "decompress"}
    heads.update(aggregator="Aggregator(base)", add="add")
    ops = [op for op in heads if op in next(iter(doc["result"].values()))]  # (to_bytes: timed since 788bf6f)
    lines = [
        f"{doc['device']}, torch {doc['torch']}: commit {doc['commit']} against {doc['against']}, alternating "
        f"processes, {doc['rounds']} rounds; ms (in brackets: {doc['commit']} over {doc['against']}).",
        "",
        "| entry | " + " | ".join(heads[op] for op in ops) + " |",
        "| --- |" + " ---: |" * len(ops),
    ]
    for e, r in doc["result"].items():
        cells = [f"{r[op]['old_ms']:.2f} → {r[op]['new_ms']:.2f} ({r[op]['new_over_old']:.2f}×)" for op in ops]
        lines.append(f"| {e} | {' | '.join(cells)} |")
    return "\n".join(lines)


def server() -> str:
    """The server's side on the CPU, ``benchmarks/results/server_cpu.json`` (``benchmarks/bench_server.py``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.bench_server import markdown

    return markdown(_load("server_cpu.json")).rstrip("\n")


def collector(name: str) -> str:
    """The engine's calls with the garbage collector held off and left alone, ``benchmarks/results/<name>``
    (``benchmarks/bench_collector.py``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.bench_collector import table

    return table(_load(name))


def layout() -> str:
    """The caller's tensors as separate allocations and as views of one, ``benchmarks/results/layout_cpu.json``
    (``benchmarks/bench_layout.py``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.bench_layout import markdown

    return markdown(_load("layout_cpu.json")).rstrip("\n")


REGIONS: dict[str, Callable[[], str]] = {
    "pipelines": pipelines,
    "topk": topk,
    "traffic": traffic,
    "nvflare": nvflare,
    "convergence": convergence,
    "headline": headline,
    "flower": flower,
    "zoo_gpu": zoo_gpu,
    "gpu_against_latest": lambda: gpu_against("gpu_against_h200_091d083.json"),  # (52 commits, none GPU-timed)
    "gpu_against_views": lambda: gpu_against("gpu_against_h200_0e78d74.json"),  # (the tensors given by address)
    "gpu_against": gpu_against,
    "gpu_against_shared": lambda: gpu_against("gpu_against_h100_2d770a8.json"),  # (the writer's shared ranges)
    "gpu_against_wrap": lambda: gpu_against("gpu_against_h100_wrap.json"),  # (the tensors wrapped as a table)
    "collector_gpu": lambda: collector("collector_gpu.json"),
    "collector_cpu": lambda: collector("collector_cpu.json"),
    "server": server,
    "layout": layout,
}
_REGION = re.compile(r"(<!-- tables:([a-z_]+) -->\n)(.*?)(\n?<!-- /tables:\2 -->)", re.S)  # (empty: filled too)


def render(text: str) -> str:
    """``text`` with every generated region rebuilt from the results."""

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in REGIONS:
            raise KeyError(f"unknown table region {name!r}; known: {sorted(REGIONS)}")
        return m.group(1) + REGIONS[name]() + "\n" + m.group(4).lstrip("\n")

    return _REGION.sub(one, text)


def regions(text: str) -> list[str]:
    return [m.group(2) for m in _REGION.finditer(text)]


def stale() -> list[str]:
    """``doc:region`` for each generated region whose text differs from what the results give."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            old_regions = {m.group(2): m.group(3) for m in _REGION.finditer(text)}
            new_regions = {m.group(2): m.group(3) for m in _REGION.finditer(new)}
            out += [f"{doc}:{n}" for n in old_regions if old_regions[n] != new_regions[n]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report docs that differ from the results")
    a = ap.parse_args()
    if a.check:
        bad = stale()
        if bad:
            print("out of date (run python benchmarks/tables.py): " + ", ".join(bad))
            sys.exit(1)
        print("every generated table agrees with benchmarks/results/")
        return
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {doc}: {', '.join(regions(text))}")


if __name__ == "__main__":
    main()
