"""Sparse server-side aggregation: the weighted mean from the payloads, order-independent to the byte."""

from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest

import gpu_codec
from gpu_codec.aggregate import MAX_PAYLOADS, Aggregator, aggregate
from gpu_codec.errors import InvalidInputError, PayloadError, PayloadIndexError, PayloadLimitError
from gpu_codec.testing import as_numpy
from tests.common import BACKENDS, HAS_GPU, build_payload, split_payload, use_backend

SHAPES = {"enc.w": (24, 16), "enc.b": (16,), "head.w": (7, 5)}


def client_updates(n: int, seed: int = 0, spread: int = 11) -> list[dict]:
    """Updates whose magnitudes differ by up to ``spread`` orders across clients."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        scale = 10.0 ** rng.integers(-7, -7 + spread)
        out.append({k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()})
    return out


def payloads_for(updates, pipelines=None, fraction=0.2):
    pipelines = pipelines or [None]
    return [
        gpu_codec.compress(u, fraction=fraction, pipeline=pipelines[i % len(pipelines)]) for i, u in enumerate(updates)
    ]


def reference_mean(payloads, weights) -> dict:
    """fp64 sum of the decoded deltas in a fixed order, over the exact weight sum."""
    dense = [gpu_codec.decompress(p) for p in payloads]
    total = math.fsum(weights)
    return {n: sum(w * d[n].astype(np.float64) for w, d in zip(weights, dense)) / total for n in SHAPES}


def as_bytes(result: dict) -> bytes:
    return b"".join(np.ascontiguousarray(result[n]).tobytes() for n in sorted(result))


PIPELINES = [None, [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd()], [{"id": "int8"}]]


def test_weighted_mean_matches_a_dense_reference():
    ups = client_updates(6, seed=1)
    ps = payloads_for(ups, PIPELINES)
    weights = [3, 1.5, 0.25, 7, 2, 1]
    got = aggregate(ps, weights)
    ref = reference_mean(ps, weights)
    for n in SHAPES:
        assert got[n].dtype == np.float32 and got[n].shape == SHAPES[n]
        bound = max(abs(w) * float(np.abs(gpu_codec.decompress(p)[n]).max()) for w, p in zip(weights, ps))
        np.testing.assert_allclose(got[n], ref[n], rtol=2**-23, atol=len(ps) * bound * 2**-35 / sum(weights))
        # a kept entry of any client is nonzero in the mean, every other entry is exactly zero
        kept = np.zeros(SHAPES[n], bool)
        for p in ps:
            kept |= gpu_codec.decompress(p)[n] != 0
        assert ((got[n] != 0) == kept).all()


def test_same_bytes_in_any_arrival_order():
    ups = client_updates(5, seed=2) + client_updates(4, seed=3, spread=2)
    ps = payloads_for(ups, PIPELINES, fraction=0.7)  # mostly overlapping entries
    blobs = [p.to_bytes() for p in ps]
    weights = [0.1, 3.0, 1.0 / 3.0, 5.5, 1e-3, 2.0, 0.7, 1.1, 2.9]
    want = as_bytes(aggregate(blobs, weights))
    rng = np.random.default_rng(0)
    naive = set()
    for _ in range(12):
        order = rng.permutation(len(ps))
        assert as_bytes(aggregate([blobs[i] for i in order], [weights[i] for i in order])) == want
        agg = Aggregator()
        for i in order:
            agg.add(ps[i], weights[i])
        assert as_bytes(agg.result()) == want
        dense = [gpu_codec.decompress(blobs[i]) for i in order]
        acc = {n: np.zeros(SHAPES[n]) for n in SHAPES}
        for i, d in zip(order, dense):
            for n in SHAPES:
                acc[n] += weights[i] * d[n].astype(np.float64)
        naive.add(as_bytes(acc))
    # the inputs do make plain fp64 accumulation order-dependent, so the equality above means something
    assert len(naive) > 1


def test_grid_change_mid_stream_is_exact():
    # a small update first, a huge one later: the grid coarsens by whole limbs, the result does not depend on it
    small = {n: np.full(s, 3e-6, np.float32) for n, s in SHAPES.items()}
    large = {n: np.full(s, 7e4, np.float32) for n, s in SHAPES.items()}
    ps = [gpu_codec.compress(u, fraction=None) for u in (small, large, small)]
    a = as_bytes(aggregate(ps, [1, 1, 2]))
    for order in itertools.permutations(range(3)):
        assert as_bytes(aggregate([ps[i] for i in order], [[1, 1, 2][i] for i in order])) == a
    got = aggregate(ps, [1, 1, 2])["enc.b"]
    np.testing.assert_allclose(got, (3 * 3e-6 + 7e4) / 4, rtol=2**-24)


def test_result_on_a_base_in_its_dtype_and_kind():
    torch = pytest.importorskip("torch")
    base = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in SHAPES.items()}
    base["head.w"] = base["head.w"].to(torch.bfloat16)
    news = [{n: b + 0.5 * (i + 1) for n, b in base.items()} for i in range(3)]
    ps = [gpu_codec.compress(u, base, fraction=0.3) for u in news]
    out = aggregate(ps, [1, 2, 3], base=base)
    assert all(isinstance(v, torch.Tensor) and v.dtype == base[n].dtype for n, v in out.items())
    mean_delta = aggregate(ps, [1, 2, 3])
    for n in SHAPES:  # base + delta in fp32, rounded once to the base's dtype
        assert torch.equal(out[n], (base[n].float() + torch.from_numpy(mean_delta[n])).to(base[n].dtype))


def test_mismatched_or_bad_payloads_leave_the_accumulator_as_it_was():
    ups = client_updates(3, seed=3)
    agg = Aggregator()
    agg.add(gpu_codec.compress(ups[0], fraction=0.2), 2.0)
    before = as_bytes(agg.result())
    other = dict(ups[1])
    bad_inputs = [
        ({k: v for k, v in other.items() if k != "enc.b"}, "different tensor set"),
        ({**other, "enc.b": np.zeros(17, np.float32)}, r"enc.b.*float32\[17\]"),
        ({**other, "enc.b": other["enc.b"].astype(np.float64)}, "float64"),
    ]
    for update, match in bad_inputs:
        with pytest.raises(InvalidInputError, match=match):
            agg.add(gpu_codec.compress(update, fraction=0.2))
    for w in (-1.0, float("nan"), True, "2", 10**400, -(10**5000)):  # (the last: more digits than str() writes)
        with pytest.raises(InvalidInputError, match="weight"):
            agg.add(gpu_codec.compress(other, fraction=0.2), w)
    blob = gpu_codec.compress(other, fraction=0.2).to_bytes(version=1)  # v1: its JSON header is easy to edit
    with pytest.raises(PayloadError):
        agg.add(blob[:-3])
    # a well-formed payload whose last tensor repeats an index: found before anything is added
    header, data = split_payload(blob)
    last = header["tensors"][-1]
    off = next(b["offset"] for b in last["buffers"] if b["role"] == "indices")
    arr = bytearray(data)
    arr[off + 4 : off + 8] = arr[off : off + 4]
    with pytest.raises(PayloadIndexError, match=r"head\.w"):
        agg.add(build_payload(header, bytes(arr)))
    assert agg.count == 1 and as_bytes(agg.result()) == before


def test_limits_and_empty():
    with pytest.raises(InvalidInputError, match="no payload"):
        Aggregator().result()
    p = gpu_codec.compress({"w": np.ones(4, np.float32)}, fraction=0.5)
    with pytest.raises(InvalidInputError, match="sum to zero"):
        aggregate([p], [0.0])
    with pytest.raises(InvalidInputError, match="2 weights for 1"):
        aggregate([p], [1.0, 2.0])
    with pytest.raises(PayloadLimitError, match="max_output_bytes"):
        aggregate([p], max_output_bytes=12)
    assert MAX_PAYLOADS * (1 << 17) < 1 << 31


def test_peak_memory_is_one_accumulator_plus_one_payload():
    n, frac = 1_000_000, 0.01
    rng = np.random.default_rng(5)
    blobs = []
    for _ in range(4):
        u = np.zeros(n, np.float32)
        idx = rng.choice(n, size=int(n * frac), replace=False)
        u[idx] = rng.standard_normal(idx.size).astype(np.float32)
        blobs.append(gpu_codec.compress({"w": u}, fraction=frac).to_bytes())
    agg = Aggregator()
    tracemalloc.start()
    try:
        for b in blobs:
            agg.add(b, 1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    accumulator = 12 * n
    one_payload = 64 * int(n * frac) + len(blobs[0])  # decoded pairs and the fp64 products of one client
    assert peak <= accumulator + one_payload, (peak, accumulator, one_payload)
    assert peak < 4 * n * 4  # far below even a dense fp32 copy per client


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_give_the_same_bytes(backend):
    ups = client_updates(4, seed=6)
    ps = [p.to_bytes() for p in payloads_for(ups, PIPELINES[:2])]
    weights = [1, 2.5, 0.5, 4]
    want = as_bytes(aggregate(ps, weights))
    with use_backend(backend):
        got = aggregate(ps[::-1], weights[::-1])
        assert as_bytes({n: np.asarray(v) for n, v in got.items()}) == want


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_gpu_result_stays_on_the_device():
    ps = payloads_for(client_updates(3, seed=7))
    with use_backend("gpu"):
        out = aggregate(ps, like="cupy")
    assert all(type(v).__module__.startswith("cupy") for v in out.values())
    assert as_bytes({n: v.get() for n, v in out.items()}) == as_bytes(aggregate(ps))


def test_benchmark_runs_and_meets_its_memory_bound(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_aggregate.py"
    out = tmp_path / "agg.json"
    args = ["--clients", "5", "--n", "200000", "--distinct", "2", "--no-write", "--json", str(out)]
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for row in res["rows"]:
        assert row["sparse_add_peak_bytes"] <= row["bound_bytes"], row
        assert row["sparse_add_peak_bytes"] < row["dense_add_peak_bytes"], row
        assert row["max_abs_difference"] <= 2**-20 * row["max_abs_mean"], row
    assert "| fp16 + Rice + zstd |" in r.stdout


def test_a_payload_with_no_entry_adds_only_its_weight():
    from gpu_codec.format import TensorRecord

    names = ["a", "b", "c"]
    empty = gpu_codec.Payload(
        [
            TensorRecord(
                n, "float32", (10,), "coo", 0, {"indices": np.zeros(0, np.uint32), "values": np.zeros(0, np.float32)}
            )
            for n in names
        ],
        [],
    )
    p = gpu_codec.compress({n: np.arange(10, dtype=np.float32) * (i + 1) for i, n in enumerate(names)}, fraction=0.5)
    agg = Aggregator()
    agg.add(empty.to_bytes())
    agg.add(p)
    want = aggregate([p])
    assert agg.count == 2 and all(np.array_equal(v, want[n] / 2) for n, v in agg.result().items())


@pytest.mark.parametrize("onto", [True, False], ids=["onto-base", "delta"])
def test_numpy_results_of_a_device_aggregator_are_copied_once_a_dtype(onto, monkeypatch):
    """A device aggregator whose result is NumPy (NumPy base, or none) copies each dtype's outputs to the host once,
    not each tensor, and gives the NumPy backend's bytes in plain host arrays."""
    pytest.importorskip("gpu_codec.backends.emulated")
    import sys

    from gpu_codec import decode
    from gpu_codec.backends import using_backend
    from gpu_codec.backends.emulated import EmulatorRunner
    from gpu_codec.testing.recording import DeviceArray, RecordingBackend

    rng = np.random.default_rng(12)
    base = {
        f"t{i}": rng.standard_normal(40 + 29 * i).astype(np.float64 if i % 5 == 2 else np.float32) for i in range(25)
    }
    blobs = []
    for _ in range(3):
        new = {k: v + rng.standard_normal(v.size).astype(v.dtype) for k, v in base.items()}
        blobs.append(gpu_codec.compress(new, base, fraction=0.1).to_bytes())
    on = base if onto else None

    def run():
        agg = Aggregator(base=on)
        for b in blobs:
            agg.add(b)
        return agg

    with use_backend("cpu"):
        want = {k: np.asarray(v).tobytes() for k, v in run().result().items()}
    device = RecordingBackend(EmulatorRunner())
    is_device = lambda a: isinstance(a, DeviceArray)  # noqa: E731  (stands for CuPy's)
    monkeypatch.setattr(decode, "is_device_array", is_device)
    monkeypatch.setattr(sys.modules["gpu_codec.aggregate"], "is_device_array", is_device)
    with using_backend(device):
        agg = run()
        copies = []
        real = device.to_host
        monkeypatch.setattr(device, "to_host", lambda a: copies.append(a.size) or real(a))
        out = agg.result()
    assert {k: np.asarray(v).tobytes() for k, v in out.items()} == want
    assert all(type(v) is np.ndarray for v in out.values())
    assert len(copies) == 2 and sum(copies) == sum(v.size for v in base.values())  # (fp32 and fp64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_add_of_a_plain_payload_read_from_bytes_decodes_no_record(backend, monkeypatch):
    """An add of a payload read from bytes with no stage after top-k reads each run's entries from the buffers as
    they lie (as decompress does), with no decoder a record; the sums are those of the records decoded one by one
    (the plain reading switched off), and a bad index in a run is refused as before, naming its tensor."""
    from gpu_codec import decode
    from gpu_codec.codecs.pipeline import Pipeline
    from gpu_codec.testing import fuzz

    rng = np.random.default_rng(2)
    base = {f"t{i}": rng.standard_normal(300 + 7 * i).astype(np.float32) for i in range(40)}
    new = {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    with use_backend(backend):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(decode, "plain_buffers", lambda pipe, records: None)  # every record through its decoder
            want = Aggregator(base=base)
            want.add(blob)
        decoded = []
        real = Pipeline.decode_stream
        monkeypatch.setattr(
            Pipeline, "decode_stream", lambda self, recs, be: decoded.extend(recs) or real(self, recs, be)
        )
        got = Aggregator(base=base)
        got.add(blob)
        assert not decoded
        w, g = want.result(), got.result()
        assert all(np.asarray(w[k]).tobytes() == np.asarray(g[k]).tobytes() for k in base)
        bad = bytearray(blob)
        idx = gpu_codec.Payload.from_bytes(blob).tensors[3].buffers["indices"]
        at = bytes(bad).index(idx.tobytes())
        bad[at : at + 4] = np.uint32(10**6).tobytes()  # an index past its tensor
        with pytest.raises(PayloadIndexError, match="t3"):
            got.add(fuzz._with_crc(bytes(bad[:-4])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_base_is_wrapped_once_for_every_add_and_the_result(backend, monkeypatch):
    """An aggregator wraps its base's tensors when it is made (where it checks them) and reads them from there for
    every add and for the result, a tensor at a time nowhere: the same sums as a fresh aggregator each time."""
    import importlib

    agg_mod = importlib.import_module("gpu_codec.aggregate")  # (the module: the package names its function so)
    rng = np.random.default_rng(11)
    base = {f"t{i}": rng.standard_normal((3, 20 + i)).astype(np.float32) for i in range(20)}
    base["flat"] = rng.standard_normal(500).astype(np.float32)
    news = [{k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()} for _ in range(3)]
    with use_backend(backend):
        blobs = [gpu_codec.compress(n, base, fraction=0.1).to_bytes() for n in news]
        want = aggregate(blobs, base=base)
        wrapped = []  # tensors wrapped: one by one, or a table at once
        real, real_table = agg_mod.to_tensor, agg_mod.tensor_table
        monkeypatch.setattr(agg_mod, "to_tensor", lambda a, n: wrapped.append(1) or real(a, n))
        monkeypatch.setattr(agg_mod, "tensor_table", lambda xs: wrapped.append(len(xs)) or real_table(xs))
        agg = Aggregator(base=base)
        assert sum(wrapped) == len(base) and len(wrapped) == 1  # (the whole table at once)
        for b in blobs:
            agg.add(b)
        got = agg.result()
        assert sum(wrapped) == len(base)
    assert all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in base)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fraction", [0.05, None], ids=["sparse", "dense"])
def test_a_signalling_nan_value_is_refused_without_a_warning(backend, fraction):
    """A payload value that is a signalling NaN raises the invalid-operation flag where it is widened: the
    aggregator, with or without a base, refuses the payload with a PayloadError and stays as it was (the suite
    runs with warnings as errors, so a floating-point warning on the way would fail here)."""
    rng = np.random.default_rng(2)
    base = {"w": np.ones(4000, np.float32), "h": np.ones(300, np.float16)}
    new = {k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}
    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=fraction)
        rec = p.tensors[0]
        vals = np.array(as_numpy(rec.buffers["values"]), np.float32)  # (a device array on the GPU)
        vals[1:2].view(np.uint32)[0] = 0x7F800001
        rec.buffers = {**rec.buffers, "values": vals}
        blob = p.to_bytes()
        for agg in (gpu_codec.Aggregator(), gpu_codec.Aggregator(base=base)):
            with pytest.raises(gpu_codec.PayloadError, match="tensor 'w'"):
                agg.add(blob)
            assert agg.count == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_result_over_a_base_is_the_mean_delta_decompressed_onto_it(backend):
    # the result adds every tensor's mean onto its base in one pass; decompress adds a dense payload of the same
    # means record by record: the same bytes, every dtype (fp16 and bf16 round their sums to their storage)
    from gpu_codec.format import TensorRecord

    rng = np.random.default_rng(11)
    shapes = {"a": (3, 4), "b": (0,), "c": (), "d": (257,), "e": (2, 2, 2)}
    kinds = {"a": np.float32, "b": np.float32, "c": np.float64, "d": np.float16, "e": np.float32}
    base = {n: rng.standard_normal(s).astype(kinds[n]) for n, s in shapes.items()}
    with use_backend(backend):
        with_base, without = Aggregator(base=base), Aggregator()
        for w in (1.0, 2.5, 0.5):
            new = {n: (b + rng.standard_normal(b.shape) * 0.1).astype(b.dtype) for n, b in base.items()}
            blob = gpu_codec.compress(new, base, fraction=0.4).to_bytes()
            with_base.add(blob, w)
            without.add(blob, w)
        got = {n: as_numpy(v) for n, v in with_base.result().items()}
        means = {n: as_numpy(v) for n, v in without.result().items()}
        recs = [TensorRecord(n, b.dtype.name, b.shape, "dense", b.size, {"values": means[n]}) for n, b in base.items()]
        want = gpu_codec.decompress(gpu_codec.Payload(recs, []).to_bytes(), base=base)
    assert got.keys() == want.keys()
    for n, v in want.items():
        v = as_numpy(v)
        assert got[n].dtype == v.dtype and got[n].shape == v.shape and got[n].tobytes() == v.tobytes(), n
