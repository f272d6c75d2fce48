"""Hostile payloads for the codec encodings: every malformed Rice stream, zstd frame, int8 or ternary layout and
pipeline/record disagreement is rejected with a PayloadError subclass, and nothing is decoded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard
from gpu_codec.cpu_fallback import rice as rice_twin

import gpu_codec
from gpu_codec import (
    Int8Blockwise,
    PayloadError,
    PayloadHeaderError,
    PayloadIndexError,
    PayloadLayoutError,
    PayloadLimitError,
    Quantize,
    RiceIndices,
    Ternary,
    Zstd,
)
from gpu_codec.xp.rice import rice_decode

from .common import build_payload, split_payload, use_backend


@pytest.fixture(autouse=True)
def cpu_backend():
    with use_backend("cpu"):
        yield


def blob_of(stages, fraction=0.02, n=5000, seed=0):
    rng = np.random.default_rng(seed)
    u = {"w": rng.standard_normal(n).astype(np.float32), "b": rng.standard_normal((40, 30)).astype(np.float32)}
    return gpu_codec.compress(u, fraction=fraction, scope="per_tensor", pipeline=stages).to_bytes(version=1)


def surgery(blob: bytes, fn) -> bytes:
    """Apply ``fn(header, buffers)`` (buffers: per tensor, list of bytes) and re-lay the data consistently, so the
    container checks pass and the codec's own validation is what is tested."""
    h, data = split_payload(blob)
    bufs = [[bytes(data[b["offset"] : b["offset"] + b["nbytes"]]) for b in t["buffers"]] for t in h["tensors"]]
    fn(h, bufs)
    out, off = bytearray(), 0
    for t, bl in zip(h["tensors"], bufs):
        for b, raw in zip(t["buffers"], bl):
            pad = (-off) % 8
            out += b"\0" * pad
            off += pad
            b["offset"], b["nbytes"] = off, len(raw)
            out += raw
            off += len(raw)
    h["data_length"] = off
    return build_payload(h, bytes(out))


def rejects(blob, exc=PayloadError, match=None):
    with pytest.raises(exc, match=match):
        gpu_codec.decompress(blob)


def test_surgery_identity_still_decodes():
    blob = blob_of([Ternary(), RiceIndices(), Zstd()])
    assert surgery(blob, lambda h, b: None) == blob


# ------------------------------------------------------------------------------------------ Rice

RICE = [Quantize("float16"), RiceIndices()]


def _set_stream(h, bufs, t, stream, bits=None):
    bufs[t][0] = stream
    if bits is not None:
        h["tensors"][t]["codec"]["bits"] = bits


