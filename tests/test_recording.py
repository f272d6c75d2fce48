"""The recording launcher (gpu_codec.testing.recording): what it counts, that a replay keeps to the recorded path,
the GPU host side's sync and launch counts against issue 26's targets, and the device decode path it measures
(checks read back once) giving the CPU's bytes and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gpu_codec
from gpu_codec import decode
from gpu_codec.backends import get_backend, using_backend
from gpu_codec.errors import GpuCodecError
from tests.common import HAS_EMULATOR, use_backend

pytestmark = pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler for the emulator")

if HAS_EMULATOR:
    from gpu_codec.backends.emulated import EmulatorRunner
    from gpu_codec.testing.recording import RecordingBackend, RecordingError, measure

SYNCS = {"compress": 4, "decompress": 2, "add": 2}  # issue 26's targets, per call at any tensor count


@pytest.fixture(scope="module")
def emulator():
    return EmulatorRunner()


def _update(tensors: int, n: int, seed: int = 0, big: int = 0) -> tuple[dict, dict]:
    """Uneven fp32 tensors (and one of ``big`` elements first, decoded alone rather than in a run)."""
    rng = np.random.default_rng(seed)
    w = rng.random(tensors) + 0.2
    sizes = np.maximum(1, (w / w.sum() * n).astype(int)).tolist()
    if big:
        sizes[0] = big
    base = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(sizes)}
    new = {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}
    return new, base


def _cpu_blob(new, base, **kw) -> bytes:
    with use_backend("cpu"):
        return gpu_codec.compress(new, base, **kw).to_bytes()


def test_it_counts_reads_array_kernels_and_launches(emulator):
    def call(_):
        xp = get_backend().xp
        x = xp.arange(6, dtype=np.int64)  # an array-module kernel (and an allocation)
        y = x[2:]  # a view: nothing runs
        assert int(y[0]) == 2 and bool((y > 1).all())  # two reads; a compare and a reduction
        np.sum(x)  # NumPy's own function on a device array: flagged (CuPy would refuse it)

    m = measure(call, emulator=emulator, repeat=1)
    c = m.counts
    assert (c.syncs, c.array_ops, c.launches, c.allocs) == (2, 3, 0, 1)
    assert c.ops == {"arange": 1, "greater": 1, "logical_and.reduce": 1}
    assert len(c.host_numpy) == 1 and "numpy.sum" in next(iter(c.host_numpy))
    assert all("test_recording.py" not in s for s in c.sync_sites)  # sites are the library's lines


def test_an_operation_whose_size_depends_on_the_data_is_a_sync_and_replays_its_result(emulator):
    sizes = []

    def call(_):
        xp = get_backend().xp
        x = xp.asarray(np.array([0, 5, 0, 7], np.int32))
        x[x > 5] = 1  # CuPy counts a mask's entries before it writes
        sizes.append((int(xp.flatnonzero(x).size), int(x[x > 0].size)))

    m = measure(call, emulator=emulator, repeat=2)
    assert m.counts.syncs == 3 and m.counts.ops["flatnonzero"] == 1 and m.counts.ops["mask"] == 1
    assert sizes == [(2, 2)] * 3  # the replays' zeros would give other sizes: the record's results are replayed


def test_a_replay_that_leaves_the_recorded_path_is_refused(emulator):
    seen = []

    def call(_):
        seen.append(1)
        xp = get_backend().xp
        a = xp.zeros(4 if len(seen) == 1 else 5, np.float32)  # the replay reads another shape
        a.get()

    with pytest.raises(RecordingError, match="replay read"):
        measure(call, emulator=emulator, repeat=1)
    new, base = _update(3, 4000)
    runs = []

    def compress(_):
        runs.append(1)
        gpu_codec.compress(new, base, fraction=0.01 if len(runs) == 1 else 0.2)  # other k: other launches

    with pytest.raises(RecordingError):
        measure(compress, resident=[new, base], emulator=emulator, repeat=1)


def test_the_recorded_call_computes_the_cpu_bytes(emulator):
    new, base = _update(20, 20_000, seed=1)
    out = []
    measure(lambda _: out.append(gpu_codec.compress(new, base, fraction=0.01)), emulator=emulator, repeat=1)
    assert out[0].to_bytes() == _cpu_blob(new, base, fraction=0.01)  # the first call is the recorded one


def _read_where_they_lie(new: dict, base: dict, emulator) -> None:
    """A recorded compress of resident ``new`` and ``base`` gives the CPU bytes and copies no tensor."""
    out = []
    m = measure(
        lambda _: out.append(gpu_codec.compress(new, base, fraction=0.01)),
        resident=[new, base],
        emulator=emulator,
        repeat=2,
    )
    assert out[0].to_bytes() == _cpu_blob(new, base, fraction=0.01)
    assert m.counts.h2d_bytes < 1000  # (the tables: no tensor is copied)


def test_resident_tensors_of_every_layout_are_read_where_they_lie(emulator):
    """Resident inputs known by identity (arrays that own their memory, flat or not; slices of one buffer, as a
    flat parameter store holds them; a reshaped slice): wrapped without a copy, and the kernels read each at its
    own address (the CPU bytes; a wrong address would read another tensor's elements)."""
    rng = np.random.default_rng(3)
    store = rng.standard_normal(30_000).astype(np.float32)
    store_new = store + rng.standard_normal(30_000).astype(np.float32)
    new = {
        "own2d": rng.standard_normal((40, 50)).astype(np.float32),
        "s0": store_new[:7000],
        "s1": store_new[7000:19000],
    }
    base = {"own2d": rng.standard_normal((40, 50)).astype(np.float32), "s0": store[:7000], "s1": store[7000:19000]}
    new["r"], base["r"] = store_new[19000:].reshape(100, 110), store[19000:].reshape(100, 110)
    _read_where_they_lie(new, base, emulator)


def test_a_resident_array_is_wrapped_once_for_every_pass(emulator):
    """As CuPy's asarray of a device array returns the array, the record pass and each replay get the same device
    view of a resident array (made once, at its own address), and nothing is copied."""
    new, _ = _update(3, 3000)
    seen = []
    m = measure(
        lambda _: seen.append([get_backend().asarray(a) for a in new.values()]),
        resident=[new],
        emulator=emulator,
        repeat=2,
    )
    assert len(seen) == 3 and all(a is b is c for a, b, c in zip(*seen))
    assert [v._addr for v in seen[0]] == [a.ctypes.data for a in new.values()]
    assert m.counts.h2d == 0
    grid = {"w": np.ones((30, 40), np.float32)}  # a flat view of all of one (a new view object each call)
    seen.clear()
    measure(
        lambda _: seen.append(get_backend().asarray(grid["w"].ravel())), resident=[grid], emulator=emulator, repeat=2
    )
    assert seen[0] is seen[1] is seen[2] and seen[0].shape == (1200,) and seen[0]._addr == grid["w"].ctypes.data


def test_resident_torch_tensors_are_read_where_they_lie(emulator):
    """torch CPU tensors (bfloat16 and float32) stand for torch CUDA tensors: none is copied, and the kernels read
    each at its own address (the CPU bytes)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    base, new = {}, {}
    for i, dt in enumerate((torch.bfloat16, torch.float32, torch.bfloat16)):
        b = rng.standard_normal(3000 * (i + 1)).astype(np.float32)
        base[f"t{i}"] = torch.from_numpy(b).to(dt)
        new[f"t{i}"] = torch.from_numpy(b + rng.standard_normal(b.size).astype(np.float32)).to(dt)
    _read_where_they_lie(new, base, emulator)


@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_compress_syncs_at_most_four_times_and_launches_as_often_at_any_tensor_count(emulator, scope):
    launches = {}
    for t in (1, 100, 300):
        new, base = _update(t, 1 << 14, seed=t)
        m = measure(
            lambda _, new=new, base=base: gpu_codec.compress(new, base, fraction=0.01, scope=scope),
            resident=[new, base],
            emulator=emulator,
            repeat=1,
        )
        assert m.counts.syncs <= SYNCS["compress"], (t, m.counts.sync_sites)
        assert m.counts.h2d <= 20 and not m.counts.host_numpy
        launches[t] = m.counts.launches + m.counts.array_ops
    assert launches[100] == launches[300], launches


@pytest.mark.parametrize(
    "stages, fraction, feedback",
    [
        (("float16", "rice", "zstd"), 0.01, False),
        (("ternary",), 0.01, True),
        (("int8", "rice"), 0.01, False),
        (("zstd",), 0.01, False),
        (("int8", "zstd"), None, True),
        ((), None, True),
    ],
)
def test_compress_with_host_reads_syncs_at_most_four_times_at_any_tensor_count(emulator, stages, fraction, feedback):
    """Stages whose records need device values on the host (ternary's mu, Rice's bit counts, the bytes zstd
    compresses there) read them all in one copy at the end of the call, which is the call's wait: a compress syncs
    at most four times with them too (it made 5 or 6), launches as often at 100 tensors as at 300 (the selection
    of fewer candidates, at 30, takes another path; a dense update's residuals are zeroed by one fill, not one a
    tensor), and gives the CPU's bytes (and error-feedback residuals)."""
    from gpu_codec import ErrorFeedback, Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd

    make = {"float16": lambda: Quantize("float16"), "int8": Int8Blockwise, "rice": RiceIndices}
    make.update(zstd=lambda: Zstd(level=3), ternary=Ternary)
    work = {}
    for t in (100, 300):
        new, base = _update(t, 1 << 16, seed=t)
        pipe = [make[s]() for s in stages]
        kw = dict(fraction=fraction, pipeline=pipe)
        m = measure(
            lambda _, new=new, base=base, kw=kw: gpu_codec.compress(
                new, base, **kw, residual=ErrorFeedback() if feedback else None
            ),
            resident=[new, base],
            emulator=emulator,
            repeat=1,
        )
        assert m.counts.syncs <= SYNCS["compress"], (t, m.counts.sync_sites)
        efs = [ErrorFeedback() if feedback else None for _ in range(2)]
        with use_backend("cpu"):
            want = gpu_codec.compress(new, base, **kw, residual=efs[0]).to_bytes()
        with _device(emulator):
            assert gpu_codec.compress(new, base, **kw, residual=efs[1]).to_bytes() == want
        if feedback:
            assert efs[1].to_bytes() == efs[0].to_bytes()
        work[t] = m.counts.launches + m.counts.array_ops
    assert work[100] == work[300], work


def _decompress_and_add(blob: bytes, base: dict, emulator) -> tuple:
    """The recording's measurements of a decompress of ``blob`` onto ``base`` and of an aggregator's add of it."""
    d = measure(lambda _: gpu_codec.decompress(blob, base=base), resident=[base], emulator=emulator, repeat=1)
    a = measure(
        lambda agg: agg.add(blob),
        setup=lambda: gpu_codec.Aggregator(base=base),
        resident=[base],
        emulator=emulator,
        repeat=1,
    )
    return d, a


@pytest.mark.parametrize("tensors", [1, 40, 300])
def test_decompress_and_add_sync_at_most_twice_at_any_tensor_count(emulator, tensors):
    new, base = _update(tensors, 1 << 15, seed=tensors, big=300_000)  # one tensor above SMALL_TENSOR, small ones
    blob = _cpu_blob(new, base, fraction=0.01)
    d, a = _decompress_and_add(blob, base, emulator)
    assert d.counts.syncs <= SYNCS["decompress"], d.counts.sync_sites
    assert a.counts.syncs <= SYNCS["add"], a.counts.sync_sites
    assert not d.counts.host_numpy and not a.counts.host_numpy
    assert d.counts.d2h_bytes <= 8 and a.counts.d2h_bytes <= 8 * (tensors + 2)  # flags, and each tensor's max


def test_decompress_of_small_tensors_launches_and_copies_as_often_at_any_tensor_count(emulator):
    """A run of small tensors read from bytes: its entries joined on the host and copied once, its bases copied
    in one launch; so the device work (launches, array-module kernels, host-to-device copies) does not grow with
    the tensor count."""
    work = {}
    for t in (30, 300):
        new, base = _update(t, 1 << 16, seed=t)
        blob = _cpu_blob(new, base, fraction=0.01)
        m = measure(lambda _, b=blob, bs=base: gpu_codec.decompress(b, base=bs), resident=[base], emulator=emulator)
        c = m.counts
        work[t] = (c.launches, c.array_ops, c.h2d, c.syncs)
        assert c.kernels["gather_copy"] == 1 and not c.host_numpy
    assert work[30] == work[300], work


def _results(blob: bytes, base: dict, where) -> list[dict]:
    """The bytes of a decompress of ``blob`` onto ``base``, of its delta alone, and of an aggregator's result, on
    the CPU (``where`` "cpu") or the GPU path's code on the emulator (``where`` the emulator)."""
    with use_backend("cpu") if where == "cpu" else _device(where):
        agg = gpu_codec.Aggregator(base=base)
        agg.add(blob)
        out = [gpu_codec.decompress(blob, base=base), gpu_codec.decompress(blob), agg.result()]
    return [{k: np.asarray(v).tobytes() for k, v in o.items()} for o in out]


def test_decompress_and_add_of_large_tensors_launch_and_copy_as_often_at_any_tensor_count(emulator):
    """Sparse tensors of any size go in runs on a device (bounded by their entries, not their elements): a
    decompress, and an aggregator's add onto the base, of tensors above SMALL_TENSOR elements launch as often for 2
    of them as for 6, and give the CPU's bytes."""
    work = {}
    for t in (2, 6):
        rng = np.random.default_rng(t)
        base = {f"t{i}": rng.standard_normal(decode.SMALL_TENSOR + 1000 * i).astype(np.float32) for i in range(t)}
        new = {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}
        blob = _cpu_blob(new, base, fraction=0.01)
        d, a = _decompress_and_add(blob, base, emulator)
        work[t] = [(c.launches, c.array_ops, c.h2d, c.syncs) for c in (d.counts, a.counts)]
        assert d.counts.kernels["gather_copy"] == 1 and a.counts.kernels["gather_entries_u32"] == 1
        assert not d.counts.host_numpy and not a.counts.host_numpy
        assert _results(blob, base, "cpu") == _results(blob, base, emulator)
    assert work[2] == work[6], work


@pytest.mark.parametrize(
    "stages, fraction",
    [
        (("float16", "rice", "zstd"), 0.01),
        (("int8", "rice"), 0.01),
        (("ternary",), 0.01),
        ((), None),
        (("int8",), None),
        (("float16", "zstd"), None),
    ],
)
def test_a_coded_payload_read_from_bytes_is_decoded_on_the_host_at_any_tensor_count(emulator, stages, fraction):
    """A payload with value, index and bytes stages, sparse or dense, read from bytes: each record's entries are
    decoded where they lie (on the host, by the twins), then joined and copied to the device once a run (sparse
    tensors of any size; small dense ones, written by one launch a run); so a decompress and an add onto the base
    sync at most twice and launch as often at 30 tensors as at 300 (the device's Rice decoder synced about twice a
    tensor, a dense tensor took a launch and a copy of its own), and give the CPU's bytes."""
    from gpu_codec import Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd

    make = {"float16": lambda: Quantize("float16"), "int8": Int8Blockwise, "rice": RiceIndices}
    make.update(zstd=lambda: Zstd(level=3), ternary=Ternary)
    work = {}
    for t in (30, 300):
        new, base = _update(t, 1 << 16, seed=t)
        with use_backend("cpu"):
            blob = gpu_codec.compress(new, base, fraction=fraction, pipeline=[make[s]() for s in stages]).to_bytes()
        d, a = _decompress_and_add(blob, base, emulator)
        assert d.counts.syncs <= SYNCS["decompress"] and a.counts.syncs <= SYNCS["add"]
        work[t] = [(c.launches, c.array_ops, c.h2d) for c in (d.counts, a.counts)]
        assert _results(blob, base, "cpu") == _results(blob, base, emulator)
    assert work[30] == work[300], work


def test_add_and_mean_of_small_tensors_launch_and_copy_as_often_at_any_tensor_count(emulator):
    """An aggregator's add of a payload of small tensors (its entries joined a run at a time, checked, split and
    added by one launch a run; the grids that coarsen moved by one launch), its mean (one launch a value dtype) and
    its result onto the base (one launch), and an add of a dense payload (runs of dense tensors): the device work
    does not grow with the tensor count; and the accumulator holds the CPU's bytes."""
    work = {}
    for t in (30, 300):
        new, base = _update(t, 1 << 16, seed=t)
        finer = {k: base[k] + (new[k] - base[k]) * np.float32(2**-30) for k in base}  # every grid coarsens after it
        blobs = [_cpu_blob(finer, base, fraction=0.01), _cpu_blob(new, base, fraction=0.01)]

        def first(blobs=blobs, base=base, both=False):
            agg = gpu_codec.Aggregator(base=base)
            agg.add(blobs[0], weight=3)
            if both:
                agg.add(blobs[1])
            return agg

        means: list = []
        add = measure(lambda agg, b=blobs[1]: agg.add(b), setup=first, resident=[base], emulator=emulator, repeat=1)
        mean = measure(
            lambda agg, means=means: means.append(agg.mean_delta()),
            setup=lambda first=first: first(both=True),
            resident=[base],
            emulator=emulator,
            repeat=1,
        )
        res = measure(
            lambda agg: agg.result(), setup=lambda first=first: first(both=True), resident=[base], emulator=emulator
        )
        a = add.counts
        assert a.kernels["limb_shift"] == 1 and sum(v for k, v in a.kernels.items() if "accumulate" in k) == 1
        assert a.syncs <= SYNCS["add"] and not a.host_numpy and not mean.counts.host_numpy
        assert res.counts.syncs <= SYNCS["add"] and res.counts.kernels["dense_apply"] == 1
        dense_blob = _cpu_blob(new, base, fraction=None)  # every element sent: runs of dense tensors
        dense = measure(lambda agg, b=dense_blob: agg.add(b), setup=first, resident=[base], emulator=emulator).counts
        assert dense.syncs <= SYNCS["add"] and sum(v for k, v in dense.kernels.items() if "accumulate" in k) == 1
        work[t] = [(c.launches, c.array_ops, c.h2d) for c in (a, mean.counts, res.counts, dense)]
        with use_backend("cpu"):
            agg = gpu_codec.Aggregator(base=base)
            agg.add(blobs[1])  # (the other order: the same bytes)
            agg.add(blobs[0], weight=3)
            want = agg.mean_delta()
        assert all(np.asarray(means[0][k]).tobytes() == want[k].tobytes() for k in want)
    assert work[30] == work[300], work


def _device(emulator):
    return using_backend(RecordingBackend(emulator))  # the GPU path's code, run on the emulator


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "mixed"])
@pytest.mark.parametrize("fraction", [0.03, None])
@pytest.mark.parametrize("alone", [False, True])
def test_the_device_decode_gives_the_cpu_bytes(emulator, dtype, fraction, alone, monkeypatch):
    """(One dtype: the NumPy outputs are cut from one region of the device's output, copied back once; mixed: one
    region a dtype.)"""
    monkeypatch.setattr(decode, "DECODE_CHUNK_DEVICE", (64, 64))  # chunks of entries: their order is checked
    if alone:  # (runs of at most 64 entries: the large tensor is decoded alone, a chunk at a time)
        monkeypatch.setattr(decode, "BATCH_ENTRIES", (64, 64))
    rng = np.random.default_rng(5)
    sizes = [300_000 if fraction else 3000, 5, 0, 7000, 1]  # (a dense tensor is never decoded in a run)
    dts = [np.float32, np.float16, np.float64, np.float32, np.float64] if dtype == "mixed" else [dtype] * len(sizes)
    base = {f"t{i}": rng.standard_normal(s).astype(dt) for i, (s, dt) in enumerate(zip(sizes, dts))}
    new = {k: (v + rng.standard_normal(v.size)).astype(v.dtype) for k, v in base.items()}
    blob = _cpu_blob(new, base, fraction=fraction)
    with use_backend("cpu"):
        want = [gpu_codec.decompress(blob, base=base), gpu_codec.decompress(blob)]
        agg = gpu_codec.Aggregator(base=base)
        agg.add(blob, weight=2)
        agg.add(_cpu_blob(base, new, fraction=fraction), weight=1)
        want.append(agg.result())
    with _device(emulator):
        got = [gpu_codec.decompress(blob, base=base), gpu_codec.decompress(blob)]
        agg = gpu_codec.Aggregator(base=base)
        agg.add(blob, weight=2)
        agg.add(_cpu_blob(base, new, fraction=fraction), weight=1)
        got.append(agg.result())
    for w, g in zip(want, got):
        assert list(w) == list(g)
        for k in w:
            assert np.asarray(g[k]).tobytes() == w[k].tobytes(), k


