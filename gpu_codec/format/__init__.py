"""The wire format: a versioned, self-describing, checksummed container (see docs/FORMAT.md).

:func:`pack` writes version 2 (a compact binary tensor table, a few bytes per tensor) wherever its table can
describe the records, which holds for every built-in codec; version 3 (version 2 whose ``nvcomp`` tensors may be
several zstd frames, one per chunk of at most 16 MiB) only where an ``nvcomp`` tensor needs more than one frame;
otherwise, or when asked with ``version=1``, version 1 (a JSON header). :func:`unpack` reads all three. All start
with the magic ``GPUCODEC`` and a u32 LE version, and end with a zlib CRC-32 of every byte before it. The reader
treats every payload as hostile: it caps the header, whitelists dtypes and encodings, bounds shapes and element
counts, requires every buffer to have exactly the length the tensor's encoding implies, and checks the checksum.
Nothing is ever unpickled.

>>> import numpy as np
>>> rec = TensorRecord("w", "float32", (4,), "coo", 1,
...                    {"indices": np.array([2], np.uint32), "values": np.array([0.5], np.float32)})
>>> blob = pack([rec], pipeline=[{"id": "topk", "fraction": 0.25}])
>>> header, (back,) = unpack(blob)
>>> header["version"], back.name, back.shape, back.buffers["indices"].tolist(), back.buffers["values"].tolist()
(2, 'w', (4,), [2], [0.5])
>>> unpack(pack([rec], pipeline=[], version=1))[0]["version"]
1
>>> unpack(blob[:-1] + bytes([blob[-1] ^ 1]))
Traceback (most recent call last):
...
gpu_codec.errors.PayloadChecksumError: checksum mismatch: payload is corrupt (stored 0x..., computed 0x...)
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from ..errors import (
    InvalidInputError,
    PayloadError,
    PayloadHeaderError,
    PayloadTruncatedError,
    UnsupportedVersionError,
)
from . import v1, v2
from .common import (
    ALIGN,
    BASE_LAYOUTS,
    BUFFER_DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_NAME,
    MAX_NAMES_BYTES,
    MAX_NDIM,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSORS,
    TENSOR_DTYPES,
    FrameSlice,
    LayoutRule,
    RecordTable,
    SharedFrame,
    TensorRecord,
    bounded_decompress,
    check_name,
    compress_bound,
    decompress_frames,
    dumps_json,
    zstd_frame,
)

VERSION = v2.VERSION  # what pack writes, unless an nvcomp tensor needs several frames (then v2.CHUNKED)
VERSIONS = (1, 2, 3)  # what unpack reads
_MAGIC_VERSION = struct.Struct("<8sI")


def _one_frame(r: TensorRecord, level: int, shared: bool) -> TensorRecord:
    """``r`` as one zstd frame of its own (zstandard on the CPU, at ``level``) where it shares a v2 frame
    (``shared``) or is several nvcomp frames; else ``r`` itself."""
    what = f"tensor {r.name!r}"
    if r.frame is not None and shared:
        raw = r.frame.read(what)
    elif v2.multi_frame(r):
        comp = np.ascontiguousarray(np.asarray(r.buffers["compressed"]))
        raw = decompress_frames(comp, r.codec["raw"], r.chunk, what)
    else:
        return r
    z = zstd_frame(bytes(raw), level)
    bufs = {"compressed": np.frombuffer(z, np.uint8)}
    return TensorRecord(r.name, r.dtype, r.shape, r.encoding, r.nnz, bufs, {**r.codec, "zbytes": len(z)})


def _single_frame_records(tensors: list[TensorRecord], pipeline: list, shared: bool) -> list[TensorRecord]:
    """Records an older version can hold: v1 (``shared``) has no shared frame, and neither v1 nor v2 has an
    nvcomp record of several frames; such a record gets one zstd frame of its own, compressed on the CPU (the
    decompressed bytes are what the format fixes, not the compressor)."""
    if type(tensors) is RecordTable or not any((shared and r.frame is not None) or v2.multi_frame(r) for r in tensors):
        return tensors  # (a table's records are plain coo: no frame)
    level = v2.zstd_level(pipeline)
    return [_one_frame(r, level, shared) for r in tensors]


def _v1_records(tensors: list[TensorRecord], pipeline: list) -> list[TensorRecord]:
    return _single_frame_records(tensors, pipeline, shared=True)


def _plan(tensors, pipeline, metadata, layouts, version, cache, fingerprint=None):
    """The v2 or v3 plan, or None where v1 must be written."""
    if version is not None and (type(version) is not int or version not in (1, 2, 3)):  # (not 2.0, not True)
        raise InvalidInputError(
            f"version must be 1, 2 or 3 (or None: the lowest that holds the records), got {version!r}"
        )
    if version == 1:
        return None
    if version == 2:
        tensors = _single_frame_records(tensors, pipeline, shared=False)
    # (multi_frame needs a chunk; a table's records have none)
    chunked = [] if type(tensors) is RecordTable else [r for r in tensors if r.chunk is not None]
    chosen = version or (v2.CHUNKED if any(v2.multi_frame(r) for r in chunked) else v2.VERSION)
    try:
        return v2.plan(tensors, pipeline, metadata, layouts, cache, version=chosen, fingerprint=fingerprint)
    except v2.Unrepresentable as e:
        if version is not None:
            raise InvalidInputError(f"wire format v{version} cannot hold these records: {e}") from None
        return None


def pack(
    tensors: list[TensorRecord],
    *,
    pipeline: list[dict],
    metadata: dict | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
    version: int | None = None,
    cache: dict | None = None,
    fingerprint: str | None = None,
) -> bytes:
    """Serialize tensor records (``version=None``): version 2 where its table can describe them, version 3 where
    an nvcomp record is several frames, else version 1. ``version=1`` or ``2`` gives such a record one frame.

    ``layouts`` are the layout rules of the records' encodings (default: ``coo`` and ``dense``;
    :meth:`gpu_codec.Payload.to_bytes` passes every encoding the codecs declare). Device buffers are gathered on
    the device and copied to the host once. ``cache`` (a dict the caller keeps) remembers the bytes stage's
    layout decision between :func:`packed_size` and :func:`pack` calls on the same records. ``fingerprint`` (16
    hex digits, :mod:`gpu_codec.format.fingerprint`) is the base fingerprint to store; None stores none, and the
    bytes are then exactly those of a payload without the feature.
    """
    if len(tensors) > MAX_TENSORS:  # (what every reader refuses is not written)
        raise InvalidInputError(f"{len(tensors)} tensors: the wire format holds at most {MAX_TENSORS}")
    if type(tensors) is not RecordTable:  # (records a caller may have made or changed: a table's are compress's)
        _check_names([r.name for r in tensors])
    try:
        dumps_json(metadata or {})
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"metadata has no JSON form a reader takes: {e}") from None
    p = _plan(tensors, pipeline, metadata, layouts, version, cache, fingerprint)
    if p is None:
        blob = v1.pack(_v1_records(tensors, pipeline), pipeline=pipeline, metadata=metadata, fingerprint=fingerprint)
        if int.from_bytes(blob[12:16], "little") > MAX_HEADER_BYTES:
            raise InvalidInputError(
                f"a version-1 header for {len(tensors)} tensors would be over the reader's limit of "
                f"{MAX_HEADER_BYTES} bytes; write version 2 (the default), whose tensor table is compact"
            )
        if version is None:  # (v2 refused the records: written as v1 only if a reader takes them)
            try:
                v1.unpack(blob, layouts)
            except PayloadError as e:
                raise InvalidInputError(f"these records make no payload a reader takes: {e}") from None
        return blob
    return v2.write(p)


def _check_names(names: list) -> None:
    """The names a reader takes: non-empty strings, each once."""
    for n in names:
        check_name(n)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        twice = next(n for n in names if n in seen or seen.add(n))
        raise InvalidInputError(f"tensor {twice!r} appears twice: a reader refuses a payload that holds it so")


def packed_size(
    tensors: list[TensorRecord],
    pipeline: list[dict],
    metadata: dict | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
    version: int | None = None,
    cache: dict | None = None,
    fingerprint: str | None = None,
) -> int:
    """The exact length :func:`pack` will return, without touching any device buffer's data."""
    p = _plan(tensors, pipeline, metadata, layouts, version, cache, fingerprint)
    if p is None:
        return v1.packed_size(_v1_records(tensors, pipeline), pipeline, metadata, fingerprint)
    return p.size