def test_rice_truncated_stream():
    blob = blob_of(RICE)
    rejects(surgery(blob, lambda h, b: _set_stream(h, b, 0, b[0][0][:-1])), PayloadLayoutError)

    # truncated consistently (bits too): the unary section no longer ends where it should
    def cut(h, b):
        bits = h["tensors"][0]["codec"]["bits"] - 8
        s = bytearray(b[0][0][: -(-bits // 8)])
        if bits % 8:
            s[-1] &= (1 << (bits % 8)) - 1
        _set_stream(h, b, 0, bytes(s), bits)

    rejects(surgery(blob, cut), PayloadError)


@pytest.mark.parametrize("delta", [1, -1, 7, 10_000_000])
def test_rice_wrong_bit_count(delta):
    blob = blob_of(RICE)

    def f(h, b):
        c = h["tensors"][0]["codec"]
        c["bits"] += delta
        b[0][0] = (b[0][0] + b"\0" * 8)[: -(-c["bits"] // 8)] if c["bits"] < 1 << 20 else b[0][0]

    rejects(surgery(blob, f), PayloadError)


@pytest.mark.parametrize(
    "field,value",
    [
        ("k", lambda k: k + 1),
        ("k", lambda k: k - 1),
        ("k", lambda k: -1),
        ("k", str),
        ("k", lambda k: True),
        ("bits", lambda b: -3),
        ("bits", lambda b: b + 0.5),
        ("bits", lambda b: None),
    ],
)
def test_rice_bad_fields(field, value):
    blob = blob_of(RICE)
    rejects(
        surgery(blob, lambda h, b: h["tensors"][0]["codec"].__setitem__(field, value(h["tensors"][0]["codec"][field]))),
        PayloadHeaderError,
    )


def test_rice_nonzero_padding_and_extra_codes():
    blob = blob_of(RICE)
    h, _ = split_payload(blob)
    bits = h["tensors"][0]["codec"]["bits"]
    assert bits % 8, "pick a case with padding bits"

    def pad(h, b):
        s = bytearray(b[0][0])
        s[-1] |= 0x80
        b[0][0] = bytes(s)

    rejects(surgery(blob, pad), PayloadLayoutError, "after its declared end")

    def extra_one(h, b):  # an extra terminator in the unary section: one code too many
        nnz, k = h["tensors"][0]["nnz"], h["tensors"][0]["codec"]["k"]
        s = np.unpackbits(np.frombuffer(b[0][0], np.uint8), bitorder="little")
        zeros = np.flatnonzero(s[nnz * k : bits] == 0)
        s[nnz * k + zeros[0]] = 1
        b[0][0] = np.packbits(s, bitorder="little").tobytes()

    rejects(surgery(blob, extra_one), PayloadLayoutError, "unary section")


def test_rice_index_beyond_numel():
    idx = np.array([5, 40, 700, 995], np.uint32)
    k = rice_twin.rice_param(4, 990)
    stream, bits = rice_twin.rice_encode(idx, k)
    with pytest.raises(PayloadIndexError, match="995"):
        rice_decode(stream, bits, k, 4, 990)
    blob = blob_of(RICE, n=1000, fraction=0.004)
    h, _ = split_payload(blob)
    assert h["tensors"][0]["nnz"] == 4 and h["tensors"][0]["codec"]["k"] == k

    def f(h, b):
        h["tensors"][0]["shape"] = [990]
        _set_stream(h, b, 0, stream.tobytes(), bits)

    rejects(surgery(blob, f), PayloadIndexError)


def test_rice_fuzz_never_crashes():
    blob = blob_of([Ternary(), RiceIndices()], n=3000)
    h, _ = split_payload(blob)
    n = len(surgery(blob, lambda h, b: None))
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(150):
        pos = int(rng.integers(0, h["tensors"][0]["buffers"][0]["nbytes"]))
        bit = int(rng.integers(0, 8))

        def flip(h, b, pos=pos, bit=bit):
            s = bytearray(b[0][0])
            s[pos] ^= 1 << bit
            b[0][0] = bytes(s)

        try:
            out = gpu_codec.decompress(surgery(blob, flip))
            outcomes.add("decoded")
            assert np.count_nonzero(out["w"]) <= h["tensors"][0]["nnz"]
        except PayloadError as e:
            outcomes.add(type(e).__name__)
    assert n and "PayloadLayoutError" in outcomes


# ------------------------------------------------------------------------------------------ zstd

ZSTD = [Quantize("float16"), RiceIndices(), Zstd()]


def _set_frame(h, b, frame, raw=None):
    b[0][0] = frame
    c = h["tensors"][0]["codec"]
    c["zbytes"] = len(frame)
    if raw is not None:
        c["raw"] = raw


def test_zstd_bomb_declaring_more_than_raw():
    blob = blob_of(ZSTD)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (4 << 20))
    assert len(bomb) < 200  # within the compressed-size bound of the tensor's 290 raw bytes
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, bomb)), PayloadLimitError, "declares 4194304 bytes")
    big = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, big)), PayloadError, "compressed size")


def test_zstd_bomb_without_content_size_is_bounded():
    blob = blob_of(ZSTD)
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(b"\0" * (4 << 20))
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, bomb)), PayloadLayoutError, "does not decompress")


def test_zstd_declared_raw_size_mismatch():
    blob = blob_of(ZSTD)
    h, _ = split_payload(blob)
    raw = h["tensors"][0]["codec"]["raw"]
    for bad in (raw + 1, raw - 1, 0, -5, "10", 1 << 50):
        rejects(
            surgery(blob, lambda h, b, bad=bad: h["tensors"][0]["codec"].__setitem__("raw", bad)),
            PayloadError,
            "raw size",
        )
    # a frame whose content is shorter than the declared (and implied) raw size
    short = zstandard.ZstdCompressor().compress(b"\1" * (raw - 3))
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, short)), PayloadLayoutError, f"{raw} expected")
    nocs = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * (raw - 3))
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, nocs)), PayloadLayoutError)