@pytest.mark.parametrize("with_base", [True, False])
def test_the_device_aggregator_gives_the_cpu_bytes_whatever_the_order_dtypes_and_pipelines(emulator, with_base):
    """Payloads whose tensors come in another order than the aggregation's (runs cut where they are not adjacent
    in the accumulator), of mixed dtypes (runs cut at a dtype), with empty and all-zero tensors, sent sparse and
    dense, raw and coded, with weights whose grids coarsen and refine: the device path's accumulator, mean and
    result are the CPU's, to the byte."""
    rng = np.random.default_rng(9)
    dts = [np.float32, np.float32, np.float32, np.float64, np.float16, np.float32, np.float64, np.float16, np.float16]
    sizes = [40, 30, 0, 50, 7, 300_000, 60, 25, 9]
    base = {f"t{i}": rng.standard_normal(n).astype(dt) for i, (n, dt) in enumerate(zip(sizes, dts))}
    names = list(base)
    coded = [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd()]
    blobs = []
    for c, (order, fraction, pipe) in enumerate(
        [(names, 0.2, None), (names[::-1], 0.3, None), (names[3:] + names[:3], 0.5, coded), (names, None, None)]
    ):
        scale = 10.0 ** (2 * c - 4)
        new = {k: (base[k] + rng.standard_normal(base[k].size) * scale).astype(base[k].dtype) for k in order}
        new["t4"] = base["t4"].copy()  # nothing changes: all zeros
        blobs.append(_cpu_blob(new, base, fraction=fraction, pipeline=pipe))
    weights = [3.0, 0.5, 1.0, 2.0]
    got = {}
    for place in ("cpu", "device"):
        with use_backend("cpu") if place == "cpu" else _device(emulator):
            agg = gpu_codec.Aggregator(base=base if with_base else None)
            states = []
            for b, w in zip(blobs, weights):
                agg.add(b, weight=w)
                states.append((np.asarray(agg._limbs).tobytes(), agg._beta.tobytes()))
            mean = {k: np.asarray(v).tobytes() for k, v in agg.mean_delta().items()}
            out = {k: np.asarray(v).tobytes() for k, v in agg.result().items()}
            got[place] = (states, mean, out)
    assert got["device"] == got["cpu"]


