"""Wire format v1 (read always, written on request): a versioned, self-describing, checksummed container.

Layout, all integers little-endian::

    magic  b"GPUCODEC"                      8 bytes
    version                                 u32 (= 1)
    header_len                              u32, header bytes (JSON, UTF-8, space-padded so data is 8-aligned)
    header                                  header_len bytes
    data                                    header["data_length"] bytes: the buffers, each 8-byte aligned,
                                            zero padding between them
    crc32                                   u32, zlib CRC-32 of every byte before it

The reader treats every payload as hostile: it caps the header, whitelists dtypes and encodings, bounds shapes
and element counts, requires buffers to be contiguous, in order, non-overlapping and of exactly the length the
tensor's encoding implies, and checks the checksum. Sparse indices are checked in range and strictly increasing
where they are used (the scatter kernel, or its NumPy twin). Nothing is ever unpickled.

>>> import numpy as np
>>> rec = TensorRecord("w", "float32", (4,), "coo", 1,
...                    {"indices": np.array([2], np.uint32), "values": np.array([0.5], np.float32)})
>>> blob = pack([rec], pipeline=[{"id": "topk", "fraction": 0.25}])
>>> header, (back,) = unpack(blob)
>>> back.name, back.shape, back.buffers["indices"].tolist(), back.buffers["values"].tolist()
('w', (4,), [2], [0.5])
>>> unpack(blob[:-1] + bytes([blob[-1] ^ 1]))
Traceback (most recent call last):
...
gpu_codec.errors.PayloadChecksumError: checksum mismatch: payload is corrupt (stored 0x..., computed 0x...)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import (
    PayloadChecksumError,
    PayloadDtypeError,
    PayloadError,
    PayloadHeaderError,
    PayloadLayoutError,
    PayloadLimitError,
    PayloadTruncatedError,
    UnsupportedVersionError,
)
from .common import (
    ALIGN,
    BASE_LAYOUTS,
    BUFFER_DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_NAME,
    MAX_TENSORS,
    TENSOR_DTYPES,
    LayoutRule,
    TensorRecord,
    buffer_dtype_name,
    check_shape,
    dumps_json,
    loads_json,
)
from .common import is_int as _is_int
from .common import req as _req
from .fingerprint import check_hex

VERSION = 1
# the header's nesting of brackets and braces: metadata's bound, one level below the header object (a tensor entry
# and a stage config nest a few levels; a deeper text parsed near the interpreter's recursion limit)
HEADER_DEPTH = MAX_JSON_DEPTH + 1
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header_and_layout(
    tensors: list[TensorRecord], pipeline: list[dict], metadata: dict | None, fingerprint: str | None = None
):
    entries, spans, off = [], [], 0
    for rec in tensors:
        bufs = []
        for role, a in rec.buffers.items():
            nbytes = int(a.size) * np.dtype(a.dtype).itemsize
            off = _align(off)
            bufs.append({"role": role, "dtype": buffer_dtype_name(a, rec, role), "offset": off, "nbytes": nbytes})
            spans.append((a, off, nbytes))
            off += nbytes
        entry = {
            "name": rec.name,
            "dtype": rec.dtype,
            "shape": list(rec.shape),
            "encoding": rec.encoding,
            "nnz": int(rec.nnz),
            "buffers": bufs,
        }
        if rec.codec:
            entry["codec"] = rec.codec
        entries.append(entry)
    header = {
        "format": "gpu_codec",
        "version": VERSION,
        "pipeline": pipeline,
        "metadata": metadata or {},
    }
    if fingerprint is not None:
        header["base_fingerprint"] = check_hex(fingerprint)
    header |= {"data_length": off, "tensors": entries}
    return header, spans, off


def _header_bytes(header: dict) -> bytes:
    hb = dumps_json(header)
    pad = (-(_PREFIX.size + len(hb))) % ALIGN
    return hb + b" " * pad


def packed_size(
    tensors: list[TensorRecord], pipeline: list[dict], metadata: dict | None = None, fingerprint: str | None = None
) -> int:
    """The exact length :func:`pack` will return, without touching any buffer's data."""
    header, _, data_len = _header_and_layout(tensors, pipeline, metadata, fingerprint)
    return _PREFIX.size + len(_header_bytes(header)) + data_len + _CRC.size


