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

from ..errors import BackendUnavailableError, PayloadHeaderError
from ..format import TensorRecord
from .base import BytesCodec, check_choice
from .wire import where

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


class Nvcomp(BytesCodec):
    """nvCOMP ``algorithm`` (``"zstd"``: standard zstd frames) on the GPU over each tensor's buffers."""

    codec_id = "nvcomp"
    encoding = "nvcomp"
    fields = ("algo",)

    def __init__(self, algorithm: str = "zstd"):
        self.algorithm = check_choice("nvcomp", "algorithm", algorithm, ("zstd",))

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
