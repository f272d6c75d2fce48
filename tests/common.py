"""pytest glue over :mod:`gpu_codec.testing` (the shared test support): backend parameters and markers."""

from __future__ import annotations

import contextlib
import tracemalloc

import pytest

from gpu_codec.backends import gpu_probe
from gpu_codec.testing import (  # noqa: F401 - re-exported for the test modules
    as_numpy,
    bf16_to_f32,
    build_payload,
    dense_from,
    ref_delta,
    ref_score,
    reference_topk,
    split_payload,
    to_f32,
    use_backend,
)

HAS_GPU = gpu_probe()[0]


def has_emulator() -> bool:
    """Whether the emulated backend can be built here: it needs a C++20 compiler (g++ or clang++)."""
    from gpu_codec.backends import emulated

    try:
        emulated._compiler()
    except emulated.EmulatorUnavailableError:
        return False
    return True


HAS_EMULATOR = has_emulator()


def logged_launches(runner) -> list[str]:
    """The names of the kernels ``runner`` launches from now on, in order (its ``launch`` wrapped)."""
    log: list[str] = []
    launch = runner.launch

    def logged(name, grid, block, args):
        log.append(name)
        return launch(name, grid, block, args)

    runner.launch = logged
    return log


BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("emulated", id="emulated", marks=pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


@contextlib.contextmanager
def allocation_cap(limit: int):
    """Fail when what runs inside allocates (as tracemalloc sees it) more than ``limit`` bytes at its peak."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"allocated {peak} bytes at its peak (cap {limit})"


def decompress_peak(blob: bytes, base: dict | None = None) -> tuple[dict, int]:
    """(decompress's output, the peak bytes traced while it ran): NumPy reports its allocations to tracemalloc."""
    import gc

    import gpu_codec

    gc.collect()
    tracemalloc.start()
    try:
        out = gpu_codec.decompress(blob, base=base)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak
