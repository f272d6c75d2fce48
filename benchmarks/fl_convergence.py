"""Federated convergence under compression: accuracy against bytes uploaded, on a real (small) federated task.

Task: scikit-learn's digits (1,797 8x8 images, 10 classes), a fixed stratified 75/25 train/test split, the
training set split over 10 clients by a Dirichlet(alpha = 0.5) draw per class (non-IID; every client holds at
least 10 samples). Two MLPs: ``small`` (64-128-64-10, 17,226 parameters) and ``wide`` (64-1024-1024-10,
1,126,410 parameters). FedAvg: every round each client loads the global model, trains one local epoch (SGD,
batch 32), and uploads its update ``new - global`` compressed by :func:`gpu_codec.compress` with
``base=global``; the server decompresses each client's delta and applies the average weighted by the clients'
sample counts. Error feedback: one :class:`gpu_codec.ErrorFeedback` per client, passed as ``residual=``.

Bytes are ``len(payload.to_bytes())`` per client per round, summed: whatever the wire format of the installed
gpu_codec costs, header included. The dense baseline is lossless, so its delta is applied as is and its bytes
are those of a ``fraction=None`` payload of the same update (one per client per round; the size depends only on
the tensor names and shapes).

A second learning rate (0.05, half the default) checks how much the gap depends on it; at that rate the
remedies of :mod:`gpu_codec.schedules` are measured too: Deep Gradient Compression's warm-up of the kept fraction
(4% down to 1% over the first 4 rounds) and server momentum (FedAvgM, beta 0.5), the latter against a dense run
with the same server momentum.

Accuracy is on the test set after each round; "acc @R" is the mean of rounds R-4..R, then mean +- std over
seeds. Run: ``python benchmarks/fl_convergence.py`` (CPU, one thread; writes benchmarks/results/fl_convergence
.json, .md and .png). ``--models``, ``--configs``, ``--seeds`` and ``--rounds`` pick a subset; ``--merge`` adds
the runs to the existing JSON instead of replacing it, so one configuration can be re-measured alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import gpu_codec
from gpu_codec import ErrorFeedback, Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"small": (64, 128, 64, 10), "wide": (64, 1024, 1024, 10)}


# ------------------------------------------------------------------------------------------------ configurations


def _fp16_rice_zstd() -> list:
    return [Quantize("float16"), RiceIndices(), Zstd(level=3)]


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of uploading updates. ``fraction`` None: dense."""

    label: str
    fraction: float | None
    error_feedback: bool = False
    pipeline: Callable[[], list] = list
    lossless_dense: bool = False  # the exact delta is applied; bytes are those of the payload
    lr: float | None = None  # local learning rate; None: the study's
    baseline: str = "dense"  # the configuration its accuracy and bytes are compared with
    warmup: tuple[float, int] | None = None  # DGC warm-up of the kept fraction: (start fraction, rounds)
    server_momentum: float = 0.0  # FedAvgM's beta; 0: plain FedAvg


CONFIGS: dict[str, Config] = {
    "dense": Config("dense fp32", None, lossless_dense=True),
    "top1": Config("top-1%", 0.01),
    "top1_ef": Config("top-1% + EF", 0.01, error_feedback=True),
    "top1_ef_fp16": Config("top-1% + EF + fp16 + Rice + zstd", 0.01, True, _fp16_rice_zstd),
    "top1_ef_ternary": Config(
        "top-1% + EF + ternary + Rice + zstd", 0.01, True, lambda: [Ternary(), RiceIndices(), Zstd(level=3)]
    ),
    "top10_ef_fp16": Config("top-10% + EF + fp16 + Rice + zstd", 0.10, True, _fp16_rice_zstd),
    "dense_int8": Config("dense int8/256 + zstd", None, False, lambda: [Int8Blockwise(block_size=256), Zstd(level=3)]),
    # half the local learning rate: plain error feedback, then the remedies of gpu_codec.schedules
    "dense_lr05": Config("dense fp32, lr 0.05", None, lossless_dense=True, lr=0.05, baseline="dense_lr05"),
    "top1_ef_fp16_lr05": Config(
        "top-1% + EF + fp16 + Rice + zstd, lr 0.05", 0.01, True, _fp16_rice_zstd, lr=0.05, baseline="dense_lr05"
    ),
    "dense_sm_lr05": Config(
        "dense fp32, server momentum 0.5, lr 0.05",
        None,
        lossless_dense=True,
        lr=0.05,
        baseline="dense_sm_lr05",
        server_momentum=0.5,
    ),
    "top1_ef_fp16_sm_lr05": Config(
        "top-1% + EF + fp16 + Rice + zstd, server momentum 0.5, lr 0.05",
        0.01,
        True,
        _fp16_rice_zstd,
        lr=0.05,
        baseline="dense_sm_lr05",
        server_momentum=0.5,
    ),
    "top1_ef_fp16_warmup_lr05": Config(
        "top-1% + EF + fp16 + Rice + zstd, warm-up 4% → 1% over 4 rounds, lr 0.05",
        0.01,
        True,
        _fp16_rice_zstd,
        lr=0.05,
        baseline="dense_lr05",
        warmup=(0.04, 4),
    ),
}
CORE = list(CONFIGS)


