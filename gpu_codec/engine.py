"""The engine: exact top-k sparse compression of a model update, and its inverse.

>>> import numpy as np, gpu_codec
>>> base = {"w": np.zeros(8, np.float32)}
>>> new = {"w": np.array([0, 3, 0, -5, 0, 1, 0, 0], np.float32)}
>>> payload = gpu_codec.compress(new, base=base, fraction=0.25)     # keep ceil(0.25 * 8) = 2 entries
>>> payload.tensors[0].buffers["indices"].tolist(), payload.tensors[0].buffers["values"].tolist()
([1, 3], [3.0, -5.0])
>>> gpu_codec.decompress(payload.to_bytes(), base=base)["w"].tolist()
[0.0, 3.0, 0.0, -5.0, 0.0, 0.0, 0.0, 0.0]

The engine is three modules: :mod:`gpu_codec.encode` (:func:`compress`, :func:`encode_coo`),
:mod:`gpu_codec.decode` (:func:`decompress`) and :mod:`gpu_codec.payload` (:class:`Payload`); this module names
them together for the adapters and for callers of ``gpu_codec.engine``.
"""

from __future__ import annotations

from .arrays import array_kind
from .codecs import check_fraction
from .decode import (
    DECODE_CHUNK,
    DECODE_CHUNK_DEVICE,
    DEFAULT_MAX_OUTPUT_BYTES,
    DeviceChecks,
    check_output_cap,
    chunk_entries,
    decoded_records,
    decompress,
)
from .encode import SparseEntries, compress, encode_coo, kept_count
from .payload import Payload, check_json, check_metadata

__all__ = [
    "DECODE_CHUNK",
    "DECODE_CHUNK_DEVICE",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DeviceChecks",
    "Payload",
    "SparseEntries",
    "array_kind",
    "check_fraction",
    "check_json",
    "check_metadata",
    "check_output_cap",
    "chunk_entries",
    "compress",
    "decoded_records",
    "decompress",
    "encode_coo",
    "kept_count",
]
