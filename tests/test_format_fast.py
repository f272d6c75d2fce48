"""The wire format's fast paths against its general ones, on the same inputs, valid and invalid alike: the same
records, the same bytes, or the same error (type and message).

- Reader: plain ``coo``/``dense`` table entries read by ``v2._read_plain`` and by ``v2._read_tensor`` alone (the
  fast reader switched off), on random payloads and on structure-aware mutations of their tables
  (gpu_codec.testing.fuzz.mutate_table).
- Writer: plain records checked by ``v2._plain_buffers`` and by the general checks of ``v2.plan`` alone, on
  valid records and on records broken one way at a time.
- Names: front-coded by NumPy over all names (``v2._entries_vector``) and name by name (``v2._entries_scalar``),
  both against the rule of docs/FORMAT.md written out here.
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec import Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd
from gpu_codec.codecs import wire_layouts
from gpu_codec.format import TensorRecord, pack, unpack, v2
from gpu_codec.format.common import SegmentBuffers, Segmented, SegmentPart
from gpu_codec.format.schema import Unrepresentable
from gpu_codec.testing import fuzz


def outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # compared, type and message, with the other path's
        return type(e).__name__, str(e)


# ------------------------------------------------------------------------------------------ payloads


def record(rng: random.Random, name: str, enc: str | None = None) -> TensorRecord:
    dtype = rng.choice(["float32", "float16", "bfloat16", "float64"])
    ndim = rng.choice([0, 1, 1, 2, 3, 4])
    shape = tuple(rng.choice([0, 1, 2, 3, 7, 130, 300]) if rng.random() < 0.9 else 0 for _ in range(ndim))
    if rng.random() < 0.05:
        shape = (1 << 33,)  # indices of uint64
    numel = int(np.prod(shape))
    vd = np.float64 if dtype == "float64" else np.float32
    enc = enc or ("dense" if numel < 64 and rng.random() < 0.3 else "coo")
    if enc == "dense":
        if numel > 4096:
            shape = (rng.choice([0, 1, 5, 17]),)
            numel = shape[0]
        return TensorRecord(name, dtype, shape, "dense", numel, {"values": np.arange(numel, dtype=vd)})
    nnz = min(numel, rng.choice([0, 1, 2, 5, 150]))
    idx = np.uint32 if numel <= 1 << 32 else np.uint64
    bufs = {"indices": np.arange(nnz, dtype=idx) * 2 % max(numel, 1), "values": np.arange(nnz, dtype=vd) - 0.5}
    return TensorRecord(name, dtype, shape, "coo", nnz, bufs)


def names(rng: random.Random, n: int) -> list[str]:
    parts = ["layer", "blocks", "weight", "bias", "é", "ü", "attn", "x" * 140, "#", "\x00"]
    out: dict[str, None] = {}
    while len(out) < n:
        k = rng.randrange(1, 5)
        s = ".".join(rng.choice(parts) + (str(rng.randrange(200)) if rng.random() < 0.6 else "") for _ in range(k))
        out[s] = None
    got = list(out)
    if rng.random() < 0.5:
        got.sort()
    return got


def payload(rng: random.Random) -> bytes:
    n = rng.choice([1, 2, 5, 20, 150])
    recs = [record(rng, nm) for nm in names(rng, n)]
    if rng.random() < 0.3:  # most records dense: the table's default form is dense, coo entries carry their own
        recs = [record(rng, nm, "dense") if rng.random() < 0.8 else record(rng, nm, "coo") for nm in names(rng, n)]
    meta = {"round": rng.randrange(9)} if rng.random() < 0.3 else None
    return pack(recs, pipeline=[{"id": "topk", "fraction": 0.01}], metadata=meta, layouts=wire_layouts(), version=2)


def read(blob: bytes):
    header, recs = unpack(blob, wire_layouts())
    rows = [
        (r.name, r.dtype, r.shape, r.encoding, r.nnz, r.codec, r.chunk, dict(r.buffer_dtypes))
        + tuple((k, v.dtype.str, v.tobytes()) for k, v in r.buffers.items())
        for r in recs
    ]
    return header, rows


def read_both(blob: bytes):
    fast = outcome(lambda: read(blob))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(v2, "_read_plain", lambda *a: None)  # every entry read by _read_tensor
        m.setattr(v2, "_read_coded", lambda *a: True)
        general = outcome(lambda: read(blob))
    assert fast == general
    return fast


def test_plain_entries_are_read_by_the_fast_reader():
    rng = random.Random(0)
    recs = [record(rng, f"t{i}", "coo") for i in range(50)]
    blob = pack(recs, pipeline=[], layouts=wire_layouts())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(v2, "_read_tensor", None)  # not called: every entry read by _read_plain
        _, back = unpack(blob, wire_layouts())
    assert [r.name for r in back] == [r.name for r in recs]
    assert read_both(blob)[0] == "ok"


@pytest.mark.parametrize("enc", ["coo", "dense"])
def test_a_table_that_repeats_one_read_before_but_for_its_nnz_is_read_from_what_is_known(enc, monkeypatch):
    """The next round's table (the same names, dtypes and shapes, other nnz) is read by comparing each entry's
    bytes before its nnz with the remembered ones (v2._read_known): the general reader's records; an nnz above its
    tensor, a shape or name that differs, or an entry more, and it is read entry by entry (the same records or
    error as the general reader's)."""
    monkeypatch.setattr(v2, "_KNOWN", ())
    rng = random.Random(7)
    recs = [record(rng, f"layer{i}.weight", enc) for i in range(40)]
    read_both(pack(recs, pipeline=[], layouts=wire_layouts(), version=2))
    assert len(v2._KNOWN) == 1 and len(v2._KNOWN[0].heads) == 40

    def again(change):
        out = []
        for i, r in enumerate(recs):
            numel = int(np.prod(r.shape))
            nnz = r.nnz if enc == "dense" else (numel - i % 3 if numel > 2 else numel)
            bufs = {k: np.arange(nnz, dtype=v.dtype) for k, v in r.buffers.items()}
            out.append(TensorRecord(r.name, r.dtype, r.shape, enc, nnz, bufs))
        change(out)
        return pack(out, pipeline=[], layouts=wire_layouts(), version=2)

    monkeypatch.setattr(v2, "_KNOWN_MAX_BYTES", sum(map(len, v2._KNOWN[0].heads)) - 1)  # (a larger table)
    v2._KNOWN = ()
    read_both(pack(recs, pipeline=[], layouts=wire_layouts(), version=2))
    assert v2._KNOWN == ()  # not remembered: what a sender can make a reader hold is bounded
    monkeypatch.setattr(v2, "_KNOWN_MAX_BYTES", 1 << 20)
    read_both(pack(recs, pipeline=[], layouts=wire_layouts(), version=2))
    calls = []
    real = v2._match
    monkeypatch.setattr(v2, "_match", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(v2, "_remember", lambda *a: calls.append("entry by entry"))
    assert read_both(again(lambda out: None))[0] == "ok" and calls == [1]

    def bigger(out):  # a shape that differs: read entry by entry, remembered
        r = out[5]
        out[5] = TensorRecord(r.name, r.dtype, (*r.shape, 1, 2), enc, 0 if enc == "coo" else r.nnz * 2, {})
        out[5].buffers.update({k: v[:0] if enc == "coo" else np.concatenate([v, v]) for k, v in r.buffers.items()})

    calls.clear()
    assert read_both(again(bigger))[0] == "ok" and calls == [1, "entry by entry"]
    calls.clear()
    assert read_both(again(lambda out: out.append(record(rng, "extra", enc))))[0] == "ok"
    assert calls == ["entry by entry"]  # (another count: not compared)
    if enc == "coo":  # the comparison itself: an nnz above its tensor's elements, or not canonical, is no match
        k = v2._KNOWN[0]
        nnz = [min(n, 200) for n in k.numels]
        table = b"".join(h + v2.uvarint(n) for h, n in zip(k.heads, nnz))
        assert v2._match(k, table, 0) == (len(table), nnz)
        big = next(i for i, n in enumerate(k.numels) if n < 100)
        over = nnz[:big] + [k.numels[big] + 1] + nnz[big + 1 :]
        assert v2._match(k, b"".join(h + v2.uvarint(n) for h, n in zip(k.heads, over)), 0) is None
        loose = b"".join(h + (b"\x80\x00" if i == big else v2.uvarint(n)) for i, (h, n) in enumerate(zip(k.heads, nnz)))
        assert v2._match(k, loose, 0) is None
        assert v2._match(k, table[:-1], 0) is None


@pytest.mark.parametrize("seed", range(4))
def test_both_readers_agree_on_valid_and_mutated_tables(seed):
    rng = random.Random(seed)
    seen = set()
    for _ in range(12):
        blob = payload(rng)
        assert read_both(blob)[0] == "ok"
        for _ in range(25):
            got = read_both(fuzz.mutate_table(blob, rng, rng.randrange(1, 3)))
            seen.add(got[0])
    assert {"ok", "PayloadHeaderError", "PayloadLayoutError", "PayloadLimitError"} <= seen, seen


FIRST = b"\x00\x01t\x04\x01\x00"  # "t": float32, shape (1,), nnz 0


@pytest.mark.parametrize(
    ("entry", "data", "valid"),
    [
        (b"\x01\x00\x00\x01u\x04\x01\x00", b"", True),  # "u", against "t"
        (b"\x00\x01v\x44\x01\x01", b"\x00" * 4, True),  # a form of its own: dense, shape (1,)
        (b"\x00\x01v\x00\x01", b"\x00" * 8, True),  # a scalar, nnz 1: indices and values
        (b"\x00\x01a\x04\x05", b"", False),  # the nnz missing
        (b"\x00\x01a\x84\x05\x00", b"", False),  # reserved bit 7
        (b"\x00\x01a\x24" + b"\x01" * 10, b"", False),  # 9 dimensions
        (b"\x00\x81\x00a\x04\x01\x00", b"", False),  # a non-canonical name length
        (b"\x00\x01\xff\x04\x01\x00", b"", False),  # a name that is not UTF-8
        (b"\x00\x00\x04\x01\x00", b"", False),  # an empty name
        (b"\x00\x01a\x04\x02\x03", b"", False),  # nnz above numel
        (b"\x00\x01a\x08" + b"\x80" * 10 + b"\x01\x01\x00", b"", False),  # a varint past 10 bytes
        (b"\x00\x01a\x08" + b"\xff\xff\xff\xff\x1f" * 2 + b"\x00", b"", False),  # too many elements
        (b"\x02\x00\x00\x01b\x04\x01\x00", b"", False),  # a reference to a name not yet read
        (b"\x01\x02\x00\x01b\x04\x01\x00", b"", False),  # a prefix longer than the name referred to
        (FIRST, b"", False),  # the name of the tensor before it
        (b"\x00\x01a\x04\x01\x00\x00", b"", False),  # a byte after the last tensor
    ],
)
def test_both_readers_agree_on_single_entries(entry, data, valid):
    table = b"\x00\x00\x02" + FIRST + entry  # no stages, default form coo, two tensors
    body = v2._PREFIX.pack(b"GPUCODEC", 2, 0) + v2.uvarint(len(table)) + table + data
    got = read_both(fuzz._with_crc(body))
    assert (got[0] == "ok") == valid, got


def test_written_bytes_are_each_buffer_as_it_lies():
    rng = random.Random(5)
    recs = [record(rng, f"w{i}", "coo") for i in range(4)]
    recs = [r for r in recs if r.nnz > 1]
    want = pack(recs, pipeline=[], layouts=wire_layouts())
    strided = [broken(r, "values strided") for r in recs]
    assert not strided[0].buffers["values"].flags.c_contiguous
    assert pack(strided, pipeline=[], layouts=wire_layouts()) == want


# ------------------------------------------------------------------------------------------ writer


def write_both(recs: list[TensorRecord], version: int | None = 2):
    def go():
        return pack(recs, pipeline=[], layouts=wire_layouts(), version=version)

    fast = outcome(go)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(v2, "_plain_buffers", lambda rec, enc: None)  # every record through plan's general checks
        m.setattr(v2, "_plain_many", lambda tensors: None)
        general = outcome(go)
    assert fast == general
    return fast


def broken(rec: TensorRecord, how: str) -> TensorRecord:
    b = dict(rec.buffers)
    r = TensorRecord(rec.name, rec.dtype, rec.shape, rec.encoding, rec.nnz, b, dict(rec.codec))
    if how.startswith("indices") and "indices" not in b:  # a dense record: an indices buffer it cannot have
        b["indices"] = np.zeros(rec.nnz, np.uint32)
    elif how == "indices int64":
        b["indices"] = b["indices"].astype(np.int64)
    elif how == "indices uint64":
        b["indices"] = b["indices"].astype(np.uint64)
    elif how == "values float64":
        b["values"] = b["values"].astype(np.float64)
    elif how == "values big-endian":
        b["values"] = b["values"].astype(">f4")
    elif how == "values strided":
        b["values"] = np.repeat(b["values"], 2)[::2]
    elif how == "values a list":
        b["values"] = b["values"].tolist()
    elif how == "indices one more":
        b["indices"] = np.append(b["indices"], b["indices"][:1])
    elif how == "one value more":
        b["values"] = np.append(b["values"], np.float32(1))
    elif how == "buffers reversed":
        r.buffers = dict(reversed(list(b.items())))
    elif how == "a buffer more":
        b["scales"] = np.zeros(1, np.float32)
    elif how == "values missing":
        del b["values"]
    elif how == "stored dtypes":
        r.buffer_dtypes = {"indices": "uint32", "values": "float32"}
    elif how == "stored dtype wrong":
        r.buffer_dtypes = {"indices": "uint64", "values": "float32"}
    elif how == "codec field":
        r.codec = {"x": 1}
    elif how == "shape a list":
        r.shape = list(rec.shape)
    elif how == "numpy dimension":
        r.shape = tuple(np.int64(d) for d in rec.shape)
    elif how == "negative dimension":
        r.shape = (-1, *rec.shape)
    elif how == "huge dimension":
        r.shape = (1 << 41,)
    elif how == "nnz a bool":
        r.nnz = True
    elif how == "nnz above numel":
        r.nnz = rec.nnz + 10**6
    elif how == "dtype int8":
        r.dtype = "int8"
    elif how == "dense":
        r.encoding = "dense"
    return r


HOW = [
    "indices int64",
    "indices uint64",
    "values float64",
    "values big-endian",
    "values strided",
    "values a list",
    "indices one more",
    "one value more",
    "buffers reversed",
    "a buffer more",
    "values missing",
    "stored dtypes",
    "stored dtype wrong",
    "codec field",
    "shape a list",
    "numpy dimension",
    "negative dimension",
    "huge dimension",
    "nnz a bool",
    "nnz above numel",
    "dtype int8",
    "dense",
]


@pytest.mark.parametrize("version", [2, None])
def test_both_writers_agree_on_valid_and_broken_records(version):
    rng = random.Random(3)
    recs = [record(rng, f"w{i}", "coo") for i in range(6)] + [record(rng, f"d{i}", "dense") for i in range(3)]
    recs = [r for r in recs if r.nnz]
    ok = write_both(recs, version)
    assert ok[0] == "ok" and read_both(ok[1])[0] == "ok"
    results = set()
    for how in HOW:
        for i in (0, len(recs) - 1):
            mixed = list(recs)
            mixed[i] = broken(recs[i], how)
            got = write_both(mixed, version)
            results.add(got[0])
            if got[0] == "ok":
                read_both(got[1])  # (what a v1 fallback wrote need not read back; the readers agree on it)
    assert {"ok", "InvalidInputError" if version else "AttributeError"} <= results, results


def coo_table(rng: random.Random, n: int = 24) -> list[TensorRecord]:
    return [record(rng, nm, "coo") for nm in names(rng, n)]


@pytest.mark.parametrize("seed", range(3))
def test_a_table_of_shared_outputs_is_checked_at_once_with_the_same_bytes_or_error(seed):
    rng = random.Random(seed)
    recs = shared([r for r in coo_table(rng) if r.numel <= 1 << 32 and r.dtype != "float64"])
    assert v2._plain_many(recs) is not None  # (the fast path is taken)
    ok = write_both(recs)
    assert ok[0] == "ok" and read_both(ok[1])[0] == "ok"
    results = set()
    for how in [*HOW, "dtype float64", "nnz one less", "shape past uint32"]:
        for i in (0, len(recs) - 1):
            mixed = list(recs)
            mixed[i] = broken_shared(recs[i], how)
            got = write_both(mixed)
            results.add(got[0])
    assert {"ok", "InvalidInputError"} <= results, results


def broken_shared(rec: TensorRecord, how: str) -> TensorRecord:
    """A record of shared outputs broken one way: its buffers in a dict where ``how`` changes them, else still the
    shared ranges, under a changed field."""
    if how == "dtype float64":  # (values of float32 in the shared array)
        return dataclasses.replace(rec, dtype="float64")
    if how == "nnz one less":
        return dataclasses.replace(rec, nnz=rec.nnz - 1)
    if how == "shape past uint32":  # (indices of uint32 in the shared array)
        return dataclasses.replace(rec, shape=(1 << 33,))
    r = broken(dataclasses.replace(rec, buffers=dict(rec.buffers)), how)
    if not how.startswith(("indices", "values", "one value", "buffers", "a buffer")):
        r.buffers = rec.buffers  # (a field changed, the buffers still the shared ranges)
    return r


def shared(recs: list[TensorRecord], split_values: bool = False) -> list[TensorRecord]:
    """The records with their buffers as ranges of shared arrays, as a selection on a device hands them over:
    one indices array, the values in one array (or float32 and float64 ones, ``split_values``)."""
    idx = np.concatenate([r.buffers["indices"] for r in recs]) if recs else np.zeros(0, np.uint32)
    vals = [r.buffers["values"] for r in recs]
    off = np.concatenate([[0], np.cumsum([r.nnz for r in recs])]).tolist()
    if split_values:
        which = [int(v.dtype == np.float64) for v in vals]
        v32 = np.zeros(off[-1], np.float32)
        v64 = np.zeros(off[-1], np.float64)
        for v, w, a in zip(vals, which, off):
            (v64 if w else v32)[a : a + v.size] = v
        values = Segmented((v32, v64), off, which)
    else:
        values = Segmented((np.concatenate(vals),), off)
    roles = {"indices": Segmented((idx,), off), "values": values}
    return [dataclasses.replace(r, buffers=SegmentBuffers(roles, t)) for t, r in enumerate(recs)]


@pytest.mark.parametrize("values", ["float32", "float64", "both"])
def test_a_table_of_shared_outputs_is_written_as_record_by_record(values):
    rng = random.Random(11)
    recs = [r for r in coo_table(rng, 40) if r.numel <= 1 << 32]  # (one indices array of uint32)
    want = {"float32": ["float32", "float16", "bfloat16"], "float64": ["float64"]}.get(values)
    for r in recs:
        r.dtype = rng.choice(want) if want else r.dtype
        r.buffers["values"] = r.buffers["values"].astype(np.float64 if r.dtype == "float64" else np.float32)
    assert values != "both" or len({r.dtype == "float64" for r in recs}) == 2
    plain = pack(recs, pipeline=[], layouts=wire_layouts())
    segs = shared(recs, split_values=values != "float32")
    laid = v2._plain_many(segs)
    assert (laid is None) == (values == "both")  # (values in two arrays: record by record)
    if values == "float32":
        assert [type(x) for x in laid[0]] == [v2._Interleaved]
    elif values == "float64":  # (8-byte values beside 4-byte indices: a range of each array a buffer)
        assert {type(x) for x in laid[0]} == {SegmentPart} and len(laid[0]) == 2 * len(segs)
    assert write_both(segs) == ("ok", plain)
    reordered = segs[1:] + segs[:1]  # (not records 0..n-1 of the outputs)
    assert v2._plain_many(reordered) is None
    assert write_both(reordered)[0] == "ok"


def test_interleaved_parts_hold_each_records_indices_then_values():
    idx = np.arange(10, 16, dtype=np.uint32)
    vals = np.arange(6, dtype=np.float32) + 0.5
    part = v2._Interleaved(idx, vals, np.array([1, 1, 3, 6], np.int64))  # (entries 1..5; an empty record)
    want = b"".join(
        [idx[1:3].tobytes(), vals[1:3].tobytes(), idx[3:6].tobytes(), vals[3:6].tobytes()]
    )  # record 0 keeps nothing
    assert part.nbytes == len(want) and part.host() == want
    assert part.host(lambda a: np.array(a, copy=True)) == want


def test_a_payload_read_from_bytes_is_written_again_at_once_with_its_bytes(monkeypatch):
    """Plain coo records read from bytes (ranges of the payload's data, as v2._read_known gives them, in a list or
    as columns) are written by the table-wide path too, as one interleaved part that cuts each role's ranges: the
    bytes read, as plan's loop writes them; a range that is not its record's nnz long is left to the loop."""
    monkeypatch.setattr(v2, "_KNOWN", ())
    blob = _coo_table(random.Random(5), 40)
    unpack(blob, wire_layouts())  # (the first read: the table is known after it)
    for columns in (False, True):
        _, recs = unpack(blob, wire_layouts(), columns=columns)
        laid = v2._plain_many(recs)
        assert [type(x) for x in laid[0]] == [v2._Interleaved] and laid[0][0].ranges is not None
        assert laid[1] == laid[0][0].nbytes == len(laid[0][0].host())
        assert write_both(list(recs)) == ("ok", blob)
        assert pack(recs, pipeline=[], layouts=wire_layouts(), version=2) == blob
    _, recs = unpack(blob, wire_layouts())
    i = next(i for i, r in enumerate(recs) if r.nnz)
    short = recs[:i] + [dataclasses.replace(recs[i], nnz=recs[i].nnz - 1)] + recs[i + 1 :]
    assert v2._plain_many(short) is None
    assert write_both(short)[0] != "ok"
    u = {f"l{i}": np.random.default_rng(i).standard_normal(300 + i).astype(np.float32) for i in range(60)}
    again = gpu_codec.compress(u, fraction=0.05).to_bytes()
    for _ in range(2):  # (the second read gives ranges)
        assert gpu_codec.Payload.from_bytes(again).to_bytes() == again


def _table_refrozen(blob: bytes, level: int) -> bytes:
    """``blob`` with its tensor table's zstd frame made again at ``level`` (as another writer might), its checksum
    fixed: the same payload in other bytes."""
    raw, frame = v2.table_frame(blob)
    table = gpu_codec.format.bounded_decompress(frame, raw, "table")
    r, tlen, _ = v2._table_lengths(memoryview(blob), v2.FLAG_TABLE_ZSTD, len(blob))
    z = v2.zstd_frame(table, level)
    rest = blob[r.pos + tlen : len(blob) - v2._CRC.size]
    body = blob[: v2._PREFIX.size] + v2.uvarint(len(z)) + v2.uvarint(raw) + z + rest
    return body + v2._CRC.pack(zlib.crc32(body) & 0xFFFFFFFF)


def test_a_payload_read_from_bytes_keeps_its_table_frame_when_written_again(monkeypatch):
    """A payload read from bytes and written again with the same table takes the table's zstd frame it was read
    with (no compression at the table's high level): its own bytes, even where another writer made that frame at
    another level; a table changed since (new metadata) gets a frame of its own, and a fresh write of the same
    records the writer's frame."""
    u = {f"l{i}": np.random.default_rng(i).standard_normal(200 + i).astype(np.float32) for i in range(40)}
    blob = gpu_codec.compress(u, fraction=0.05).to_bytes()
    assert v2.table_frame(blob) is not None
    made = []
    real = v2._compress_table
    monkeypatch.setattr(v2, "_compress_table", lambda t: made.append(1) or real(t))
    p = gpu_codec.Payload.from_bytes(blob)
    assert p.to_bytes() == blob and made == []
    other = _table_refrozen(blob, 1)
    assert other != blob
    same = gpu_codec.decompress(other), gpu_codec.decompress(blob)
    assert all(np.array_equal(same[0][k], same[1][k]) for k in u)
    q = gpu_codec.Payload.from_bytes(other)
    assert q.to_bytes() == other and made == []
    fresh = gpu_codec.Payload(q.tensors, q.pipeline, q.metadata)
    assert fresh.to_bytes() == blob and made == [1]  # (the writer's own frame)
    q.metadata = {"round": 3}
    again = q.to_bytes()
    assert made == [1, 1] and gpu_codec.Payload.from_bytes(again).metadata == {"round": 3}
    assert gpu_codec.format.table_frame(gpu_codec.compress(u, fraction=0.05).to_bytes(version=1)) is None


def test_interleaved_ranges_hold_each_records_indices_then_values():
    idx = np.arange(10, 20, dtype=np.uint32)
    vals = np.arange(10, dtype=np.float32) + 0.5
    ranges = ([6, 1, 4], [8, 1, 5], [0, 3, 9], [2, 3, 10])  # (index starts, stops; value starts, stops)
    part = v2._Interleaved(idx, vals, None, ranges)
    want = b"".join([idx[6:8].tobytes(), vals[0:2].tobytes(), idx[4:5].tobytes(), vals[9:10].tobytes()])
    assert part.nbytes == len(want) and part.host() == want


# ------------------------------------------------------------------------------------------ coded writer

PIPES = {
    "f16+rice": lambda: [Quantize("float16"), RiceIndices(), Zstd()],
    "bf16": lambda: [Quantize("bfloat16"), Zstd(2)],
    "f32+rice": lambda: [Quantize("float32"), RiceIndices(), Zstd()],
    "int8+rice": lambda: [Int8Blockwise(16), RiceIndices(), Zstd()],
    "ternary+rice": lambda: [Ternary(), RiceIndices(), Zstd()],
}


def coded(rng: random.Random, pipe: str, dense: bool = False):
    """A payload of a bytes stage's records over ``pipe``: tensors of uneven sizes and dtypes, some keeping
    nothing."""
    gen = np.random.default_rng(rng.randrange(1 << 30))
    dtype = rng.choice([np.float32, np.float16, np.float64])
    sizes = [rng.choice([0, 1, 3, 9, 64, 700, 5000]) for _ in range(rng.choice([1, 3, 20, 60]))]
    u = {f"l{i}.w": gen.standard_normal(n).astype(dtype) for i, n in enumerate(sizes)}
    if rng.random() < 0.3:  # exact zeros: a tensor may keep nothing
        u["frozen"] = np.zeros(50, dtype)
    fraction = None if dense else rng.choice([0.001, 0.01, 0.3, 1.0])
    scope = rng.choice(["global", "per_tensor"])
    stages = [s for s in PIPES[pipe]() if not (dense and isinstance(s, RiceIndices))]
    return gpu_codec.compress(u, fraction=fraction, scope=scope, pipeline=stages)


def plan_both(recs: list[TensorRecord], p, mode: int | None = None, version: int | None = 2):
    """``v2.plan`` and write with ``v2._coded_many`` and without it (every record through plan's loop): the same
    bytes, or the same error."""

    def go():
        return pack(recs, pipeline=p.pipeline, metadata=p.metadata, layouts=wire_layouts(), version=version)

    if mode is not None:
        go = lambda: v2.write(v2.plan(recs, p.pipeline, p.metadata, wire_layouts(), data_mode=mode))  # noqa: E731
    fast = outcome(go)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(v2, "_coded_many", lambda tensors, tables: None)
        general = outcome(go)
    assert fast == general
    return fast


@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize("dense", [False, True])
def test_a_bytes_stage_table_is_checked_at_once_with_the_same_bytes(pipe, dense):
    rng = random.Random(f"{pipe}{dense}")
    for _ in range(4):
        p = coded(rng, pipe, dense)
        assert v2._coded_many(p.tensors, v2.tables_of(wire_layouts())) is not None  # (the fast path is taken)
        for mode in (None, v2.DATA_RECORDS, v2.DATA_ZSTD, v2.DATA_PLAIN):
            got = plan_both(p.tensors, p, mode)
            assert got[0] == "ok"
        assert gpu_codec.Payload.from_bytes(p.to_bytes()).to_bytes() == p.to_bytes()


def broken_coded(rec: TensorRecord, how: str) -> TensorRecord:
    wrapped = rec.encoding == "zstd"
    c = dict(rec.codec)
    ic = dict(rec.codec["ic"]) if wrapped else c
    b = dict(rec.buffers)
    r = dataclasses.replace(rec, codec=c, buffers=b)
    if wrapped:
        c["ic"] = ic
    key, _, value = how.partition("=")
    if not wrapped and key in ("raw", "zbytes", "inner", "no zbytes", "ic not a dict", "compressed", "chunk"):
        key = "codec extra"  # (fields of a zstd record: on a record of its own, a key it cannot hold)
    if not wrapped and key == "stored dtype":
        r.buffer_dtypes = {**rec.buffer_dtypes, next(iter(b)): value}
        return r
    if key == "buffer":  # (a record with its buffers: one changed)
        role, _, expr = value.partition(":")
        role = next(iter(b)) if role == "first" else list(b)[-1]
        b[role] = eval(expr, {"np": np, "a": b[role]})
        return r
    if key == "buffers reversed":
        r.buffers = dict(reversed(list(b.items())))
        return r
    if key in ("raw", "zbytes", "inner"):
        c[key] = eval(value, {"np": np, "c": c})
    elif key == "no zbytes":
        del c["zbytes"]
    elif key == "codec extra":
        c["x"] = 1
    elif key == "ic extra":
        ic["x"] = 1
    elif key == "ic not a dict":
        c["ic"] = list(ic.items())
    elif key in ("k", "bits", "v", "i", "block", "mu"):
        if key in ic or key in ("v", "i"):
            ic[key] = eval(value, {"np": np, "ic": ic})
    elif key == "ic missing":
        ic.pop(value, None)
    elif key == "compressed":
        b["compressed"] = eval(value, {"np": np, "a": b["compressed"]})
    elif key == "buffer more":
        b["x"] = np.zeros(1, np.uint8)
    elif key == "stored dtype":
        r.buffer_dtypes = {"compressed": value}
    elif key == "chunk":
        r.chunk = 1 << 16
    elif key == "shape":
        r.shape = eval(value, {"np": np, "s": rec.shape})
    elif key == "nnz":
        r.nnz = eval(value, {"np": np, "n": rec.nnz})
    elif key == "dtype":
        r.dtype = value
    elif key == "encoding":
        r.encoding = value
    else:
        raise AssertionError(how)
    return r


CODED_HOW = [
    "raw=c['raw'] + 1",
    "raw=c['raw'] - 1",
    "raw=float(c['raw'])",
    "raw=np.int64(c['raw'])",
    "raw=True",
    "raw=1 << 70",
    "zbytes=c['zbytes'] + 1",
    "zbytes=0",
    "zbytes=1 << 40",
    "zbytes=1 << 70",
    "zbytes=None",
    "no zbytes",
    "inner='coo'",
    "inner='dense_q'",
    "inner='sparse'",
    "inner=['sparse']",
    "codec extra",
    "ic extra",
    "ic not a dict",
    "ic missing=bits",
    "ic missing=k",
    "ic missing=v",
    "k=ic['k'] + 1",
    "k=np.int64(ic['k'])",
    "k=bool(ic['k'])",
    "bits=ic['bits'] + 8",
    "bits=ic['bits'] - 1",
    "bits=0",
    "bits=1 << 70",
    "bits=True",
    "v='bf16'",
    "v='f32'",
    "v='nope'",
    "v=None",
    "i='raw'",
    "i='rice'",
    "block=ic['block'] + 1",
    "block=0",
    "block=float(ic['block'])",
    "mu=-1.0",
    "mu=float('nan')",
    "mu=np.float32(ic['mu'])",
    "mu=0.1",
    "compressed=a.view(np.int8)",
    "compressed=a[:-1]",
    "compressed=a.tolist()",
    "compressed=np.append(a, a[:1])",
    "buffer more",
    "stored dtype=uint8",
    "stored dtype=int8",
    "chunk",
    "shape=list(s)",
    "shape=tuple(np.int64(d) for d in s)",
    "shape=(-1, *s)",
    "shape=(1 << 41,)",
    "shape=s + (1,) * 9",
    "nnz=n + 1",
    "nnz=-1",
    "nnz=True if n == 1 else n",
    "nnz=np.int64(n)",
    "dtype=int8",
    "encoding=nvcomp",
]


UNWRAPPED_HOW = [
    "buffer=first:a[:-1]",
    "buffer=last:a[:-1]",
    "buffer=first:np.append(a, a[:1])",
    "buffer=last:a.astype(np.float64)",
    "buffer=first:a.view(np.int8)",
    "buffer=last:a.view(np.uint8)",
    "buffer=first:a.astype(np.uint64)",
    "buffer=last:a.tolist()",
    "buffers reversed",
    "stored dtype=uint32",
    "stored dtype=float16",
]


@pytest.mark.parametrize("pipe", sorted(PIPES) + ["f16+rice alone", "int8 alone", "bf16 alone"])
def test_both_writers_agree_on_broken_bytes_stage_records(pipe):
    rng = random.Random(pipe)
    if pipe.endswith("alone"):  # (coded records with their buffers: no bytes stage)
        stages = {"f16+rice alone": "f16+rice", "int8 alone": "int8+rice", "bf16 alone": "bf16"}[pipe]
        PIPES[pipe] = lambda: [s for s in PIPES[stages]() if not isinstance(s, Zstd)]
    try:
        p = coded(rng, pipe)
        while len(p.tensors) < 3 or not all(r.nnz for r in p.tensors[:2]):
            p = coded(rng, pipe)
    finally:
        if pipe.endswith("alone"):
            del PIPES[pipe]
    assert v2._coded_many(p.tensors, v2.tables_of(wire_layouts())) is not None  # (the fast path is taken)
    while len(p.tensors) < 3 or not all(r.nnz for r in p.tensors[:2]):
        p = coded(rng, pipe)
    recs = p.tensors
    assert plan_both(recs, p)[0] == "ok"
    results = set()
    for how in CODED_HOW + (UNWRAPPED_HOW if pipe.endswith("alone") else []):
        for i in (0, len(recs) - 1):
            mixed = list(recs)
            mixed[i] = broken_coded(recs[i], how)
            for version, mode in ((2, None), (None, None), (2, v2.DATA_ZSTD)):
                got = plan_both(mixed, p, mode, version)
                results.add(got[0])
    assert {"ok", "InvalidInputError", "Unrepresentable"} <= results, results


@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_a_bytes_stage_joins_each_records_buffers_as_record_by_record(pipe):
    """wire.host_raws (the layouts of every record by the rule's many) against wire.host_raw record by record:
    the same bytes, and the same refusal of a buffer shorter than its layout."""
    from gpu_codec.codecs import wire
    from gpu_codec.codecs.wire import host_raw, host_raws

    rng = random.Random(pipe)
    stages = [s for s in PIPES[pipe]() if not isinstance(s, Zstd)]
    lay = wire_layouts()
    for dense in (False, True):
        dense = dense and pipe in ("f16+rice", "bf16")
        gen = np.random.default_rng(rng.randrange(99))
        u = {f"t{i}": gen.standard_normal(n).astype(np.float32) for i, n in enumerate([1, 90, 4000, 0])}
        kept = [s for s in stages if not (dense and isinstance(s, RiceIndices))]
        p = gpu_codec.compress(u, fraction=None if dense else 0.05, pipeline=kept)
        recs, host = p.tensors, [dict(r.buffers) for r in p.tensors]
        want = [host_raw(r, h, lay) for r, h in zip(recs, host)]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(wire, "host_raw", None)  # (the layouts of all at once: no record by record)
            assert host_raws(recs, host, lay) == want
        role = next(iter(host[1]))
        host[1][role] = host[1][role][:-1]
        with pytest.raises(AssertionError, match="layout says"):
            host_raw(recs[1], host[1], lay)
        with pytest.raises(AssertionError, match="layout says"):
            host_raws(recs, host, lay)


UNWRAPPED = {
    "f16+rice alone": lambda: [Quantize("float16"), RiceIndices()],
    "int8 alone": lambda: [Int8Blockwise(8)],
    "ternary+rice alone": lambda: [Ternary(), RiceIndices()],
}


def coded_blobs(rng: random.Random) -> list[bytes]:
    """Payloads of coded tables: each bytes-stage pipeline in each data mode, and value and index stages alone."""
    out = []
    for pipe in sorted(PIPES):
        p = coded(rng, pipe, dense=rng.random() < 0.2)
        for mode in (v2.DATA_RECORDS, v2.DATA_ZSTD, v2.DATA_PLAIN):
            out.append(v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=mode)))
    for pipe in sorted(UNWRAPPED):
        PIPES[pipe] = UNWRAPPED[pipe]
        try:
            out.append(coded(rng, pipe).to_bytes())
        finally:
            del PIPES[pipe]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_coded_tables_are_read_at_once_with_the_same_records(seed, monkeypatch):
    rng = random.Random(seed)
    fast = []
    real = v2._coded_rows
    monkeypatch.setattr(v2, "_coded_rows", lambda rows, *a: fast.append(len(rows)) or real(rows, *a))
    for blob in coded_blobs(rng):
        fast.clear()
        got = read_both(blob)
        assert got[0] == "ok"
        tensors = len(got[1][1])
        # (ternary's mu is a float in each entry: its tables are read entry by entry)
        assert sum(fast) == tensors or got[1][1][0][5].get("ic", got[1][1][0][5]).get("v") == "ternary", fast
    seen = set()
    for blob in coded_blobs(rng):
        for _ in range(30):
            got = read_both(fuzz.mutate_table(blob, rng, rng.randrange(1, 3)))
            seen.add(got[0])
    assert {"ok", "PayloadHeaderError", "PayloadLayoutError"} <= seen, seen


