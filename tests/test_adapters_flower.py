"""Flower adapter: Array and ParametersRecord as flwr's, a gpu_codec payload inside, round trips via real flwr."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec.errors import InvalidInputError, PayloadError
from gpu_codec.flower import _GUARD, STYPE_GPU_CODEC, Array, ArrayRecord, ParametersRecord
from tests.common import HAS_GPU, dense_from, reference_topk, use_backend

ADAPTER_BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


def ref_topk(update: dict, fraction: float) -> dict:
    """The dense top-k delta of fp32 tensors, from the shared reference."""
    f32 = {n: np.asarray(v, np.float32) for n, v in update.items()}
    ref = reference_topk(f32, None, fraction)
    return dense_from(ref, {n: v.shape for n, v in f32.items()}, dict.fromkeys(f32, "float32"))


def update_and_base(seed=0):
    rng = np.random.default_rng(seed)
    base = {
        "enc.w": rng.standard_normal((16, 8)).astype(np.float32),
        "enc.b": rng.standard_normal(8).astype(np.float32),
    }
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    return new, base


def test_array_from_numpy_is_flwrs_npy_encoding():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    a = Array.from_numpy_ndarray(x)
    assert (a.dtype, a.shape, a.stype) == ("float64", (3, 4), "numpy.ndarray")
    np.testing.assert_array_equal(a.numpy(), x)
    assert Array("float64", (3, 4), "numpy.ndarray", a.data) == a
    assert Array(x) == a and Array(ndarray=x) == a
    assert Array(dtype="float64", shape=(3, 4), stype="numpy.ndarray", data=a.data) == a
    for bad in (
        lambda: Array("float64", (3, 4), "numpy.ndarray", "not bytes"),
        lambda: Array(x, ndarray=x),
        lambda: Array(ndarray=x, dtype="float64"),
        lambda: Array("float64", (3, 4), "numpy.ndarray", a.data, b""),
        lambda: Array(),
    ):
        with pytest.raises(TypeError, match="Array"):
            bad()
    with pytest.raises(InvalidInputError, match="holds a gpu_codec payload"):
        Array.from_payload(gpu_codec.compress({"w": x.astype(np.float32)}, fraction=0.5)).numpy()
    with pytest.raises(TypeError, match="holds no gpu_codec payload"):
        a.payload()
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        Array("float32", (1,), "other", b"").numpy()


def test_same_constructions_as_flwr():
    fa = pytest.importorskip("flwr.app")
    torch = pytest.importorskip("torch")
    x = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    t = torch.arange(4.0)
    assert Array(x).to_flwr() == fa.Array(x) and Array(ndarray=x).to_flwr() == fa.Array(ndarray=x)
    assert Array(torch_tensor=t).to_flwr() == fa.Array(torch_tensor=t) and Array(t).to_flwr() == fa.Array(t)

    def same(ours, theirs):
        assert list(ours) == list(theirs)
        assert all(ours[k].to_flwr() == theirs[k] for k in theirs)

    same(ArrayRecord([x, x + 1]), fa.ArrayRecord([x, x + 1]))
    same(ArrayRecord(numpy_ndarrays=[x]), fa.ArrayRecord(numpy_ndarrays=[x]))
    sd = {"a": t, "b": t * 2}
    same(ArrayRecord(sd), fa.ArrayRecord(sd))
    same(ArrayRecord(torch_state_dict=sd), fa.ArrayRecord(torch_state_dict=sd))
    same(ArrayRecord(array_dict={"k": Array(x)}), fa.ArrayRecord(array_dict={"k": fa.Array(x)}))
    same(ArrayRecord({"k": fa.Array(x)}), fa.ArrayRecord({"k": fa.Array(x)}))
    assert len(ArrayRecord()) == 0 and len(ArrayRecord(numpy_ndarrays=[])) == 0
    for args, kw in [
        (([x], [x]), {}),
        (([x],), {"numpy_ndarrays": [x]}),
        ((), {"numpy_ndarrays": [x], "array_dict": {}}),
    ]:
        with pytest.raises(TypeError, match="Invalid arguments for ArrayRecord"):
            ArrayRecord(*args, **kw)
        with pytest.raises(TypeError, match="Invalid arguments for ArrayRecord"):
            fa.ArrayRecord(*args, **kw)
    with pytest.raises(TypeError):
        ArrayRecord([x], False)  # keep_input is keyword-only, as in flwr


def test_torch_arrays_and_bfloat16():
    torch = pytest.importorskip("torch")
    t = torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3)
    a = Array.from_torch_tensor(t)
    # widened exactly: a stock peer gets float32 values, never the uint16 bit pattern
    assert a.dtype == "float32" and a.numpy().dtype == np.float32
    assert torch.equal(a.to_torch().to(torch.bfloat16), t)
    assert a == Array.from_numpy_ndarray(t.float().numpy())
    f = torch.ones(3)
    assert Array.from_array(f) == Array.from_numpy_ndarray(f.numpy())
    # a record from an earlier version (bfloat16 as uint16 .npy) is read, and converted before it reaches flwr
    bits = t.view(torch.int16).numpy().view(np.uint16)
    legacy = Array("bfloat16", (2, 3), "numpy.ndarray", Array.from_numpy_ndarray(bits).data)
    assert torch.equal(legacy.to_torch().to(torch.bfloat16), t)
    if pytest.importorskip("flwr.app"):
        sent = legacy.to_flwr()
        assert sent.dtype == "float32" and np.array_equal(sent.numpy(), t.float().numpy())


def test_record_keep_input_and_count_bytes():
    arrays = {"a": Array.from_numpy_ndarray(np.ones(3, np.float32)), "b": Array.from_numpy_ndarray(np.zeros(2))}
    rec = ParametersRecord(arrays)  # the seed's default, keep_input=False, empties the input
    assert arrays == {} and list(rec) == ["a", "b"]
    assert rec.count_bytes() == sum(len(v.data) + len(k) for k, v in rec.items())
    kept = {"a": Array.from_numpy_ndarray(np.ones(3, np.float32))}
    ParametersRecord(kept, True)
    ParametersRecord(array_dict=kept, keep_input=True)
    assert list(kept) == ["a"] and len(ParametersRecord()) == 0 and len(ParametersRecord(None)) == 0
    lst = [np.ones(2, np.float32), np.zeros(3, np.int32)]
    rec = ArrayRecord(lst, keep_input=False)
    assert lst == [] and list(rec) == ["0", "1"]
    kept = [np.ones(2, np.float32)]
    ArrayRecord(kept)  # flwr's default keeps it
    assert len(kept) == 1
    sd = {"w": np.ones(2, np.float32)}
    ArrayRecord(torch_state_dict=sd, keep_input=False)
    assert sd == {}
    with pytest.raises(TypeError, match="Key must be"):
        rec[1] = Array(np.ones(1))
    with pytest.raises(TypeError, match="Value must be"):
        rec["x"] = np.ones(2)
    assert issubclass(ParametersRecord, ArrayRecord)


def test_payload_array_is_lazy_and_counted_exactly():
    new, base = update_and_base(1)
    payload = gpu_codec.compress(new, base, fraction=0.1)
    arr = Array.from_payload(payload)
    assert arr._data is None and arr.nbytes == len(_GUARD) + payload.nbytes == arr.shape[0]
    rec = ParametersRecord({"gpu_codec": arr})
    assert rec.count_bytes() == arr.nbytes + len("gpu_codec") and arr._data is None
    assert arr.data == _GUARD + payload.to_bytes() and arr.payload() is payload
    assert Array.from_payload(payload.to_bytes()) == arr and arr.is_payload
    assert len(_GUARD) % 64 == 0
    with pytest.raises(PayloadError):
        Array.from_payload(payload.to_bytes()[:-1])
    # the form without the guard, as earlier versions wrote it, still reads
    old = Array("uint8", (payload.nbytes,), STYPE_GPU_CODEC, payload.to_bytes())
    assert old.is_payload and old.payload().to_bytes() == payload.to_bytes()
    # a tampered guard is not taken for a payload
    bad = Array(STYPE_GPU_CODEC, arr.shape, "numpy.ndarray", b"x" + arr.data[1:])
    assert not bad.is_payload


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_compressed_record_round_trip(backend):
    new, base = update_and_base(2)
    with use_backend(backend):
        rec = ParametersRecord.compressed(new, base, fraction=0.05)
        if backend == "gpu":
            assert type(rec["gpu_codec"].payload().tensors[0].buffers["values"]).__module__.startswith("cupy")
        wire = ParametersRecord(
            {"gpu_codec": Array(**{f: getattr(rec["gpu_codec"], f) for f in ("dtype", "shape", "stype", "data")})}
        )
        delta = wire.decompress()
        full = wire.decompress(base=base)
    want = ref_topk({k: new[k] - base[k] for k in new}, 0.05)
    for n in new:
        np.testing.assert_array_equal(delta[n], want[n])
        np.testing.assert_array_equal(full[n], base[n] + want[n])


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_torch_state_dicts_on_their_device(backend):
    torch = pytest.importorskip("torch")
    device = "cuda" if backend == "gpu" else "cpu"
    torch.manual_seed(0)
    base = {k: v.to(device) for k, v in torch.nn.Linear(10, 4).state_dict().items()}
    new = {k: v + torch.randn_like(v) for k, v in base.items()}
    with use_backend(backend):
        rec = ParametersRecord.compressed(new, base, fraction=0.2)
        rec["extra"] = Array.from_array(torch.arange(3.0, device=device))
        out = rec.decompress(base={**base, "extra": torch.zeros(3, device=device)})
    assert all(v.device.type == device for v in out.values())
    want = ref_topk({k: (new[k] - base[k]).cpu().numpy() for k in new}, 0.2)
    for n in new:
        np.testing.assert_array_equal(out[n].cpu().numpy(), (base[n].cpu().numpy() + want[n]))
    assert out["extra"].tolist() == [0.0, 1.0, 2.0]
    plain = ParametersRecord.from_torch_state_dict(dict(base))
    sd = plain.to_torch_state_dict(device=device)
    assert all(torch.equal(sd[k], base[k]) for k in base)


def test_codec_stages_in_a_record():
    new, base = update_and_base(4)
    rec = ParametersRecord.compressed(
        new, base, fraction=0.1, pipeline=[{"id": "quantize", "dtype": "bfloat16"}, {"id": "zstd", "level": 1}]
    )
    assert [s["id"] for s in rec["gpu_codec"].payload().pipeline] == ["topk", "quantize", "zstd"]
    want = ref_topk({k: new[k] - base[k] for k in new}, 0.1)
    got = rec.decompress()
    for n in new:
        np.testing.assert_allclose(got[n], want[n], rtol=2**-8)
        assert ((got[n] != 0) == (want[n] != 0)).all()


def test_real_flwr_round_trip():
    fc = pytest.importorskip("flwr.common")
    from flwr.common import serde

    new, base = update_and_base(3)
    rec = ParametersRecord.compressed(new, base, fraction=0.1)
    rec["dense.w"] = Array.from_numpy_ndarray(np.arange(4, dtype=np.float32))
    flwr_rec = rec.to_flwr()
    assert isinstance(flwr_rec, fc.ArrayRecord)
    assert flwr_rec["gpu_codec"].dtype == STYPE_GPU_CODEC
    assert flwr_rec.count_bytes() == rec.count_bytes()
    # our numpy Arrays are byte-identical to flwr's own
    assert flwr_rec["dense.w"].data == fc.Array(np.arange(4, dtype=np.float32)).data
    assert np.array_equal(flwr_rec["dense.w"].numpy(), np.arange(4, dtype=np.float32))

    # through flwr's wire format (protobuf) and back
    wire = serde.recorddict_to_proto(fc.RecordDict({"update": flwr_rec})).SerializeToString()
    proto = type(serde.recorddict_to_proto(fc.RecordDict({})))()
    proto.ParseFromString(wire)
    received = ParametersRecord.from_flwr(serde.recorddict_from_proto(proto)["update"])
    assert list(received) == ["gpu_codec", "dense.w"]
    out = received.decompress(base=base)
    want = ref_topk({k: new[k] - base[k] for k in new}, 0.1)
    for n in new:
        np.testing.assert_array_equal(out[n], base[n] + want[n])
    assert out["dense.w"].tolist() == [0.0, 1.0, 2.0, 3.0]

    # and a record flwr built from NumPy arrays reads back as ours
    ours = ParametersRecord.from_flwr(fc.ArrayRecord([np.ones(2, np.float32)]))
    assert ours["0"].numpy().tolist() == [1.0, 1.0]


def test_a_stock_peer_is_told_what_to_install():
    fc = pytest.importorskip("flwr.common")
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    new, base = update_and_base(5)
    flwr_rec = ParametersRecord.compressed(new, base, fraction=0.1).to_flwr()
    with pytest.raises(ValueError, match=r"gpu_codec\.v1 payload.*pip install 'gpu_codec\[flower\]'") as info:
        flwr_rec["gpu_codec"].numpy()
    assert not isinstance(info.value, TypeError)
    content = fc.RecordDict({"arrays": flwr_rec, "metrics": fc.MetricRecord({"num-examples": 3})})
    with pytest.raises(ValueError, match=r"pip install 'gpu_codec\[flower\]'"):
        aggregate_arrayrecords([content, content], "num-examples")


def test_records_take_a_cap_and_check_npy_headers_before_allocating():
    import tracemalloc

    from gpu_codec.errors import PayloadLayoutError, PayloadLimitError

    # a compressed Array declaring 64 MiB in a few hundred bytes: refused under a smaller cap, nothing allocated
    n = 16 << 20
    rec = ArrayRecord.compressed({"w": np.zeros(n, np.float32)}, fraction=1e-7)
    rec["steps"] = Array(np.arange(4, dtype=np.int64))
    assert rec.count_bytes() < 1024
    tracemalloc.start()
    try:
        with pytest.raises(PayloadLimitError, match="max_output_bytes"):
            rec.decompress(max_output_bytes=8 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10
    # the cap counts the whole record: the compressed Array first, then what is left for the plain one
    assert sorted(rec.decompress(max_output_bytes=4 * n + 32)) == ["steps", "w"]
    with pytest.raises(PayloadLimitError, match="cap of 31"):
        rec.decompress(max_output_bytes=4 * n + 31)
    # a .npy header is read before its array is made: a shape its bytes do not hold, an object dtype, no header
    good = Array(np.ones(3, np.float32))
    for head, body, err, match in [
        (b"(3,)", b"(9,)", PayloadLayoutError, "36 bytes.*its data holds 12"),
        (b"'<f4'", b"'|O' ", PayloadLayoutError, "object dtype"),
    ]:
        data = good.data.replace(head, body)
        with pytest.raises(err, match=match):
            Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data).numpy()
    with pytest.raises(PayloadLayoutError, match=r"not a valid \.npy"):
        Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"\x00" * 40).numpy()
    with pytest.raises(PayloadLimitError):
        good.numpy(max_bytes=11)
    assert good.numpy(max_bytes=12).tolist() == [1.0, 1.0, 1.0]
    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    back = Array(fortran).numpy()
    assert back.flags.f_contiguous and np.array_equal(back, fortran) and back.flags.writeable
