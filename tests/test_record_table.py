"""Records held as columns (gpu_codec.format.common.RecordTable): a compress with no stage after top-k and the v2
reader's second read of a table give them, with no object a record. Each is compared with the same records held
as a list: the same bytes, sizes, outputs and sums; ``Payload.tensors`` makes the list once, and the payload holds
that list (and what is done to it) from then on."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec import decode
from gpu_codec.codecs import Quantize, wire_layouts
from gpu_codec.format import RecordTable, TensorRecord, unpack
from gpu_codec.format.common import SegmentBuffers
from gpu_codec.payload import Payload, payload_records

from .common import BACKENDS, use_backend
from .test_shared_ranges import _update


def _as_list(p: Payload) -> Payload:
    """The same records, held as a list made apart from ``p`` (``p`` keeps its columns)."""
    table = payload_records(p)
    assert type(table) is RecordTable
    made = [
        TensorRecord(r.name, r.dtype, r.shape, r.encoding, r.nnz, dict(r.buffers))
        for r in RecordTable(table.names, table.dtypes, table.shapes, table.nnz, table.roles)
    ]
    q = Payload(made, p.pipeline, p.metadata, backend=p.backend)
    assert type(payload_records(p)) is RecordTable  # (still columns)
    return q


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_a_compress_holds_its_records_as_columns_and_writes_the_same_bytes(backend, scope):
    new, base = _update(tensors=60)
    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=0.02, scope=scope, metadata={"round": 3})
        if backend == "cpu" and scope == "per_tensor":  # (the NumPy selection per tensor: an array a tensor)
            assert type(payload_records(p)) is list
            return
        q = _as_list(p)
        assert (p.nbytes, p.header_nbytes, p.nnz, p.dense_nbytes) == (q.nbytes, q.header_nbytes, q.nnz, q.dense_nbytes)
        assert repr(p) == repr(q)
        blob = p.to_bytes()
        assert blob == q.to_bytes() and len(blob) == p.nbytes
        assert type(payload_records(p)) is RecordTable  # (sizes and bytes read the columns)
        got, want = gpu_codec.decompress(p, base=base), gpu_codec.decompress(q, base=base)
        assert list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)
        delta = gpu_codec.decompress(p)
        assert all(np.array_equal(delta[k], gpu_codec.decompress(q)[k]) for k in want)


def test_reading_tensors_makes_the_list_once_and_the_payload_keeps_it():
    new, base = _update(tensors=30)
    p = gpu_codec.compress(new, base, fraction=0.05)
    assert type(payload_records(p)) is RecordTable
    recs = p.tensors
    assert type(recs) is list and recs is p.tensors and payload_records(p) is recs
    assert {type(r.buffers) for r in recs} == {SegmentBuffers}
    assert [r.name for r in recs] == list(new) and [r.shape for r in recs] == [a.shape for a in new.values()]
    # what is done to the list is what the payload writes
    before = p.to_bytes()
    recs[0].name = "renamed"
    after = Payload.from_bytes(p.to_bytes())
    assert after.tensors[0].name == "renamed" and p.to_bytes() != before
    p.tensors = recs[1:]
    assert len(Payload.from_bytes(p.to_bytes()).tensors) == len(new) - 1


def test_a_pipeline_with_stages_makes_records():
    new, base = _update(tensors=20)
    p = gpu_codec.compress(new, base, fraction=0.05, pipeline=[Quantize("float16")])
    assert type(payload_records(p)) is list and {r.encoding for r in p.tensors} == {"sparse"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_table_read_again_is_columns_and_decodes_as_the_list_does(backend):
    new, base = _update(tensors=50, seed=["cpu", "emulated", "gpu"].index(backend) + 10)  # (not read before)
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    first = Payload.from_bytes(blob)  # (the first read of these names and shapes: a list of records)
    assert type(payload_records(first)) is list
    again = Payload.from_bytes(blob)
    table = payload_records(again)
    assert type(table) is RecordTable and list(table.names) == list(new)
    assert type(unpack(blob, wire_layouts(), describe=False)[1]) is list  # (columns only when asked for)
    assert again.nnz == first.nnz and again.dense_nbytes == first.dense_nbytes and again.to_bytes() == blob
    with use_backend(backend):
        for b in (base, None):
            got, want = gpu_codec.decompress(Payload.from_bytes(blob), base=b), gpu_codec.decompress(first, base=b)
            assert list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)
        agg, ref = gpu_codec.Aggregator(base=base), gpu_codec.Aggregator(base=base)
        agg.add(Payload.from_bytes(blob))
        ref.add(first)
        out, want = agg.result(), ref.result()
        assert all(np.array_equal(out[k], want[k]) for k in want)
    assert [r.nnz for r in again.tensors] == [r.nnz for r in first.tensors]


def test_a_bad_table_read_again_names_the_tensor():
    """An index past its tensor in a table read before: the same error as the list's, naming the same tensor."""
    from .test_decode_batched import _past_its_tensor, _tamper

    new, base = _update(tensors=40, seed=2)
    p = gpu_codec.compress(new, base, fraction=0.05)
    Payload.from_bytes(p.to_bytes())  # (the table remembered)
    bad = _tamper(p, "t9", _past_its_tensor).to_bytes()
    assert type(payload_records(Payload.from_bytes(bad))) is RecordTable
    with pytest.raises(gpu_codec.PayloadIndexError, match="'t9'"):
        gpu_codec.decompress(bad, base=base)
    with pytest.raises(gpu_codec.PayloadIndexError, match="'t9'"):
        gpu_codec.decompress(bad)


def test_ranges_end_to_end_are_one_slice_as_the_gather_gives_them(monkeypatch):
    """A selection's shared outputs (each role's ranges end to end) are joined by one slice: the entries a gather
    of them gives, the indices a fresh array (the caller shifts them in place), nothing of the payload written."""
    new, base = _update(tensors=40, seed=7)
    p = gpu_codec.compress(new, base, fraction=0.05)
    plain = decode.plain_buffers(gpu_codec.codecs.as_pipeline(None), payload_records(p))
    assert type(plain) is decode.SharedEntries
    nnz = payload_records(p).nnz
    kept = plain.indices.source.copy()
    gi, vals, counts = decode._gather_shared(plain, 3, 35, nnz[3:35])
    monkeypatch.setattr(decode, "_end_to_end", lambda *a: False)
    monkeypatch.setattr(decode, "SHARED_JOIN_ENTRIES", 1 << 40)
    gi2, vals2, counts2 = decode._gather_shared(plain, 3, 35, nnz[3:35])
    assert counts == counts2 and np.array_equal(gi, gi2) and np.array_equal(vals, vals2)
    gi += 1
    assert np.array_equal(plain.indices.source, kept)
