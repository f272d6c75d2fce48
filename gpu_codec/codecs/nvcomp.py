"""nvCOMP on the GPU as a lossless stage (the ``nvcomp`` wire encoding): optional extra ``nvcomp12`` or
``nvcomp13`` (``pip install 'gpu_codec[nvcomp12]'``).

Each tensor's buffers are compressed on the device with nvCOMP's zstd in RAW bitstream mode, which writes a
standard zstd frame; so any machine decodes it, on the CPU with zstandard (bounded exactly as the ``zstd``
stage). Only the compressed bytes come to the host. Encoding needs the GPU backend and nvCOMP; elsewhere it
raises :class:`~gpu_codec.errors.BackendUnavailableError` naming the extra to install (the ``zstd`` stage
does the same job on the CPU). The bytes are nvCOMP's, so they differ from the ``zstd`` stage's.
RAW mode compresses each tensor's buffers as a single chunk (nvCOMP limits a zstd chunk to 16 MiB).

>>> Nvcomp().get_config()
{'id': 'nvcomp', 'algorithm': 'zstd'}
"""

from __future__ import annotations

from typing import Any

import zstandard

from ..errors import BackendUnavailableError
from .base import check_choice
from .registry import register_codec
from .zstd import BytesCodec

EXTRA_HINT = (
    "the 'nvcomp' stage needs the GPU backend and nvCOMP: pip install 'gpu_codec[nvcomp12]' (CUDA 12) or "
    "'gpu_codec[nvcomp13]' (CUDA 13); the 'zstd' stage compresses on the CPU instead"
)


def _nvcomp_module() -> Any:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except Exception as e:
        raise BackendUnavailableError(f"{EXTRA_HINT} ({type(e).__name__}: {e})") from None
    return nvcomp


@register_codec
class Nvcomp(BytesCodec):
    """nvCOMP ``algorithm`` (``"zstd"``: standard zstd frames) on the GPU over each tensor's buffers."""

    codec_id = "nvcomp"
    encoding = "nvcomp"

    def __init__(self, algorithm: str = "zstd"):
        self.algorithm = check_choice("nvcomp", "algorithm", algorithm, ("zstd",))

    def _extra(self) -> dict:
        return {"algo": self.algorithm}

    def encode_records(self, records, backend):
        if not getattr(backend, "on_device", False):
            raise BackendUnavailableError(f"{EXTRA_HINT} (backend in use: {backend.name!r})")
        self._nv = _nvcomp_module()
        return super().encode_records(records, backend)

    def _compress(self, flat, sizes, backend):  # pragma: no cover - needs a GPU with nvCOMP
        nv, xp = self._nv, backend.xp
        codec = nv.Codec(algorithm="Zstd", bitstream_kind=nv.BitstreamKind.RAW)
        out, a = [], 0
        for n in sizes:
            if n == 0:
                out.append(zstandard.ZstdCompressor(write_checksum=False).compress(b""))
                continue
            comp = codec.encode(nv.as_array(flat[a : a + n]))
            out.append(xp.asnumpy(xp.asarray(comp)).tobytes())  # only the compressed bytes leave the device
            a += n
        return out