@pytest.mark.parametrize("excess", [8 * 10**6, 1 << 62, 1 << 63, (1 << 64) - 1])
def test_a_coded_table_refused_at_its_end_is_read_entry_by_entry_once(excess, monkeypatch):
    """A table whose entries all parse but whose checks over the whole table fail (a Rice bit count past what its
    nnz and numel allow, past the field's bound, past 64 bits) is read again entry by entry, and the rest of the
    table too (not by the fast reader again after each entry: that would read it n^2 / 2 times)."""
    rng = random.Random(9)
    p = coded(rng, "f16+rice")
    while len(p.tensors) < 10 or not all(r.nnz for r in p.tensors):
        p = coded(rng, "f16+rice")
    lay = v2.tables_of(wire_layouts())
    forms, fields, zbytes, _ = v2._coded_many(p.tensors, lay)
    fields[-1] = v2.uvarint(min(p.tensors[-1].codec["ic"]["bits"] + excess, (1 << 64) - 1))
    table = v2._table(p.tensors, p.pipeline, p.metadata, forms, fields, zbytes, v2.DATA_RECORDS, None, lay)
    blob = fuzz._with_crc(v2._PREFIX.pack(v2.MAGIC, 2, 0) + v2.uvarint(len(table)) + table + bytes(sum(zbytes)))
    calls = []
    real = v2._read_coded
    monkeypatch.setattr(v2, "_read_coded", lambda *a: calls.append(a[1]) or real(*a))
    got = read_both(blob)
    assert got[0] == "PayloadHeaderError" and "bit" in got[1], got
    assert calls == [len(p.tensors)]  # (once, then every entry by _read_tensor)
    calls.clear()
    good = v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, lay, data_mode=v2.DATA_RECORDS))
    _, recs = unpack(good, wire_layouts())
    assert calls == [len(p.tensors)] and [r.codec for r in recs] == [r.codec for r in p.tensors]


