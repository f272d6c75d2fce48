"""OpenFL adapter: TensorKey tag logic and dependencies as OpenFL's TensorCodec, gpu_codec as a pipeline."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec.errors import InvalidInputError, PayloadError
from gpu_codec.openfl import (
    GpuCodecPipeline,
    LossyPipelineError,
    NoCompressionPipeline,
    TensorCodec,
    TensorKey,
    TensorTagError,
    change_tags,
)
from tests.common import HAS_GPU, dense_from, reference_topk, use_backend

ADAPTER_BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


def ref_topk(x: np.ndarray, fraction: float) -> np.ndarray:
    """The dense top-k of one fp32 tensor, from the shared reference."""
    x = np.asarray(x, np.float32)
    return dense_from(reference_topk({"x": x}, None, fraction), {"x": x.shape}, {"x": "float32"})["x"]


def test_tensor_key_and_change_tags_follow_openfl():
    key = TensorKey("w", "col1", 2, False, ("trained",))
    assert key._fields == ("tensor_name", "origin", "round_number", "report", "tags")
    assert tuple(key) == ("w", "col1", 2, False, ("trained",))
    assert change_tags(("b", "a", "b")) == ("a", "b")
    assert change_tags(("trained",), add_field="trained") == ("trained",)
    assert change_tags(("delta", "trained"), remove_field="delta") == ("trained",)
    with pytest.raises(TensorTagError, match="compressed not in tags"):
        change_tags(("trained",), remove_field="compressed")


def test_compress_decompress_tags_lossy_and_lossless():
    x = (np.arange(1, 41) * np.where(np.arange(40) % 3, 1, -1)).astype(np.float32).reshape(5, 8)
    key = TensorKey("w", "col1", 0, False, ("delta", "trained"))
    lossy = TensorCodec(GpuCodecPipeline(fraction=0.1))
    assert isinstance(lossy.lossless_pipeline, NoCompressionPipeline)

    ck, blob, meta = lossy.compress(key, x)
    assert ck.tags == ("delta", "lossy_compressed", "trained") and meta == [{"int_list": [5, 8]}]
    dk, back = lossy.decompress(ck, blob, meta)
    assert dk.tags == ("delta", "lossy_decompressed", "trained")
    np.testing.assert_array_equal(back, ref_topk(x, 0.1))

    ck, blob, meta = lossy.compress(key, x, require_lossless=True)  # OpenFL's float32 bytes
    assert ck.tags == ("compressed", "delta", "trained") and blob == x.tobytes() and meta == [{"int_list": [5, 8]}]
    dk, back = lossy.decompress(ck, blob, meta, require_lossless=True)
    assert dk.tags == ("delta", "trained")
    np.testing.assert_array_equal(back, x)

    lossless = TensorCodec(GpuCodecPipeline(fraction=None))
    assert lossless.lossless_pipeline is lossless.compression_pipeline
    ck, blob, meta = lossless.compress(key, x)
    assert ck.tags == ("compressed", "delta", "trained")
    dk, back = lossless.decompress(ck, blob, meta)
    assert dk.tags == ("delta", "trained")
    np.testing.assert_array_equal(back, x)


def test_decompress_refuses_what_openfl_refuses():
    codec = TensorCodec(GpuCodecPipeline(fraction=0.5))
    key = TensorKey("w", "col1", 0, False, ("trained",))
    ck, blob, meta = codec.compress(key, np.ones(4, np.float32))
    with pytest.raises(TensorTagError, match="uncompressed"):
        codec.decompress(key, blob, meta)
    with pytest.raises(TensorTagError, match="losslessly"):
        codec.decompress(ck, blob, meta, require_lossless=True)
    with pytest.raises(InvalidInputError, match="metadata"):
        codec.decompress(ck, blob, [])
    with pytest.raises(PayloadError):
        codec.decompress(ck, blob[:-1] + bytes([blob[-1] ^ 1]), meta)


def test_delta_tags_and_aggregator_origin():
    base, new = np.zeros(3, np.float32), np.array([1, 2, 3], np.float32)
    dkey, delta = TensorCodec.generate_delta(TensorKey("w", "col1", 1, False, ("trained",)), new, base)
    assert dkey.tags == ("delta", "trained") and delta.tolist() == [1, 2, 3]
    with pytest.raises(TensorTagError, match="base model"):
        TensorCodec.generate_delta(TensorKey("w", "col1", 1, False, ("model",)), new, base)
    with pytest.raises(InvalidInputError, match="Shape"):
        TensorCodec.generate_delta(dkey, new, np.zeros(4, np.float32))

    k, m = TensorCodec.apply_delta(TensorKey("w", "col1", 1, False, ("delta", "trained")), delta, base)
    assert k.tags == ("model",) and m.tolist() == [1, 2, 3]
    agg = TensorKey("w", "aggregator_abc", 1, False, ("aggregated", "delta"))
    assert TensorCodec.apply_delta(agg, delta, base)[0].tags == ("aggregated",)
    assert TensorCodec.apply_delta(agg, delta, base, creates_model=True)[0].tags == ("model",)


def test_find_dependencies():
    model_key = TensorKey("w", "aggregator_x", 3, False, ("model",))
    lossy, lossless = TensorCodec(GpuCodecPipeline(fraction=0.1)), TensorCodec(NoCompressionPipeline())
    assert lossy.find_dependencies(model_key, True) == [
        TensorKey("w", "aggregator_x", 2, False, ("model",)),
        TensorKey("w", "aggregator_x", 3, False, ("aggregated", "delta", "lossy_compressed")),
    ]
    assert lossless.find_dependencies(model_key, True)[1].tags == ("aggregated", "delta", "compressed")
    assert lossy.find_dependencies(model_key, False) == []
    assert lossy.find_dependencies(model_key._replace(round_number=0), True) == []
    assert lossy.find_dependencies(model_key._replace(tags=("trained",)), True) == []


def test_set_lossless_pipeline():
    codec = TensorCodec(GpuCodecPipeline(fraction=0.1))
    with pytest.raises(LossyPipelineError):
        codec.set_lossless_pipeline(GpuCodecPipeline(fraction=0.5))
    dense = GpuCodecPipeline(fraction=None)
    codec.set_lossless_pipeline(dense)
    assert codec.lossless_pipeline is dense
    with pytest.raises(InvalidInputError, match="forward, backward and is_lossy"):
        TensorCodec(object())


def test_dtypes_round_trip_losslessly_when_dense():
    p = GpuCodecPipeline(fraction=None)
    for dt in (np.float16, np.float32, np.float64):
        x = (np.arange(12) / 7 - 0.8).astype(dt).reshape(3, 4)
        back = p.backward(*p.forward(x))
        assert back.dtype == dt and back.shape == (3, 4)
        np.testing.assert_array_equal(back, x)
    ints = p.backward(*p.forward(np.array([1, -2, 3], np.int64)))  # OpenFL casts to float32 as well
    assert ints.dtype == np.float32 and ints.tolist() == [1.0, -2.0, 3.0]
    assert p.backward(*p.forward(2.5)).tolist() == 2.5


def test_torch_input_and_bfloat16():
    torch = pytest.importorskip("torch")
    p = GpuCodecPipeline(fraction=None, like="torch")
    x = torch.linspace(-1, 1, 10, dtype=torch.bfloat16)
    back = p.backward(*p.forward(x))
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    assert p.backward(*p.forward(x), like="numpy").dtype == np.float32


def test_codec_stages_after_topk():
    if not hasattr(gpu_codec, "get_codec"):
        with pytest.raises(InvalidInputError, match="codec pipelines"):
            GpuCodecPipeline([{"id": "zstd"}], fraction=0.1).forward(np.ones(4, np.float32))
        return
    x = np.random.default_rng(3).standard_normal((20, 10)).astype(np.float32)
    stages = [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}]
    codec = TensorCodec(stages)  # stage configs are wrapped in a GpuCodecPipeline
    assert isinstance(codec.compression_pipeline, GpuCodecPipeline) and codec.compression_pipeline.is_lossy()
    key = TensorKey("w", "col1", 0, False, ("trained",))
    ck, blob, meta = codec.compress(key, x)
    assert ck.tags == ("lossy_compressed", "trained")
    _, back = codec.decompress(ck, blob, meta)
    np.testing.assert_array_equal(back, ref_topk(x, 0.01).astype(np.float16).astype(np.float32))
    dense_zstd = GpuCodecPipeline([{"id": "zstd"}], fraction=None)
    assert not dense_zstd.is_lossy()
    assert TensorCodec(dense_zstd).lossless_pipeline is dense_zstd
    np.testing.assert_array_equal(dense_zstd.backward(*dense_zstd.forward(x)), x)


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_collaborator_to_aggregator_flow(backend):
    """A collaborator sends a compressed delta; the aggregator rebuilds the model tensor."""
    torch = pytest.importorskip("torch")
    device = "cuda" if backend == "gpu" else "cpu"
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=g).to(device)
    trained = base + torch.randn(64, 32, generator=g).to(device)
    with use_backend(backend):
        codec = TensorCodec(GpuCodecPipeline(fraction=0.05, like="torch"))
        key = TensorKey("fc.weight", "col1", 4, False, ("trained",))
        dkey, delta = codec.generate_delta(key, trained, base)
        assert delta.device.type == device
        if backend == "gpu":
            payload, _ = codec.compression_pipeline.forward(delta, serialize=False)
            assert type(payload.tensors[0].buffers["values"]).__module__.startswith("cupy")
        ckey, blob, meta = codec.compress(dkey, delta)
        agg_key = ckey._replace(origin="aggregator_1")
        rkey, rdelta = codec.decompress(agg_key, blob, meta)
        mkey, model = codec.apply_delta(rkey, rdelta.to(device), base, creates_model=True)
    assert mkey.tags == ("model",) and model.device.type == device
    want = base.cpu().numpy() + ref_topk(delta.cpu().numpy(), 0.05)
    np.testing.assert_array_equal(model.cpu().numpy(), want)