def header_size(
    tensors: list[TensorRecord], pipeline: list[dict], metadata: dict | None = None, fingerprint: str | None = None
) -> int:
    """Bytes of prefix and JSON header (with its padding) of the payload :func:`pack` writes."""
    header, _, _ = _header_and_layout(tensors, pipeline, metadata, fingerprint)
    return _PREFIX.size + len(_header_bytes(header))


def _gather_host(spans, data_len: int) -> bytes:
    out = bytearray(data_len)
    for a, off, n in spans:
        if n:
            out[off : off + n] = np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes()
    return bytes(out)


def _gather_device(spans, data_len: int) -> bytes:
    import cupy

    dev = cupy.zeros(data_len, dtype=cupy.uint8)
    for a, off, n in spans:
        if n:
            dev[off : off + n] = cupy.ascontiguousarray(a).view(cupy.uint8).reshape(-1)
    return cupy.asnumpy(dev).tobytes()  # the one device-to-host copy of a compress


def pack(
    tensors: list[TensorRecord],
    *,
    pipeline: list[dict],
    metadata: dict | None = None,
    fingerprint: str | None = None,
) -> bytes:
    """Serialize tensor records. Device buffers are gathered on the device and copied to the host once."""
    header, spans, data_len = _header_and_layout(tensors, pipeline, metadata, fingerprint)
    on_device = any(type(a).__module__.startswith("cupy") for a, _, _ in spans)
    data = _gather_device(spans, data_len) if on_device else _gather_host(spans, data_len)
    hb = _header_bytes(header)
    body = _PREFIX.pack(MAGIC, VERSION, len(hb)) + hb + data
    return body + _CRC.pack(zlib.crc32(body) & 0xFFFFFFFF)


def parse_header(blob: bytes | bytearray | memoryview) -> tuple[dict, memoryview]:
    """Check prefix, checksum and header JSON; return (header dict, data section)."""
    mv = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    n = len(mv)
    _req(
        n >= _PREFIX.size + _CRC.size,
        PayloadTruncatedError if mv[:8] == MAGIC else PayloadHeaderError,
        f"payload is {n} bytes, shorter than the smallest valid payload",
    )
    magic, version, hlen = _PREFIX.unpack_from(mv, 0)
    _req(magic == MAGIC, PayloadHeaderError, f"bad magic {bytes(magic)!r}: not a gpu_codec payload")
    _req(
        version == VERSION,
        UnsupportedVersionError,
        f"payload format version {version} is not supported (this reader knows version {VERSION})",
    )
    _req(
        hlen <= MAX_HEADER_BYTES,
        PayloadHeaderError,
        f"header length {hlen} exceeds the limit of {MAX_HEADER_BYTES} bytes",
    )
    _req(
        _PREFIX.size + hlen + _CRC.size <= n,
        PayloadTruncatedError,
        f"payload is truncated: {n} bytes, its prefix declares a header of {hlen} bytes "
        f"(at least {_PREFIX.size + hlen + _CRC.size} bytes in all)",
    )
    (stored,) = _CRC.unpack_from(mv, n - _CRC.size)
    computed = zlib.crc32(mv[: n - _CRC.size]) & 0xFFFFFFFF
    if stored != computed:
        _check_not_truncated(mv, hlen)
        raise PayloadChecksumError(
            f"checksum mismatch: payload is corrupt (stored 0x{stored:08x}, computed 0x{computed:08x})"
        )
    header = loads_json(bytes(mv[_PREFIX.size : _PREFIX.size + hlen]), max_depth=HEADER_DEPTH)
    _req(isinstance(header, dict), PayloadHeaderError, "header JSON must be an object")
    _req(
        header.get("format") == "gpu_codec" and _is_int(header.get("version")) and header["version"] == VERSION,
        PayloadHeaderError,
        "header does not declare format 'gpu_codec' version 1",
    )
    dl = header.get("data_length")
    _req(_is_int(dl) and dl >= 0, PayloadHeaderError, "header field 'data_length' must be a non-negative integer")
    start = _PREFIX.size + hlen
    _req(start % ALIGN == 0, PayloadHeaderError, "header is not padded to an 8-byte boundary")
    _req(
        start + dl + _CRC.size == n,
        PayloadLayoutError,
        f"payload length {n} does not match header ({start} + data_length {dl} + {_CRC.size})",
    )
    return header, mv[start : start + dl]