# ------------------------------------------------------------------------------------------ names


def reference_entries(names: tuple) -> list[bytes]:
    """docs/FORMAT.md's name coding as the writer applies it: each name against no earlier name, the previous one
    (distance 1), and the last earlier one whose digits-collapsed form is the same, the shortest entry winning,
    the earlier tried of two that tie (tried in the order of the set {1, distance})."""
    out, encoded, last = [], [], {}
    for i, name in enumerate(names):
        if not isinstance(name, str) or not 0 < len(name) <= v2.MAX_NAME or name in names[:i]:
            raise Unrepresentable(f"tensor name {name!r}")
        try:
            nb = name.encode("utf-8")
        except UnicodeEncodeError:
            raise Unrepresentable(f"tensor name {name!r} is not encodable as UTF-8") from None
        best = v2.uvarint(0) + v2.uvarint(len(nb)) + nb
        skeleton = re.sub(rb"[0-9]+", b"#", nb)
        j = last.get(skeleton)
        for d in {1, i - j} if j is not None else ({1} if i else set()):
            ref = encoded[i - d]
            p = 0
            while p < min(len(nb), len(ref)) and nb[p] == ref[p]:
                p += 1
            s = 0
            while s < min(len(nb), len(ref)) and nb[-1 - s] == ref[-1 - s]:
                s += 1
            q = min(s, len(ref) - p, len(nb) - p)
            e = v2.uvarint(d) + v2.uvarint(p) + v2.uvarint(q) + v2.uvarint(len(nb) - p - q) + nb[p : len(nb) - q]
            if len(e) < len(best):
                best = e
        last[skeleton] = i
        encoded.append(nb)
        out.append(best)
    return out


