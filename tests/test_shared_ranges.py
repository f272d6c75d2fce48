"""Plain ``coo`` records read from bytes as ranges of the payload's data (gpu_codec.format.common.Ranges): the v2
reader makes no array per record, decompress and an aggregator's ``add`` join a run's entries by one gather a
role. Each is compared with the reader's per-record views (shared ranges turned off: ``SHARED_VIEWS_MIN`` out of
reach): the same buffers, bytes, outputs and sums, and the same error naming the same tensor."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gpu_codec
from gpu_codec import decode
from gpu_codec.errors import PayloadIndexError
from gpu_codec.format import v2
from gpu_codec.format.common import Ranges, SegmentBuffers, buffer_dtype_name
from gpu_codec.payload import Payload

from .common import BACKENDS, use_backend
from .test_decode_batched import _descending, _nan, _past_its_tensor, _repeated, _tamper


def _update(tensors: int = 40, seed: int = 0, mixed: bool = False) -> tuple[dict, dict]:
    """Uneven float32 tensors (and float16 ones where ``mixed``: float32 values too), empty and one-element ones
    among them."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 3000, tensors).tolist()
    sizes[3], sizes[7] = 0, 1
    base, new = {}, {}
    for i, n in enumerate(sizes):
        dt = np.float16 if mixed and i % 5 == 2 else np.float32
        b = rng.standard_normal(n).astype(dt)
        base[f"t{i}"], new[f"t{i}"] = b, (b + rng.standard_normal(n)).astype(dt)
    return new, base


def _per_record(monkeypatch) -> None:
    monkeypatch.setattr(v2, "SHARED_VIEWS_MIN", 1 << 62)  # (for a table read before, too)


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "with-float16"])
def test_the_reader_gives_ranges_of_the_data_equal_to_per_record_views(mixed, monkeypatch):
    new, base = _update(mixed=mixed)
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    shared = Payload.from_bytes(blob)
    assert {type(r.buffers) for r in shared.tensors} == {SegmentBuffers}
    roles = shared.tensors[0].buffers.roles
    assert [type(x) for x in roles.values()] == [Ranges, Ranges]
    assert all(r.buffers.roles is roles for r in shared.tensors)
    _per_record(monkeypatch)
    alone = Payload.from_bytes(blob)
    assert {type(r.buffers) for r in alone.tensors} == {dict}
    for a, b in zip(shared.tensors, alone.tensors):
        assert list(a.buffers) == list(b.buffers)
        for role in b.buffers:
            assert buffer_dtype_name(a.buffers[role], a, role) == buffer_dtype_name(b.buffers[role], b, role)
            assert a.buffers[role].dtype == b.buffers[role].dtype
            assert a.buffers[role].tobytes() == b.buffers[role].tobytes()
    assert shared.to_bytes() == blob


def test_other_layouts_and_few_records_keep_per_record_views():
    """A float64 tensor's float64 values (8-byte words among 4-byte ones), or fewer records than
    SHARED_VIEWS_MIN: every record is read as before."""
    new, base = _update(20)
    new["wide"], base["wide"] = np.arange(50, dtype=np.float64), np.zeros(50, np.float64)
    few = _update(v2.SHARED_VIEWS_MIN - 1)
    for blob in (gpu_codec.compress(new, base, fraction=0.05).to_bytes(), gpu_codec.compress(*few).to_bytes()):
        p = Payload.from_bytes(blob)
        assert {type(r.buffers) for r in p.tensors} == {dict}
        assert p.to_bytes() == blob


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("onto", [True, False], ids=["onto-base", "delta"])
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "with-float16"])
def test_decompress_and_add_give_what_per_record_views_give(backend, onto, mixed, monkeypatch):
    new, base = _update(mixed=mixed)
    with use_backend("cpu"):  # (about 30 entries a record, gathered; and about 450, sliced)
        blobs = [gpu_codec.compress(new, base, fraction=f).to_bytes() for f in (0.02, 0.3)]
    gathered = []
    real = decode._gather_shared

    def spy(*a):
        got = real(*a)
        if got is not None:
            gathered.append(a[1:3])
        return got

    monkeypatch.setattr(decode, "_gather_shared", spy)

    def run() -> tuple[dict, dict]:
        with use_backend(backend):
            out = gpu_codec.decompress(blobs[0], base=base if onto else None)
            agg = gpu_codec.Aggregator(base=base if onto else None)
            for b in blobs:
                agg.add(b)
            return out, agg.result()

    out, mean = run()
    assert gathered or mixed  # the runs were joined by gathers (float16 ones between: per dtype, maybe not)
    with monkeypatch.context() as m:
        _per_record(m)
        gathered.clear()
        want_out, want_mean = run()
        assert not gathered
    for got, want in ((out, want_out), (mean, want_mean)):
        assert list(got) == list(want)
        for k in want:
            assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "indices,values", [(_past_its_tensor, None), (_repeated, None), (_descending, None), (None, _nan)]
)
def test_a_bad_entry_read_from_ranges_names_its_tensor(indices, values, backend):
    new, base = _update()
    with use_backend("cpu"):
        p = gpu_codec.compress(new, base, fraction=0.02)  # (few entries a record: the runs are gathered)
        name = next(r.name for r in p.tensors[10:] if r.nnz >= 3)  # in the middle of a run of float32 tensors
        blob = _tamper(p, name, indices, values).to_bytes()
    read = Payload.from_bytes(blob)
    assert type(read.tensors[0].buffers) is SegmentBuffers
    nnz = [r.nnz for r in read.tensors]
    plain = decode.plain_buffers(gpu_codec.codecs.decoder_for(read.pipeline), read.tensors)
    assert decode._gather_shared(plain, 0, len(nnz), nnz) is not None
    with use_backend(backend):
        for onto in (base, None):
            with pytest.raises(PayloadIndexError, match=re.escape(f"tensor '{name}'")):
                gpu_codec.decompress(blob, base=onto)
        agg = gpu_codec.Aggregator(base=base)
        with pytest.raises(PayloadIndexError, match=re.escape(f"tensor '{name}'")):
            agg.add(blob)
        assert agg.count == 0


