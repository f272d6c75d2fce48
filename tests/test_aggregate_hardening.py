"""The Aggregator under a server's conditions: threads sharing it, clients that cannot be represented, and a cap
on its memory checked before anything is decoded or allocated."""

from __future__ import annotations

import sys
import threading
import tracemalloc

import numpy as np
import pytest

import gpu_codec
from gpu_codec.aggregate import SPARSE_ENTRY_BYTES, Aggregator, held_bytes
from gpu_codec.decode import SMALL_TENSOR
from gpu_codec.errors import InvalidInputError, PayloadLimitError, PayloadValueError
from tests.common import BACKENDS, use_backend


def state(agg: Aggregator) -> tuple:
    """Everything add() may change, as bytes."""
    limbs = None if agg._limbs is None else agg._backend.to_host(agg._limbs).tobytes()  # (a GPU's: copied)
    return limbs, agg._beta.tobytes(), list(agg._weights), agg._template and agg._template.entries


def result_bytes(agg: Aggregator) -> bytes:
    return b"".join(np.asarray(v).tobytes() for _, v in sorted(agg.result().items()))


@pytest.fixture
def fast_switching():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads change hands as often as the interpreter allows
    yield
    sys.setswitchinterval(saved)


def add_some(agg, barrier, ps, weights, which) -> None:
    barrier.wait()  # every thread starts adding at once
    for i in which:
        agg.add(ps[i], weights[i])