def entries_both(names: tuple):
    want = outcome(lambda: reference_entries(names))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(v2, "_VECTOR_NAMES", 1)
        vector = outcome(lambda: list(v2._entries_of(names)))
        m.setattr(v2, "_NAME_CELLS", 0)
        scalar = outcome(lambda: list(v2._entries_of(names)))
    assert vector == want and scalar == want
    return want


@pytest.mark.parametrize("seed", range(3))
def test_names_coded_by_numpy_and_name_by_name_as_the_rule_says(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", ".", "0", "1", "9", "12", "é", "weight", "layer", "\x00", "x" * 130]
    for trial in range(150):
        letters = alphabet + (["#"] if trial % 3 == 0 else []) + (["\n"] if trial % 5 == 0 else [])
        got: dict[str, None] = {}
        for _ in range(rng.randrange(0, 80)):
            k = rng.randrange(1, 6)
            got["".join(rng.choice(letters) for _ in range(k)) + str(rng.randrange(300))] = None
        t = list(got)
        if rng.random() < 0.5:
            t.sort()
        assert entries_both(tuple(t))[0] == "ok"
    far = tuple(f"blk{i % 7}.{'y' * (i % 3)}.{i}" for i in range(400))  # references 7 back, and past 127
    assert entries_both(far + tuple(f"z{i}" for i in range(200)))[0] == "ok"


@pytest.mark.parametrize(
    "bad",
    [("a", 3), ("a", ""), ("a", "a"), ("a", "\ud800"), ("a", "x" * 1025), ("a", ["b"]), (b"a",)],
)
def test_names_refused_as_before(bad):
    want = entries_both(bad)
    assert want[0] == "Unrepresentable"
    assert outcome(lambda: v2._name_entries(bad)) == want  # through the memo too (an unhashable name included)


def test_names_remembered_for_the_same_names():
    t = tuple(f"layer{i}.weight" for i in range(200))
    first = v2._name_entries(t)
    assert v2._name_entries(tuple(f"layer{i}.weight" for i in range(200))) is first  # equal, not the same
    assert list(first) == reference_entries(t)


def _coo_table(rng: random.Random, n: int) -> bytes:
    sizes = [rng.choice([1, 3, 100, 200, 20000, 3_000_000]) for _ in range(n)]
    recs = []
    for i, numel in enumerate(sizes):
        nnz = min(numel, rng.choice([0, 1, 127, 128, 300, 16383, 16384, 20000]))
        recs.append(
            TensorRecord(
                f"b{i // 4}.w{i}",
                "float32",
                (numel,),
                "coo",
                nnz,
                {"indices": np.arange(nnz, dtype=np.uint32), "values": np.ones(nnz, np.float32)},
            )
        )
    return pack(recs, pipeline=[], layouts=wire_layouts(), version=2)


@pytest.mark.parametrize("seed", range(6))
def test_a_known_table_compared_at_once_gives_what_entry_by_entry_gives(seed, monkeypatch):
    """v2._match_widths (the known table's entries compared at once, each nnz as wide as a guess) against
    v2._match_entries on the same bytes: where it matches, the same position and nnz; and v2._match (the guess,
    then entry by entry) always the same as entry by entry. The tables: nnz of one to three bytes, over its tensor,
    not canonical (a redundant zero group), a head changed, cut short; guesses right and wrong."""
    monkeypatch.setattr(v2, "_KNOWN", ())
    rng = random.Random(seed)
    n = rng.choice([16, 40, 150])
    read_both(_coo_table(rng, n))
    (k,) = v2._KNOWN
    right = 0
    for trial in range(60):
        nnz = [min(m, rng.choice([0, 1, 5, 127, 128, 129, 16383, 16384, 70000])) for m in k.numels]
        varints = [v2.uvarint(x) for x in nnz]
        flaw = trial % 6
        j = rng.randrange(n)
        if flaw == 1:
            varints[j] = v2.uvarint(k.numels[j] + 1)  # over its tensor
        elif flaw == 2:
            varints[j] = bytes(b | 0x80 for b in varints[j]) + b"\x00"  # a redundant zero group
        heads = list(k.heads)
        if flaw == 3:
            heads[j] = heads[j][:-1] + bytes([heads[j][-1] ^ 1])
        table = b"\x07" + b"".join(h + v for h, v in zip(heads, varints)) + b"\x00\x01"
        if flaw == 4:
            table = table[: rng.randrange(len(table) - 2)]
        widths = v2._varint_widths(nnz)
        if trial % 2:  # a wrong guess of one width
            widths = widths.copy()
            widths[j] = 1 + widths[j] % 3
        want = v2._match_entries(k, table, 1)
        got = v2._match_widths(k, table, 1, widths)
        assert got is None or got == want
        right += got is not None
        assert v2._match(k, table, 1) == want
        if flaw in (1, 2, 3, 4):
            assert want is None or flaw == 4
        else:
            assert want == (len(table) - 2, nnz)
    assert right >= 10  # (the guess is taken where it is right)


def test_a_known_table_of_plain_4_byte_coo_records_reads_as_shared_ranges(monkeypatch):
    """The second read of a table (v2._read_known) gives its records' buffers as ranges of the data at once
    (v2._SharedCoo, no layout list): the same records, buffers and bytes as the first read, and, with shared
    ranges turned off, as per-record views."""
    monkeypatch.setattr(v2, "_KNOWN", ())
    rng = random.Random(3)
    blob = _coo_table(rng, 40)
    first = read(blob)
    calls = []
    real = v2._shared_coo
    monkeypatch.setattr(v2, "_shared_coo", lambda *a: calls.append(1) or real(*a))
    _, recs = unpack(blob, wire_layouts())
    assert calls == [1] and {type(r.buffers).__name__ for r in recs} == {"SegmentBuffers"}
    assert read(blob) == first
    assert pack(recs, pipeline=[], layouts=wire_layouts(), version=2) == blob
    monkeypatch.setattr(v2, "SHARED_VIEWS_MIN", 1 << 62)
    alone = read(blob)
    assert calls == [1, 1] and alone[0] == first[0]  # (not read as known ranges)
    # (per-record views name their buffers' dtypes; ranges leave it to each array's own dtype, the same names)
    assert [r[:7] + r[8:] for r in alone[1]] == [r[:7] + r[8:] for r in first[1]]
    assert all(r[7] == {"indices": "uint32", "values": "float32"} and not f[7] for r, f in zip(alone[1], first[1]))


# ------------------------------------------------------------------------------------------ table rows at once


@pytest.mark.parametrize("seed", range(40))
def test_table_rows_coded_at_once_are_the_rows_coded_one_by_one(seed, monkeypatch):
    """The tensor table's rows of records of one form (``v2._rows_many``: every row's numbers coded by one
    vectorized varint pass) are the bytes the row-by-row loop writes, or the same error where a record is broken."""
    rng = random.Random(seed)
    enc = rng.choice(["coo", "dense", None])
    recs = [record(rng, nm, enc) for nm in names(rng, rng.choice([2, 5, 150]))]
    if seed % 4 == 3:  # one record broken one way: a dimension or an nnz the table has no varint for
        i = rng.randrange(len(recs))
        broken = rng.choice([(-1,), (2.0,), (1 << 70,), "nnz"])
        change = {"nnz": -1} if broken == "nnz" else {"shape": broken}
        recs[i] = dataclasses.replace(recs[i], **change)
    taken = []
    real = v2._rows_many
    monkeypatch.setattr(v2, "_rows_many", lambda *a: taken.append(real(*a) is not None) or real(*a))

    def write():
        return pack(recs, pipeline=[{"id": "topk", "fraction": 0.01}], layouts=wire_layouts(), version=2)

    fast = outcome(write)
    monkeypatch.setattr(v2, "_rows_many", lambda *a: None)
    assert fast == outcome(write)
    if enc is not None and seed % 4 != 3:
        assert taken and all(taken)  # (one form, nothing broken: the rows at once)