def test_zstd_garbage_trailing_and_oversized():
    blob = blob_of(ZSTD)
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, b"\x28\xb5\x2f\xfd" + b"\xff" * 40)), PayloadLayoutError)
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, b"not zstd at all")), PayloadLayoutError, "not a zstd")
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, b[0][0] + b"xx")), PayloadLayoutError)
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, b[0][0] * 2)), PayloadError)
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, b[0][0] + b"\0" * 100_000)), PayloadError, "compressed size")


def test_zstd_frame_that_fails_only_at_its_end():
    """A frame of the right content whose checksum is wrong, and one whose content is empty and whose block is
    corrupt: zstd says so only once the content is read, at the frame's end, which must still be our error (zstd's
    own escaped there)."""
    blob = blob_of(ZSTD)
    frames: list = []
    surgery(blob, lambda h, b: frames.append(b[0][0]))
    content = zstandard.ZstdDecompressor().decompress(frames[0])
    frame = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(content))
    frame[-1] ^= 1
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, bytes(frame))), PayloadLayoutError, "checksum")
    # a v2 frame is read a range at a time (FrameStream), its end checked once it is built: an empty tensor's frame
    # (content size 0) whose one block is corrupt failed only there, with zstd's own error
    from gpu_codec.format.common import open_stream

    with pytest.raises(PayloadLayoutError, match="checksum"):
        open_stream(bytes(frame), len(content), None, 0, "frame")
    with pytest.raises(PayloadLayoutError, match="corruption"):
        open_stream(bytes.fromhex("28b52ffd2000050000"), 0, None, 0, "frame")


@pytest.mark.parametrize("inner", ["zstd", "gzip", None, 3])
def test_zstd_bad_inner_encoding(inner):
    blob = blob_of(ZSTD)
    rejects(surgery(blob, lambda h, b: h["tensors"][0]["codec"].__setitem__("inner", inner)), PayloadHeaderError)


def test_zstd_frame_of_other_content_fails_validation_downstream():
    # a valid frame of the right size whose content is not a valid Rice stream
    blob = blob_of(ZSTD)
    h, _ = split_payload(blob)
    raw = h["tensors"][0]["codec"]["raw"]
    frame = zstandard.ZstdCompressor().compress(b"\xff" * raw)
    rejects(surgery(blob, lambda h, b: _set_frame(h, b, frame)), PayloadLayoutError)


# ------------------------------------------------------------------------------------------ values


def test_int8_mismatched_scales_length():
    blob = blob_of([Int8Blockwise(16)])
    rejects(surgery(blob, lambda h, b: b[0].__setitem__(2, b[0][2][:-4])), PayloadLayoutError, "scales")
    rejects(surgery(blob, lambda h, b: b[0].__setitem__(2, b[0][2] + b"\0" * 4)), PayloadLayoutError, "scales")
    rejects(surgery(blob, lambda h, b: h["tensors"][0]["codec"].__setitem__("block", 32)), PayloadLayoutError)


@pytest.mark.parametrize("block", [0, -1, "16", True, 1.5, 1 << 21, None])
def test_int8_bad_block(block):
    blob = blob_of([Int8Blockwise(16)])
    rejects(surgery(blob, lambda h, b: h["tensors"][0]["codec"].__setitem__("block", block)), PayloadHeaderError)


@pytest.mark.parametrize("mu", [-1.0, "1", None, True, 0.1, 1e300])
def test_ternary_bad_mu(mu):
    blob = blob_of([Ternary()])
    rejects(surgery(blob, lambda h, b: h["tensors"][0]["codec"].__setitem__("mu", mu)), PayloadHeaderError, "mu")