# ------------------------------------------------------------------------------------------------ data and model


def load_data() -> dict[str, np.ndarray]:
    """Digits, standardized with the training set's statistics; the split is the same for every seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    f32 = np.float32
    return {"xtr": ((xtr - mu) / sd).astype(f32), "ytr": ytr, "xte": ((xte - mu) / sd).astype(f32), "yte": yte}


def dirichlet_partition(
    labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 10
) -> list[np.ndarray]:
    """Indices per client: each class's samples split by proportions drawn from Dirichlet(alpha); redrawn until
    every client holds at least ``min_size`` samples."""
    while True:
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha))) * idx.size).astype(int)[:-1]
            for p, chunk in zip(parts, np.split(idx, cuts)):
                p.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def make_mlp(widths: tuple[int, ...]):
    import torch

    layers: list[Any] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def n_params(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


# ------------------------------------------------------------------------------------------------ one federated run


def federated_run(
    model: str,
    cfg: Config,
    seed: int,
    rounds: int,
    data: dict[str, np.ndarray],
    *,
    n_clients: int = 10,
    alpha: float = 0.5,
    lr: float = 0.1,
    batch: int = 32,
) -> dict[str, Any]:
    """One FedAvg run; returns per-round test accuracy and uploaded bytes, and the clients' final residual norms."""
    import torch

    torch.set_num_threads(1)
    lr = cfg.lr if cfg.lr is not None else lr
    if cfg.warmup or cfg.server_momentum:
        from gpu_codec import schedules

        server = schedules.ServerMomentum(cfg.server_momentum) if cfg.server_momentum else None
    else:
        server = None
    rng = np.random.default_rng(seed)
    parts = dirichlet_partition(data["ytr"], n_clients, alpha, rng)
    weights = np.array([p.size for p in parts], dtype=np.float64)
    weights /= weights.sum()
    torch.manual_seed(seed)
    net = make_mlp(MODELS[model])
    glob = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    xtr, ytr = torch.from_numpy(data["xtr"]), torch.from_numpy(data["ytr"])
    xte, yte = torch.from_numpy(data["xte"]), torch.from_numpy(data["yte"])
    efs = [ErrorFeedback() if cfg.error_feedback else None for _ in range(n_clients)]
    dense_size = 0
    gen = torch.Generator().manual_seed(seed)
    acc, up_bytes = [], []
    t0 = time.perf_counter()
    for rnd in range(rounds):
        fraction = cfg.fraction
        if cfg.warmup and fraction is not None:
            fraction = schedules.warmup_fraction(rnd, fraction, start=cfg.warmup[0], rounds=cfg.warmup[1])
        agg = {k: np.zeros_like(v) for k, v in glob.items()}
        sent = 0
        for c, idx in enumerate(parts):
            net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in glob.items()})
            opt = torch.optim.SGD(net.parameters(), lr=lr)
            order = torch.from_numpy(idx)[torch.randperm(idx.size, generator=gen)]
            for s in range(0, idx.size, batch):
                b = order[s : s + batch]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xtr[b]), ytr[b]).backward()
                opt.step()
            new = {k: v.detach().numpy() for k, v in net.state_dict().items()}
            if cfg.lossless_dense:  # exact; the payload's size depends only on the names and shapes
                if not dense_size:
                    dense_size = len(gpu_codec.compress(new, base=glob, fraction=None).to_bytes())
                sent += dense_size
                for k in agg:
                    agg[k] += weights[c] * (new[k] - glob[k])
                continue
            payload = gpu_codec.compress(new, base=glob, fraction=fraction, residual=efs[c], pipeline=cfg.pipeline())
            blob = payload.to_bytes()
            sent += len(blob)
            delta = gpu_codec.decompress(blob)
            for k in agg:
                agg[k] += weights[c] * delta[k]
        if server is not None:
            agg = server.step(agg)
        for k in glob:
            glob[k] = glob[k] + agg[k]
        net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in glob.items()})
        with torch.no_grad():
            acc.append(float((net(xte).argmax(1) == yte).float().mean()))
        up_bytes.append(int(sent))
    res_norm = [float(np.sqrt(sum(float((e.residual(n) ** 2).sum()) for n in e.names()))) for e in efs if e]
    return {
        "model": model,
        "seed": seed,
        "rounds": rounds,
        "acc": acc,
        "bytes": up_bytes,
        "lr": lr,
        "residual_norms": res_norm,
        "seconds": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------------ summary


def window_acc(acc: list[float], r: int, w: int = 5) -> float:
    """Mean test accuracy of rounds r-w+1..r (1-based)."""
    return float(np.mean(acc[max(0, r - w) : r]))


def summarize(runs: list[dict], at: tuple[int, ...]) -> list[dict]:
    by: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        by.setdefault((run["model"], run["config"]), []).append(run)
    rows = []
    for (model, name), rs in sorted(by.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
        baseline = CONFIGS[name].baseline if name in CONFIGS else "dense"
        dense = by.get((model, baseline), [])
        row: dict[str, Any] = {"model": model, "config": name, "label": rs[0]["label"], "seeds": len(rs)}
        row["baseline"] = baseline
        for r in at:
            if any(len(x["acc"]) < r for x in rs):
                continue
            accs = np.array([window_acc(x["acc"], r) for x in rs]) * 100
            mb = float(np.mean([sum(x["bytes"][:r]) for x in rs]))
            row[f"acc@{r}"] = float(accs.mean())
            row[f"acc_std@{r}"] = float(accs.std())
            row[f"bytes@{r}"] = mb
            if dense and all(len(x["acc"]) >= r for x in dense):
                row[f"gap@{r}"] = float(accs.mean() - np.mean([window_acc(x["acc"], r) for x in dense]) * 100)
                row[f"ratio@{r}"] = float(np.mean([sum(x["bytes"][:r]) for x in dense])) / mb
        rows.append(row)
    return rows


def _order(name: str) -> int:
    return list(CONFIGS).index(name) if name in CONFIGS else len(CONFIGS)


def markdown(rows: list[dict], at: tuple[int, ...], params: dict[str, int]) -> str:
    head = "| model | upload | " + " | ".join(f"acc @{r} (%) | Δ dense @{r} | MB @{r} | × fewer @{r}" for r in at)
    lines = [head + " |", "| --- | --- |" + " ---: | ---: | ---: | ---: |" * len(at)]
    for row in rows:
        cells = [f"{row['model']} ({params[row['model']] / 1e3:,.0f}k)", row["label"]]
        for r in at:
            if f"acc@{r}" not in row:
                cells += ["–"] * 4
                continue
            cells.append(f"{row[f'acc@{r}']:.1f} ± {row[f'acc_std@{r}']:.1f}")
            gap = row.get(f"gap@{r}")
            cells.append("–" if gap is None or row["config"] == row["baseline"] else f"{gap:+.1f}")
            cells.append(f"{row[f'bytes@{r}'] / 1e6:,.2f}")
            ratio = row.get(f"ratio@{r}")
            cells.append("–" if ratio is None else f"{ratio:,.0f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Accuracy against cumulative bytes: one panel per model and local learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["lr"]) for r in runs}, key=lambda p: (list(MODELS).index(p[0]), -p[1]))
    ncol = len({m for m, _ in panels})
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.5 * nrow), squeeze=False)
    order = sorted(panels, key=lambda p: (-p[1], list(MODELS).index(p[0])))  # rows: learning rate; columns: model
    for ax, (model, lr) in zip(axes.flat, order):
        names = sorted({r["config"] for r in runs if r["model"] == model and r["lr"] == lr}, key=_order)
        for name in names:
            rs = [r for r in runs if r["model"] == model and r["config"] == name]
            n = min(len(r["acc"]) for r in rs)
            acc = np.mean([r["acc"][:n] for r in rs], axis=0) * 100
            cum = np.mean([np.cumsum(r["bytes"][:n]) for r in rs], axis=0)
            ax.plot(cum, acc, label=rs[0]["label"], lw=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("cumulative bytes uploaded (all clients)")
        ax.set_ylabel("test accuracy (%), mean over seeds")
        ax.set_title(f"{model} MLP ({n_params(MODELS[model]):,} params), local lr {lr:g}", fontsize=10)
        ax.set_ylim(50, 100)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(order) :]:
        ax.set_visible(False)
    fig.suptitle("digits, 10 non-IID clients (Dirichlet 0.5), FedAvg, 1 local epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info() -> dict:
    import sklearn
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),  # other work on the machine stretches the run times, not the results
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "sklearn": sklearn.__version__,
        "gpu_codec": gpu_codec.__version__,
        "backend": gpu_codec.backend_info()["backend"],
    }