def test_threads_sharing_one_aggregator_give_the_serial_bytes(fast_switching):
    rng = np.random.default_rng(0)
    # magnitudes 10 orders apart: adds that coarsen the grid interleave with adds onto the old one
    ps = [
        gpu_codec.compress(
            {"w": (rng.standard_normal(48) * 10.0 ** rng.integers(-6, 5)).astype(np.float32)}, fraction=0.5
        )
        for _ in range(24)
    ]
    weights = [float(w) for w in rng.uniform(0.5, 3.0, len(ps))]
    serial = Aggregator()
    for p, w in zip(ps, weights):
        serial.add(p, w)
    want = result_bytes(serial)
    for trial in range(25):
        agg = Aggregator()
        order = np.random.default_rng(trial).permutation(len(ps))
        barrier = threading.Barrier(8)

        threads = [threading.Thread(target=add_some, args=(agg, barrier, ps, weights, order[k::8])) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert agg.count == len(ps)
        assert result_bytes(agg) == want, f"trial {trial}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_unrepresentable_clients_are_refused_and_leave_the_accumulator_as_it_was(backend):
    with use_backend(backend):
        check_unrepresentable_clients()


def check_unrepresentable_clients():
    small = gpu_codec.compress({"w": np.array([1e-20, 0, -3e-20, 2e-20], np.float32)}, fraction=None)
    ordinary = gpu_codec.compress({"w": np.array([0.5, -1.0, 0, 2.0], np.float32)}, fraction=None)
    good = [(small, 1e307), (ordinary, 2.0), (small, 5e307)]
    agg = Aggregator()
    for p, w in good:
        agg.add(p, w)
    before = state(agg)
    # weight x value beyond the accumulator's range
    with pytest.raises(InvalidInputError, match="beyond the accumulator's range"):
        agg.add(ordinary, 1e300)
    assert state(agg) == before
    # a weight whose sum with the others leaves fp64's range (each product alone is representable)
    with pytest.raises(InvalidInputError, match="sum of the weights"):
        agg.add(small, 1.7e308)
    assert state(agg) == before
    with pytest.raises(InvalidInputError, match="sum of the weights"):
        aggregate_with_refusals([(small, 1e308), (small, 1e308)])
    # the round goes on without them, to the byte
    reference = Aggregator()
    for p, w in good:
        reference.add(p, w)
    assert result_bytes(agg) == result_bytes(reference)
    assert np.isfinite(agg.result()["w"]).all()


def aggregate_with_refusals(entries):
    agg = Aggregator()
    for p, w in entries:
        agg.add(p, w)
    return agg.result()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_a_delta_that_takes_the_base_out_of_range_is_refused_at_add(fraction, backend):
    base = {"w": np.array([60000, 1, -60000, 3, 0, 7], np.float16), "b": np.ones(3, np.float32)}
    zero = {n: np.zeros_like(a) for n, a in base.items()}

    def payload(w):
        return gpu_codec.compress(
            {"w": np.asarray(w, np.float16), "b": np.full(3, 2, np.float32)}, zero, fraction=fraction
        )

    fine = [payload([1000, 2, -1000, 1, 0, 0]), payload([-500, 0, 500, 0, 8, 0])]
    with use_backend(backend):
        check_refusals_onto_a_base(base, fine, payload)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", [[1.0], [1.0, 1.0, 1.0, 2.0**36]], ids=["alone", "weighty"])
def test_a_sum_the_means_rounding_takes_past_the_range_is_its_largest_finite_value(backend, weights):
    """A client whose base + delta is finite (accepted at add) but at the very edge of fp32: the accumulator's grid
    (2^-35 of the largest weighted value, here 2^127's) rounds its delta up by a hair, to half an ulp of FLT_MAX,
    which takes the sum to inf. The exact mean of finite sums rounds to FLT_MAX, so the result is FLT_MAX, where
    the round used to fail for every client."""
    top = np.finfo(np.float32).max
    base = {"w": np.array([top, -top, 0.0, 1.0], np.float32)}
    edge = np.float32(2.0**103) * np.float32(1 - 2.0**-24)  # FLT_MAX + edge rounds to FLT_MAX
    kept = np.array([edge, 2.0**127], np.float32)
    entries = gpu_codec.SparseEntries(np.array([0, 1], np.uint32), kept, (4,), "float32")
    crafted = gpu_codec.encode_coo({"w": entries}).to_bytes()
    honest = gpu_codec.compress({"w": np.array([top, -top, 0.0, 2.0], np.float32)}, base, fraction=0.25)
    with use_backend(backend):
        assert np.isfinite(gpu_codec.decompress(crafted, base=base)["w"]).all()
        agg = Aggregator(base)
        for w in weights[:-1]:
            agg.add(honest, w)
        agg.add(crafted, weights[-1])  # accepted: its own sum is finite
        got = agg.result()["w"]
    assert got[0] == top  # the edge, not inf
    assert np.isfinite(got).all() and got[1] > -top and got[2] == 0.0


def test_a_mean_value_the_apply_refuses_is_not_saturated_away(monkeypatch):
    """Where the one apply of the means onto the bases refuses a value (its error word set, that element left as
    it was: here inf), the retry that saturates the sums keeps that word: the result comes from the fallback's
    decode, right to the byte, not from an output with an element the apply never wrote."""
    base = {"w": np.arange(6, dtype=np.float32)}
    p = gpu_codec.compress({"w": np.arange(6, dtype=np.float32) + 0.5}, base, fraction=None)
    with use_backend("cpu"):
        want = Aggregator(base)
        want.add(p)
        want = want.result()["w"]
        agg = Aggregator(base)
        agg.add(p)
        real, calls = agg._backend.dense_apply, []

        def refusing(outs, *a, **k):  # (the first call, the result's one apply: entry 0 refused)
            got = real(outs, *a, **k)
            if not calls:
                outs[0][0] = np.inf
                got = np.zeros(1, np.uint64) if k.get("defer") or len(a) > 4 else 0
            calls.append(1)
            return got

        monkeypatch.setattr(agg._backend, "dense_apply", refusing)
        got = agg.result()["w"]
    assert got.tobytes() == want.tobytes() and len(calls) > 1  # (the fallback decoded it again)


@pytest.mark.parametrize("size", [50, SMALL_TENSOR + 50], ids=["small", "large"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_of_a_run_that_takes_its_base_out_of_range_is_refused(backend, size):
    """Sparse tensors are checked against their bases a run at a time (small ones; on a device, of any size), from
    the bases read at the entries: the one past fp16's range is named, the others' sums are fine, nothing is
    added."""
    names = [f"t{i}" for i in range(6)]
    base = {n: np.ones(size, np.float16) for n in names}
    base["t3"][20] = 60000
    zero = {n: np.zeros(size, np.float16) for n in names}

    def payload(big: float):
        new = {n: np.zeros(size, np.float16) for n in names}
        for i, n in enumerate(names):
            new[n][i * 3 : i * 3 + 2] = 7
        new["t3"][20] = big
        return gpu_codec.compress(new, zero, fraction=15 / (6 * size))

    with use_backend(backend):
        agg = Aggregator(base=base)
        agg.add(payload(3000))
        before = state(agg)
        with pytest.raises(PayloadValueError, match=r"'t3'.*past the range of float16"):
            agg.add(payload(30000))
        assert state(agg) == before
        agg.add(payload(-3000))
        out = agg.result()
    assert all(np.isfinite(v).all() for v in out.values()) and out["t3"][20] == 60000


def check_refusals_onto_a_base(base, fine, payload):
    agg = Aggregator(base=base)
    for p in fine:
        agg.add(p)
    before = state(agg)
    for bad in ([60000, 0, 0, 0, 0, 0], [0, 0, -60000, 0, 0, 0]):  # each alone: 120000 is inf in fp16
        with pytest.raises(PayloadValueError, match=r"'w'.*past the range of float16"):
            agg.add(payload(bad))
        assert state(agg) == before
        with pytest.raises(PayloadValueError):  # what decompress says of the same client
            gpu_codec.decompress(payload(bad), base=base)
    reference = Aggregator(base=base)
    for p in fine:
        reference.add(p)
    out = agg.result()
    assert result_bytes(agg) == result_bytes(reference) and all(np.isfinite(v).all() for v in out.values())
    assert out["w"].dtype == np.float16


def test_a_base_that_is_not_finite_or_over_the_cap_is_refused_up_front():
    with pytest.raises(InvalidInputError, match="inf or NaN"):
        Aggregator(base={"w": np.array([1.0, np.inf], np.float32)})
    with pytest.raises(InvalidInputError, match="max_output_bytes=1000"):
        Aggregator(base={"w": np.ones(100, np.float32)}, max_output_bytes=1000)
    for cap in (-1, 1.5, True, "8"):
        with pytest.raises(InvalidInputError, match="max_output_bytes"):
            Aggregator(max_output_bytes=cap)


def test_held_bytes_counts_the_accumulator_mean_and_result():
    recs = gpu_codec.compress(
        {"a": np.ones(10, np.float32), "b": np.ones(3, np.float64), "c": np.ones(4, np.float16)}, fraction=0.01
    ).tensors
    assert held_bytes(recs, with_base=False) == 10 * 20 + 3 * 28 + 4 * 20
    assert held_bytes(recs, with_base=True) == 10 * 20 + 3 * 28 + 4 * 18
    # every entry sent as a sparse tensor: the decoder's buffers count instead
    recs = gpu_codec.compress({"a": np.ones(10, np.float32)}, fraction=1.0).tensors
    assert held_bytes(recs, with_base=False) == 10 * (12 + SPARSE_ENTRY_BYTES)
    recs = gpu_codec.compress({"a": np.ones(10, np.float32)}, fraction=None, pipeline=[gpu_codec.Zstd()]).tensors
    assert held_bytes(recs, with_base=False) == 10 * 20


def test_a_base_is_refused_exactly_where_its_per_tensor_count_passes_the_cap():
    # the base's count is taken one dtype at a time: the same bytes as one dense record a tensor
    import math

    from gpu_codec.format import TensorRecord

    rng = np.random.default_rng(4)
    kinds = [np.float32, np.float16, np.float64]
    base = {f"t{i}": np.zeros(rng.integers(0, 40, size=rng.integers(0, 3)), kinds[i % 3]) for i in range(40)}
    recs = [TensorRecord(n, a.dtype.name, a.shape, "dense", math.prod(a.shape), {}) for n, a in base.items()]
    need = held_bytes(recs, with_base=True)
    assert need > 0
    Aggregator(base=base, max_output_bytes=need)
    with pytest.raises(InvalidInputError, match=f"needs {need} bytes"):
        Aggregator(base=base, max_output_bytes=need - 1)


def traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_small_payload_declaring_more_than_the_cap_is_refused_before_allocating():
    cap = 8 << 20
    n = (64 << 20) // 4  # 64 MiB of fp32 output declared
    blob = gpu_codec.compress({"w": np.zeros(n, np.float32)}, fraction=1e-7).to_bytes()
    assert len(blob) < 1024
    agg = Aggregator(max_output_bytes=cap)

    def add():
        with pytest.raises(PayloadLimitError, match="max_output_bytes=8388608"):
            agg.add(blob)

    assert traced_peak(add) < 64 << 10
    assert agg.count == 0 and agg._limbs is None


PIPELINES = {
    "dense fp32 + zstd": (None, [gpu_codec.Zstd()]),
    "dense int8": (None, [{"id": "int8"}]),
    "top-k raw": (0.3, None),
    "every entry, fp16 + Rice + zstd": (
        1.0,
        [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd()],
    ),
}


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("name", list(PIPELINES))
def test_peak_memory_stays_within_one_and_a_half_caps(name, with_base):
    cap = 8 << 20
    fraction, pipeline = PIPELINES[name]
    # as many fp32 elements as the cap admits: 20 bytes each, or 12 + 32 per kept entry of a sparse payload
    n = int(cap / max(20, 12 + SPARSE_ENTRY_BYTES * (fraction or 0))) - 64
    rng = np.random.default_rng(1)
    base = {"w": rng.standard_normal(n).astype(np.float32)} if with_base else None
    blobs = []
    for _ in range(2):
        new = (base["w"] if with_base else 0) + rng.standard_normal(n).astype(np.float32)
        blobs.append(gpu_codec.compress({"w": new}, base, fraction=fraction, pipeline=pipeline).to_bytes())
    need = held_bytes(gpu_codec.Payload.from_bytes(blobs[0]).tensors, with_base)
    assert cap - 4096 < need <= cap
    with pytest.raises(PayloadLimitError):
        Aggregator(max_output_bytes=need - 1).add(blobs[0])
    agg = Aggregator(base=base, max_output_bytes=cap)

    def run():
        for b in blobs:
            agg.add(b, 1.0)
        agg.result()

    peak = traced_peak(run)
    assert peak <= 1.5 * cap, (peak / cap, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_peak_memory_onto_a_base_of_another_dtype_stays_within_one_and_a_half_caps(dtype):
    """The sum with a bf16, fp16 or fp64 base is made a block at a time: a whole-tensor fp32 temporary (and the
    finiteness test's) took a bf16 result to 1.83 caps."""
    torch = pytest.importorskip("torch")
    cap = 8 << 20
    rng = np.random.default_rng(2)
    probe = {"w": torch.zeros(16, dtype=getattr(torch, dtype))}
    per = held_bytes(gpu_codec.compress(probe, probe, fraction=None).tensors, True) / 16
    n = int(cap / per) - 64
    base = {"w": torch.from_numpy(rng.standard_normal(n)).to(getattr(torch, dtype))}
    blobs = [
        gpu_codec.compress(
            {"w": base["w"] + torch.from_numpy(rng.standard_normal(n)).to(base["w"].dtype)}, base, fraction=None
        ).to_bytes()
        for _ in range(2)
    ]
    agg = Aggregator(base=base, max_output_bytes=cap)

    def run():
        for b in blobs:
            agg.add(b, 1.0)
        agg.result()

    assert traced_peak(run) <= 1.5 * cap


def test_memory_benchmark_runs_and_stays_within_its_target(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_aggregate.py"
    out = tmp_path / "mem.json"
    args = ["--memory", "--n", "200000", "--clients", "3", "--no-write", "--json", str(out)]
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 8 and res["max_ratio"] <= 1.5
    assert res["hostile"]["refused_with"] == ["PayloadLimitError"] and res["hostile"]["peak_bytes"] < 1 << 20


@pytest.mark.parametrize(
    "base, why",
    [
        ({1: np.ones(2, np.float32)}, "non-empty strings"),
        ({"": np.ones(2, np.float32)}, "non-empty strings"),
        ({"w": np.ones((1,) * 9, np.float32)}, "9 dimensions"),
        ({"ok": np.ones(2, np.float32), "w": np.ones((1,) * 9, np.float32)}, "tensor 'w': 9 dimensions"),
    ],
)
def test_a_base_no_payload_can_match_is_refused_up_front(base, why):
    # (compress refuses these tensors, so every add() would have failed, blaming each client in turn)
    with pytest.raises(gpu_codec.errors.InvalidInputError, match=why):
        gpu_codec.Aggregator(base=base)