def _hostile(kind: str):
    """(payload, base) that decompress and add refuse: each check of the decode, in the tensor after a good one."""
    rng = np.random.default_rng(2)
    dtype = np.float16 if "overflow" in kind else np.float32
    base = {"a": np.ones(50, dtype), "b": np.ones(400_000, dtype), "c": np.ones(60, dtype), "d": np.ones(40, dtype)}
    new = {k: (v + rng.standard_normal(v.size)).astype(dtype) for k, v in base.items()}
    with use_backend("cpu"):
        p = gpu_codec.compress(new, base, fraction=None if "dense" in kind else 0.05, scope="per_tensor")
    t = 2 if kind in ("run", "dense_nan", "dense_overflow") else 1
    idx, vals = p.tensors[t].buffers.get("indices"), p.tensors[t].buffers["values"]
    if kind == "dense_nan":  # ("c" and "d" are added in one run of dense tensors)
        vals[7] = np.nan
    elif kind == "dense_overflow":
        base["c"][5] = 60000
        vals[5] = 60000
    elif kind in ("order", "run"):  # ("c" and "d" are decoded in one run)
        idx[[1, 2]] = idx[[2, 1]]
    elif kind == "chunks":  # each chunk of 256 entries ascending, the second starting below the first's end
        idx[[255, 256]] = idx[[256, 255]]
    elif kind == "range":
        idx[-1] = p.tensors[t].numel
    elif kind == "nan":
        vals[7] = np.nan
    elif kind == "overflow":
        base["b"][idx[5]] = 60000
        vals[5] = 60000
    return p, base


