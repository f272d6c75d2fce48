"""Lossless zstd over each tensor's encoded buffers (the ``zstd`` wire encoding).

Each tensor's buffers are concatenated in layout order (no padding) and compressed as one zstd frame that
records its content size. Decoding (:meth:`gpu_codec.codecs.Pipeline.decode_stream`) reads the frame a range at a
time through :class:`gpu_codec.format.common.FrameStream`, never whole, and is bounded: the frame must declare
exactly the raw size that the tensor's inner encoding implies from nnz and numel (a frame that declares more is
rejected before any allocation), must be one frame with no trailing bytes, and must decompress to exactly that
size.

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

from collections.abc import Mapping
from typing import Any

import numpy as np
import zstandard

from ..format import LayoutRule, TensorRecord
from ..format.schema import Field
from ..format.v2 import SHARED_FRAME_MAX
from .base import BytesCodec, check_int
from .wire import gather, host_raws


def encode_wrapped(
    codec: BytesCodec,
    records: list[TensorRecord],
    backend: Any,
    layouts: Mapping[str, LayoutRule],
    host: list[Mapping[str, np.ndarray]] | None = None,
) -> list[TensorRecord]:
    """Wrap each record's buffers into one ``compressed`` buffer with ``codec`` (a bytes stage's encode); from
    ``host``, the host copies of each record's buffers by role, where the caller read them (``codec.on_host``)."""
    kept = [None] * len(records)
    if host is None:
        flat, sizes = gather(records, backend, layouts)
        parts = codec.compress_parts(flat, sizes, backend)
    else:
        raws = host_raws(records, host, layouts)
        sizes = [len(r) for r in raws]
        parts = codec.compress_host(raws)
        if sum(sizes) <= SHARED_FRAME_MAX:  # (the writer joins them into one shared frame: kept, not decompressed)
            kept = raws
    out = []
    for rec, n, z, raw in zip(records, sizes, parts, kept):
        fields = {**codec.extra_fields(), "inner": rec.encoding, "raw": n, "zbytes": len(z)}
        if rec.codec:
            fields["ic"] = rec.codec
        comp = np.frombuffer(z, np.uint8)
        out.append(
            TensorRecord(
                rec.name,
                rec.dtype,
                rec.shape,
                codec.encoding,
                rec.nnz,
                {"compressed": comp},
                fields,
                chunk=codec.chunk,
                raw=None if raw is None else (comp, raw),
            )
        )
    return out


class Zstd(BytesCodec):
    """zstd (CPU, the zstandard package) at ``level`` 1..22 over each tensor's buffers."""

    codec_id = "zstd"
    encoding = "zstd"
    wire_code = 6
    wire_fields = (Field("level", "u8", lo=1, hi=22),)

    def __init__(self, level: int = 3):
        self.level = check_int("zstd", "level", level, 1, 22)

    on_host = True

    def compress_host(self, raws):
        c = zstandard.ZstdCompressor(level=self.level, write_checksum=False, write_content_size=True)
        return [c.compress(r) for r in raws]