def write_results(out: Path, runs: list[dict], at: tuple[int, ...], args: argparse.Namespace) -> str:
    """Write the JSON (every run, the summary, the machine) and the Markdown table; return the table."""
    params = {m: n_params(w) for m, w in MODELS.items()}
    rows = summarize(runs, at)
    table = markdown(rows, at, params)
    configs = {}
    for k, v in CONFIGS.items():
        configs[k] = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name != "pipeline"}
        configs[k]["pipeline"] = [c.get_config() for c in v.pipeline()]
    doc = {
        "benchmark": "fl_convergence",
        "task": {
            "data": "sklearn digits, stratified 75/25 split (random_state 0), standardized",
            "clients": 10,
            "partition": "Dirichlet(0.5) per class, at least 10 samples per client",
            "aggregation": "FedAvg weighted by client sample counts",
            "local": f"1 epoch SGD, batch 32, lr {args.lr} unless the configuration sets one",
            "accuracy": "test accuracy, mean of the last 5 rounds up to the reported round",
        },
        "params": params,
        "configs": configs,
        "machine": machine_info(),
        "seconds": sum(r["seconds"] for r in runs),  # of the runs, each timed alone
        "summary": rows,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    return table


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate (configurations may set theirs)")
    ap.add_argument("--at", nargs="+", type=int, default=[30, 60], help="rounds at which to report")
    ap.add_argument("--out", type=Path, default=RESULTS / "fl_convergence.json")
    ap.add_argument("--merge", action="store_true", help="replace matching runs in --out, keep the others")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    data = load_data()
    runs: list[dict] = []
    if args.merge and args.out.exists():
        old = json.loads(args.out.read_text())["runs"]
        keys = {(m, c, s) for m in args.models for c in args.configs for s in args.seeds}
        runs = [r for r in old if (r["model"], r["config"], r["seed"]) not in keys]
    at = tuple(args.at)
    table = ""
    for model in args.models:
        for name in args.configs:
            for seed in args.seeds:
                cfg = CONFIGS[name]
                run = federated_run(model, cfg, seed, args.rounds, data, lr=args.lr)
                run.update(config=name, label=cfg.label)
                runs.append(run)
                a = {r: round(window_acc(run["acc"], r) * 100, 1) for r in at if r <= args.rounds}
                print(
                    f"{model:5s} {name:22s} seed {seed}: acc {a}, {sum(run['bytes']) / 1e6:,.2f} MB, "
                    f"{run['seconds']:.1f} s",
                    flush=True,
                )
                table = write_results(args.out, runs, at, args)
    print(table)
    if not args.no_plot:
        plot(runs, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
