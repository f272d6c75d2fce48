"""Hardening of the server side: decompress caps its output before it allocates or decompresses anything, streams
tensor by tensor within 1.5x of the declared output, and refuses a sum with the base that leaves the dtype's
range; compress refuses what the reader would refuse; error feedback never advances on a failed call and never
loads a non-finite residual."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

import gpu_codec
from gpu_codec import (
    ErrorFeedback,
    Int8Blockwise,
    InvalidInputError,
    PayloadError,
    PayloadIndexError,
    PayloadLimitError,
    PayloadValueError,
    Quantize,
    RiceIndices,
    Ternary,
    Zstd,
)
from gpu_codec.format import MAX_HEADER_BYTES, MAX_NAME, MAX_NDIM, MAX_TENSORS

from .common import BACKENDS, build_payload, decompress_peak, split_payload, use_backend


@pytest.fixture(autouse=True)
def cpu_backend():
    with use_backend("cpu"):
        yield


def ones(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


# ------------------------------------------------------------------------------------------ output cap


def _declare(blob: bytes, shape: list[int], dtype: str | None = None) -> bytes:
    """The payload with its first tensor's shape (and dtype) replaced: the header alone asks for the memory."""
    h, data = split_payload(blob)
    h["tensors"][0]["shape"] = shape
    if dtype is not None:
        h["tensors"][0]["dtype"] = dtype
    return build_payload(h, data)


def test_small_payload_declaring_16_gib_is_refused_before_allocation(monkeypatch):
    blob = gpu_codec.compress({"w": np.arange(8, dtype=np.float64)}, fraction=0.25).to_bytes(version=1)
    hostile = _declare(blob, [1 << 31])
    assert len(hostile) < 512
    calls = []
    monkeypatch.setattr(np, "zeros", lambda *a, **k: calls.append(a) or pytest.fail("allocated"))
    with pytest.raises(PayloadLimitError, match="17179869184 bytes of dense output"):
        gpu_codec.decompress(hostile)
    assert calls == []


def test_cap_counts_bytes_with_a_base_too():
    new = {"w": np.arange(1000, dtype=np.float64)}
    blob = gpu_codec.compress(new, fraction=0.01).to_bytes(version=1)
    base = {"w": np.zeros(1000)}
    with pytest.raises(PayloadLimitError, match="8000 bytes"):
        gpu_codec.decompress(blob, base=base, max_output_bytes=7999)
    assert gpu_codec.decompress(blob, base=base, max_output_bytes=8000)["w"][-1] == 999.0
    fp16 = gpu_codec.compress({"w": np.ones(1000, np.float16)}, fraction=0.01).to_bytes(version=1)
    # with a base the output is the base's dtype (2 bytes here); without, fp32 deltas (4 bytes)
    gpu_codec.decompress(fp16, base={"w": np.zeros(1000, np.float16)}, max_output_bytes=2000)
    with pytest.raises(PayloadLimitError, match="4000 bytes"):
        gpu_codec.decompress(fp16, max_output_bytes=2000)


def test_default_cap_is_4_gib_and_none_removes_it():
    assert gpu_codec.engine.DEFAULT_MAX_OUTPUT_BYTES == 4 << 30
    blob = _declare(gpu_codec.compress({"w": np.ones(8, np.float32)}, fraction=0.25).to_bytes(version=1), [1 << 30, 2])
    with pytest.raises(PayloadLimitError, match="max_output_bytes=4294967296"):
        gpu_codec.decompress(blob)
    with pytest.raises(PayloadLimitError):  # a cap of 0 refuses any non-empty output
        gpu_codec.decompress(gpu_codec.compress({"w": ones(4)}).to_bytes(version=1), max_output_bytes=0)
    assert (
        gpu_codec.decompress(gpu_codec.compress({"w": ones(4)}).to_bytes(version=1), max_output_bytes=None)["w"].size
        == 4
    )


@pytest.mark.parametrize("cap", [-1, 1.5, "1", True])
def test_bad_cap_is_invalid_input(cap):
    with pytest.raises(InvalidInputError, match="max_output_bytes"):
        gpu_codec.decompress(gpu_codec.compress({"w": ones(4)}).to_bytes(version=1), max_output_bytes=cap)