def test_a_range_shorter_than_its_nnz_is_not_gathered():
    """Records whose ranges do not say their nnz (a payload made by hand from read records) are sliced one by one,
    as before."""
    new, base = _update(mixed=True)
    p = Payload.from_bytes(gpu_codec.compress(new, base, fraction=0.02).to_bytes())
    plain = decode.plain_buffers(gpu_codec.codecs.decoder_for(p.pipeline), p.tensors)
    assert type(plain) is decode.SharedEntries
    nnz = [r.nnz for r in p.tensors]
    assert decode._gather_shared(plain, 0, len(nnz), nnz) is not None
    nnz[5] += 1
    assert decode._gather_shared(plain, 0, len(nnz), nnz) is None


def _greedy_runs(nnz: list[int], most: int) -> list[int]:
    """decode._runs' loop for records of one dtype on a device: a record joins the run while its entries fit."""
    out, run, entries = [], -1, 0
    for i, n in enumerate(nnz):
        if not (i and entries + n <= most):
            run, entries = run + 1, 0
        out.append(run)
        entries += n
    return out


def test_runs_of_coo_records_are_cut_where_the_record_loop_cuts_them():
    rng = np.random.default_rng(4)
    for _ in range(300):
        nnz = rng.integers(0, 50, rng.integers(1, 60)).tolist()
        if rng.random() < 0.3:
            nnz[rng.integers(len(nnz))] = 500  # a record over the bound: a run of its own
        most = int(rng.integers(1, 200))
        assert decode._coo_runs(nnz, most) == _greedy_runs(nnz, most), (nnz, most)
    records = Payload.from_bytes(gpu_codec.compress(*_update(), fraction=0.05).to_bytes()).tensors
    logical = [r.dtype for r in records]
    numels = [r.numel for r in records]
    most = decode.batch_entries(decode._output_bytes(logical, numels))
    assert decode._runs(records, logical, numels, device=True, dense=True) == _greedy_runs(
        [r.nnz for r in records], most
    )


def test_positions_are_the_ranges_end_to_end():
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(0, 30))
        counts, starts = rng.integers(0, 5, n).tolist(), rng.integers(0, 100, n).tolist()
        want = [p for s, c in zip(starts, counts) for p in range(s, s + c)]
        assert decode._positions(starts, counts).tolist() == want


def test_records_of_many_entries_are_sliced_not_gathered():
    new, base = _update()
    for fraction, gathers in ((0.02, True), (0.3, False)):
        p = Payload.from_bytes(gpu_codec.compress(new, base, fraction=fraction).to_bytes())
        plain = decode.plain_buffers(gpu_codec.codecs.decoder_for(p.pipeline), p.tensors)
        nnz = [r.nnz for r in p.tensors]
        assert (sum(nnz) <= decode.SHARED_JOIN_ENTRIES * len(nnz)) == gathers
        assert (decode._gather_shared(plain, 0, len(nnz), nnz) is not None) == gathers


def test_a_slice_of_ranges_is_its_items():
    r = Ranges(np.arange(40), [0, 5, 9, 14, 30], [3, 7, 12, 20, 30])
    for sl in (slice(None), slice(1, 3), slice(None, None, 2), slice(-2, None), slice(3, 1), slice(-9, 99)):
        got, want = r[sl], [r[i] for i in range(*sl.indices(len(r)))]
        assert [x.tolist() for x in got] == [x.tolist() for x in want], sl


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_the_aggregators_runs_of_adjacent_sparse_records_are_what_its_record_loop_cuts(device):
    """Aggregator._runs takes decode's runs as they are where every record is in a sparse run and the records lie
    adjacent in the accumulator: the runs and dense set its record loop (Aggregator._cut_runs) gives them."""
    from gpu_codec.aggregate import Aggregator

    rng = np.random.default_rng(11)
    taken = 0
    for seed in range(12):
        new, base = _update(int(rng.integers(2, 60)), seed=seed, mixed=seed % 3 == 0)
        fraction = float(rng.choice([0.001, 0.02, 0.3]))
        records = Payload.from_bytes(gpu_codec.compress(new, base, fraction=fraction).to_bytes()).tensors
        logical = [r.dtype for r in records]
        numels = [r.numel for r in records]
        pos = np.arange(len(records), dtype=np.int64)
        given = decode._runs(records, logical, numels, device)
        want = Aggregator._cut_runs(records, logical, pos, device, given, numels)
        assert Aggregator._runs(records, logical, pos, device) == want
        taken += None not in given
    assert taken >= 3  # (the shortcut taken, not only the loop)
