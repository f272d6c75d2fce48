"""A float64 tensor whose finite delta is past the float32 range: dense mode sends it exactly; top-k, which
compares float32 scores, refuses it saying why, never calling a finite value non-finite."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec import InvalidInputError, Zstd

from .common import use_backend

BIG = {"w": np.array([1e300, 1.0, -3e39, 0.0]), "v": np.ones(3, np.float32)}


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
@pytest.mark.parametrize("pipeline", [None, [Zstd()]])
def test_dense_mode_sends_a_huge_finite_float64_delta_exactly(backend, pipeline):
    base = {"w": np.array([0.0, 2.0, 1e39, 5.0]), "v": np.zeros(3, np.float32)}
    new = {"w": base["w"] + BIG["w"], "v": BIG["v"]}
    with use_backend(backend):
        blob = gpu_codec.compress(new, base=base, fraction=None, pipeline=pipeline).to_bytes()
        out = gpu_codec.decompress(blob, base=base)
    np.testing.assert_array_equal(out["w"], new["w"])
    np.testing.assert_array_equal(gpu_codec.decompress(blob)["w"], new["w"] - base["w"])


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
def test_top_k_says_why_it_cannot(backend):
    with use_backend(backend), pytest.raises(InvalidInputError) as e:
        gpu_codec.compress(BIG, fraction=0.5)
    msg = str(e.value)
    assert "tensor 'w'" in msg and "float32 range" in msg and "fraction=None" in msg
    assert "non-finite" not in msg


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
@pytest.mark.parametrize("score", ["largest_final_magnitude", "smallest_final_magnitude"])
def test_a_criterion_that_reads_the_weights_blames_the_weight_not_the_delta(backend, score):
    """An unchanged weight of 1e300 (its delta 0): under a criterion that scores the weights, the weight's score
    overflows float32; the message said a delta was past the range, where every delta is small."""
    base, new = {"w": np.array([1e300, 1.0, 2.0])}, {"w": np.array([1e300, 1.5, 2.5])}
    with use_backend(backend):
        assert gpu_codec.compress(new, base, fraction=0.34).tensors[0].nnz == 2  # (|delta| is fine)
        with pytest.raises(InvalidInputError) as e:
            gpu_codec.compress(new, base, fraction=0.34, score=score)
    msg = str(e.value)
    assert "float64 weight past the float32 range" in msg and repr(score) in msg and "delta" not in msg


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_a_non_finite_delta_is_still_called_non_finite(backend, fraction):
    with use_backend(backend), pytest.raises(InvalidInputError, match="non-finite"):
        gpu_codec.compress({"w": np.array([np.inf, 1.0])}, fraction=fraction)
    with use_backend(backend), pytest.raises(InvalidInputError, match="non-finite"):
        gpu_codec.compress({"w": np.array([1e308, 1.0])}, base={"w": np.array([-1e308, 0.0])}, fraction=fraction)


def test_a_custom_score_that_is_not_finite_is_refused_in_dense_mode_too():
    def score(update, base):
        return {k: np.full(np.shape(v), np.nan, np.float32) for k, v in update.items()}

    with use_backend("cpu"), pytest.raises(InvalidInputError, match="non-finite"):
        gpu_codec.compress(BIG, fraction=None, score=score)