def test_max_elements_is_deprecated_but_still_applies():
    blob = gpu_codec.compress({"w": ones(100)}, fraction=0.1).to_bytes(version=1)
    with pytest.warns(DeprecationWarning, match="max_output_bytes"), pytest.raises(PayloadLimitError):
        gpu_codec.decompress(blob, max_elements=99)
    with pytest.warns(DeprecationWarning):
        assert gpu_codec.decompress(blob, max_elements=100)["w"].size == 100


def test_zstd_bomb_is_refused_before_decompression(monkeypatch):
    """A 2.5 KB dense int8 + zstd payload of a huge all-zero tensor: refused by the cap, zstd never called."""
    n = 1 << 28
    blob = gpu_codec.compress(
        {"w": np.zeros(n // 1024, np.float32)}, fraction=None, pipeline=[Int8Blockwise(256), Zstd()]
    )
    h, _ = split_payload(blob.to_bytes(version=1))
    raw = n + 4 * (n // 256)
    frame = zstandard.ZstdCompressor(level=19).compress(b"\0" * raw)
    h["tensors"][0].update(shape=[n])
    h["tensors"][0]["nnz"] = n
    h["tensors"][0]["codec"].update(raw=raw, zbytes=len(frame))
    h["tensors"][0]["buffers"][0]["nbytes"] = len(frame)
    h["data_length"] = len(frame)
    bomb = build_payload(h, frame)
    assert len(bomb) < 64 << 10
    monkeypatch.setattr(zstandard, "ZstdDecompressor", lambda *a, **k: pytest.fail("decompressed"))
    with pytest.raises(PayloadLimitError, match="1073741824 bytes"):
        gpu_codec.decompress(bomb, max_output_bytes=1 << 29)


def test_indices_are_checked_before_the_output_is_allocated(monkeypatch):
    blob = gpu_codec.compress({"a": np.arange(100, dtype=np.float32)}, fraction=0.1).to_bytes(version=1)
    h, data = split_payload(blob)
    b = h["tensors"][0]["buffers"][0]
    d = bytearray(data)
    d[b["offset"] : b["offset"] + 4] = (10_000).to_bytes(4, "little")
    bad = build_payload(h, bytes(d))
    real_zeros = np.zeros
    sizes = []
    monkeypatch.setattr(np, "zeros", lambda n, *a, **k: sizes.append(n) or real_zeros(n, *a, **k))
    with pytest.raises(PayloadIndexError, match="'a'"):
        gpu_codec.decompress(bad)
    assert 100 not in sizes


# ------------------------------------------------------------------------------------------ streaming memory

MEMORY_CASES = {
    "raw": dict(fraction=0.01, pipeline=None),
    "fp16_rice_zstd": dict(fraction=0.01, pipeline=[Quantize("float16"), RiceIndices(), Zstd()]),
    "int8_dense_zstd": dict(fraction=None, pipeline=[Int8Blockwise(256), Zstd()]),
    "ternary": dict(fraction=0.01, pipeline=[Ternary()]),
    "fp16_dense": dict(fraction=None, pipeline=[Quantize("float16")]),
    "fp16_dense_zstd": dict(fraction=None, pipeline=[Quantize("float16"), Zstd()]),
    "f32_dense_zstd": dict(fraction=None, pipeline=[Zstd()]),
    "ternary_dense_zstd": dict(fraction=None, pipeline=[Ternary(), Zstd()]),
}


@pytest.mark.parametrize("with_base", [False, True], ids=["delta", "base"])
@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_peak_memory_within_1_5x_of_the_declared_output(case, with_base):
    """A memory property, not a timing: tracemalloc's peak during decompress over the dense output's bytes."""
    rng = np.random.default_rng(3)
    u = {
        "big": rng.standard_normal(1 << 21).astype(np.float32),
        "small": rng.standard_normal((300, 7)).astype(np.float32),
    }
    blob = gpu_codec.compress(u, **MEMORY_CASES[case]).to_bytes(version=1)
    base = {k: np.zeros_like(v) for k, v in u.items()} if with_base else None
    declared = sum(v.nbytes for v in u.values())
    out, peak = decompress_peak(blob, base)
    assert set(out) == set(u)
    assert peak <= 1.5 * declared, f"peak {peak} bytes for a {declared}-byte output ({peak / declared:.2f}x)"


# ------------------------------------------------------------------------------------------ streamed zstd frames


def _dense_zstd(stages):
    rng = np.random.default_rng(9)
    return gpu_codec.compress({"w": rng.standard_normal(5000).astype(np.float32)}, fraction=None, pipeline=list(stages))


def _set_frame(blob: bytes, frame: bytes, raw: int | None = None) -> bytes:
    h, _ = split_payload(blob)
    t = h["tensors"][0]
    t["codec"]["zbytes"] = len(frame)
    if raw is not None:
        t["codec"]["raw"] = raw
    t["buffers"][0]["nbytes"] = len(frame)
    h["data_length"] = len(frame)
    return build_payload(h, frame)


@pytest.mark.parametrize(
    "stages", [(Int8Blockwise(16), Zstd()), (Zstd(),), (Ternary(), Zstd())], ids=["int8", "f32", "ternary"]
)
def test_streamed_dense_frames_are_bounded_and_checked(stages):
    blob = _dense_zstd(stages).to_bytes(version=1)
    h, data = split_payload(blob)
    raw = h["tensors"][0]["codec"]["raw"]
    frame = bytes(data[: h["tensors"][0]["codec"]["zbytes"]])
    assert gpu_codec.decompress(blob)["w"].size == 5000
    cases = {
        "trailing bytes": (frame + b"xx", PayloadError),
        "second frame": (frame + zstandard.ZstdCompressor().compress(b"\0"), PayloadError),
        "truncated": (frame[:-3], PayloadError),
        "garbage": (b"\x28\xb5\x2f\xfd" + b"\xff" * 40, PayloadError),
        "declares more": (zstandard.ZstdCompressor().compress(b"\0" * (raw + 1)), PayloadLimitError),
        "no size, shorter": (
            zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * (raw - 5)),
            PayloadError,
        ),
        "no size, bomb": (
            zstandard.ZstdCompressor(level=19, write_content_size=False).compress(b"\0" * (64 * raw)),
            PayloadError,
        ),
    }
    for name, (f, exc) in cases.items():
        with pytest.raises(exc):
            gpu_codec.decompress(_set_frame(blob, f))
            pytest.fail(name)
    # a frame without a content size but of the right content decodes like the original
    plain = zstandard.ZstdDecompressor().decompress(frame)
    nocs = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(plain)
    assert gpu_codec.decompress(_set_frame(blob, nocs))["w"].tobytes() == gpu_codec.decompress(blob)["w"].tobytes()


@pytest.mark.parametrize("scale", [3.0e38, np.inf, np.nan])
def test_hostile_int8_scales_are_refused_without_a_warning(scale):
    blob = gpu_codec.compress({"w": np.ones(64, np.float32)}, fraction=None, pipeline=[Int8Blockwise(16)]).to_bytes(
        version=1
    )
    h, data = split_payload(blob)
    b = h["tensors"][0]["buffers"][1]
    d = bytearray(data)
    d[b["offset"] : b["offset"] + 4] = np.float32(scale).tobytes()
    with pytest.raises(PayloadIndexError, match="not finite"):  # filterwarnings=error: no RuntimeWarning first
        gpu_codec.decompress(build_payload(h, bytes(d)))


@pytest.mark.parametrize("bits", [0x7E00, 0x7C00, 0xFC00, 0x7C01, 0xFD00])
@pytest.mark.parametrize("fraction", [None, 0.5], ids=["dense", "sparse"])
def test_non_finite_fp16_values_of_an_fp64_tensor_are_refused_without_a_warning(bits, fraction):
    """Found by the fuzz driver: widening a hostile fp16 (signalling) NaN warned before the scatter refused it."""
    u = {"w": np.arange(1.0, 9.0)}
    blob = gpu_codec.compress(u, fraction=fraction, pipeline=[Quantize("float16")]).to_bytes(version=1)
    h, data = split_payload(blob)
    b = h["tensors"][0]["buffers"][-1]
    d = bytearray(data)
    d[b["offset"] : b["offset"] + 2] = bits.to_bytes(2, "little")
    with pytest.raises(PayloadIndexError, match="not finite"):
        gpu_codec.decompress(build_payload(h, bytes(d)))


def test_frame_size_walker_matches_zstandard():
    from gpu_codec.format.common import zstd_frame_size

    for level, n, kw in [
        (1, 0, {}),
        (3, 1000, {}),
        (19, 300_000, {"write_checksum": True}),
        (1, 5, {"write_content_size": False}),
    ]:
        f = zstandard.ZstdCompressor(level=level, **kw).compress(
            np.random.default_rng(n).bytes(n // 2) + b"\0" * (n // 2)
        )
        assert zstd_frame_size(f + b"junk", "t") == len(f)


# ------------------------------------------------------------------------------------------ overflow of the base


@pytest.mark.parametrize(
    "dtype,big",
    [(np.float16, 60000.0), ("bfloat16", 3.0e38), (np.float32, 3.0e38)],
    ids=["fp16", "bf16", "fp32"],
)
@pytest.mark.parametrize("pipeline", [None, [Quantize("float32"), Zstd()]], ids=["coo", "sparse_zstd"])
def test_sum_past_the_dtype_range_is_an_error_and_the_base_is_untouched(dtype, big, pipeline):
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        arr = torch.tensor([big, 1.0, 2.0, 3.0], dtype=torch.bfloat16)
    else:
        arr = np.array([big, 1.0, 2.0, 3.0], dtype)
    base = {"w": arr.clone() if dtype == "bfloat16" else arr.copy()}
    before = np.asarray(base["w"].float() if dtype == "bfloat16" else base["w"]).tobytes()
    blob = gpu_codec.compress({"w": arr}, fraction=0.25, pipeline=pipeline).to_bytes(version=1)  # delta = arr itself
    with pytest.raises(PayloadValueError, match=r"'w'.*inf or NaN"):
        gpu_codec.decompress(blob, base=base)
    assert np.asarray(base["w"].float() if dtype == "bfloat16" else base["w"]).tobytes() == before
    # a delta back towards zero fits: decoded, finite
    half = gpu_codec.compress({"w": -arr / 4}, fraction=0.25, pipeline=pipeline).to_bytes(version=1)
    out = gpu_codec.decompress(half, base=base)["w"]
    assert np.isfinite(np.asarray(out.float() if dtype == "bfloat16" else out, np.float32)).all()


def test_dense_overflow_is_caught_too():
    base = {"w": np.full(1000, 40000.0, np.float16)}
    blob = gpu_codec.compress({"w": np.full(1000, 40000.0, np.float16)}, fraction=None).to_bytes(version=1)
    with pytest.raises(PayloadValueError):
        gpu_codec.decompress(blob, base=base)
    assert (base["w"] == 40000.0).all()


def test_base_inf_at_a_touched_entry_is_refused():
    base = {"w": np.array([np.inf, 0, 0, 0], np.float32)}
    blob = gpu_codec.compress({"w": np.array([1.0, 0, 0, 0], np.float32)}, fraction=0.25).to_bytes(version=1)
    with pytest.raises(PayloadValueError):
        gpu_codec.decompress(blob, base=base)


# ---------------------------------------------------------------------------------- compress writes what is read


def _compress_raises(update, match, **kw):
    with pytest.raises(InvalidInputError, match=match):
        gpu_codec.compress(update, **kw)


def test_compress_refuses_what_the_reader_refuses():
    _compress_raises({"w": ones(*([1] * (MAX_NDIM + 1)))}, "9 dimensions")
    _compress_raises({"x" * (MAX_NAME + 1): ones(2)}, "1025 characters")
    gpu_codec.decompress(gpu_codec.compress({"x" * MAX_NAME: ones(*([1] * MAX_NDIM))}).to_bytes(version=1))
    _compress_raises({str(i): ones(1) for i in range(MAX_TENSORS + 1)}, "100001 tensors")


def test_compress_refuses_a_header_over_the_limit():
    # 20,000 tensors with 1000-character names: 20 MB of version-1 JSON header, over 16 MiB; version 2's table
    # codes each name against the previous one and fits, so only an explicit version-1 write is refused
    u = {f"{i:06d}" + "n" * 994: ones(1) for i in range(20_000)}
    p = gpu_codec.compress(u, fraction=0.5)
    assert len(gpu_codec.Payload.from_bytes(p.to_bytes()).tensors) == 20_000
    with pytest.raises(InvalidInputError, match="version-1 header"):
        p.to_bytes(version=1)
    with pytest.raises(InvalidInputError, match="metadata is"):
        gpu_codec.compress({"w": ones(2)}, metadata={"blob": "x" * (MAX_HEADER_BYTES // 2)})


@pytest.mark.parametrize(
    "metadata,match",
    [
        ({"loss": float("nan")}, "not a finite"),
        ({"loss": float("inf")}, "not a finite"),
        ({"round": np.int64(3)}, "numpy.int64"),
        ({"w": np.ones(2)}, "numpy.ndarray"),
        ({1: "x"}, "key 1"),
        ({"b": b"bytes"}, "builtins.bytes"),
        ({"s": {1, 2}}, "builtins.set"),
        ({"big": 10**40}, "40 digits"),
        ([("a", 1)], "must be a mapping"),
    ],
)
def test_metadata_json_cannot_hold_is_refused_at_compress(metadata, match):
    _compress_raises({"w": ones(4)}, match, metadata=metadata)


def test_deep_or_cyclic_metadata_is_refused():
    deep: dict = {}
    node = deep
    for _ in range(100):
        node["a"] = {}
        node = node["a"]
    _compress_raises({"w": ones(4)}, "nested deeper", metadata=deep)
    cyclic: dict = {}
    cyclic["self"] = cyclic
    _compress_raises({"w": ones(4)}, "nested deeper", metadata=cyclic)


def test_metadata_that_passes_round_trips():
    md = {"round": 3, "lr": 0.5, "ok": True, "none": None, "tags": ("a", "b"), "nested": {"x": [1, 2.5]}}
    p = gpu_codec.compress({"w": ones(4)}, metadata=md)
    assert gpu_codec.Payload.from_bytes(p.to_bytes()).metadata == {**md, "tags": ["a", "b"]}


def test_torch_meta_sparse_and_ragged_inputs_are_invalid_input():
    torch = pytest.importorskip("torch")
    _compress_raises({"w": torch.empty(4, device="meta")}, "meta")
    _compress_raises({"w": torch.eye(3).to_sparse()}, "sparse_coo")
    _compress_raises({"w": ones(3)}, "meta", base={"w": torch.empty(3, device="meta")})
    _compress_raises({"w": [[1.0], [1.0, 2.0]]}, "not convertible")
    blob = gpu_codec.compress({"w": ones(3)}).to_bytes(version=1)
    with pytest.raises(InvalidInputError, match="sparse"):
        gpu_codec.decompress(blob, base={"w": torch.zeros(3).to_sparse()})


# ------------------------------------------------------------------------------------------ error feedback


def test_failed_call_does_not_advance_the_residual():
    ef = ErrorFeedback()
    u = {"w": np.array([4.0, 1.0, -2.0, 0.5], np.float32)}
    gpu_codec.compress(u, fraction=0.25, residual=ef)
    saved = ef.to_bytes()
    with pytest.raises(InvalidInputError, match="index stage"):
        gpu_codec.compress(u, fraction=None, pipeline=[RiceIndices()], residual=ef)
    assert ef.to_bytes() == saved
    with pytest.raises(InvalidInputError, match="metadata"):
        gpu_codec.compress(u, fraction=0.25, residual=ef, metadata={"x": float("nan")})
    assert ef.to_bytes() == saved
    bad = {"w": np.array([4.0, np.nan, -2.0, 0.5], np.float32)}
    with pytest.raises(InvalidInputError, match="non-finite"):
        gpu_codec.compress(bad, fraction=0.25, residual=ef)
    assert ef.to_bytes() == saved


def test_failure_inside_the_value_stage_does_not_advance_the_residual(monkeypatch):
    from gpu_codec.backends.cpu import CpuBackend

    ef = ErrorFeedback()
    u = {"w": np.arange(1.0, 9.0, dtype=np.float32)}
    gpu_codec.compress(u, fraction=0.25, residual=ef, pipeline=[Quantize("float16")])
    saved = ef.to_bytes()

    def boom(*a, **k):
        raise RuntimeError("stage failed")

    monkeypatch.setattr(CpuBackend, "cast16", boom)
    with pytest.raises(RuntimeError, match="stage failed"):
        gpu_codec.compress(u, fraction=0.25, residual=ef, pipeline=[Quantize("float16")])
    assert ef.to_bytes() == saved


def test_residual_must_be_an_error_feedback():
    _compress_raises({"w": ones(4)}, "residual must be", residual={"w": np.zeros(4)})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_saved_state_with_non_finite_residual_is_refused(bad):
    ef = ErrorFeedback()
    gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, fraction=0.25, residual=ef)
    h, data = split_payload(ef.to_bytes(version=1))
    d = bytearray(data)
    off = h["tensors"][0]["buffers"][0]["offset"]
    d[off + 4 : off + 8] = np.float32(bad).tobytes()
    with pytest.raises(PayloadValueError, match="non-finite"):
        ErrorFeedback.from_bytes(build_payload(h, bytes(d)))
    assert isinstance(PayloadValueError("x"), PayloadError)


def test_shared_state_mismatch_is_refused_without_change():
    ef = ErrorFeedback()
    gpu_codec.compress({"w": ones(4)}, fraction=0.5, residual=ef)
    saved = ef.to_bytes()
    _compress_raises({"w": ones(5)}, "reset", fraction=0.5, residual=ef)
    assert ef.to_bytes() == saved


# ------------------------------------------------------------------------------------------ every backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_decode_gives_the_same_result_on_every_backend(backend):
    """The decode path (per tensor, chunked scatter, overflow check) is the same code on every backend."""
    rng = np.random.default_rng(5)
    u = {"a": rng.standard_normal((70, 90)).astype(np.float32), "h": rng.standard_normal(3000).astype(np.float16)}
    base = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in u.items()}
    blobs = [gpu_codec.compress(u, base, **kw).to_bytes(version=1) for kw in MEMORY_CASES.values()]
    want = [gpu_codec.decompress(b, base=base) for b in blobs] + [gpu_codec.decompress(b) for b in blobs]
    over = gpu_codec.compress({"a": u["a"], "h": np.full(3000, 60000.0, np.float16)}, fraction=0.01).to_bytes(version=1)
    full = {"a": u["a"], "h": np.full(3000, 60000.0, np.float16)}
    with use_backend(backend) as be:
        on = (lambda d: {k: be.xp.asarray(v) for k, v in d.items()}) if be.on_device else (lambda d: d)
        like = "cupy" if be.on_device else None
        got = [gpu_codec.decompress(b, base=on(base)) for b in blobs] + [
            gpu_codec.decompress(b, like=like) for b in blobs
        ]
        with pytest.raises(PayloadValueError, match="'h'"):
            gpu_codec.decompress(over, base=on(full))
    for w, g in zip(want, got):
        assert {k: np.asarray(v).tobytes() for k, v in w.items()} == {
            k: (v.get() if be.on_device else np.asarray(v)).tobytes() for k, v in g.items()
        }


@pytest.mark.parametrize("stages", [[], [gpu_codec.Int8Blockwise(256), gpu_codec.Zstd()]])
def test_to_bytes_makes_one_copy_of_the_payload_and_keeps_none(stages):
    # The writer joined the payload, then copied it whole again to append its 4-byte checksum; a record's own
    # zstd frame was copied into the writer's cache, where it stayed beside the payload's.
    import tracemalloc

    rng = np.random.default_rng(0)
    n = 1 << 22
    new = {"a": rng.standard_normal(n).astype(np.float32), "b": rng.standard_normal(n // 3).astype(np.float32)}
    p = gpu_codec.compress(new, fraction=None if stages else 0.25, pipeline=stages or None)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        blob = p.to_bytes()
        size, peak = len(blob), tracemalloc.get_traced_memory()[1] - start
        del blob
        kept = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert peak < 1.1 * size, f"to_bytes peaked at {peak / size:.2f} payloads"
    assert kept < 0.05 * size, f"the payload keeps {kept} bytes after to_bytes"
    assert gpu_codec.Payload.from_bytes(p.to_bytes()).to_bytes() == p.to_bytes()
