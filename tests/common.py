"""pytest glue over :mod:`gpu_codec.testing` (the shared test support): backend parameters and markers."""

from __future__ import annotations

import pytest

from gpu_codec.backend import _gpu_probe
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

HAS_GPU = _gpu_probe()[0]

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("emulated", id="emulated"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]