def _check_not_truncated(mv: memoryview, hlen: int) -> None:
    """Where the checksum fails: a PayloadTruncatedError if the header (read as far as it can be) declares more
    data than the payload holds, so a cut payload is reported as cut and not only as corrupt."""
    try:
        dl = loads_json(bytes(mv[_PREFIX.size : _PREFIX.size + hlen]), max_depth=HEADER_DEPTH).get("data_length")
    except (PayloadError, AttributeError):
        return
    need = _PREFIX.size + hlen + dl + _CRC.size if _is_int(dl) else 0
    _req(
        need <= len(mv),
        PayloadTruncatedError,
        f"payload is truncated: {len(mv)} bytes, its header declares {need} ({dl} bytes of data)",
    )


def _utf8(name: str) -> bool:
    """Whether a name read from JSON (where ``\\ud800`` escapes a lone surrogate) is text with a UTF-8 form."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_record(i: int, e: Any, layouts: Mapping[str, LayoutRule]) -> TensorRecord:
    _req(isinstance(e, dict), PayloadHeaderError, f"tensor entry {i} is not an object")
    name = e.get("name")
    _req(
        isinstance(name, str) and 0 < len(name) <= MAX_NAME,
        PayloadHeaderError,
        f"tensor entry {i}: 'name' must be a non-empty string of at most {MAX_NAME} characters",
    )
    _req(_utf8(name), PayloadHeaderError, f"tensor entry {i}: 'name' {name!r} has no UTF-8 form (a lone surrogate)")
    where = f"tensor {name!r}"
    dtype = e.get("dtype")
    _req(
        isinstance(dtype, str) and dtype in TENSOR_DTYPES,
        PayloadDtypeError,
        f"{where}: dtype {dtype!r} is not one of {', '.join(TENSOR_DTYPES)}",
    )
    shape = e.get("shape")
    _req(isinstance(shape, list), PayloadLimitError, f"{where}: shape must be a list, got {shape!r}")
    numel = check_shape(shape, where)
    enc = e.get("encoding")
    _req(isinstance(enc, str) and enc in layouts, PayloadHeaderError, f"{where}: unknown encoding {enc!r}")
    nnz = e.get("nnz")
    _req(
        _is_int(nnz) and 0 <= nnz <= numel,
        PayloadLayoutError,
        f"{where}: nnz {nnz!r} must be an integer between 0 and the element count {numel}",
    )
    codec = e.get("codec", {})
    _req(isinstance(codec, dict), PayloadHeaderError, f"{where}: 'codec' must be an object")
    bufs = e.get("buffers")
    _req(isinstance(bufs, list), PayloadHeaderError, f"{where}: 'buffers' must be a list")
    rec = TensorRecord(name, dtype, tuple(shape), enc, nnz, {}, codec)
    return rec


def unpack(
    blob: bytes | bytearray | memoryview, layouts: Mapping[str, LayoutRule] | None = None
) -> tuple[dict, list[TensorRecord]]:
    """Validate a payload completely and return (header, records with NumPy views of the buffers).

    ``layouts`` maps each encoding the reader accepts to its layout rule; the default is the container's own
    ``coo`` and ``dense``. :meth:`gpu_codec.Payload.from_bytes` passes every encoding the codecs declare.
    Raises a :class:`~gpu_codec.errors.PayloadError` subclass naming the tensor and the problem.
    """
    layouts = BASE_LAYOUTS if layouts is None else layouts
    header, data = parse_header(blob)
    entries = header.get("tensors")
    _req(isinstance(entries, list), PayloadHeaderError, "header field 'tensors' must be a list")
    _req(len(entries) <= MAX_TENSORS, PayloadLimitError, f"{len(entries)} tensors exceed the limit of {MAX_TENSORS}")
    _req(isinstance(header.get("pipeline", []), list), PayloadHeaderError, "header field 'pipeline' must be a list")
    _req(isinstance(header.get("metadata", {}), dict), PayloadHeaderError, "header field 'metadata' must be an object")
    if "base_fingerprint" in header:
        check_hex(header["base_fingerprint"], "header field 'base_fingerprint'")
    records, names, expect = [], set(), 0
    for i, e in enumerate(entries):
        rec = _check_record(i, e, layouts)
        where = f"tensor {rec.name!r}"
        _req(rec.name not in names, PayloadHeaderError, f"{where} appears twice")
        names.add(rec.name)
        try:
            layout = layouts[rec.encoding](rec)
        except PayloadError:
            raise
        except (KeyError, TypeError, ValueError) as ex:
            raise PayloadHeaderError(f"{where}: codec parameters do not fit encoding {rec.encoding!r}: {ex}") from None
        bufs = e["buffers"]
        roles = [b.get("role") if isinstance(b, dict) else None for b in bufs]
        _req(
            roles == list(layout),
            PayloadLayoutError,
            f"{where}: buffers {roles} do not match encoding {rec.encoding!r}, which needs {list(layout)}",
        )
        for b in bufs:
            role = b["role"]
            allowed, count = layout[role]
            bd = b.get("dtype")
            _req(
                isinstance(bd, str) and bd in BUFFER_DTYPES,
                PayloadDtypeError,
                f"{where}: buffer {role!r} dtype {bd!r} is not allowed",
            )
            _req(
                bd in allowed,
                PayloadDtypeError,
                f"{where}: buffer {role!r} has dtype {bd}, encoding {rec.encoding!r} allows {', '.join(allowed)}",
            )
            off, nb = b.get("offset"), b.get("nbytes")
            _req(
                _is_int(off) and _is_int(nb) and nb >= 0,
                PayloadLayoutError,
                f"{where}: buffer {role!r} offset and nbytes must be non-negative integers",
            )
            _req(
                off == _align(expect),
                PayloadLayoutError,
                f"{where}: buffer {role!r} starts at {off}, expected {_align(expect)} (buffers must be contiguous, "
                "in order and non-overlapping)",
            )
            item = BUFFER_DTYPES[bd].itemsize
            _req(
                nb == count * item,
                PayloadLayoutError,
                f"{where}: buffer {role!r} holds {nb} bytes, its encoding implies {count} x {item} = {count * item}",
            )
            _req(
                off + nb <= len(data),
                PayloadLayoutError,
                f"{where}: buffer {role!r} ends at {off + nb}, past the data section ({len(data)} bytes)",
            )
            if off > expect:
                _req(not any(data[expect:off]), PayloadLayoutError, f"{where}: non-zero padding before {role!r}")
            rec.buffers[role] = np.frombuffer(data, dtype=BUFFER_DTYPES[bd], count=count, offset=off)
            rec.buffer_dtypes[role] = bd
            expect = off + nb
        records.append(rec)
    _req(expect == len(data), PayloadLayoutError, f"data section is {len(data)} bytes but the buffers end at {expect}")
    return header, records
