"""Flower adapter: a gpu_codec payload in flwr's own Array and ArrayRecord, round trips through flwr's wire format."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flwr.app")

from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

import gpu_codec
from gpu_codec.errors import InvalidInputError, PayloadError
from gpu_codec.flower import (
    _GUARD,
    STYPE_GPU_CODEC,
    array_payload,
    compressed_record,
    decompress_record,
    holds_payload,
    payload_array,
    read_numpy,
)
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


def test_the_module_needs_flwr_and_the_package_does_not():
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "import gpu_codec\n"
        "try:\n"
        "    import gpu_codec.flower\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.startswith("gpu_codec.flower needs flwr: pip install 'gpu_codec[flower]'"), out.stdout


def test_readers_tell_a_payload_from_an_array():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    a = Array(x)
    np.testing.assert_array_equal(read_numpy(a), x)
    assert not holds_payload(a)
    payload = payload_array(gpu_codec.compress({"w": x.astype(np.float32)}, fraction=0.5))
    with pytest.raises(InvalidInputError, match="holds a gpu_codec payload"):
        read_numpy(payload)
    with pytest.raises(TypeError, match="holds no gpu_codec payload"):
        array_payload(a)
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        read_numpy(Array("float32", (1,), "other", b""))
    with pytest.raises(InvalidInputError, match="Payload or its bytes"):
        payload_array(x)


def test_bfloat16_in_a_payload_and_in_earlier_records():
    torch = pytest.importorskip("torch")
    t = torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3)
    # inside a payload bfloat16 travels as itself (the record says so) and its delta comes back exactly
    rec = compressed_record({"t": t}, fraction=None)
    assert array_payload(rec["gpu_codec"]).tensors[0].dtype == "bfloat16"
    out = decompress_record(rec, like="torch")
    assert torch.equal(out["t"].to(torch.bfloat16), t) and torch.equal(out["t"], t.float())
    # a record from an earlier version (bfloat16 as uint16 .npy) reads as float32, exactly
    bits = t.view(torch.int16).numpy().view(np.uint16)
    legacy = Array("bfloat16", (2, 3), "numpy.ndarray", Array(bits).data)
    got = read_numpy(legacy)
    assert got.dtype == np.float32 and torch.equal(torch.from_numpy(got).to(torch.bfloat16), t)


def test_payload_array_fields_and_forms():
    new, base = update_and_base(1)
    payload = gpu_codec.compress(new, base, fraction=0.1)
    arr = payload_array(payload)
    assert (arr.dtype, arr.stype) == (STYPE_GPU_CODEC, "numpy.ndarray")
    assert arr.shape == (len(arr.data),) and len(arr.data) == len(_GUARD) + payload.nbytes
    assert arr.data == _GUARD + payload.to_bytes() and array_payload(arr).to_bytes() == payload.to_bytes()
    assert payload_array(payload.to_bytes()) == arr and holds_payload(arr)
    rec = ArrayRecord({"gpu_codec": arr})
    assert rec.count_bytes() == len(arr.data) + len("gpu_codec")
    assert len(_GUARD) % 64 == 0
    with pytest.raises(PayloadError):
        payload_array(payload.to_bytes()[:-1])
    bad_payload = Array(STYPE_GPU_CODEC, arr.shape, "numpy.ndarray", arr.data[:-1])
    with pytest.raises(PayloadError):
        array_payload(bad_payload)
    # the form without the guard, as earlier versions wrote it, still reads
    old = Array("uint8", (payload.nbytes,), STYPE_GPU_CODEC, payload.to_bytes())
    assert holds_payload(old) and array_payload(old).to_bytes() == payload.to_bytes()
    # a tampered guard is not taken for a payload
    bad = Array(STYPE_GPU_CODEC, arr.shape, "numpy.ndarray", b"x" + arr.data[1:])
    assert not holds_payload(bad)


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_compressed_record_round_trip(backend):
    new, base = update_and_base(2)
    with use_backend(backend):
        rec = compressed_record(new, base, fraction=0.05)
        wire = ArrayRecord(
            {"gpu_codec": Array(**{f: getattr(rec["gpu_codec"], f) for f in ("dtype", "shape", "stype", "data")})}
        )
        delta = decompress_record(wire)
        full = decompress_record(wire, base=base)
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
        rec = compressed_record(new, base, fraction=0.2)
        rec["extra"] = Array(torch.arange(3.0, device=device))
        rec["count"] = Array(torch.tensor(5.0, device=device))  # 0-d, as a BatchNorm's counter
        plain_base = {"extra": torch.zeros(3, device=device), "count": torch.zeros((), device=device)}
        out = decompress_record(rec, base={**base, **plain_base})
    assert all(v.device.type == device for v in out.values())
    want = ref_topk({k: (new[k] - base[k]).cpu().numpy() for k in new}, 0.2)
    for n in new:
        np.testing.assert_array_equal(out[n].cpu().numpy(), (base[n].cpu().numpy() + want[n]))
    assert out["extra"].tolist() == [0.0, 1.0, 2.0]
    assert out["count"].shape == () and out["count"].item() == 5.0


def test_codec_stages_in_a_record():
    new, base = update_and_base(4)
    rec = compressed_record(
        new, base, fraction=0.1, pipeline=[{"id": "quantize", "dtype": "bfloat16"}, {"id": "zstd", "level": 1}]
    )
    assert [s["id"] for s in array_payload(rec["gpu_codec"]).pipeline] == ["topk", "quantize", "zstd"]
    want = ref_topk({k: new[k] - base[k] for k in new}, 0.1)
    got = decompress_record(rec)
    for n in new:
        np.testing.assert_allclose(got[n], want[n], rtol=2**-8)
        assert ((got[n] != 0) == (want[n] != 0)).all()


def test_real_flwr_round_trip():
    from flwr.common import serde

    new, base = update_and_base(3)
    rec = compressed_record(new, base, fraction=0.1)
    rec["dense.w"] = Array(np.arange(4, dtype=np.float32))
    # through flwr's wire format (protobuf) and back
    wire = serde.recorddict_to_proto(RecordDict({"update": rec})).SerializeToString()
    proto = type(serde.recorddict_to_proto(RecordDict({})))()
    proto.ParseFromString(wire)
    received = serde.recorddict_from_proto(proto)["update"]
    assert list(received) == ["gpu_codec", "dense.w"] and received["gpu_codec"] == rec["gpu_codec"]
    out = decompress_record(received, base=base)
    want = ref_topk({k: new[k] - base[k] for k in new}, 0.1)
    for n in new:
        np.testing.assert_array_equal(out[n], base[n] + want[n])
    assert out["dense.w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_stock_peer_is_told_what_to_install():
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    new, base = update_and_base(5)
    rec = compressed_record(new, base, fraction=0.1)
    with pytest.raises(ValueError, match=r"gpu_codec\.v1 payload.*pip install 'gpu_codec\[flower\]'") as info:
        rec["gpu_codec"].numpy()
    assert not isinstance(info.value, TypeError)
    content = RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 3})})
    with pytest.raises(ValueError, match=r"pip install 'gpu_codec\[flower\]'"):
        aggregate_arrayrecords([content, content], "num-examples")


def test_records_take_a_cap_and_check_npy_headers_before_allocating():
    import tracemalloc

    from gpu_codec.errors import PayloadLayoutError, PayloadLimitError

    # a compressed Array declaring 64 MiB in a few hundred bytes: refused under a smaller cap, nothing allocated
    n = 16 << 20
    rec = compressed_record({"w": np.zeros(n, np.float32)}, fraction=1e-7)
    rec["steps"] = Array(np.arange(4, dtype=np.int64))
    assert rec.count_bytes() < 1024
    tracemalloc.start()
    try:
        with pytest.raises(PayloadLimitError, match="max_output_bytes"):
            decompress_record(rec, max_output_bytes=8 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10
    # the cap counts the whole record: the compressed Array first, then what is left for the plain one
    assert sorted(decompress_record(rec, max_output_bytes=4 * n + 32)) == ["steps", "w"]
    with pytest.raises(PayloadLimitError, match="cap of 31"):
        decompress_record(rec, max_output_bytes=4 * n + 31)
    # a .npy header is read before its array is made: a shape its bytes do not hold, an object dtype, no header
    good = Array(np.ones(3, np.float32))
    for head, body, err, match in [
        (b"(3,)", b"(9,)", PayloadLayoutError, "36 bytes.*its data holds 12"),
        (b"'<f4'", b"'|O' ", PayloadLayoutError, "object dtype"),
    ]:
        data = good.data.replace(head, body)
        with pytest.raises(err, match=match):
            read_numpy(Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data))
    with pytest.raises(PayloadLayoutError, match=r"not a valid \.npy"):
        read_numpy(Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"\x00" * 40))
    with pytest.raises(PayloadLimitError):
        read_numpy(good, max_bytes=11)
    assert read_numpy(good, max_bytes=12).tolist() == [1.0, 1.0, 1.0]
    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    back = read_numpy(Array(fortran))
    assert back.flags.f_contiguous and np.array_equal(back, fortran) and back.flags.writeable