def header_size(
    tensors: list[TensorRecord],
    pipeline: list[dict],
    metadata: dict | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
    version: int | None = None,
    cache: dict | None = None,
    fingerprint: str | None = None,
) -> int:
    """Bytes of the payload :func:`pack` writes that are not buffer data or checksum: the prefix and the
    tensor table (v2), or the prefix and the JSON header with its padding (v1)."""
    p = _plan(tensors, pipeline, metadata, layouts, version, cache, fingerprint)
    if p is None:
        return v1.header_size(_v1_records(tensors, pipeline), pipeline, metadata, fingerprint)
    return len(p.head)


def payload_version(blob: bytes | bytearray | memoryview) -> int:
    """The format version a payload declares (after checking its type, length and magic)."""
    try:
        mv = memoryview(blob).cast("B")
    except TypeError:  # (not a buffer, or one whose bytes are not in order: a strided view)
        what = "a non-contiguous memoryview" if isinstance(blob, memoryview) else type(blob).__name__
        raise InvalidInputError(
            f"a payload is bytes, a bytearray or a C-contiguous buffer, got {what}"
            + (" (pass bytes(view))" if isinstance(blob, memoryview) else "")
        ) from None
    if len(mv) < _MAGIC_VERSION.size:
        cut = len(mv) > 0 and bytes(mv[:8]) == MAGIC[: len(mv)]
        raise (PayloadTruncatedError if cut else PayloadHeaderError)(
            f"payload is {len(mv)} bytes, shorter than the smallest valid payload"
            + (" (it is truncated: the bytes are the start of a payload's magic)" if cut else "")
        )
    magic, version = _MAGIC_VERSION.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadHeaderError(f"bad magic {bytes(magic)!r}: not a gpu_codec payload")
    if version not in VERSIONS:
        raise UnsupportedVersionError(
            f"payload format version {version} is not supported (this reader knows versions 1, 2 and 3)"
        )
    return version


