"""nvCOMP on the GPU as a lossless stage (the ``nvcomp`` wire encoding): optional extra ``nvcomp12`` or
``nvcomp13`` (``pip install 'gpu_codec[nvcomp12]'``).

Each tensor's buffers are cut into chunks of :attr:`Nvcomp.chunk` bytes (16 MiB, the most nvCOMP's zstd takes
in one chunk in every release, set explicitly as nvCOMP's chunk size), every chunk starting at a multiple of
:data:`ALIGN` bytes (nvCOMP's zstd reads its inputs from 4-byte-aligned addresses; tensors whose buffers do not
start so are staged, on the device, into a layout where each tensor starts on a multiple), and every chunk of
every tensor is compressed in one batched nvCOMP call on the caller's stream, with nvCOMP's zstd in RAW
bitstream mode, which writes a standard zstd frame per chunk; so any machine decodes
them, on the CPU with zstandard (bounded as the ``zstd`` stage). The compressed chunks are gathered on the device
and come to the host in one copy. A tensor of more than one chunk needs wire format v3, which
:meth:`~gpu_codec.Payload.to_bytes` then writes; smaller ones keep version 2. Encoding needs the GPU backend and
nvCOMP; elsewhere it raises :class:`~gpu_codec.errors.BackendUnavailableError` naming the extra to install (the
``zstd`` stage does the same job on the CPU). The bytes are nvCOMP's, so they differ from the ``zstd`` stage's.

>>> Nvcomp().get_config()
{'id': 'nvcomp', 'algorithm': 'zstd'}
>>> plan_chunks([5, 0, 9], chunk=4)
([(0, 4), (4, 1), (5, 4), (9, 4), (13, 1)], [2, 0, 3])
>>> plan_chunks([5, 0, 9], chunk=8, align=8)                 # the second tensor's bytes start at 8, not 5
([(0, 5), (8, 8), (16, 1)], [1, 0, 2])
"""

from __future__ import annotations

from typing import Any

import zstandard

from ..errors import BackendUnavailableError, PayloadHeaderError
from ..format import TensorRecord
from ..format.common import MAX_CHUNK_LOG2
from ..format.schema import Field
from .base import BytesCodec, check_choice
from .wire import where

EXTRA_HINT = (
    "the 'nvcomp' stage needs the GPU backend and nvCOMP: pip install 'gpu_codec[nvcomp12]' (CUDA 12) or "
    "'gpu_codec[nvcomp13]' (CUDA 13); the 'zstd' stage compresses on the CPU instead"
)

ALIGN = 8  # chunk starts: nvCOMP's zstd compresses from 4-byte-aligned inputs (and decompresses from 8)

# The frame of an empty tensor (nvCOMP is given no empty chunk): magic, a single-segment descriptor with a
# one-byte content size of 0, and one empty raw block, the last.
EMPTY_FRAME = bytes.fromhex("28b52ffd2000010000")


def _nvcomp_module() -> Any:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except Exception as e:
        raise BackendUnavailableError(f"{EXTRA_HINT} ({type(e).__name__}: {e})") from None
    return nvcomp