@pytest.mark.parametrize("kind", ["order", "chunks", "run", "range", "nan", "overflow", "dense_nan", "dense_overflow"])
def test_the_device_decode_refuses_what_the_cpu_refuses_with_its_error(emulator, kind, monkeypatch):
    for name in ("DECODE_CHUNK", "DECODE_CHUNK_DEVICE"):  # (the messages name a chunk of entries)
        monkeypatch.setattr(decode, name, (256, 256))
    errors = []
    for place in ("cpu", "device"):
        p, base = _hostile(kind)
        with use_backend("cpu") if place == "cpu" else _device(emulator):
            got = []
            calls = (
                lambda p=p, b=base: gpu_codec.decompress(p, base=b),
                lambda p=p, b=base: gpu_codec.Aggregator(b).add(p),
                lambda p=p, b=base: gpu_codec.decompress(p.to_bytes(), base=b),
                lambda p=p, b=base: gpu_codec.Aggregator(b).add(p.to_bytes()),
            )
            for call in calls:
                with pytest.raises(GpuCodecError) as e:
                    call()
                got.append((type(e.value), str(e.value)))
        errors.append(got)
    assert errors[0] == errors[1]


def test_the_benchmark_writes_its_table_and_checks_the_targets(tmp_path, capsys):
    from benchmarks import bench_host

    out = tmp_path / "host.json"
    assert (
        bench_host.main(
            ["--tensors", "3", "--elements", "3000", "--entries", "iid-2^24", "--full", "--pipelines", "dense-int8"]
            + ["--repeat", "1", "--out", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    row, _, dense = doc["rows"]
    assert dense["entry"] == "iid-2^24 dense-int8" and dense["pipeline"] == "dense-int8"
    assert dense["ops"]["decompress"]["syncs"] <= 2 and dense["ops"]["compress"]["launches"] <= 2
    assert row["tensors"] == 3 and set(row["ops"]) == {"compress", "decompress", "add"}
    assert row["ops"]["decompress"]["syncs"] <= 2 and doc["machine"]["cpu_model"]
    assert "| split-3 | 3 |" in out.with_suffix(".md").read_text()
    bench_host.main(["--check", "--from-json", str(out)])
    verdicts = capsys.readouterr().out
    assert "PASS split-3" in verdicts and "decompress syncs 2 <= 2" in verdicts
    # an entry at its full size launches as often as scaled down, or fails
    full = {**row, "entry": "split-3" + bench_host.FULL, "elements": 10**8}
    grown = {**full, "ops": {**row["ops"], "add": {**row["ops"]["add"], "launches": row["ops"]["add"]["launches"] + 1}}}
    same = [v for v in bench_host.check({"rows": [row, full]}) if "launches" in v[2]]
    assert len(same) == 3 and all(v == "PASS" for v, _, _ in same)
    failed = [w for v, _, w in bench_host.check({"rows": [row, grown]}) if v == "FAIL" and "launches" in w]
    assert failed == [
        f"add launches {row['ops']['add']['launches'] + 1} at 100,000,000 elements = "
        f"{row['ops']['add']['launches']} at 3,000"
    ]


def test_an_aggregator_checks_its_base_with_one_read_at_any_tensor_count(emulator):
    """An Aggregator's base is checked for inf and NaN on the device, small tensors together (a few array ops at
    any tensor count, where it made three a tensor), the flags read back at once (one host wait, where it read one
    a tensor); a bad tensor is still named."""
    ops = []
    for t in (30, 300):
        _, base = _update(t, 1 << 14, seed=t)
        m = measure(lambda _, b=base: gpu_codec.Aggregator(base=b), resident=[base], emulator=emulator, repeat=1)
        assert m.counts.syncs == 1, m.counts.sync_sites
        ops.append(m.counts.array_ops)
    assert ops[0] == ops[1] <= 6, ops
    base["t7"][3] = np.nan
    with _device(emulator), pytest.raises(gpu_codec.errors.InvalidInputError, match=r"'t7'.*inf or NaN"):
        gpu_codec.Aggregator(base=base)
