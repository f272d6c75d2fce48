"""Peak memory of decompress against the dense output it declares, for each pipeline and data mode.

For each pipeline (raw top-k, fp16 + Rice + zstd, dense int8 + zstd, ternary, dense fp32 + zstd, top-k 50% + zstd)
and each size, a payload is made from a synthetic update, written in each data mode its pipeline allows (a zstd
stage: ``records``, one frame per tensor; ``zstd``, one frame shared by all tensors; ``plain``, the same bytes
uncompressed; the writer picks the smallest, and a shared frame only up to 1 MiB of raw bytes, so the others are
forced here), then decompressed with and without a base while memory is traced:

* host (NumPy backend): ``tracemalloc`` peak during the call (NumPy reports its buffers to it; the payload bytes
  themselves are held by the caller and not counted), over the declared dense output bytes;
* device (GPU backend, where one is present): peak bytes held from CuPy's memory pool during the call, over the
  same declared output.

The target is a ratio of at most 1.5. Run: ``python benchmarks/bench_decode_memory.py`` (NumPy, about a minute;
``--backend gpu`` on a GPU machine); writes benchmarks/results/decode_memory_<backend>.json.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

import gpu_codec
from gpu_codec import Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd
from gpu_codec.synthetic import synthetic_delta
from gpu_codec.testing import use_backend

PIPELINES = {
    "raw (top-k 1%, u32 + fp32)": dict(fraction=0.01, pipeline=None),
    "fp16 + rice + zstd (top-k 1%)": dict(fraction=0.01, pipeline=[Quantize("float16"), RiceIndices(), Zstd()]),
    "int8/256 dense + zstd": dict(fraction=None, pipeline=[Int8Blockwise(256), Zstd()]),
    "ternary (top-k 1%)": dict(fraction=0.01, pipeline=[Ternary()]),
    "fp32 dense + zstd": dict(fraction=None, pipeline=[Zstd()]),
    "top-k 50% + zstd (u32 + fp32)": dict(fraction=0.5, pipeline=[Zstd()]),
}
DATA_MODES = {"records": 0, "zstd": 1, "plain": 2}  # wire format v2's data modes (gpu_codec.format.v2)


def blobs(p: gpu_codec.Payload):
    """(data mode, payload bytes) in every data mode the payload's pipeline allows."""
    if not p.tensors or p.tensors[0].encoding != "zstd":
        yield "records", p.to_bytes()
        return
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import v2

    for name, mode in DATA_MODES.items():
        yield name, v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=mode))


def declared_bytes(payload: gpu_codec.Payload, with_base: bool) -> int:
    total = 0
    for r in payload.tensors:
        logical = r.dtype if with_base else ("float64" if r.dtype == "float64" else "float32")
        total += r.numel * gpu_codec.dtypes.storage_dtype(logical).itemsize
    return total


def _cap_kwargs() -> dict:
    # measure older versions of decompress too (before max_output_bytes existed)
    return (
        {"max_output_bytes": None} if "max_output_bytes" in inspect.signature(gpu_codec.decompress).parameters else {}
    )


def peak_host(blob: bytes, base) -> tuple[int, float]:
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    out = gpu_codec.decompress(blob, base=base, **_cap_kwargs())
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del out
    return peak, dt


class _PeakHook:
    """CuPy memory hook: bytes held from the pool, and their peak."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.memory_hook.MemoryHook):
            name = "PeakHook"

            def __init__(self):
                self.cur = self.peak = 0

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                self.cur += mem_size
                self.peak = max(self.peak, self.cur)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                self.cur -= mem_size

        self.hook = Hook()


def peak_device(blob: bytes, base) -> tuple[int, float]:
    import cupy

    base_dev = {k: cupy.asarray(v) for k, v in base.items()} if base is not None else None
    cupy.cuda.Device().synchronize()
    ph = _PeakHook().hook
    t0 = time.perf_counter()
    with ph:
        out = gpu_codec.decompress(blob, base=base_dev, like="cupy", **_cap_kwargs())
        cupy.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    del out
    return ph.peak, dt


def updates(scales: list[float], singles: list[int]):
    """The synthetic model's delta at each scale, then one tensor of each single size (the hardest case:
    a single tensor's temporaries are not shared out over many)."""
    for scale in scales:
        yield f"synthetic x{scale:g}", synthetic_delta(scale)
    for n in singles:
        rng = np.random.default_rng(n)
        yield f"one tensor of {n}", {"w": rng.standard_t(3, n).astype(np.float32)}


def run(backend: str, scales: list[float], singles: list[int]) -> dict:
    rows = []
    with use_backend(backend):
        for model, delta in updates(scales, singles):
            base = {k: np.zeros_like(v) for k, v in delta.items()}
            n = sum(v.size for v in delta.values())
            for name, kw in PIPELINES.items():
                p = gpu_codec.compress(delta, fraction=kw["fraction"], pipeline=kw["pipeline"])
                for mode, blob in blobs(p):
                    payload = gpu_codec.Payload.from_bytes(blob)
                    for with_base in (False, True):
                        declared = declared_bytes(payload, with_base)
                        peak, dt = (peak_device if backend == "gpu" else peak_host)(blob, base if with_base else None)
                        rows.append(
                            {
                                "pipeline": name,
                                "data": mode,
                                "model": model,
                                "params": int(n),
                                "tensors": len(delta),
                                "with_base": with_base,
                                "payload_bytes": len(blob),
                                "declared_output_bytes": declared,
                                "peak_bytes": int(peak),
                                "ratio": round(peak / declared, 3),
                                "seconds": round(dt, 3),
                            }
                        )
                        print(
                            f"{name:32s} {mode:7s} {n:>11,d} params base={with_base!s:5s} payload {len(blob):>10,d} B  "
                            f"output {declared / 2**20:8.1f} MiB  peak {peak / 2**20:8.1f} MiB  "
                            f"ratio {peak / declared:5.2f}  {dt:6.2f} s",
                            flush=True,
                        )
    return {
        "backend": backend,
        "measure": "tracemalloc peak during decompress" if backend != "gpu" else "CuPy pool bytes held, peak",
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "machine": platform.machine(),
        "max_ratio": max(r["ratio"] for r in rows),
        "max_ratio_by_data_mode": {m: max(r["ratio"] for r in rows if r["data"] == m) for m in DATA_MODES},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--scales", type=float, nargs="*", default=[1.0, 8.0], help="synthetic model scales (1.0: 5.3M)")
    ap.add_argument("--singles", type=int, nargs="*", default=[1 << 24], help="sizes of one-tensor updates")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    res = run(a.backend, a.scales, a.singles)
    out = a.out or Path(__file__).parent / "results" / f"decode_memory_{a.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"max ratio {res['max_ratio']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
