"""The ``nvcomp`` stage's launch side, on the CPU: chunk starts aligned as nvCOMP's zstd needs them, the chunk
size set explicitly, and the frames it assembles decoded by the CPU ``zstandard`` library. A fake
``nvidia.nvcomp`` module checks every input address and compresses with zstandard (as RAW zstd frames without
a content size, which the stage then declares)."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
import zstandard

from gpu_codec.codecs import nvcomp as nvc
from gpu_codec.testing.nvcomp import check_frames

SIZES = [
    [5, 0, 9],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [4096 + 3, 17, 0, 0, 8191, 1],
    [64, 64, 1],
]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("chunk", [8, 64, 4096])
def test_every_chunk_starts_aligned_and_covers_its_tensor(sizes, chunk):
    spans, counts = nvc.plan_chunks(sizes, chunk, nvc.ALIGN)
    starts = nvc.tensor_starts(sizes, nvc.ALIGN)
    assert all(a % nvc.ALIGN == 0 for a, _ in spans)
    assert all(0 < n <= chunk for _, n in spans)
    i = 0
    for t, (s, n) in enumerate(zip(starts, sizes)):
        mine = spans[i : i + counts[t]]
        i += counts[t]
        assert sum(m for _, m in mine) == n and (not mine or mine[0][0] == s)
        assert all(b[0] == a[0] + a[1] for a, b in itertools.pairwise(mine))  # back to back in the tensor
    with pytest.raises(ValueError, match="multiple of the alignment"):
        nvc.plan_chunks(sizes, 12, 8)


class FakeNvcomp:
    """``nvidia.nvcomp`` as far as the stage uses it; ``encode`` refuses an input nvCOMP's zstd would refuse."""

    BitstreamKind = types.SimpleNamespace(RAW="RAW", NVCOMP_NATIVE="NATIVE")

    def __init__(self, align: int = 4, max_chunk: int = 1 << 24):
        self.align, self.max_chunk = align, max_chunk
        self.made: list[dict] = []

    def as_array(self, a):
        return a

    def Codec(self, **kw):
        self.made.append(kw)
        fake = self

        class Codec:
            def encode(self, arrays):
                out = []
                c = zstandard.ZstdCompressor(write_content_size=False)
                for a in arrays:
                    if a.ctypes.data % fake.align:
                        raise RuntimeError(f"nvcompErrorAlignment: input at {a.ctypes.data:#x}")
                    if a.size > min(fake.max_chunk, kw.get("uncomp_chunk_size", 65536)):
                        raise RuntimeError("nvcompErrorChunkSizeTooLarge")
                    out.append(np.frombuffer(c.compress(a.tobytes()), np.uint8))
                return out

        return Codec()


def _backend():
    cuda = types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=0xBEEF),
        Device=lambda: types.SimpleNamespace(id=3),
    )
    xp = types.SimpleNamespace(
        cuda=cuda, uint8=np.uint8, zeros=np.zeros, asarray=np.asarray, concatenate=np.concatenate
    )
    return types.SimpleNamespace(xp=xp, on_device=True, name="gpu", to_host=np.asarray)


@pytest.mark.parametrize("sizes", SIZES)
def test_device_encode_sends_aligned_chunks_and_its_frames_decode_on_the_cpu(sizes, monkeypatch):
    rng = np.random.default_rng(sum(sizes))
    raws = [rng.integers(0, 4, n, dtype=np.uint8).tobytes() for n in sizes]
    flat = np.frombuffer(b"".join(raws), np.uint8).copy()
    nv = FakeNvcomp()
    codec = nvc.Nvcomp()
    monkeypatch.setattr(codec, "chunk", 64)
    buffers = codec._compress_on_device(nv, flat, sizes, _backend())
    assert check_frames(buffers, raws, 64) == []
    if any(sizes):
        (kw,) = nv.made
        assert kw["bitstream_kind"] == "RAW" and kw["uncomp_chunk_size"] == 64
        assert kw["cuda_stream"] == 0xBEEF and kw["device_id"] == 3 and kw["algorithm"] == "Zstd"


def test_the_fake_refuses_what_nvcomp_refuses():
    """Not vacuous: unaligned chunks (the old plan) and a chunk size left at nvCOMP's default are refused."""
    sizes = [5, 9]
    flat = np.arange(14, dtype=np.uint8)
    nv = FakeNvcomp()
    spans, _ = nvc.plan_chunks(sizes, 8)  # no alignment: the second tensor starts at byte 5
    with pytest.raises(RuntimeError, match="nvcompErrorAlignment"):
        nv.Codec().encode([flat[a : a + n] for a, n in spans])
    with pytest.raises(RuntimeError, match="ChunkSizeTooLarge"):
        nv.Codec().encode([np.zeros(1 << 17, np.uint8)])


def test_check_frames_finds_extra_and_missing_frames():
    raw = bytes(range(10))
    c = zstandard.ZstdCompressor(write_content_size=True)
    one = [c.compress(raw[:4]), c.compress(raw[4:8]), c.compress(raw[8:])]
    assert check_frames([b"".join(one)], [raw], 4) == []
    assert "2 frames, expected 3" in check_frames([b"".join(one[:2])], [raw], 4)[0]
    assert "after the last frame" in check_frames([b"".join(one + one[:1])], [raw], 4)[0]
    assert check_frames([nvc.EMPTY_FRAME], [b""], 4) == []
