"""OpenFL adapter: gpu_codec as a TransformationPipeline, run by OpenFL's own TensorCodec, protobuf messages,
collaborator and aggregator code (needs the ``openfl`` extra; CI runs this file in an environment of its own)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("openfl")

from openfl.pipelines import NoCompressionPipeline, TensorCodec
from openfl.pipelines.pipeline import TransformationPipeline, Transformer
from openfl.protocols import base_pb2
from openfl.protocols.utils import construct_named_tensor
from openfl.utilities import TensorKey

from gpu_codec.errors import InvalidInputError, PayloadError, PayloadLimitError
from gpu_codec.openfl import GpuCodecPipeline, GpuCodecTransformer
from tests.common import HAS_GPU, dense_from, reference_topk, use_backend

ADAPTER_BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]

# OpenFL 1.9's own float32 pipeline (its TensorCodec's lossless default) calls np.reshape(newshape=...), which
# NumPy 2.1 to 2.3 deprecate (the extra excludes 2.4, which removed it).
OPENFL_RESHAPE = pytest.mark.filterwarnings("ignore:`newshape` keyword argument is deprecated:DeprecationWarning")


def ref_topk(x: np.ndarray, fraction: float) -> np.ndarray:
    """The dense top-k of one fp32 tensor, from the shared reference."""
    x = np.asarray(x, np.float32)
    return dense_from(reference_topk({"x": x}, None, fraction), {"x": x.shape}, {"x": "float32"})["x"]


def sample(shape=(5, 8), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def over_the_wire(named_tensor) -> list[dict]:
    """A NamedTensor serialized, parsed back, and its metadata read as OpenFL's collaborator and aggregator read
    it (protobuf containers, not lists)."""
    received = base_pb2.NamedTensor.FromString(named_tensor.SerializeToString())
    meta = [
        {"int_to_float": m.int_to_float, "int_list": m.int_list, "bool_list": m.bool_list}
        for m in received.transformer_metadata
    ]
    return received, meta


def test_built_on_openfls_own_types():
    assert issubclass(GpuCodecPipeline, TransformationPipeline)
    assert issubclass(GpuCodecTransformer, Transformer)
    lossy = GpuCodecPipeline(fraction=0.1)
    assert [type(t) for t in lossy.transformers] == [GpuCodecTransformer] and lossy.is_lossy()
    codec = TensorCodec(lossy)
    assert codec.compression_pipeline is lossy and isinstance(codec.lossless_pipeline, NoCompressionPipeline)
    dense = GpuCodecPipeline(fraction=None)
    assert not dense.is_lossy() and TensorCodec(dense).lossless_pipeline is dense
    assert GpuCodecPipeline([{"id": "quantize", "dtype": "float16"}], fraction=None).is_lossy()


@OPENFL_RESHAPE
def test_tensor_codec_round_trips_and_tags():
    x = sample()
    key = TensorKey("w", "col1", 0, False, ("delta", "trained"))
    codec = TensorCodec(GpuCodecPipeline(fraction=0.1))

    ck, blob, meta = codec.compress(key, x)
    assert ck.tags == ("delta", "lossy_compressed", "trained") and meta == [{"int_list": [5, 8]}]
    assert isinstance(blob, bytes) and len(blob) < x.nbytes
    dk, back = codec.decompress(ck, blob, meta)
    assert dk.tags == ("delta", "lossy_decompressed", "trained") and back.dtype == np.float32
    np.testing.assert_array_equal(back, ref_topk(x, 0.1))
    assert meta == [{"int_list": [5, 8]}]  # left as it was: a second read gives the same
    np.testing.assert_array_equal(codec.decompress(ck, blob, meta)[1], back)

    ck, blob, meta = codec.compress(key, x, require_lossless=True)  # OpenFL's float32 bytes
    assert ck.tags == ("compressed", "delta", "trained") and blob == x.tobytes()
    dk, back = codec.decompress(ck, blob, meta, require_lossless=True)
    assert dk.tags == ("delta", "trained")
    np.testing.assert_array_equal(back, x)

    lossless = TensorCodec(GpuCodecPipeline([{"id": "zstd", "level": 3}], fraction=None))
    ck, blob, meta = lossless.compress(key, x)
    assert ck.tags == ("compressed", "delta", "trained")
    dk, back = lossless.decompress(ck, blob, meta)
    assert dk.tags == ("delta", "trained")
    np.testing.assert_array_equal(back, x)


def test_delta_and_apply_delta():
    base, trained = sample(seed=1), sample(seed=2)
    codec = TensorCodec(GpuCodecPipeline(fraction=0.25))
    dkey, delta = codec.generate_delta(TensorKey("w", "col1", 1, False, ("trained",)), trained, base)
    ck, blob, meta = codec.compress(dkey, delta)
    rkey, rdelta = codec.decompress(ck._replace(origin="aggregator_1"), blob, meta)
    akey, model = codec.apply_delta(rkey, rdelta, base)
    assert akey.tags == ("lossy_decompressed", "trained")  # the aggregator keeps the tags, less "delta"
    np.testing.assert_array_equal(model, base + ref_topk(trained - base, 0.25))
    assert codec.apply_delta(rkey, rdelta, base, creates_model=True)[0].tags == ("model",)
    model_key = TensorKey("w", "aggregator_1", 2, False, ("model",))
    assert codec.find_dependencies(model_key, True)[1].tags == ("aggregated", "delta", "lossy_compressed")


def test_metadata_and_bytes_through_openfls_protobuf():
    x = sample((3, 4, 2))
    codec = TensorCodec(GpuCodecPipeline([{"id": "quantize", "dtype": "float16"}, {"id": "rice"}], fraction=0.3))
    ck, blob, meta = codec.compress(TensorKey("conv.w", "col2", 5, False, ("delta", "trained")), x)
    received, wire_meta = over_the_wire(construct_named_tensor(ck, blob, meta, lossless=False))
    assert received.data_bytes == blob and list(received.transformer_metadata[0].int_list) == [3, 4, 2]
    key = TensorKey(received.name, "aggregator_a", received.round_number, received.report, tuple(received.tags))
    dk, back = codec.decompress(key, received.data_bytes, wire_meta)
    assert dk.tags == ("delta", "lossy_decompressed", "trained") and back.shape == (3, 4, 2)
    np.testing.assert_array_equal(back, ref_topk(x, 0.3).astype(np.float16).astype(np.float32))


@OPENFL_RESHAPE
def test_openfls_collaborator_and_aggregator_code_run_the_pipeline():
    """OpenFL's own methods (Collaborator.nparray_to_named_tensor, Aggregator._process_named_tensor,
    Aggregator._nparray_to_named_tensor, Collaborator.named_tensor_to_nparray) over a TensorDB, with the
    pipeline as a plan would build it; only the objects around them are reduced to what they read."""
    from openfl.component.aggregator.aggregator import Aggregator
    from openfl.component.collaborator.collaborator import Collaborator
    from openfl.databases import TensorDB
    from openfl.federated.plan import Plan

    settings = {"pipeline": [{"id": "zstd", "level": 3}], "fraction": 0.2}
    pipe = Plan.build("gpu_codec.openfl.GpuCodecPipeline", dict(settings))
    assert isinstance(pipe, GpuCodecPipeline) and pipe.get_config()["fraction"] == 0.2
    assert Plan.build("gpu_codec.openfl.GpuCodecPipeline", pipe.get_config()).get_config() == pipe.get_config()

    base, trained = sample((16, 8), seed=3), sample((16, 8), seed=4)
    col = SimpleNamespace(
        collaborator_name="col1", use_delta_updates=True, tensor_db=TensorDB(), tensor_codec=TensorCodec(pipe)
    )
    agg = SimpleNamespace(uuid="aggregator_x", tensor_db=TensorDB(), tensor_codec=TensorCodec(pipe))
    col.tensor_db.cache_tensor({TensorKey("fc.w", "col1", 4, False, ("model",)): base})
    agg.tensor_db.cache_tensor({TensorKey("fc.w", "aggregator_x", 4, False, ("model",)): base})

    sent = Collaborator.nparray_to_named_tensor(col, TensorKey("fc.w", "col1", 4, False, ("trained",)), trained)
    received = base_pb2.NamedTensor.FromString(sent.SerializeToString())
    key, value = Aggregator._process_named_tensor(agg, received, "col1")
    assert key == TensorKey("fc.w", "aggregator_x", 4, False, ("col1", "lossy_decompressed", "trained"))
    want = base + ref_topk(trained - base, 0.2)
    np.testing.assert_array_equal(value, want)

    # back down: the aggregated model as a compressed delta against the previous round's model
    agg_key = TensorKey("fc.w", "aggregator_x", 5, False, ("aggregated",))
    down = Aggregator._nparray_to_named_tensor(agg, agg_key, value, send_model_deltas=True, compress_lossless=False)
    assert tuple(down.tags) == ("aggregated", "delta", "lossy_compressed")
    got = Collaborator.named_tensor_to_nparray(col, base_pb2.NamedTensor.FromString(down.SerializeToString()))
    np.testing.assert_array_equal(got, ref_topk(value - base, 0.2))

    # a tensor that must arrive exactly goes through OpenFL's lossless pipeline
    exact = Collaborator.nparray_to_named_tensor(col, TensorKey("fc.b", "col1", 4, False, ("trained",)), base[0])
    assert tuple(exact.tags) == ("compressed", "trained") and exact.data_bytes == base[0].tobytes()


def test_bad_input_gets_gpu_codec_errors():
    p = GpuCodecPipeline(fraction=0.5)
    blob, meta = p.forward(sample((4, 4)))
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])
    codec = TensorCodec(p)
    with pytest.raises(PayloadError):
        codec.decompress(TensorKey("w", "c", 0, False, ("lossy_compressed",)), flipped, meta)
    with pytest.raises(PayloadError):
        p.backward(NoCompressionPipeline().forward(sample((4, 4)))[0], meta)  # float32 bytes, not a payload
    with pytest.raises(InvalidInputError, match="shape"):
        p.backward(blob, [{"int_list": [2, 8]}])
    with pytest.raises(InvalidInputError, match="one metadata entry per transformer"):
        p.backward(blob, [])
    with pytest.raises(InvalidInputError, match="one metadata entry per transformer"):
        p.backward(blob, meta + meta)
    with pytest.raises(InvalidInputError, match="int_list"):
        p.backward(blob, [{"int_to_float": {}}])
    with pytest.raises(InvalidInputError, match="integers"):
        p.backward(blob, [{"int_list": ["four", 4]}])
    for lie in ([float("inf"), 4], [3.9, 4.2], "34", {3: "x", 4: "y"}, [True, 4]):  # (coerced or overflowed before)
        with pytest.raises(InvalidInputError, match="integers"):
            p.backward(blob, [{"int_list": lie}])
    with pytest.raises(InvalidInputError, match="payload's bytes"):
        p.backward(np.frombuffer(blob, np.uint8), meta)
    with pytest.raises(InvalidInputError, match="like"):
        p.backward(blob, meta, like="jax")
    with pytest.raises(PayloadLimitError):
        GpuCodecPipeline(fraction=0.5, max_output_bytes=32).backward(blob, meta)  # 16 fp32 entries: 64 bytes
    with pytest.raises(InvalidInputError, match="real numbers"):
        p.forward(np.array(["a", "b"]))
    with pytest.raises(InvalidInputError, match="real numbers"):
        p.forward(np.ones(3, np.complex64))
    with pytest.raises(InvalidInputError):
        p.forward({"w": np.ones(3)})
    with pytest.raises(InvalidInputError):
        GpuCodecPipeline(fraction=1.5)
    with pytest.raises(InvalidInputError):
        GpuCodecPipeline([{"id": "no-such-codec"}])
    with pytest.raises(InvalidInputError, match="like"):
        GpuCodecPipeline(like="jax")


_UNPICKLED = []


def _mark_unpickled() -> int:
    _UNPICKLED.append(True)
    return 0


class _Trap:
    def __reduce__(self):
        return (_mark_unpickled, ())


def test_never_unpickles(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on received bytes")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    trap = pickle.dumps(_Trap())
    codec = TensorCodec(GpuCodecPipeline(fraction=0.5))
    with pytest.raises(PayloadError):
        codec.decompress(TensorKey("w", "c", 0, False, ("lossy_compressed",)), trap, [{"int_list": [1]}])
    assert _UNPICKLED == []


def test_dtypes_round_trip_losslessly_when_dense():
    p = GpuCodecPipeline(fraction=None)
    for dt in (np.float16, np.float32, np.float64):
        x = (np.arange(12) / 7 - 0.8).astype(dt).reshape(3, 4)
        back = p.backward(*p.forward(x))
        assert back.dtype == dt and back.shape == (3, 4)
        np.testing.assert_array_equal(back, x)
    ints = p.backward(*p.forward(np.array([1, -2, 3], np.int64)))  # OpenFL's own pipelines cast to float32 too
    assert ints.dtype == np.float32 and ints.tolist() == [1.0, -2.0, 3.0]
    assert p.backward(*p.forward(2.5)).tolist() == 2.5
    assert p.backward(*p.forward([0.5, 1.5])).tolist() == [0.5, 1.5]


def test_torch_input_and_bfloat16():
    torch = pytest.importorskip("torch")
    p = GpuCodecPipeline(fraction=None, like="torch")
    x = torch.linspace(-1, 1, 10, dtype=torch.bfloat16)
    back = p.backward(*p.forward(x))
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    assert p.backward(*p.forward(x), like="numpy").dtype == np.float32


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_torch_delta_on_its_device(backend):
    """A collaborator's torch delta is compressed where it lives; the aggregator rebuilds the model tensor."""
    torch = pytest.importorskip("torch")
    device = "cuda" if backend == "gpu" else "cpu"
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=g).to(device)
    trained = base + torch.randn(64, 32, generator=g).to(device)
    with use_backend(backend):
        codec = TensorCodec(GpuCodecPipeline(fraction=0.05, like="torch"))
        dkey, delta = codec.generate_delta(TensorKey("fc.weight", "col1", 4, False, ("trained",)), trained, base)
        assert delta.device.type == device
        if backend == "gpu":
            payload, _ = codec.compression_pipeline.forward(delta, serialize=False)
            assert type(payload.tensors[0].buffers["values"]).__module__.startswith("cupy")
        ckey, blob, meta = codec.compress(dkey, delta)
        rkey, rdelta = codec.decompress(ckey._replace(origin="aggregator_1"), blob, meta)
        mkey, model = codec.apply_delta(rkey, rdelta.to(device), base, creates_model=True)
    assert mkey.tags == ("model",) and model.device.type == device
    want = base.cpu().numpy() + ref_topk(delta.cpu().numpy(), 0.05)
    np.testing.assert_array_equal(model.cpu().numpy(), want)
