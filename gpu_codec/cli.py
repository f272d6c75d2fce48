"""Command line: ``gpu-codec demo | compress | decompress | inspect | info``.

``gpu-codec demo`` is the main job on a built-in default: clients compress updates of a synthetic model, the
server decompresses and averages them; it prints sizes, ratio, times and the backend.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

import numpy as np

from . import Quantize, RiceIndices, Ternary, Zstd, backend_info, compress, decompress, kept_count
from .errors import GpuCodecError
from .format import unpack


def _load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:  # never unpickle
        return {k: z[k] for k in z.files}


def _progress(it, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(it, desc=desc, unit="client", disable=quiet, file=sys.stderr, leave=False)


_PIPELINES = {
    "raw": None,
    "fp16": [Quantize("float16"), RiceIndices(), Zstd()],
    "ternary": [Ternary(), RiceIndices(), Zstd()],
}


def cmd_demo(a: argparse.Namespace) -> int:
    from .synthetic import synthetic_model, synthetic_update

    info = backend_info()
    on_gpu = info["backend"] == "gpu"
    if on_gpu:  # the model lives on the device, as after training; nothing full-size comes back to the host
        import cupy as xp
    else:
        xp = np
    base_host = synthetic_model(a.params, seed=0)
    n = sum(v.size for v in base_host.values())
    dense_bytes = sum(v.nbytes for v in base_host.values())
    base = {k: xp.asarray(v) for k, v in base_host.items()}
    print(f"backend: {info['backend']} ({info['reason']})")
    print(
        f"model: {len(base)} tensors, {n:,} parameters, {dense_bytes / 2**20:.1f} MiB dense; "
        f"fraction {a.fraction} ({a.scope}), {a.clients} clients"
    )
    pipeline = _PIPELINES[a.codec]
    kept_per_client = (
        kept_count(a.fraction, n) if a.scope == "global" else sum(kept_count(a.fraction, v.size) for v in base.values())
    )
    total = None
    t_c, t_d, sizes = [], [], []
    for c in _progress(range(a.clients), "clients", a.quiet):
        new = {k: xp.asarray(v) for k, v in synthetic_update(base_host, seed=100 + c).items()}
        t0 = time.perf_counter()
        blob = compress(new, base, fraction=a.fraction, scope=a.scope, pipeline=pipeline).to_bytes()
        t1 = time.perf_counter()
        upd = decompress(blob, like="cupy" if on_gpu else None)  # the server's dense delta, on its device
        t2 = time.perf_counter()
        t_c.append(t1 - t0)
        t_d.append(t2 - t1)
        sizes.append(len(blob))
        total = upd if total is None else {k: total[k] + upd[k] for k in total}
    touched = sum(int(xp.count_nonzero(v)) for v in total.values())
    size = float(np.mean(sizes))
    print(
        f"payload ({a.codec}): {size / 1024:.1f} KiB per client, {size / max(1, kept_per_client):.2f} B per kept "
        f"parameter, ratio {dense_bytes / size:.1f}x"
    )
    print(f"compress: {1e3 * np.median(t_c):.1f} ms, decompress: {1e3 * np.median(t_d):.1f} ms (median per client)")
    print(f"aggregate: {touched:,} parameters touched by the summed update")
    return 0


def cmd_compress(a: argparse.Namespace) -> int:
    new = _load_npz(a.new)
    base = _load_npz(a.base) if a.base else None
    t0 = time.perf_counter()
    p = compress(new, base, fraction=a.fraction, scope=a.scope, score=a.score)
    blob = p.to_bytes()
    dt = time.perf_counter() - t0
    with open(a.output, "wb") as f:
        f.write(blob)
    print(
        f"{a.output}: {len(blob):,} bytes, {p.nnz:,} entries kept, ratio {p.ratio:.1f}x, {dt * 1e3:.1f} ms "
        f"({p.backend})"
    )
    return 0


def cmd_decompress(a: argparse.Namespace) -> int:
    with open(a.payload, "rb") as f:
        blob = f.read()
    base = _load_npz(a.base) if a.base else None
    out = decompress(blob, base=base)
    np.savez(a.output, **{k: np.asarray(v) for k, v in out.items()})
    print(f"{a.output}: {len(out)} tensors")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    with open(a.payload, "rb") as f:
        header, records = unpack(f.read())
    if a.json:
        print(json.dumps(header, indent=2))
        return 0
    print(
        f"format v{header['version']}, pipeline {json.dumps(header['pipeline'])}, "
        f"metadata {json.dumps(header['metadata'])}"
    )
    w = max([len(r.name) for r in records] + [4])
    print(f"{'name':<{w}}  {'dtype':<8} {'shape':<18} {'encoding':<8} {'kept':>10}")
    for r in records:
        print(f"{r.name:<{w}}  {r.dtype:<8} {list(r.shape)!s:<18} {r.encoding:<8} {r.nnz:>10,}")
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    print(json.dumps(backend_info(), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-codec", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log the backend choice")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="compress and aggregate updates of a built-in synthetic model")
    d.add_argument("--params", type=int, default=5_000_000, help="model size (default 5,000,000)")
    d.add_argument("--fraction", type=float, default=0.01, help="share of entries kept (default 0.01)")
    d.add_argument("--scope", choices=["global", "per_tensor"], default="global")
    d.add_argument("--clients", type=int, default=4)
    d.add_argument(
        "--codec",
        choices=sorted(_PIPELINES),
        default="fp16",
        help="stages after top-k: raw (u32 + fp32), fp16 (fp16 + Rice + zstd, default), ternary",
    )
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo)
    c = sub.add_parser("compress", help="compress NEW.npz (minus --base BASE.npz) into a payload file")
    c.add_argument("new")
    c.add_argument("--base")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--fraction", type=float, default=0.01)
    c.add_argument("--scope", choices=["global", "per_tensor"], default="global")
    c.add_argument("--score", default="magnitude")
    c.set_defaults(fn=cmd_compress)
    x = sub.add_parser("decompress", help="decode a payload into an .npz (onto --base if given)")
    x.add_argument("payload")
    x.add_argument("--base")
    x.add_argument("-o", "--output", required=True)
    x.set_defaults(fn=cmd_decompress)
    i = sub.add_parser("inspect", help="validate a payload and list its tensors")
    i.add_argument("payload")
    i.add_argument("--json", action="store_true", help="print the whole header")
    i.set_defaults(fn=cmd_inspect)
    b = sub.add_parser("info", help="which backend is used and why")
    b.set_defaults(fn=cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.fn(args)
    except (GpuCodecError, OSError) as e:
        print(f"gpu-codec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
