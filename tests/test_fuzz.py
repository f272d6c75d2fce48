"""Property-based tests (hypothesis) of the decoder and of compress.

Decoder: mutations of valid payloads of every pipeline (header nodes replaced or deleted, data bytes flipped,
set, inserted or cut, prefix and header text flipped, truncation), checksum recomputed: the outcome is a decode
with finite values of the declared shapes, or a PayloadError, never another exception.

compress: random shapes, dtypes, fractions, scopes and pipelines round-trip with exactly k entries kept, indices
strictly ascending and equal to an independent reference selection, decoded values within the value codec's
error bound, and the same bytes on the NumPy and the emulated backends.

Example counts keep the module within about 40 s on a CI core; ``derandomize`` makes each run the same.
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gpu_codec  # noqa: E402
from gpu_codec.codecs import decoder_for  # noqa: E402
from gpu_codec.testing import fuzz, reference_topk, use_backend  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden"
CI = dict(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def cpu_backend():
    with use_backend("cpu"):
        yield


@functools.lru_cache(maxsize=1)
def corpus() -> dict[str, bytes]:
    with use_backend("cpu"):
        return fuzz.seed_corpus(GOLDEN)


# ------------------------------------------------------------------------------------------ decoder

JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 10**40])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["float32", "uint64", "coo", "dense", "zstd", "rice", "f16", "int8", "values", "indices"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
POS = st.integers(min_value=0, max_value=2**31)
MUTATION = st.one_of(
    st.tuples(st.just("header"), POS, JUNK),
    st.tuples(st.just("delete"), POS),
    st.tuples(st.just("flip"), POS, st.integers(0, 7)),
    st.tuples(st.just("byte"), POS, st.integers(0, 255)),
    st.tuples(st.just("insert"), POS, st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("cut"), POS, st.integers(1, 16)),
    st.tuples(st.just("body_flip"), POS, st.integers(0, 7)),
    st.tuples(st.just("body_byte"), POS, st.integers(0, 255)),
    st.tuples(st.just("truncate"), POS),
)


@settings(max_examples=800, **CI)
@given(
    seed=st.sampled_from(sorted(corpus())),
    ops=st.lists(MUTATION, min_size=1, max_size=4),
    with_base=st.booleans(),
)
def test_mutated_payloads_decode_or_raise_a_payload_error(seed, ops, with_base):
    blob = fuzz.mutate(corpus()[seed], ops)
    base = None
    if with_base and not seed.startswith("golden/"):
        base = fuzz.seed_base()
    fuzz.check(blob, base)


@pytest.mark.parametrize("then", [("body_flip", 0, 0), ("truncate", 10**6), ("flip", 0, 0)])
def test_a_value_set_twice_or_into_itself_leaves_the_header_writable(then):
    """The mutator's values are copied into the header: the same list set into a node and then into its own
    first element would make the header circular, which JSON cannot write (and a later op could not walk)."""
    blob = corpus()["raw"]
    shared = [0, 2**63]
    ops = [("header", 0, shared), ("header", 1, shared), ("header", 2, {}), then]
    out = fuzz.mutate(blob, ops)
    assert isinstance(out, bytes) and out != blob and shared == [0, 2**63]
    fuzz.check(out)  # (a payload error, as any mutated header)


def test_the_corpus_decodes():
    for name, blob in corpus().items():
        assert fuzz.check(blob) == "decoded", name


# ------------------------------------------------------------------------------------------ compress round trip

VALUE_STAGES = {
    "none": None,
    "f16": {"id": "quantize", "dtype": "float16"},
    "bf16": {"id": "quantize", "dtype": "bfloat16"},
    "int8": {"id": "int8", "block_size": 8},
    "ternary": {"id": "ternary"},
}
SHAPE = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)


@st.composite
def updates(draw):
    n = draw(st.integers(1, 3))
    out = {}
    for i in range(n):
        shape = draw(SHAPE)
        dtype = draw(st.sampled_from([np.float32, np.float16, np.float64]))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        a = rng.standard_t(3, shape) * draw(st.sampled_from([1e-3, 1.0, 100.0]))
        if draw(st.booleans()):  # ties and exact zeros
            a = np.round(a)
        out[f"t{i}"] = np.asarray(a).astype(dtype)
    return out


def _bound(stage: str, v: np.ndarray, tensor_vals: np.ndarray) -> np.ndarray:
    """The largest error the value codec may make on each kept value."""
    a = np.abs(v.astype(np.float64))
    if stage == "none":
        return np.zeros_like(a)
    if stage == "f16":
        return np.maximum(a * 2.0**-11, 2.0**-24) + np.maximum(a - 65504.0, 0)
    if stage == "bf16":
        return a * 2.0**-8 + 1e-38
    if stage == "int8":
        return np.full_like(a, np.abs(tensor_vals).max(initial=0.0) / 254 * 1.0001 + 1e-12)
    return np.full_like(a, np.inf)  # ternary: checked separately


@settings(max_examples=80, **CI)
@given(
    u=updates(),
    fraction=st.sampled_from([0.01, 0.1, 0.3, 0.5, 1.0]),
    scope=st.sampled_from(["global", "per_tensor"]),
    stage=st.sampled_from(sorted(VALUE_STAGES)),
    rice=st.booleans(),
    zstd=st.booleans(),
)
def test_compress_round_trip_properties(u, fraction, scope, stage, rice, zstd):
    stages = (VALUE_STAGES[stage], {"id": "rice"} if rice else None, {"id": "zstd"} if zstd else None)
    pipeline = [s for s in stages if s is not None]
    blob = gpu_codec.compress(u, fraction=fraction, scope=scope, pipeline=pipeline).to_bytes()
    ref = reference_topk(u, None, fraction, scope)
    payload = gpu_codec.Payload.from_bytes(blob)
    decoded = {r.name: r for r in decoder_for(payload.pipeline).decode(payload.tensors, gpu_codec.get_backend())}
    sizes = {n: a.size for n, a in u.items()}
    want_k = (
        gpu_codec.kept_count(fraction, sum(sizes.values()))
        if scope == "global"
        else sum(gpu_codec.kept_count(fraction, s) for s in sizes.values())
    )
    assert sum(r.nnz for r in payload.tensors) == want_k  # exactly k
    dense = gpu_codec.decompress(blob)
    for n in u:
        idx = np.asarray(decoded[n].buffers["indices"]).astype(np.int64)
        vals = np.asarray(decoded[n].buffers["values"])
        assert np.all(np.diff(idx) > 0)  # strictly ascending
        np.testing.assert_array_equal(idx, ref[n][0])  # the reference's selection
        rv = ref[n][1]
        if stage == "ternary":
            mu = np.float32(np.abs(rv.astype(np.float64)).mean()) if rv.size else np.float32(0)
            np.testing.assert_allclose(np.abs(vals), mu, rtol=1e-6)
            assert np.all((vals < 0) == (rv < 0)) or mu == 0
        else:
            err = np.abs(vals.astype(np.float64) - rv.astype(np.float64))
            assert np.all(err <= _bound(stage, rv, rv)), (stage, err.max(initial=0))
        flat = np.asarray(dense[n]).reshape(-1)
        np.testing.assert_array_equal(flat[idx], vals)
        assert np.count_nonzero(np.delete(flat, idx)) == 0
        assert np.isfinite(flat).all()


@settings(max_examples=25, **CI)
@given(
    u=updates(),
    fraction=st.sampled_from([0.05, 0.3, None]),
    scope=st.sampled_from(["global", "per_tensor"]),
    stage=st.sampled_from(sorted(VALUE_STAGES)),
    rice=st.booleans(),
)
def test_same_bytes_on_numpy_and_emulated_backends(u, fraction, scope, stage, rice):
    pipeline = [s for s in (VALUE_STAGES[stage], {"id": "rice"} if rice and fraction else None) if s is not None]
    base = {n: np.zeros_like(a) for n, a in u.items()}
    blobs = []
    for backend in ("cpu", "emulated"):
        with use_backend(backend):
            ef = gpu_codec.ErrorFeedback()
            p = gpu_codec.compress(u, base, fraction=fraction, scope=scope, pipeline=pipeline, residual=ef)
            blob = p.to_bytes()
            out = gpu_codec.decompress(blob, base=base)
            blobs.append((blob, ef.to_bytes(), {n: np.asarray(v).tobytes() for n, v in out.items()}))
    assert blobs[0] == blobs[1]