def tensor_starts(sizes: list[int], align: int = 1) -> list[int]:
    """Where each tensor's bytes start when tensors of ``sizes`` bytes lie one after the other, each starting at
    a multiple of ``align``; one more entry, the end.

    >>> tensor_starts([5, 0, 9], 8), tensor_starts([5, 0, 9])
    ([0, 8, 8, 17], [0, 5, 5, 14])
    """
    out, a = [], 0
    for n in sizes:
        out.append(a)
        a = -(-(a + n) // align) * align if n else a
    return out + [out[-1] + sizes[-1] if sizes else 0]


def plan_chunks(sizes: list[int], chunk: int, align: int = 1) -> tuple[list[tuple[int, int]], list[int]]:
    """The chunks to compress when tensors of ``sizes`` bytes lie one after the other, each starting at a multiple
    of ``align`` (:func:`tensor_starts`): (offset, length) of each chunk of each tensor, in order, every one
    ``chunk`` bytes but a tensor's last, and each tensor's chunk count (0 for an empty tensor, whose frame is
    :data:`EMPTY_FRAME`). ``chunk`` is a multiple of ``align``, so every chunk starts at a multiple of it.

    >>> plan_chunks([8, 9], chunk=8)
    ([(0, 8), (8, 8), (16, 1)], [1, 2])
    """
    if chunk <= 0 or chunk % align:
        raise ValueError(f"chunk {chunk} must be a positive multiple of the alignment {align}")
    spans, counts = [], []
    for a, n in zip(tensor_starts(sizes, align), sizes):
        starts = range(a, a + n, chunk)
        spans += [(s, min(chunk, a + n - s)) for s in starts]
        counts.append(len(starts))
    return spans, counts


def stage_aligned(xp: Any, flat: Any, sizes: list[int], align: int) -> Any:
    """``flat`` (tensors of ``sizes`` bytes back to back, uint8) laid out as :func:`tensor_starts` places them:
    ``flat`` itself where every tensor already starts on a multiple of ``align``, else a copy in ``xp``'s memory
    (the gaps zero, never compressed).

    >>> import numpy as np
    >>> stage_aligned(np, np.arange(7, dtype=np.uint8), [3, 4], 4).tolist()
    [0, 1, 2, 0, 3, 4, 5, 6]
    """
    starts = tensor_starts(sizes, align)
    if starts == tensor_starts(sizes):
        return flat
    out = xp.zeros(starts[-1], dtype=xp.uint8)
    a = 0
    for s, n in zip(starts, sizes):
        out[s : s + n] = flat[a : a + n]
        a += n
    return out


def declare_content_size(frame: bytes, n: int) -> bytes:
    """A zstd frame of ``n`` bytes of content that declares its content size (wire format v3 requires it): the
    frame itself if it does, else the same frame with a 4-byte Frame_Content_Size field added to its header
    (RFC 8878 section 3.1.1.1; nothing else changes, the blocks included).

    >>> f = zstandard.ZstdCompressor(write_content_size=False).compress(b"abc" * 100)
    >>> g = declare_content_size(f, 300)
    >>> zstandard.get_frame_parameters(g).content_size, zstandard.ZstdDecompressor().decompress(g) == b"abc" * 100
    (300, True)
    """
    cs = zstandard.get_frame_parameters(frame).content_size
    if cs == n:
        return frame
    if cs != zstandard.CONTENTSIZE_UNKNOWN or n >= 1 << 32:
        raise AssertionError(f"a zstd frame of {n} bytes declares {cs}")
    # no content size: the descriptor's size flag is 0 and the frame is not single-segment, so a window
    # descriptor follows it, then the dictionary id (0 to 4 bytes); the size field goes after those
    fhd = frame[4]
    at = 6 + (0, 1, 2, 4)[fhd & 3]
    return frame[:4] + bytes([fhd | 0x80]) + frame[5:at] + n.to_bytes(4, "little") + frame[at:]


def assemble(blob: bytes, comp_sizes: list[int], spans: list[tuple[int, int]], counts: list[int]) -> list[bytes]:
    """Each tensor's compressed buffer from the compressed chunks, back to back in ``blob`` (``comp_sizes`` bytes
    each, in the order of ``spans`` from :func:`plan_chunks`): its frames, each declaring its content size, in
    order; :data:`EMPTY_FRAME` for an empty tensor."""
    if len(comp_sizes) != len(spans) or sum(comp_sizes) != len(blob) or sum(counts) != len(spans):
        raise AssertionError(f"{len(comp_sizes)} compressed chunks of {len(blob)} bytes for {len(spans)} chunks")
    frames, a = [], 0
    for (_, n), z in zip(spans, comp_sizes):
        frames.append(declare_content_size(blob[a : a + z], n))
        a += z
    out, i = [], 0
    for c in counts:
        out.append(b"".join(frames[i : i + c]) if c else EMPTY_FRAME)
        i += c
    return out


ALGORITHMS = ("zstd",)


class Nvcomp(BytesCodec):
    """nvCOMP ``algorithm`` (``"zstd"``: standard zstd frames, one per chunk of :attr:`chunk` bytes) on the GPU
    over each tensor's buffers."""

    codec_id = "nvcomp"
    encoding = "nvcomp"
    fields = ("algo",)
    wire_code = 7
    wire_fields = (Field("algorithm", "choice", choices=ALGORITHMS),)
    chunk = 1 << MAX_CHUNK_LOG2  # nvCOMP's zstd compresses at most 16 MiB per chunk

    def __init__(self, algorithm: str = "zstd"):
        self.algorithm = check_choice("nvcomp", "algorithm", algorithm, ALGORITHMS)

    def extra_fields(self) -> dict:
        return {"algo": self.algorithm}

    @classmethod
    def check_fields(cls, rec: TensorRecord) -> None:
        if rec.codec.get("algo") != "zstd":
            raise PayloadHeaderError(
                f"{where(rec)}: nvcomp algorithm {rec.codec.get('algo')!r} is not supported (this reader decodes "
                "'zstd')"
            )

    def compress_parts(self, flat, sizes, backend):
        if not getattr(backend, "on_device", False):
            raise BackendUnavailableError(f"{EXTRA_HINT} (backend in use: {backend.name!r})")
        return self._compress_on_device(_nvcomp_module(), flat, sizes, backend)

    def _compress_on_device(self, nv, flat, sizes, backend):  # pragma: no cover - needs a GPU with nvCOMP
        xp = backend.xp
        spans, counts = plan_chunks(sizes, self.chunk, ALIGN)
        blob, comp_sizes = b"", []
        if spans:
            flat = stage_aligned(xp, flat, sizes, ALIGN)  # every chunk on an aligned address
            stream = xp.cuda.get_current_stream()  # the caller's: GpuBackend.stream made it current
            codec = _codec(nv, xp.cuda.Device().id, stream.ptr, self.chunk)
            comp = codec.encode([nv.as_array(flat[a : a + n]) for a, n in spans])  # one batched call
            parts = [xp.asarray(c).view(xp.uint8).reshape(-1) for c in comp]
            comp_sizes = [int(p.size) for p in parts]
            blob = backend.to_host(xp.concatenate(parts)).tobytes()  # the one device-to-host copy
        return assemble(blob, comp_sizes, spans, counts)


def codec_options(device_id: int, stream_ptr: int, chunk: int) -> dict[str, Any]:
    """The keyword arguments of ``nvidia.nvcomp.Codec``: zstd, RAW frames (no nvCOMP header), the caller's
    device and stream, and the chunk size set explicitly to the codec's chunk (each input, at most one chunk
    long, is one frame).

    >>> codec_options(0, 7, 1 << 24)["uncomp_chunk_size"]
    16777216
    """
    return {
        "algorithm": "Zstd",
        "device_id": device_id,
        "cuda_stream": stream_ptr,
        "uncomp_chunk_size": chunk,
    }


def _codec(nv: Any, device_id: int, stream_ptr: int, chunk: int) -> Any:  # pragma: no cover - needs nvCOMP
    return nv.Codec(bitstream_kind=nv.BitstreamKind.RAW, **codec_options(device_id, stream_ptr, chunk))
