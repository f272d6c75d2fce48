"""Error feedback: the residual carries exactly what was not sent (top-k drop and quantization error), on sparse
and dense updates, and survives a save/restore round trip in gpu_codec's own format."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec import (
    ErrorFeedback,
    Int8Blockwise,
    InvalidInputError,
    PayloadChecksumError,
    PayloadLayoutError,
    Quantize,
    RiceIndices,
    Ternary,
    Zstd,
)

from .common import use_backend

VALUE_STAGES = [None, Quantize("float16"), Quantize("bfloat16"), Int8Blockwise(8), Ternary()]


@pytest.fixture(autouse=True)
def cpu_backend():
    with use_backend("cpu"):
        yield


def update(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"a": (rng.standard_normal(600) * 3).astype(dtype), "b": rng.standard_t(3, size=(20, 15)).astype(dtype)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fraction", [0.1, None], ids=["topk", "dense"])
@pytest.mark.parametrize("values", VALUE_STAGES, ids=repr)
def test_residual_is_what_was_not_sent(values, fraction, dtype):
    ef = ErrorFeedback()
    stages = [values] if values is not None else []
    prev = {n: np.zeros(a.size, dtype) for n, a in update(0, dtype).items()}
    for rnd in range(3):
        u = update(rnd, dtype)
        p = gpu_codec.compress(u, fraction=fraction, pipeline=stages, residual=ef)
        sent = gpu_codec.decompress(p.to_bytes())
        for n, a in u.items():
            d = a.reshape(-1) + prev[n]  # what was to be sent this round (delta + carried residual)
            s = sent[n].reshape(-1)
            r = ef.residual(n).reshape(-1)
            kept = s != 0
            assert r.dtype == d.dtype
            np.testing.assert_array_equal(r[~kept], d[~kept])  # dropped entries carry the whole delta
            np.testing.assert_array_equal(r[kept], d[kept] - s[kept])  # kept ones: what decoding lost
            prev[n] = r


def test_residual_added_before_selection():
    ef = ErrorFeedback()
    u = {"w": np.array([1.0, 0.6, 0.0, 0.0], np.float32)}
    p1 = gpu_codec.compress(u, fraction=0.25, residual=ef)
    assert p1.tensors[0].buffers["indices"].tolist() == [0]
    p2 = gpu_codec.compress(u, fraction=0.25, residual=ef)  # 0.6 + 0.6 = 1.2 > 1.0
    assert p2.tensors[0].buffers["indices"].tolist() == [1]
    assert p2.tensors[0].buffers["values"].tolist() == [np.float32(0.6) + np.float32(0.6)]


def test_save_restore_round_trip(tmp_path):
    stages = [Ternary(), RiceIndices(), Zstd()]
    ef = ErrorFeedback()
    gpu_codec.compress(update(0), fraction=0.1, pipeline=stages, residual=ef)
    blob = ef.to_bytes()
    assert blob[:8] == b"GPUCODEC" and b"pickle" not in blob
    ef.save(tmp_path / "ef.bin")
    restored = [ErrorFeedback.from_bytes(blob), ErrorFeedback.load(tmp_path / "ef.bin")]
    for r in restored:
        assert r.names() == ef.names() and len(r) == 2 and "a" in r
        for n in ef.names():
            assert r.residual(n).tobytes() == ef.residual(n).tobytes() and r.residual(n).shape == update(0)[n].shape
    nxt = gpu_codec.compress(update(1), fraction=0.1, pipeline=stages, residual=ef).to_bytes()
    for r in restored:
        assert gpu_codec.compress(update(1), fraction=0.1, pipeline=stages, residual=r).to_bytes() == nxt


def test_restore_rejects_other_payloads_and_corruption():
    ef = ErrorFeedback()
    gpu_codec.compress(update(0), fraction=0.1, residual=ef)
    blob = ef.to_bytes()
    with pytest.raises(PayloadChecksumError):
        ErrorFeedback.from_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(PayloadLayoutError, match="not a saved ErrorFeedback"):
        ErrorFeedback.from_bytes(gpu_codec.compress(update(0), fraction=0.1).to_bytes())


def test_shape_change_and_reset():
    ef = ErrorFeedback()
    gpu_codec.compress(update(0), fraction=0.1, residual=ef)
    bad = {"a": np.zeros(601, np.float32), "b": np.zeros((20, 15), np.float32)}
    with pytest.raises(InvalidInputError, match="reset"):
        gpu_codec.compress(bad, fraction=0.1, residual=ef)
    with pytest.raises(InvalidInputError):
        gpu_codec.compress(update(0, np.float64), fraction=0.1, residual=ef)
    ef.reset()
    assert len(ef) == 0
    gpu_codec.compress(bad, fraction=0.1, residual=ef)
    assert ef.residual("a").shape == (601,)
    with pytest.raises(InvalidInputError, match=r"no residual is held for tensor 'nope' \(2 held: \['a', 'b'\]\)"):
        ef.residual("nope")  # (the library's own error, where a bare KeyError came)
    assert repr(ef) == "ErrorFeedback(2 tensors)"
    for names in ("a", None, 5):  # (a string alone discarded its characters; None or 5 raised TypeError)
        with pytest.raises(InvalidInputError, match="discard takes a list of tensor names"):
            ef.discard(names)
    ef.discard([None, "zz", ["a"]])  # (names not held are ignored, whatever they are)
    ef.discard(n for n in ("a",))
    assert ef.names() == ["b"]


def test_bf16_tensors_keep_fp32_residual():
    torch = pytest.importorskip("torch")
    u = {"w": torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    ef = ErrorFeedback()
    p = gpu_codec.compress(u, fraction=0.1, pipeline=[Int8Blockwise(4)], residual=ef)
    d = u["w"].float().numpy()
    s = gpu_codec.decompress(p.to_bytes())["w"]
    np.testing.assert_array_equal(ef.residual("w"), d - s)
    assert ef.residual("w").dtype == np.float32


def test_load_holds_one_copy_of_the_state_and_goes_on_as_the_saved_one(tmp_path):
    # load read the file, then copied each residual out of it (and tested it with a mask of its size): 2x the state.
    import tracemalloc

    rng = np.random.default_rng(0)
    base = {"a": rng.standard_normal(1 << 21).astype(np.float32), "b": rng.standard_normal(999).astype(np.float16)}
    new = {k: (v + rng.standard_normal(v.size).astype(v.dtype)).astype(v.dtype) for k, v in base.items()}
    ef = ErrorFeedback()
    gpu_codec.compress(new, base, fraction=0.01, residual=ef)
    path = tmp_path / "ef.gcef"
    ef.save(path)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        loaded = ErrorFeedback.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.2 * size, f"load peaked at {peak / size:.2f} states"
    again = {k: (v + 1).astype(v.dtype) for k, v in new.items()}
    want = gpu_codec.compress(again, new, fraction=0.01, residual=ef).to_bytes()
    assert gpu_codec.compress(again, new, fraction=0.01, residual=loaded).to_bytes() == want
    assert loaded.to_bytes() == ef.to_bytes()


@pytest.mark.parametrize("with_base", [False, True])
def test_a_residual_grown_past_the_range_is_named_and_nothing_is_stored(with_base):
    # round 1 sends a[0] and keeps 3e38 for a[1]; from round 2 on delta + residual is inf though the update is finite
    ef = ErrorFeedback()
    new = {"a": np.array([3e38, 3e38], np.float32)}
    base = {"a": np.zeros(2, np.float32)} if with_base else None
    gpu_codec.compress(new, base, fraction=0.5, residual=ef)
    kept = ef.residual("a").copy()
    for _ in range(2):
        with pytest.raises(InvalidInputError, match=r"plus the error-feedback residual is not.*reset"):
            gpu_codec.compress(new, base, fraction=0.5, residual=ef)
        np.testing.assert_array_equal(ef.residual("a"), kept)
    ef.reset()
    gpu_codec.compress(new, base, fraction=0.5, residual=ef)  # (a fresh residual: the round goes through)


def test_a_grown_residual_is_named_with_a_custom_score_too():
    ef = ErrorFeedback()
    new = {"a": np.array([3e38, 3e38], np.float32)}
    gpu_codec.compress(new, fraction=0.5, residual=ef)
    with pytest.raises(InvalidInputError, match="plus the error-feedback residual is not"):
        gpu_codec.compress(new, fraction=0.5, residual=ef, score=lambda u, b: {k: np.abs(v) for k, v in u.items()})


def test_a_float64_residual_past_the_float32_range_is_named():
    ef = ErrorFeedback()
    new = {"a": np.array([3e38, 3e38], np.float64)}
    gpu_codec.compress(new, fraction=0.5, residual=ef)
    with pytest.raises(InvalidInputError, match="float64 delta plus the error-feedback residual is past"):
        gpu_codec.compress(new, fraction=0.5, residual=ef)
    with pytest.raises(InvalidInputError, match="a finite float64 delta past the float32 range"):  # (no residual)
        gpu_codec.compress({"a": np.array([1e39, 1.0])}, fraction=0.5, residual=ErrorFeedback())


def test_a_non_finite_update_with_a_residual_is_not_blamed_on_the_residual():
    ef = ErrorFeedback()
    gpu_codec.compress({"a": np.ones(4, np.float32)}, fraction=0.5, residual=ef)
    for bad in (np.inf, np.nan):
        with pytest.raises(InvalidInputError, match="the update, its delta against base or its score holds") as e:
            gpu_codec.compress({"a": np.array([1, bad, 1, 1], np.float32)}, fraction=0.5, residual=ef)
        assert "residual" not in str(e.value)
    with pytest.raises(InvalidInputError, match="the update, its delta against base or its score holds"):
        gpu_codec.compress(
            {"a": np.full(4, 3e38, np.float32)}, {"a": np.full(4, -3e38, np.float32)}, fraction=0.5, residual=ef
        )


def test_a_residual_kept_from_an_earlier_call_does_not_hold_that_call_s_memory():
    import gc
    import weakref

    ef = ErrorFeedback()
    rng = np.random.default_rng(0)
    model = {n: rng.standard_normal(50_000).astype(np.float32) for n in ("a", "b", "c")}
    gpu_codec.compress(model, fraction=0.01, residual=ef)
    first = weakref.ref(ef._state["a"][0].base)  # (the first call's one allocation, which every residual slices)
    kept = ef.residual("a")
    gpu_codec.compress({"b": model["b"], "c": model["c"]}, fraction=0.01, residual=ef)  # (not naming "a")
    gc.collect()
    assert first() is None
    np.testing.assert_array_equal(ef.residual("a"), kept)  # ("a" is kept, as it was)
    assert sorted(ef.names()) == ["a", "b", "c"]


def test_an_adapter_s_state_drops_a_layer_that_is_gone_and_keeps_the_others():
    from gpu_codec.adapt import restart_if_changed

    ef = ErrorFeedback()
    model = {"a": np.ones(8, np.float32), "b": np.arange(8, dtype=np.float32)}
    gpu_codec.compress(model, fraction=0.25, residual=ef)
    kept = ef.residual("b")
    assert restart_if_changed(ef, model, whole=True) == [] and len(ef) == 2
    assert restart_if_changed(ef, {"b": model["b"]}) == [] and len(ef) == 2  # (a partial update: nothing gone)
    assert restart_if_changed(ef, {"b": model["b"], "c": np.ones(3, np.float32)}, whole=True) == ["'a' is gone"]
    assert ef.names() == ["b"]
    np.testing.assert_array_equal(ef.residual("b"), kept)


def test_residuals_that_still_fill_their_allocation_are_not_copied():
    # (a client compressing its model in two halves a round: each call's residuals stay where they were written)
    ef = ErrorFeedback()
    a, b = {"a": np.ones(1000, np.float32)}, {"b": np.ones(1000, np.float32)}
    gpu_codec.compress(a, fraction=0.01, residual=ef)
    held = ef._state["a"][0]
    gpu_codec.compress(b, fraction=0.01, residual=ef)
    assert ef._state["a"][0] is held