def test_ternary_signs_length_and_infinite_mu():
    blob = blob_of([Ternary()])
    rejects(surgery(blob, lambda h, b: b[0].__setitem__(1, b[0][1][:-1])), PayloadLayoutError, "signs")
    h, data = split_payload(blob)
    text = json.dumps(h).replace(f'"mu": {h["tensors"][0]["codec"]["mu"]}', '"mu": 1e999')
    rejects(build_payload(json.loads(text), data), PayloadHeaderError)


@pytest.mark.parametrize(
    "change",
    [
        {"v": "f8"},
        {"i": "elias"},
        {"extra": 1},
        {"v": None},
        {"i": "raw"},
        {"v": "int8", "block": 4},
    ],
)
def test_bad_forms_and_fields(change):
    blob = blob_of([Ternary(), RiceIndices()])
    rejects(surgery(blob, lambda h, b: h["tensors"][0]["codec"].update(change)), PayloadError)


def test_dense_q_must_be_dense():
    blob = gpu_codec.compress({"w": np.ones(64, np.float32)}, fraction=None, pipeline=[Quantize("float16")]).to_bytes(
        version=1
    )
    rejects(surgery(blob, lambda h, b: h["tensors"][0].__setitem__("nnz", 63)), PayloadError, "dense")


# ------------------------------------------------------------------------------------------ pipeline vs records


def test_pipeline_and_records_must_agree():
    blob = blob_of([Quantize("float16"), RiceIndices()])
    rejects(
        surgery(blob, lambda h, b: h["pipeline"].__setitem__(1, {"id": "quantize", "dtype": "bfloat16"})),
        PayloadLayoutError,
        "pipeline says",
    )
    rejects(
        surgery(blob, lambda h, b: h["pipeline"].__setitem__(1, {"id": "lzma"})),
        PayloadHeaderError,
        "cannot be rebuilt",
    )
    rejects(
        surgery(blob, lambda h, b: h["pipeline"].__setitem__(1, {"id": "quantize", "dtype": "x"})), PayloadHeaderError
    )
    rejects(
        surgery(blob, lambda h, b: h["pipeline"].append({"id": "zstd", "level": 3})), PayloadLayoutError, "ends with"
    )
    rejects(surgery(blob, lambda h, b: h.__setitem__("pipeline", "topk")), PayloadHeaderError)
    zblob = blob_of(ZSTD)
    rejects(surgery(zblob, lambda h, b: h["pipeline"].pop()), PayloadLayoutError, "no 'zstd' stage")
    iblob = blob_of([Int8Blockwise(16)])
    rejects(
        surgery(iblob, lambda h, b: h["pipeline"].__setitem__(1, {"id": "int8", "block_size": 8})),
        PayloadLayoutError,
        "block",
    )


