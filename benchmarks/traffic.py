"""Global-memory traffic per element of compress, decompress and each codec stage, measured without a GPU.

The emulated backend is built in its traffic-counting variant (``EmulatorRunner(trace=True)``): the kernel
sources are compiled with GCC's address instrumentation in call mode, so every load and store a kernel makes
reaches a hook, and each launch reports the distinct 32-byte sectors it read and wrote inside its buffers (the
arrays passed to it and those named in its address tables). Bytes per element = 32 x (sectors read + sectors
written) / dense elements, summed over the launches of one call: the DRAM traffic of a GPU whose L2 keeps
nothing between launches and everything within one.

Counted: the kernels of kernels/*.cu. Not seen by the emulator: array-library work between launches (CuPy or
NumPy copies, fills and concatenations the engine does, e.g. a sparse decompress's copy of the base); it is
added analytically (``glue_bytes_per_element``, see ``sparse_decompress_glue``). Host-to-device uploads of the
payload are transfers, not counted.

    python benchmarks/traffic.py                 # n = 2^16, writes benchmarks/results/traffic.json
    python benchmarks/traffic.py --n 8192 --quick

Also the fused selection's workspace (the peak of its scratch alive at once) at fraction 0.01 on one fp32 tensor
of 2^22, 2^24 and 2^26 elements, as a share of the dense bytes (target: at most 3%), computed with the NumPy
twins (about 2 GB of host memory at 2^26).

Floors: compress reads new and base (8 B/elem in fp32), with error feedback also reads and writes the residual
(16); dense compress also writes every value (12); sparse decompress onto a base reads and writes the output
(8); dense decode and apply reads the base and the values and writes the output (12).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from gpu_codec.cpu_fallback.rice import rice_param

import gpu_codec
from gpu_codec.backends import using_backend
from gpu_codec.backends.emulated import EmulatedBackend, EmulatorRunner

ROOT = Path(__file__).resolve().parent
TARGETS = {"compress": 10.0, "compress_residual": 18.0, "dense_apply_over_floor": 1.2, "fused_workspace": 0.03}
FLOORS = {
    "compress": 8.0,
    "compress_residual": 16.0,
    "compress_dense": 12.0,  # read new and base, write the values
    "decompress": 8.0,
    "decompress_dense": 12.0,
}


def traced_backend() -> EmulatedBackend:
    return EmulatedBackend(EmulatorRunner(trace=True))


def update(n: int, tensors: int, seed: int = 0) -> tuple[dict, dict]:
    """A random fp32 update of ``n`` elements in ``tensors`` tensors of varied sizes, and its base."""
    rng = np.random.default_rng(seed)
    if tensors == 1:
        sizes = [n]
    else:
        w = rng.random(tensors) + 0.2
        sizes = np.maximum(1, np.floor(w / w.sum() * n)).astype(int)
        sizes[-1] += n - sizes.sum()
    new = {f"t{i}": device_aligned(rng.standard_normal(int(s)).astype(np.float32)) for i, s in enumerate(sizes)}
    base = {k: device_aligned(v + rng.standard_normal(v.size).astype(np.float32) * 0.1) for k, v in new.items()}
    return new, base


def device_aligned(a: np.ndarray, align: int = 256) -> np.ndarray:
    """A copy of ``a`` whose data starts on an ``align``-byte boundary, as a GPU allocator places every tensor
    (NumPy guarantees only 16 bytes, which would split sampled 32-byte runs over two sectors).

    >>> int(device_aligned(np.arange(5, dtype=np.float32)).ctypes.data % 256)
    0
    """
    buf = np.empty(a.nbytes + align, np.uint8)
    off = -buf.ctypes.data % align
    out = buf[off : off + a.nbytes].view(a.dtype)
    out[...] = a
    return out


def _per_kernel(launches: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"launches": 0, "read_bytes": 0, "write_bytes": 0})
    for rec in launches:
        k = out[rec["kernel"]]
        k["launches"] += 1
        k["read_bytes"] += rec["read_bytes"]
        k["write_bytes"] += rec["write_bytes"]
    return dict(out)


def _measured(backend: EmulatedBackend, fn) -> tuple[Any, list[dict]]:
    run = backend.runner
    start = len(run.traffic)
    with using_backend(backend):
        result = fn()
    return result, run.traffic[start:]


def _record(op: str, launches: list[dict], n: int, glue: float = 0.0, **fields) -> dict:
    read = sum(r["read_bytes"] for r in launches)
    write = sum(r["write_bytes"] for r in launches)
    rec = {
        "op": op,
        **fields,
        "n": n,
        "kernel_bytes_per_element": (read + write) / n,
        "glue_bytes_per_element": glue,
        "bytes_per_element": (read + write) / n + glue,
        "read_bytes": read,
        "write_bytes": write,
        "kernels": {
            k: {**v, "bytes_per_element": (v["read_bytes"] + v["write_bytes"]) / n}
            for k, v in _per_kernel(launches).items()
        },
    }
    return rec


# Array-library work between launches, bytes per dense element (fp32), as the engine does it: a sparse decode
# onto a base copies the base (read and write, 8) and concatenates the entries' indices and values (16 per entry).
# A dense decode has none (dense_apply reads base and values in place).
def sparse_decompress_glue(n: int, k: int) -> float:
    return 8.0 + 16.0 * k / n


def compress_records(backend, n: int, fractions, tensor_counts, residuals=(False, True)) -> list[dict]:
    out = []
    for tensors in tensor_counts:
        new, base = update(n, tensors)
        for fraction in fractions:
            for residual in residuals:
                ef = gpu_codec.ErrorFeedback() if residual else None

                def call(new=new, base=base, fraction=fraction, ef=ef):
                    return gpu_codec.compress(new, base, fraction=fraction, residual=ef)

                if ef is not None:  # steady state: the residual exists (a first call only writes it)
                    _measured(backend, call)
                _, launches = _measured(backend, call)
                out.append(_record("compress", launches, n, fraction=fraction, residual=residual, tensors=tensors))
    return out


def dense_compress_records(backend, n: int) -> list[dict]:
    """compress(fraction=None): every value sent (a residual, when kept, is zeroed by a fill after the pass)."""
    new, base = update(n, 1)
    out = []
    for residual in (False, True):
        ef = gpu_codec.ErrorFeedback() if residual else None

        def call(ef=ef):
            return gpu_codec.compress(new, base, fraction=None, residual=ef)

        if ef is not None:
            _measured(backend, call)
        _, launches = _measured(backend, call)
        glue = 4.0 if residual else 0.0  # res_out.fill(0): a write of the residual
        out.append(_record("compress_dense", launches, n, glue, fraction=None, residual=residual, tensors=1))
    return out


def decompress_records(backend, n: int) -> list[dict]:
    new, base = update(n, 1)
    with using_backend(backend):
        sparse = gpu_codec.compress(new, base, fraction=0.01).to_bytes()
        dense = gpu_codec.compress(new, base, fraction=None).to_bytes()
    k = gpu_codec.Payload.from_bytes(sparse).tensors[0].nnz
    _, sl = _measured(backend, lambda: gpu_codec.decompress(sparse, base=base))
    _, dl = _measured(backend, lambda: gpu_codec.decompress(dense, base=base))
    return [
        _record("decompress", sl, n, sparse_decompress_glue(n, k), fraction=0.01, residual=False, tensors=1),
        _record("decompress_dense", dl, n, fraction=None, residual=False, tensors=1),
    ]


def codec_records(backend, n: int, fraction: float = 0.01) -> list[dict]:
    new, base = update(n, 1)
    with using_backend(backend):
        p = gpu_codec.compress(new, base, fraction=fraction)
    rec = p.tensors[0]
    idx, vals = rec.buffers["indices"], rec.buffers["values"]
    k = int(idx.size)
    stages = {
        "quantize_float16": lambda: backend.cast16([vals], "float16", [idx], [None]),
        "quantize_bfloat16": lambda: backend.cast16([vals], "bfloat16", [idx], [None]),
        "int8": lambda: backend.int8([vals], 256, [idx], [None]),
        "ternary": lambda: backend.ternary([vals], [idx], [None]),
        "rice": lambda: backend.rice([idx], [rice_param(k, n)], [n]),
    }
    out = []
    for name, fn in stages.items():
        _, launches = _measured(backend, fn)
        r = _record(name, launches, n, fraction=fraction, residual=False, tensors=1)
        r["entries"] = k
        r["bytes_per_entry"] = (r["read_bytes"] + r["write_bytes"]) / k
        out.append(r)
    return out


def workspace_records(log2_sizes=(22, 24, 26), fraction: float = 0.01) -> list[dict]:
    """The fused selection's workspace (peak scratch alive at once) on one fp32 tensor per size, as a share of the
    update's dense bytes. Run with the NumPy twins: the sizes are planned on the host from the sample, so every
    runner allocates the same."""
    from gpu_codec.backends.kernels import KernelOps
    from gpu_codec.testing.kernel_cases import TwinRunner

    out = []
    for e in log2_sizes:
        n = 1 << e
        new, base = update(n, 1, seed=1)
        ops = KernelOps(TwinRunner(), fused=True)
        k = round(n * fraction)
        ops.topk_select([new["t0"]], [base["t0"]], [None], [None], [0], [None], [0], 0, [[0]], [k], 0)
        out.append(
            {
                "op": "fused_workspace",
                "fraction": fraction,
                "residual": False,
                "tensors": 1,
                "n": n,
                "workspace_bytes": ops.fused_workspace_bytes,
                "workspace_share": ops.fused_workspace_bytes / (4 * n),
                "fallbacks": ops.fused_fallbacks,
            }
        )
    return out


def run(n: int = 1 << 16, quick: bool = False) -> list[dict]:
    backend = traced_backend()
    fractions = (0.01,) if quick else (0.01, 0.001)
    counts = (1,) if quick else (1, 300)
    return [
        *compress_records(backend, n, fractions, counts),
        *dense_compress_records(backend, n),
        *decompress_records(backend, n),
        *codec_records(backend, n),
    ]


def check_targets(records: list[dict]) -> list[str]:
    """Every record over its target, as text (empty: all within)."""
    bad = []
    for r in records:
        if r["op"] == "compress":
            t = TARGETS["compress_residual" if r["residual"] else "compress"]
            if r["bytes_per_element"] > t:
                bad.append(
                    f"compress (fraction {r['fraction']}, residual {r['residual']}, {r['tensors']} tensors): "
                    f"{r['bytes_per_element']:.2f} B/elem > {t}"
                )
        elif r["op"] == "fused_workspace":
            if r["workspace_share"] > TARGETS["fused_workspace"] or r["fallbacks"]:
                bad.append(f"fused workspace at n = {r['n']}: {100 * r['workspace_share']:.2f}% of the dense bytes")
        elif r["op"] == "decompress_dense":
            lim = TARGETS["dense_apply_over_floor"] * FLOORS["decompress_dense"]
            if r["bytes_per_element"] > lim:
                bad.append(f"dense decode and apply: {r['bytes_per_element']:.2f} B/elem > {lim:.1f}")
    return bad


def _table(records: list[dict]) -> str:
    lines = [f"{'op':<18} {'fraction':>8} {'resid':>5} {'tensors':>7} {'B/elem':>8}  (kernels + glue)  per kernel"]
    for r in records:
        if r["op"] == "fused_workspace":
            lines.append(
                f"{r['op']:<18} {r['fraction']!s:>8} {r['residual']!s:>5} {r['tensors']:>7} {'':>8}  "
                f"n = 2^{r['n'].bit_length() - 1}: {100 * r['workspace_share']:.2f}% of the dense bytes"
            )
            continue
        per = ", ".join(f"{k} {v['bytes_per_element']:.2f}" for k, v in r["kernels"].items())
        lines.append(
            f"{r['op']:<18} {r['fraction']!s:>8} {r['residual']!s:>5} {r['tensors']:>7} {r['bytes_per_element']:>8.2f}"
            f"  ({r['kernel_bytes_per_element']:.2f} + {r['glue_bytes_per_element']:.2f})  {per}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1 << 16, help="dense elements per update (default 65536)")
    ap.add_argument("--quick", action="store_true", help="fraction 0.01 and one tensor only")
    ap.add_argument("--json", default=str(ROOT / "results" / "traffic.json"), help="where to write the records")
    ap.add_argument("--check", action="store_true", help="exit 1 when a record is over its target")
    ap.add_argument(
        "--workspace",
        default=None,
        help="log2 sizes at which to report the fused selection's workspace (default 22,24,26, none with --quick)",
    )
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    records = run(a.n, a.quick)
    sizes = ("" if a.quick else "22,24,26") if a.workspace is None else a.workspace
    records += workspace_records(tuple(int(e) for e in sizes.split(",") if e))
    print(_table(records))
    print(f"({time.perf_counter() - t0:.1f} s; counted by the emulator, 32-byte sectors per launch)")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    bad = check_targets(records)
    for b in bad:
        print("over target:", b)
    return 1 if (bad and a.check) else 0


if __name__ == "__main__":
    sys.exit(main())
