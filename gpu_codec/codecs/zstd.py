"""Lossless zstd over each tensor's encoded buffers (the ``zstd`` wire encoding).

Each tensor's buffers are concatenated in layout order (no padding) and compressed as one zstd frame that
records its content size. Decoding is bounded: the frame must declare exactly the raw size that the tensor's
inner encoding implies from nnz and numel (a frame that declares more is rejected before any allocation), must
be one frame with no trailing bytes, and must decompress to exactly that size.

On the GPU backend this stage copies the tensor's already-coded buffers (a few bytes per kept value) to the host
in one transfer and compresses them there; the dense tensors never leave the device. The bytes depend only on
the input and the zstandard library, not on the backend. For compression on the GPU itself, see ``nvcomp``.

>>> import numpy as np, gpu_codec
>>> u = {"w": np.linspace(-1, 1, 4000, dtype=np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.05, pipeline=[Zstd(level=3)])
>>> p.tensors[0].encoding, p.tensors[0].codec["inner"], p.tensors[0].codec["raw"]
('zstd', 'coo', 1600)
>>> bool(np.array_equal(gpu_codec.decompress(p.to_bytes())["w"], gpu_codec.decompress(
...     gpu_codec.compress(u, fraction=0.05).to_bytes())["w"]))
True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from ..backends.base import Backend
from ..errors import PayloadLayoutError, PayloadLimitError
from ..format import TensorRecord
from ._wire import inner_record, raw_layout, split_raw, where
from .base import Codec, check_int
from .registry import register_codec

MAX_WINDOW = 1 << 27


class BytesCodec(Codec):
    """A ``bytes`` stage: wraps each tensor's buffers into one compressed buffer."""

    stage = "bytes"
    encoding = ""

    @property
    def lossless(self) -> bool:
        return True

    def _compress(self, flat: Any, sizes: list[int], backend: Backend) -> list[bytes]:
        """Compress each record's slice of ``flat`` (uint8, in the backend's memory)."""
        raise NotImplementedError

    def _extra(self) -> dict:
        return {}

    def encode_records(self, records: list[TensorRecord], backend: Backend) -> list[TensorRecord]:
        flat, sizes = gather(records, backend)
        out = []
        for rec, n, z in zip(records, sizes, self._compress(flat, sizes, backend)):
            codec = {**self._extra(), "inner": rec.encoding, "raw": n, "zbytes": len(z)}
            if rec.codec:
                codec["ic"] = rec.codec
            out.append(
                TensorRecord(
                    rec.name,
                    rec.dtype,
                    rec.shape,
                    self.encoding,
                    rec.nnz,
                    {"compressed": np.frombuffer(z, np.uint8)},
                    codec,
                )
            )
        return out

    @staticmethod
    def decode_record(rec: TensorRecord) -> TensorRecord:
        """The inner record (NumPy buffers) of a ``zstd`` or ``nvcomp`` record; the frame is standard zstd."""
        inner = inner_record(rec)
        raw = bounded_decompress(bytes(np.asarray(rec.buffers["compressed"])), int(rec.codec["raw"]), where(rec))
        inner.buffers = split_raw(inner, raw)
        return inner


def gather(records: list[TensorRecord], backend: Backend) -> tuple[Any, list[int]]:
    """Every record's buffers concatenated in layout order into one uint8 array in the backend's memory, and
    each record's byte count."""
    parts, sizes = [], []
    for rec in records:
        n = 0
        for role, _, count in raw_layout(rec):
            a = backend.asarray(rec.buffers[role])
            if int(a.size) != count:
                raise AssertionError(f"{where(rec)}: buffer {role!r} has {int(a.size)} entries, layout says {count}")
            parts.append(a.reshape(-1).view(np.uint8))
            n += int(a.nbytes)
        sizes.append(n)
    flat = backend.xp.concatenate(parts) if parts else backend.xp.zeros(0, np.uint8)
    return flat, sizes


def split_host(flat: Any, sizes: list[int], backend: Backend) -> list[bytes]:
    blob = np.asarray(backend.to_host(flat)).tobytes()  # the one device-to-host copy of this stage
    out, a = [], 0
    for n in sizes:
        out.append(blob[a : a + n])
        a += n
    return out


def bounded_decompress(data: bytes, raw: int, what: str) -> bytes:
    """Decompress one zstd frame of exactly ``raw`` bytes, never allocating more than that."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise PayloadLayoutError(f"{what}: compressed buffer is not a zstd frame ({e})") from None
    cs = params.content_size
    if cs != zstandard.CONTENTSIZE_UNKNOWN and cs != raw:
        exc = PayloadLimitError if cs > raw else PayloadLayoutError
        raise exc(f"{what}: zstd frame declares {cs} bytes, the tensor's encoding implies {raw}")
    if params.window_size > MAX_WINDOW:
        raise PayloadLimitError(f"{what}: zstd window of {params.window_size} bytes exceeds {MAX_WINDOW}")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompress(
            data, max_output_size=max(raw, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise PayloadLayoutError(f"{what}: zstd frame does not decompress to {raw} bytes ({e})") from None
    if len(out) != raw:
        raise PayloadLayoutError(f"{what}: zstd frame decompressed to {len(out)} bytes, expected {raw}")
    return out


@register_codec
class Zstd(BytesCodec):
    """zstd (CPU, the zstandard package) at ``level`` 1..22 over each tensor's buffers."""

    codec_id = "zstd"
    encoding = "zstd"

    def __init__(self, level: int = 3):
        self.level = check_int("zstd", "level", level, 1, 22)

    def _compress(self, flat, sizes, backend):
        c = zstandard.ZstdCompressor(level=self.level, write_checksum=False, write_content_size=True)
        return [c.compress(r) for r in split_host(flat, sizes, backend)]