def test_rice_with_no_index_carries_no_bytes():
    """A tensor with nnz = 0 has an empty Rice stream: a stream of any length there would be bytes nobody
    examines, so the reader rejects it."""
    u = {"w": np.arange(1000, dtype=np.float32), "z": np.zeros(500, np.float32)}
    blob = gpu_codec.compress(u, fraction=0.001, pipeline=RICE).to_bytes(version=1)
    h, _ = split_payload(blob)
    assert h["tensors"][1]["nnz"] == 0 and h["tensors"][1]["codec"]["bits"] == 0
    gpu_codec.decompress(surgery(blob, lambda h, b: None))
    for bits in (1, 8, 64, 500):
        rejects(
            surgery(blob, lambda h, b, bits=bits: _set_stream(h, b, 1, b"\xa5" * -(-bits // 8), bits)),
            PayloadHeaderError,
            "bit count",
        )


# ------------------------------------------------------------------------------------------ wire format v2


def surgery_v2(blob: bytes, fn) -> bytes:
    """Parse a v2 payload (mode ``records``), let ``fn(pipeline, records)`` change codec fields and buffers, and
    write the table and data back without validating them, so the codec's own checks are what is tested."""
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import unpack, v2

    from .test_format_v2 import join_v2, split_v2

    header, records = unpack(blob, wire_layouts())
    flags, _, _ = split_v2(blob)
    assert header["data"] == "records"
    for r in records:
        r.buffers = {k: np.array(v) for k, v in r.buffers.items()}
    pipeline = header["pipeline"]
    fn(pipeline, records)
    w = wire_layouts()
    forms, fields = zip(*(v2._record_form(r, w) for r in records))
    zb = [r.codec.get("zbytes") for r in records]
    table = v2._table(records, pipeline, header["metadata"], list(forms), list(fields), zb, v2.DATA_RECORDS, None, w)
    data = b"".join(np.ascontiguousarray(a).tobytes() for r in records for a in r.buffers.values())
    return join_v2(flags, table, data)


def v2_blob(stages, **kw):
    rng = np.random.default_rng(0)
    u = {"w": rng.standard_normal(5000).astype(np.float32), "b": rng.standard_normal((40, 30)).astype(np.float32)}
    blob = gpu_codec.compress(u, fraction=kw.pop("fraction", 0.02), scope="per_tensor", pipeline=stages).to_bytes()
    assert blob[8] == 2
    return blob


def test_v2_surgery_identity():
    for stages in (RICE, [Ternary(), RiceIndices()], [Int8Blockwise(16)]):
        blob = v2_blob(stages)
        assert surgery_v2(blob, lambda p, r: None) == blob


@pytest.mark.parametrize("delta", [1, -1, 7, -7, 10_000_000])
def test_v2_rice_wrong_bit_count(delta):
    def f(p, recs):
        c = recs[0].codec
        c["bits"] += delta
        s = recs[0].buffers["indices"]
        n = -(-c["bits"] // 8)
        recs[0].buffers["indices"] = np.resize(s, n) if n < 1 << 20 else s

    rejects(surgery_v2(v2_blob(RICE), f), PayloadError)


def test_v2_rice_padding_and_truncation():
    def pad(p, recs):
        recs[0].buffers["indices"][-1] |= 0x80

    rejects(surgery_v2(v2_blob(RICE), pad), PayloadLayoutError, "after its declared end")

    def cut(p, recs):
        recs[0].buffers["indices"] = recs[0].buffers["indices"][:-1]

    rejects(surgery_v2(v2_blob(RICE), cut), PayloadLayoutError)


def test_v2_int8_scales_and_block():
    blob = v2_blob([Int8Blockwise(16)])

    def short(p, recs):
        recs[0].buffers["scales"] = recs[0].buffers["scales"][:-1]

    rejects(surgery_v2(blob, short), PayloadLayoutError)

    def block(p, recs):
        for r in recs:
            r.codec["block"] = 32
            r.buffers["scales"] = r.buffers["scales"][: -(-r.nnz // 32)]

    rejects(surgery_v2(blob, block), PayloadLayoutError, "block")


def test_v2_ternary_signs_length():
    def f(p, recs):
        recs[0].buffers["signs"] = recs[0].buffers["signs"][:-1]

    rejects(surgery_v2(v2_blob([Ternary()]), f), PayloadLayoutError)


def test_v2_pipeline_and_records_must_agree():
    blob = v2_blob([Quantize("float16"), RiceIndices()])
    rejects(
        surgery_v2(blob, lambda p, r: p.__setitem__(1, {"id": "quantize", "dtype": "bfloat16"})),
        PayloadLayoutError,
        "pipeline says",
    )
    rejects(surgery_v2(blob, lambda p, r: p.__setitem__(1, {"id": "lzma"})), PayloadHeaderError, "cannot be rebuilt")
    rejects(surgery_v2(blob, lambda p, r: p.append({"id": "zstd", "level": 3})), PayloadLayoutError, "ends with")


def v2_zstd_records_blob():
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import v2

    rng = np.random.default_rng(0)
    u = {"w": rng.standard_normal(5000).astype(np.float32), "b": rng.standard_normal((40, 30)).astype(np.float32)}
    p = gpu_codec.compress(u, fraction=0.02, scope="per_tensor", pipeline=ZSTD)
    return v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=v2.DATA_RECORDS))


def _v2_frame(frame):
    def f(p, recs):
        recs[0].buffers["compressed"] = np.frombuffer(frame, np.uint8)
        recs[0].codec["zbytes"] = len(frame)

    return f


def test_v2_zstd_frame_bombs_and_garbage():
    blob = v2_zstd_records_blob()
    gpu_codec.decompress(surgery_v2(blob, lambda p, r: None))
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (4 << 20))
    rejects(surgery_v2(blob, _v2_frame(bomb)), PayloadLimitError, "declares 4194304 bytes")
    nocs = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(b"\0" * (4 << 20))
    rejects(surgery_v2(blob, _v2_frame(nocs)), PayloadLayoutError, "does not decompress")
    rejects(surgery_v2(blob, _v2_frame(b"not zstd at all")), PayloadLayoutError, "not a zstd")
    big = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    rejects(surgery_v2(blob, _v2_frame(big)), PayloadLayoutError, "compressed size")


# ------------------------------------------------------------------------------------------ empty wrapped tensors

EMPTY = zstandard.ZstdCompressor(write_content_size=True).compress(b"")  # 9 bytes: a frame declaring 0 bytes
# after a valid header declaring size 0: a cut frame, junk, a second frame, a frame with data
NOT_ONE_EMPTY_FRAME = {
    "cut_block": EMPTY[:-1],
    "cut_header": EMPTY[:6],
    "junk": EMPTY + b"junk",
    "second_frame": EMPTY + EMPTY,
    "zero_byte": EMPTY + b"\0",
    "skippable": EMPTY + bytes.fromhex("502a4d1800000000"),
}


def empty_tensor_blob(version: int, encoding: str = "zstd") -> bytes:
    """Two tensors under global top-k where ``empty`` keeps nothing: its wrapped buffer holds 0 raw bytes."""
    u = {"big": np.full(100, 1000.0, np.float32), "empty": np.full(50, 1e-3, np.float32)}
    p = gpu_codec.compress(u, fraction=0.1, pipeline=[Zstd()])
    assert p.tensors[1].nnz == 0 and p.tensors[1].codec["raw"] == 0
    if encoding == "nvcomp":  # the same frames under the nvcomp stage (both are standard zstd frames)
        p.pipeline[-1] = {"id": "nvcomp", "algorithm": "zstd"}
        for r in p.tensors:
            r.encoding, r.codec = "nvcomp", {"algo": "zstd", **r.codec}
    if version == 1:
        return p.to_bytes(version=1)
    from gpu_codec.codecs import wire_layouts
    from gpu_codec.format import v2

    return v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=v2.DATA_RECORDS))


def _empty_frame_v1(frame):
    def f(h, b):
        b[1][0] = frame
        h["tensors"][1]["codec"]["zbytes"] = len(frame)

    return f


def _empty_frame_v2(frame):
    def f(p, recs):
        recs[1].buffers["compressed"] = np.frombuffer(frame, np.uint8)
        recs[1].codec["zbytes"] = len(frame)

    return f


@pytest.mark.parametrize("encoding", ["zstd", "nvcomp"])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bad", sorted(NOT_ONE_EMPTY_FRAME))
def test_an_empty_wrapped_tensor_is_exactly_one_empty_frame(bad, version, encoding):
    blob = empty_tensor_blob(version, encoding)
    frame = NOT_ONE_EMPTY_FRAME[bad]
    if version == 1:
        same, broken = surgery(blob, _empty_frame_v1(EMPTY)), surgery(blob, _empty_frame_v1(frame))
    else:
        same, broken = surgery_v2(blob, _empty_frame_v2(EMPTY)), surgery_v2(blob, _empty_frame_v2(frame))
    out = gpu_codec.decompress(same)
    assert not out["empty"].any() and out["big"].sum() == 15_000
    rejects(broken, PayloadLayoutError, "tensor 'empty'")


def test_v1_dense_tensor_with_nnz_other_than_numel():
    blob = gpu_codec.compress({"w": np.arange(1, 7, dtype=np.float32)}, fraction=None).to_bytes(version=1)
    assert gpu_codec.Payload.from_bytes(blob).nnz == 6
    for nnz in (0, 5):
        bad = surgery(blob, lambda h, b, nnz=nnz: h["tensors"][0].__setitem__("nnz", nnz))
        with pytest.raises(PayloadLayoutError, match="nnz = numel = 6, got"):
            gpu_codec.Payload.from_bytes(bad)
        rejects(bad, PayloadLayoutError)
