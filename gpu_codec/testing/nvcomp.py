"""Payloads of the ``nvcomp`` stage written on the CPU, for tests: the ``zstd`` stage's records rewritten as
nvCOMP writes them, each tensor's raw bytes cut into chunks and every chunk compressed as one zstd frame by the
zstandard library. The format fixes the decompressed bytes, not the compressor, so these are valid ``nvcomp``
payloads (wire format v3 where a tensor has several frames); ``frames`` swaps in other frames to build invalid
ones.

>>> import numpy as np, gpu_codec
>>> u = {"w": np.arange(20_000, dtype=np.float32), "b": np.ones(3, np.float32)}
>>> blob = nvcomp_payload(u, chunk=1 << 16, fraction=None, pipeline=[gpu_codec.Zstd()])
>>> blob[8], gpu_codec.Payload.from_bytes(blob).tensors[0].chunk
(3, 65536)
>>> bool((gpu_codec.decompress(blob)["w"] == u["w"]).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

import gpu_codec

from ..codecs import wire_layouts
from ..format import TensorRecord, bounded_decompress, pack
from ..format.v2 import frames_unchecked

Frames = Callable[[bytes, int], list[bytes]]


def chunk_frames(raw: bytes, chunk: int, level: int = 3) -> list[bytes]:
    """``raw`` cut into chunks of ``chunk`` bytes (the last one shorter), each compressed as one zstd frame that
    declares its content size; one empty frame for no bytes.

    >>> [len(zstandard.ZstdDecompressor().decompress(f)) for f in chunk_frames(bytes(10), 4)]
    [4, 4, 2]
    """
    c = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return [c.compress(raw[a : a + chunk]) for a in range(0, max(len(raw), 1), chunk)]


def nvcomp_records(records: list[TensorRecord], chunk: int, frames: Frames = chunk_frames) -> list[TensorRecord]:
    """``zstd`` records (one frame each) as the ``nvcomp`` stage writes them: ``frames(raw, chunk)`` back to back,
    with the record's ``chunk`` set."""
    out = []
    for r in records:
        comp = np.asarray(r.buffers["compressed"]).tobytes()
        z = b"".join(frames(bounded_decompress(comp, r.codec["raw"], r.name), chunk))
        codec = {"algo": "zstd", **r.codec, "zbytes": len(z)}
        bufs = {"compressed": np.frombuffer(z, np.uint8)}
        out.append(TensorRecord(r.name, r.dtype, r.shape, "nvcomp", r.nnz, bufs, codec, chunk=chunk))
    return out


def nvcomp_payload(
    update: dict[str, Any],
    base: dict[str, Any] | None = None,
    *,
    chunk: int,
    frames: Frames = chunk_frames,
    version: int | None = None,
    **kwargs: Any,
) -> bytes:
    """``gpu_codec.compress(update, base, **kwargs)`` (whose pipeline ends with a ``zstd`` stage) written as the
    ``nvcomp`` stage would write it, in frames of ``chunk`` raw bytes, as wire format ``version`` (by default
    the lowest that holds it)."""
    p = gpu_codec.compress(update, base, **kwargs)
    if not p.pipeline or p.pipeline[-1].get("id") != "zstd":
        raise ValueError("the pipeline must end with a zstd stage")
    pipeline = [*p.pipeline[:-1], {"id": "nvcomp", "algorithm": "zstd"}]
    records = nvcomp_records(p.tensors, chunk, frames)
    with frames_unchecked():  # (``frames`` may lie: that is what these payloads test)
        return pack(records, pipeline=pipeline, metadata=p.metadata, layouts=wire_layouts(), version=version)


def check_frames(buffers: list[bytes], raws: list[bytes], chunk: int) -> list[str]:
    """What is wrong with the ``nvcomp`` stage's per-tensor buffers, decoded on the CPU by the ``zstandard``
    library: each must be ``ceil(len(raw) / chunk)`` zstd frames (one, empty, for no bytes), each declaring its
    content size, the k-th holding raw bytes ``[k * chunk, (k + 1) * chunk)``. Empty when all is right.

    >>> check_frames([b"".join(chunk_frames(b"abcdef", 4))], [b"abcdef"], 4)
    []
    >>> check_frames([b"".join(chunk_frames(b"abcdef", 2))], [b"abcdef"], 4)[0]
    'tensor 0: frame 0 declares 2 bytes, expected 4'
    """
    out = []
    d = zstandard.ZstdDecompressor()
    for t, (buf, raw) in enumerate(zip(buffers, raws)):
        want = [raw[a : a + chunk] for a in range(0, len(raw), chunk)] or [b""]
        rest = memoryview(buf)
        for k, w in enumerate(want):
            if not len(rest):
                out.append(f"tensor {t}: {k} frames, expected {len(want)}")
                break
            params = zstandard.get_frame_parameters(rest)
            if params.content_size != len(w):
                out.append(f"tensor {t}: frame {k} declares {params.content_size} bytes, expected {len(w)}")
            obj = d.decompressobj()
            got = obj.decompress(rest)
            if got != w:
                out.append(f"tensor {t}: frame {k} holds {len(got)} bytes, expected {len(w)}")
                break
            rest = memoryview(obj.unused_data)
        else:
            if len(rest):
                out.append(f"tensor {t}: {len(rest)} bytes after the last frame")
    return out
