"""Wire format v3: nvcomp tensors as one zstd frame per chunk. Payloads are written on the CPU by
gpu_codec.testing.nvcomp (zstandard, frame by frame), decoded by gpu_codec.decompress and compared with the same
update through the zstd stage; every way the frames can lie is rejected with our errors, under an allocation
cap; the encoder's host-side steps (chunk plan, content sizes, splitting the one gathered buffer) run on real
zstd frames. nvCOMP itself runs only on a GPU machine."""

from __future__ import annotations

import itertools
import pathlib
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import zstandard

import gpu_codec
from gpu_codec import Zstd
from gpu_codec import errors as E
from gpu_codec.codecs import wire_layouts
from gpu_codec.codecs.nvcomp import EMPTY_FRAME, Nvcomp, assemble, declare_content_size, plan_chunks
from gpu_codec.format import unpack
from gpu_codec.format.common import decompress_frames, frame_count, frames_bound, split_frames
from gpu_codec.testing.nvcomp import chunk_frames, nvcomp_payload
from tests import common
from tests.common import use_backend

from .test_format import GOLDEN, REGEN

C = 1 << 16  # the smallest chunk the format allows


@pytest.fixture(autouse=True)
def cpu_backend():
    with use_backend("cpu"):
        yield


def update(seed: int = 0) -> dict[str, np.ndarray]:
    """float32 tensors of 0 bytes, 4, exactly one chunk, a chunk and 4 bytes, and 7 chunks and 12 bytes."""
    rng = np.random.default_rng(seed)
    sizes = {"empty": 0, "one": 1, "full": C // 4, "over": C // 4 + 1, "many": 7 * C // 4 + 3}
    return {k: np.repeat(rng.standard_normal(n // 16 + 1), 16)[:n].astype(np.float32) for k, n in sizes.items()}


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


CASES = {
    "dense": dict(fraction=None, pipeline=[Zstd(1)]),
    "dense_int8": dict(fraction=None, pipeline=[gpu_codec.Int8Blockwise(64), Zstd(1)]),
    "dense_int8_scales_over_frames": dict(fraction=None, pipeline=[gpu_codec.Int8Blockwise(1), Zstd(1)]),
    "sparse_f16_rice": dict(fraction=0.5, pipeline=[gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), Zstd(1)]),
    "coo": dict(fraction=0.9, scope="per_tensor", pipeline=[Zstd(1)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_payloads_decode_like_the_zstd_stage(case):
    u = update()
    base = {k: v + 1 for k, v in u.items()}
    blob = nvcomp_payload(u, base, chunk=C, **CASES[case])
    ref = gpu_codec.compress(u, base, **CASES[case]).to_bytes()
    assert same(gpu_codec.decompress(blob), gpu_codec.decompress(ref))
    assert same(gpu_codec.decompress(blob, base=base), gpu_codec.decompress(ref, base=base))
    header, records = unpack(blob, wire_layouts())
    assert blob[8] == 3 and {t["name"]: t["chunk"] for t in header["tensors"]} == dict.fromkeys(u, C)
    counts = {r.name: frame_count(r.codec["raw"], C) for r in records}
    assert counts["many"] > 1
    if case == "dense":
        assert counts == {"empty": 1, "one": 1, "full": 1, "over": 2, "many": 8}


def test_one_frame_per_tensor_stays_version_2():
    u = {k: v for k, v in update().items() if k in ("one", "full")}
    blob = nvcomp_payload(u, chunk=C, fraction=None, pipeline=[Zstd()])
    assert blob[8] == 2 and gpu_codec.Payload.from_bytes(blob).tensors[0].chunk is None
    assert same(gpu_codec.decompress(blob), u)
    assert nvcomp_payload(u, chunk=C, fraction=None, pipeline=[Zstd()], version=3)[8] == 3


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_on_request_get_one_frame_per_tensor(version):
    u = update()
    p = gpu_codec.Payload.from_bytes(nvcomp_payload(u, chunk=C, fraction=None, pipeline=[Zstd()]))
    blob = p.to_bytes(version=version)
    assert blob[8] == version
    assert all(r.chunk is None and r.encoding == "nvcomp" for r in gpu_codec.Payload.from_bytes(blob).tensors)
    assert same(gpu_codec.decompress(blob), u)
    assert p.to_bytes()[8] == 3 and len(p.to_bytes()) == p.nbytes


def test_the_largest_chunk():
    """16 MiB + 4 bytes of raw bytes in the chunk nvCOMP's zstd allows at most: two frames."""
    u = {"w": np.zeros((1 << 22) + 1, np.float32)}
    u["w"][-1] = 3.0
    blob = nvcomp_payload(u, chunk=Nvcomp.chunk, fraction=None, pipeline=[Zstd(1)])
    assert blob[8] == 3 and Nvcomp.chunk == 1 << 24
    out = gpu_codec.decompress(blob)["w"]
    assert out[-1] == 3.0 and not out[:-1].any()


# ------------------------------------------------------------------------------------------ the encoder's host side


def test_plan_chunks_edges():
    assert plan_chunks([], C) == ([], [])
    assert plan_chunks([0], C) == ([], [0])
    assert plan_chunks([C], C) == ([(0, C)], [1])
    assert plan_chunks([C + 1, 0, 1], C) == ([(0, C), (C, 1), (C + 1, 1)], [2, 0, 1])
    spans, counts = plan_chunks([3 * C, 5], C)
    assert spans == [(0, C), (C, C), (2 * C, C), (3 * C, 5)] and counts == [3, 1]


@pytest.mark.parametrize("content_size", [True, False])
def test_assemble_splits_the_gathered_chunks(content_size):
    """What the device call hands back (every chunk's frame, back to back in one buffer, with or without content
    sizes) becomes each tensor's buffer, which the reader decodes."""
    rng = np.random.default_rng(1)
    sizes = [0, 1, C, C + 1, 3 * C - 7]
    flat = np.repeat(rng.integers(0, 255, sum(sizes) // 8 + 1, np.uint8), 8)[: sum(sizes)].tobytes()
    spans, counts = plan_chunks(sizes, C)
    zc = zstandard.ZstdCompressor(write_content_size=content_size)
    comp = [zc.compress(flat[a : a + n]) for a, n in spans]
    out = assemble(b"".join(comp), [len(z) for z in comp], spans, counts)
    assert out[0] == EMPTY_FRAME
    a = 0
    for n, z in zip(sizes, out):
        assert len(z) <= frames_bound(n, C)
        assert bytes(decompress_frames(z, n, C, "t")) == flat[a : a + n]
        a += n
    with pytest.raises(AssertionError):
        assemble(b"".join(comp)[:-1], [len(z) for z in comp], spans, counts)


def test_declare_content_size():
    assert zstandard.get_frame_parameters(EMPTY_FRAME).content_size == 0
    assert zstandard.ZstdDecompressor().decompress(EMPTY_FRAME) == b""
    data = bytes(range(256)) * 300
    for kw in ({}, {"write_checksum": True}, {"write_dict_id": True}):
        f = zstandard.ZstdCompressor(write_content_size=False, **kw).compress(data)
        g = declare_content_size(f, len(data))
        assert zstandard.get_frame_parameters(g).content_size == len(data)
        assert zstandard.ZstdDecompressor().decompress(g) == data
        assert declare_content_size(g, len(data)) is g
    with pytest.raises(AssertionError):
        declare_content_size(g, len(data) - 1)


# ------------------------------------------------------------------------------------------ what the reader rejects


def frames_with(fn):
    def frames(raw: bytes, chunk: int) -> list[bytes]:
        return fn(chunk_frames(raw, chunk), raw, chunk)

    return frames


def _short_content(fs, raw, chunk):
    return fs[:-1] + [declare_content_size(zstandard.ZstdCompressor(write_content_size=False).compress(raw[-5:-1]), 4)]


SKIPPABLE = struct.pack("<II", 0x184D2A50, 0)

LIES = {
    "no content size": (
        lambda fs, raw, c: [zstandard.ZstdCompressor(write_content_size=False).compress(raw[:c])] + fs[1:],
        E.PayloadLayoutError,
    ),
    "trailing byte": (lambda fs, raw, c: [*fs, b"\0"], E.PayloadLayoutError),
    "an extra frame": (lambda fs, raw, c: [*fs, EMPTY_FRAME], E.PayloadLayoutError),
    "a frame missing": (lambda fs, raw, c: fs[:-1], E.PayloadLayoutError),
    "last frame first": (lambda fs, raw, c: [fs[-1], *fs[:-1]], E.PayloadLayoutError),
    "one frame for all": (lambda fs, raw, c: chunk_frames(raw, len(raw)), E.PayloadLimitError),
    "first frame short": (
        lambda fs, raw, c: chunk_frames(raw[: c - 4], c) + chunk_frames(raw[c - 4 :], c),
        E.PayloadLayoutError,
    ),
    "content shorter than declared": (_short_content, E.PayloadLayoutError),
    "a skippable frame": (lambda fs, raw, c: [SKIPPABLE, *fs], E.PayloadLayoutError),
    "junk": (lambda fs, raw, c: [b"\0" * 16] + fs[1:], E.PayloadLayoutError),
}


@pytest.mark.parametrize("lie", sorted(LIES))
@pytest.mark.parametrize("inner", ["dense", "coo"])
def test_lying_frames_are_rejected(lie, inner):
    fn, exc = LIES[lie]
    u = {"many": update()["many"]}
    kw = dict(fraction=None) if inner == "dense" else dict(fraction=0.99)
    blob = nvcomp_payload(u, chunk=C, frames=frames_with(fn), pipeline=[Zstd(1)], **kw)
    with allocation_cap(), pytest.raises(exc) as e:
        gpu_codec.decompress(blob)
    assert "'many'" in str(e.value)


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def one_tensor_v3() -> tuple[bytes, int]:
    """A v3 payload of one nvcomp tensor with its table stored plainly, and the offset of its chunk byte."""
    blob = nvcomp_payload({"w": update()["many"]}, chunk=C, fraction=None, pipeline=[Zstd(1)])
    assert blob[12] & 0x02 == 0  # flag Z: a table this small is stored plainly
    tlen = blob[13]  # one varint byte
    end = 14 + tlen
    zb = unpack(blob, wire_layouts())[1][0].codec["zbytes"]
    pos = end - len(gpu_codec.format.v2.uvarint(zb)) - 1
    assert blob[pos] == 16
    return blob, pos


@pytest.mark.parametrize("code", [0, 15, 25, 255])
def test_chunk_size_codes_out_of_range(code):
    blob, pos = one_tensor_v3()
    bad = reseal(blob[:pos] + bytes([code]) + blob[pos + 1 : -4])
    with pytest.raises(E.PayloadHeaderError, match="chunk size"):
        gpu_codec.decompress(bad)


def test_a_bigger_chunk_code_misreads_the_frames():
    blob, pos = one_tensor_v3()
    with pytest.raises(E.PayloadLayoutError, match="declares 65536"):  # frames of 2^17 bytes expected
        gpu_codec.decompress(reseal(blob[:pos] + bytes([17]) + blob[pos + 1 : -4]))


def test_zbytes_past_the_frames_bound():
    blob, pos = one_tensor_v3()
    rec = unpack(blob, wire_layouts())[1][0]
    zb, bound = rec.codec["zbytes"], frames_bound(rec.codec["raw"], C)
    old, new = gpu_codec.format.v2.uvarint(zb), gpu_codec.format.v2.uvarint(bound + 1)
    end = pos + 1 + len(old)
    table = blob[14:end]
    table = table[: len(table) - len(old)] + new
    body = blob[:13] + bytes([len(table)]) + table + blob[end:-4] + bytes(bound + 1 - zb)
    with pytest.raises(E.PayloadLayoutError, match="compressed size"):
        gpu_codec.decompress(reseal(body))
    good = blob[:13] + bytes([len(table) - len(new) + len(old)]) + table[: len(table) - len(new)] + old + blob[end:-4]
    assert reseal(good) == blob


def test_a_v2_payload_has_no_chunk_byte():
    """Version 2 reads the same table without the chunk byte: the byte is read as the compressed size."""
    blob, _ = one_tensor_v3()
    with pytest.raises(E.PayloadError):
        gpu_codec.decompress(reseal(blob[:8] + struct.pack("<I", 2) + blob[12:-4]))


def test_split_frames_reads_headers_only():
    raw = bytes(3 * C + 5)
    z = b"".join(chunk_frames(raw, C))
    spans = split_frames(z, len(raw), C, "t")
    assert len(spans) == 4 and spans[0][0] == 0 and spans[-1][1] == len(z)
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(spans))


def allocation_cap(limit: int = 8 << 20):
    return common.allocation_cap(limit)


def test_decoding_allocates_the_raw_size_and_one_chunk():
    """A frame bomb in every chunk is stopped by the declared sizes; a valid sparse tensor allocates its raw
    bytes plus one chunk, a dense one streams."""
    raw = bytes(32 * C)
    z = b"".join(chunk_frames(raw, C))
    tracemalloc.start()
    try:
        decompress_frames(z, len(raw), C, "t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(raw) + 3 * C
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    with allocation_cap(), pytest.raises(E.PayloadLimitError):
        decompress_frames(bomb, len(raw), C, "t")


def test_flipped_frame_bytes():
    """Random bytes of the frames flipped (checksum recomputed): decoded with finite values, or a PayloadError."""
    blob = nvcomp_payload(update(), chunk=C, fraction=None, pipeline=[Zstd(1)])
    header = gpu_codec.Payload.from_bytes(blob).header_nbytes
    rng = np.random.default_rng(5)
    with allocation_cap(32 << 20):
        for pos in rng.integers(header, len(blob) - 4, 150):
            bad = bytearray(blob[:-4])
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            try:
                out = gpu_codec.decompress(reseal(bytes(bad)), max_output_bytes=8 << 20)
            except E.PayloadError:
                continue
            assert all(np.isfinite(v).all() for v in out.values())


# ------------------------------------------------------------------------------------------ golden payload


def test_golden_v3_payload():
    """A checked-in v3 payload still decodes to the same update (its frames are zstandard's, whose bytes may
    change between versions, so today's bytes are not compared). Regenerate with GPU_CODEC_REGEN_GOLDEN=1."""
    u = update(7)
    base = {k: np.full_like(v, 0.5) for k, v in u.items()}
    path = GOLDEN / "nvcomp_chunked_v3.bin"
    blob = nvcomp_payload(u, base, chunk=C, fraction=None, pipeline=[gpu_codec.Quantize("float16"), Zstd(3)])
    if REGEN:
        path.write_bytes(blob)
    assert path.exists(), f"missing golden payload {path}; regenerate deliberately with GPU_CODEC_REGEN_GOLDEN=1"
    stored = path.read_bytes()
    assert stored[8] == 3
    assert same(gpu_codec.decompress(stored, base=base), gpu_codec.decompress(blob, base=base))
    assert same(
        gpu_codec.decompress(stored),
        gpu_codec.decompress(
            gpu_codec.compress(u, base, fraction=None, pipeline=[gpu_codec.Quantize("float16"), Zstd(3)]).to_bytes()
        ),
    )
    assert pathlib.Path(path).stat().st_size < 64 << 10


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda r: setattr(r, "name", "a"), "appears twice"),
        (lambda r: setattr(r, "name", ""), "non-empty strings"),
        (lambda r: setattr(r, "chunk", 1 << 17), "does not match its frames"),
        (lambda r: setattr(r, "chunk", None), "does not match its frames"),
        (lambda r: setattr(r, "dtype", "float64"), "no payload a reader takes"),
        (lambda r: setattr(r, "encoding", "zstd"), "no payload a reader takes"),
    ],
)
def test_records_changed_after_reading_are_refused_not_written(edit, says):
    # to_bytes wrote each of these (some silently as version 1) for the reader to refuse
    from gpu_codec.testing.nvcomp import nvcomp_payload

    rng = np.random.default_rng(0)
    update = {"a": rng.standard_normal(100).astype(np.float32), "many": rng.standard_normal(114_691).astype(np.float32)}
    blob = nvcomp_payload(update, chunk=1 << 16, fraction=None, pipeline=[gpu_codec.Zstd(1)])
    p = gpu_codec.Payload.from_bytes(blob)
    assert p.to_bytes() == blob
    edit(p.tensors[1])
    with pytest.raises(gpu_codec.errors.InvalidInputError, match=says):
        p.to_bytes()


def test_metadata_with_no_json_form_is_our_error():
    p = gpu_codec.compress({"w": np.ones(4, np.float32)}, fraction=0.5)
    p.metadata = {"x": float("nan")}
    with pytest.raises(gpu_codec.errors.InvalidInputError, match="no JSON form"):
        p.to_bytes()