def unpack(
    blob: bytes | bytearray | memoryview,
    layouts: Mapping[str, LayoutRule] | None = None,
    *,
    describe: bool = True,
    columns: bool = False,
) -> tuple[dict, list[TensorRecord] | RecordTable]:
    """Validate a payload (version 1, 2 or 3) completely and return (header, records).

    Records hold NumPy views of their buffers; a ``zstd`` record of a v2 payload whose bytes stage ran over all
    tensors at once holds its share of that frame in ``frame`` instead, decompressed when it is decoded.
    ``layouts`` maps each encoding the reader accepts to its layout rule; the default is the container's own
    ``coo`` and ``dense``. :meth:`gpu_codec.Payload.from_bytes` passes every encoding the codecs declare.
    ``header`` holds ``version``, ``pipeline``, ``metadata`` and a ``tensors`` list (what the records say of
    each tensor; a v2 or v3 header leaves it out with ``describe=False``). With ``columns``, the records of a
    v2 or v3 table of plain ``coo`` records that repeats one read before (a federated round's) may come as a
    :class:`~gpu_codec.format.common.RecordTable` (columns, no object a record until one is read); else a list.
    Raises a :class:`~gpu_codec.errors.PayloadError` subclass naming the tensor and the problem.
    """
    if payload_version(blob) == 1:
        return v1.unpack(blob, layouts)
    return v2.unpack(blob, layouts, describe=describe, columns=columns)


def table_frame(blob: bytes | bytearray | memoryview) -> tuple[int, bytes] | None:
    """(raw size, bytes) of the zstd frame that holds the tensor table of a payload :func:`unpack` accepted, which
    a write of the same records may take again (:func:`gpu_codec.format.v2.table_frame`); None for a version-1
    payload and a table stored as it is."""
    return None if payload_version(blob) == 1 else v2.table_frame(blob)


__all__ = [
    "ALIGN",
    "BASE_LAYOUTS",
    "BUFFER_DTYPES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_NAME",
    "MAX_NAMES_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "MAX_TENSOR_ELEMENTS",
    "TENSOR_DTYPES",
    "VERSION",
    "VERSIONS",
    "FrameSlice",
    "LayoutRule",
    "RecordTable",
    "SharedFrame",
    "TensorRecord",
    "bounded_decompress",
    "compress_bound",
    "header_size",
    "pack",
    "packed_size",
    "payload_version",
    "table_frame",
    "unpack",
]
