"""Wire format v1: golden payloads, and a hostile reader that rejects every malformed payload with our errors."""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec import errors as E
from gpu_codec.format import MAX_HEADER_BYTES, unpack
from tests.common import build_payload, split_payload

GOLDEN = pathlib.Path(__file__).parent / "golden"
REGEN = os.environ.get("GPU_CODEC_REGEN_GOLDEN") == "1"


def golden_inputs():
    rng = np.random.default_rng(20261121)
    base = {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "fc.weight": rng.standard_normal((10, 32)).astype(np.float32),
        "fc.bias": rng.standard_normal(10).astype(np.float64),
        "scale": np.asarray(np.float32(1.5)),
    }
    new = {k: (v + rng.standard_normal(v.shape).astype(v.dtype)).astype(v.dtype) for k, v in base.items()}
    return new, base


GOLDEN_CASES = {
    "topk_global": dict(fraction=0.05, scope="global"),
    "topk_per_tensor": dict(fraction=0.1, scope="per_tensor", metadata={"round": 3, "client": "site-1"}),
    "fp16_rice": dict(fraction=0.05, pipeline=[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}]),
    "bf16": dict(fraction=0.05, pipeline=[{"id": "quantize", "dtype": "bfloat16"}]),
    "ternary_rice": dict(fraction=0.05, pipeline=[{"id": "ternary"}, {"id": "rice"}]),
    "int8_dense": dict(fraction=None, pipeline=[{"id": "int8", "block_size": 64}]),
    "fp16_rice_zstd": dict(
        fraction=0.05, pipeline=[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}]
    ),
}
# zstd output may change with the zstandard library version: for those, old payloads must still decode, but
# today's bytes need not equal them.
WRITER_MAY_DIFFER = {"fp16_rice_zstd"}


def golden_path(case: str, version: int) -> pathlib.Path:
    return GOLDEN / f"{case}_v{version}.bin"


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_payloads(case, version):
    """Today's writer reproduces the checked-in bytes of each format version, and the reader decodes them: a
    format change that breaks old payloads fails here. Regenerate only deliberately, with
    GPU_CODEC_REGEN_GOLDEN=1."""
    new, base = golden_inputs()
    blob = gpu_codec.compress(new, base, **GOLDEN_CASES[case]).to_bytes(version=version)
    path = golden_path(case, version)
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(blob)
    assert path.exists(), f"missing golden payload {path}; regenerate deliberately with GPU_CODEC_REGEN_GOLDEN=1"
    stored = path.read_bytes()
    assert stored[8] == version
    if case not in WRITER_MAY_DIFFER:
        assert blob == stored
    out = gpu_codec.decompress(stored, base=base)
    assert {k: v.tobytes() for k, v in out.items()} == {
        k: v.tobytes() for k, v in gpu_codec.decompress(blob, base=base).items()
    }
    lossless = "pipeline" not in GOLDEN_CASES[case]
    for k in base:
        assert out[k].dtype == base[k].dtype and out[k].shape == base[k].shape
        changed = out[k].reshape(-1) != base[k].reshape(-1)
        assert changed.any() or GOLDEN_CASES[case]["fraction"] is not None
        if lossless:
            assert np.array_equal(out[k].reshape(-1)[changed], new[k].reshape(-1)[changed])


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_v1_and_v2_hold_the_same_update(case):
    """The two versions of a golden payload decode to the same bytes, with the same pipeline and metadata, and
    the v2 payload is smaller."""
    v1, v2 = golden_path(case, 1).read_bytes(), golden_path(case, 2).read_bytes()
    _, base = golden_inputs()
    a, b = gpu_codec.decompress(v1, base=base), gpu_codec.decompress(v2, base=base)
    assert {k: v.tobytes() for k, v in a.items()} == {k: v.tobytes() for k, v in b.items()}
    p1, p2 = gpu_codec.Payload.from_bytes(v1), gpu_codec.Payload.from_bytes(v2)
    assert p1.pipeline == p2.pipeline and p1.metadata == p2.metadata
    assert [(r.name, r.dtype, r.shape, r.nnz) for r in p1.tensors] == [
        (r.name, r.dtype, r.shape, r.nnz) for r in p2.tensors
    ]
    assert len(v2) < len(v1)


def valid_blob():
    new, base = golden_inputs()
    return gpu_codec.compress(new, base, fraction=0.05).to_bytes(version=1)


def mutate(fn):
    header, data = split_payload(valid_blob())
    header = copy.deepcopy(header)
    data = bytearray(data)
    out = fn(header, data)
    return build_payload(header, bytes(data)) if out is None else out


def _buf(h, t=0, b=0):
    return h["tensors"][t]["buffers"][b]


HOSTILE = {
    "empty": (lambda h, d: b"", E.PayloadHeaderError, "shorter"),
    "bad magic": (lambda h, d: b"NOTCODEC" + valid_blob()[8:], E.PayloadHeaderError, "magic"),
    "version 4": (lambda h, d: build_payload(h, bytes(d), version=4), E.UnsupportedVersionError, "version 4"),
    "version 0": (lambda h, d: build_payload(h, bytes(d), version=0), E.UnsupportedVersionError, "version 0"),
    "bad checksum": (lambda h, d: build_payload(h, bytes(d), fix_crc=False), E.PayloadChecksumError, "checksum"),
    "truncated": (lambda h, d: valid_blob()[:-9], E.PayloadError, None),
    "huge header length": (
        lambda h, d: valid_blob()[:12] + (MAX_HEADER_BYTES + 8).to_bytes(4, "little") + valid_blob()[16:],
        E.PayloadHeaderError,
        "header length",
    ),
    "header not json": (
        lambda h, d: b"GPUCODEC" + (1).to_bytes(4, "little") + (8).to_bytes(4, "little") + b"{{{{{{{{",
        E.PayloadError,
        None,
    ),
    "data length lies": (lambda h, d: h.update(data_length=h["data_length"] + 8), E.PayloadLayoutError, "length"),
    "dtype int64 tensor": (lambda h, d: h["tensors"][0].update(dtype="int64"), E.PayloadDtypeError, "dtype"),
    "object dtype buffer": (lambda h, d: _buf(h).update(dtype="object"), E.PayloadDtypeError, "not allowed"),
    "values as int8": (lambda h, d: _buf(h, 0, 1).update(dtype="int8"), E.PayloadDtypeError, "allows"),
    "negative shape": (lambda h, d: h["tensors"][0].update(shape=[-1, 3]), E.PayloadLimitError, "shape"),
    "too many dims": (lambda h, d: h["tensors"][0].update(shape=[1] * 9), E.PayloadLimitError, "shape"),
    "too many elements": (lambda h, d: h["tensors"][0].update(shape=[1 << 30, 1 << 30]), E.PayloadLimitError, "limit"),
    "nnz above numel": (lambda h, d: h["tensors"][3].update(nnz=5), E.PayloadLayoutError, "nnz"),
    "nnz disagrees with buffers": (
        lambda h, d: h["tensors"][0].update(nnz=h["tensors"][0]["nnz"] + 1),
        E.PayloadLayoutError,
        "implies",
    ),
    "overlapping buffers": (lambda h, d: _buf(h, 0, 1).update(offset=0), E.PayloadLayoutError, "contiguous"),
    "gap between buffers": (
        lambda h, d: _buf(h, 0, 1).update(offset=_buf(h, 0, 1)["offset"] + 8),
        E.PayloadLayoutError,
        None,
    ),
    "wrong buffer length": (
        lambda h, d: _buf(h, 0, 0).update(nbytes=_buf(h, 0, 0)["nbytes"] - 4),
        E.PayloadLayoutError,
        None,
    ),
    "missing buffer": (lambda h, d: h["tensors"][0]["buffers"].pop() and None, E.PayloadLayoutError, "needs"),
    "duplicate name": (
        lambda h, d: h["tensors"][1].update(name=h["tensors"][0]["name"]),
        E.PayloadHeaderError,
        "twice",
    ),
    "unknown encoding": (lambda h, d: h["tensors"][0].update(encoding="pickle"), E.PayloadHeaderError, "encoding"),
    "name not string": (lambda h, d: h["tensors"][0].update(name=7), E.PayloadHeaderError, "name"),
    "tensors not list": (lambda h, d: h.update(tensors={}), E.PayloadHeaderError, "tensors"),
    "NaN constant": (
        lambda h, d: build_payload(h, bytes(d)).replace(b'"nnz":', b'"nnz":NaN,"x":', 1),
        E.PayloadError,
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_payloads(case):
    fn, exc, msg = HOSTILE[case]
    blob = mutate(fn)
    with pytest.raises(exc, match=msg):
        unpack(blob)
    with pytest.raises(exc):
        gpu_codec.decompress(blob)


def _set_index(h, d, value):
    b = _buf(h, 0, 0)
    d[b["offset"] : b["offset"] + 4] = int(value).to_bytes(4, "little")


@pytest.mark.parametrize("how", ["out_of_range", "descending", "duplicate"])
def test_hostile_indices_are_caught_before_any_write(how):
    def fn(h, d):
        b = _buf(h, 0, 0)
        idx = np.frombuffer(bytes(d[b["offset"] : b["offset"] + b["nbytes"]]), np.uint32).copy()
        if how == "out_of_range":
            idx[-1] = 10**6
        elif how == "descending":
            idx[0], idx[1] = idx[1], idx[0]
        else:
            idx[1] = idx[0]
        d[b["offset"] : b["offset"] + b["nbytes"]] = idx.tobytes()

    blob = mutate(fn)
    unpack(blob)  # structurally valid: indices are checked where they are used
    _new, base = golden_inputs()
    before = {k: v.copy() for k, v in base.items()}
    with pytest.raises(E.PayloadIndexError, match=r"conv\.weight"):
        gpu_codec.decompress(blob, base=base)
    for k in base:  # nothing already stored is lost
        assert np.array_equal(base[k], before[k])


def test_every_error_is_a_value_error_of_ours():
    for _, exc, _ in HOSTILE.values():
        assert issubclass(exc, E.PayloadError) and issubclass(exc, ValueError)


def test_max_output_bytes_guards_allocation():
    blob = gpu_codec.compress({"w": np.ones(1000, np.float32)}, fraction=0.01).to_bytes()
    with pytest.raises(E.PayloadLimitError, match="max_output_bytes"):
        gpu_codec.decompress(blob, max_output_bytes=3999)
    with pytest.warns(DeprecationWarning), pytest.raises(E.PayloadLimitError, match="max_elements"):
        gpu_codec.decompress(blob, max_elements=999)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


JUNK = [
    None,
    True,
    -1,
    0,
    1,
    2**63,
    2**70,
    1.5,
    float("1e308"),
    "",
    "x",
    "float32",
    "uint64",
    [],
    [1, -2],
    {},
    {"role": "values"},
]


@pytest.mark.parametrize(
    "case", ["topk_global_v1", "fp16_rice_v1", "ternary_rice_v1", "int8_dense_v1", "fp16_rice_zstd_v1"]
)
def test_header_fuzz_only_raises_our_errors(case):
    """Every field of the header replaced by junk: decoding either succeeds or raises a PayloadError, never
    anything else (no KeyError, TypeError, IndexError, MemoryError, crash)."""
    header, data = split_payload((GOLDEN / f"{case}.bin").read_bytes())
    paths = [p for p in _paths(header) if p]
    for p in paths:
        for junk in JUNK:
            h = copy.deepcopy(header)
            node = h
            for key in p[:-1]:
                node = node[key]
            node[p[-1]] = junk
            blob = build_payload(h, data)
            with contextlib.suppress(E.PayloadError):
                gpu_codec.decompress(blob, max_output_bytes=8 << 20)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_in_a_payload_are_rejected(bad):
    """A hostile payload must not poison a model with NaN or inf: nothing is decoded."""

    def fn(h, d):
        b = _buf(h, 0, 1)
        d[b["offset"] : b["offset"] + 4] = np.float32(bad).tobytes()

    _new, base = golden_inputs()
    with pytest.raises(E.PayloadIndexError, match="not finite"):
        gpu_codec.decompress(mutate(fn), base=base)


@pytest.mark.parametrize(
    "case", ["topk_global_v1", "fp16_rice_v1", "ternary_rice_v1", "int8_dense_v1", "fp16_rice_zstd_v1"]
)
def test_data_fuzz_only_raises_our_errors(case):
    """Random bytes of the data section flipped (checksum recomputed): decoding succeeds or raises a PayloadError,
    and a successful decode holds only finite values."""
    header, data = split_payload((GOLDEN / f"{case}.bin").read_bytes())
    rng = np.random.default_rng(7)
    _new, base = golden_inputs()
    for _ in range(60):
        d = bytearray(data)
        for pos in rng.integers(0, len(d), int(rng.integers(1, 4))):
            d[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = gpu_codec.decompress(build_payload(header, bytes(d)), base=base)
        except E.PayloadError:
            continue
        assert all(np.isfinite(v).all() for v in out.values())


# ------------------------------------------------------------------------------------------ header parsing limits


def _raw_header_payload(fn) -> bytes:
    """A v1 payload whose header JSON text is rewritten by ``fn`` (for literals json.dumps cannot write)."""
    header, data = split_payload(valid_blob())
    blob = build_payload(header, data)
    hlen = int.from_bytes(blob[12:16], "little")
    text = fn(blob[16 : 16 + hlen].decode().rstrip(" "))
    return build_payload_text(text, data)


def build_payload_text(text: str, data: bytes) -> bytes:
    import struct
    import zlib

    hb = text.encode()
    hb += b" " * ((-(16 + len(hb))) % 8)
    body = struct.pack("<8sII", b"GPUCODEC", 1, len(hb)) + hb + data
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


@pytest.mark.parametrize(
    "literal",
    ["9" * 5000, "-" + "9" * 5000, "1" + "0" * 41],
    ids=["past the int-conversion limit", "negative, past the limit", "41 digits"],
)
def test_header_integer_too_long_is_a_payload_error(literal):
    blob = _raw_header_payload(lambda t: t.replace('"metadata":{}', '"metadata":{"x":' + literal + "}", 1))
    assert b'"x":' in blob
    with pytest.raises(E.PayloadHeaderError, match="digits"):
        unpack(blob)
    blob = _raw_header_payload(lambda t: t.replace('"nnz":', '"nnz":' + literal + ',"y":', 1))
    with pytest.raises(E.PayloadHeaderError):
        gpu_codec.decompress(blob)


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "1E999"])
def test_header_float_overflow_is_rejected(literal):
    blob = _raw_header_payload(lambda t: t.replace('"metadata":{}', '"metadata":{"lr":' + literal + "}", 1))
    with pytest.raises(E.PayloadHeaderError, match="not a finite float"):
        unpack(blob)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_header_version_must_be_the_integer_1(version):
    with pytest.raises(E.PayloadHeaderError, match="version 1"):
        unpack(mutate(lambda h, d: h.update(version=version)))


@pytest.mark.parametrize("shape", [[0, 2**63], [2**63, 0], [0, 2**41], [3, 0, 2**40], [0, 2**70, 0]])
def test_zero_dimension_cannot_hide_a_huge_one(shape):
    """A zero beside a huge dimension makes zero elements, but reshaping to it fails: rejected up front."""
    with pytest.raises(E.PayloadLimitError, match="exceeds the limit"):
        unpack(mutate(lambda h, d: h["tensors"][3].update(shape=shape, nnz=0)))


def test_zero_size_tensor_within_limits_decodes():
    blob = gpu_codec.compress(
        {"e": np.zeros((0, 1 << 20), np.float32), "w": np.arange(4, dtype=np.float32)}, fraction=0.5
    ).to_bytes()
    out = gpu_codec.decompress(blob)
    assert out["e"].shape == (0, 1 << 20) and out["w"].tolist() == [0, 0, 2, 3]


# ------------------------------------------------------------------------------------------ names


def test_a_v1_name_with_no_utf8_form_is_a_header_error():
    """JSON can escape a lone surrogate (``\\ud800``); such a name has no UTF-8 form (a fingerprint, an output
    file's keys): the reader refuses it, and compress never writes one."""
    blob = _raw_header_payload(lambda t: t.replace('"name":"conv.weight"', '"name":"\\ud800"', 1))
    assert b'"\\ud800"' in blob
    with pytest.raises(E.PayloadHeaderError, match="no UTF-8 form"):
        gpu_codec.Payload.from_bytes(blob)
    for names in (["\ud800"], ["a", "b\udfff"]):
        with pytest.raises(E.InvalidInputError, match="no UTF-8 form"):
            gpu_codec.compress({n: np.ones(3, np.float32) for n in names}, fraction=0.5)


@pytest.mark.parametrize("pipeline", [None, [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices()]])
def test_the_names_of_a_table_are_bounded_as_read(monkeypatch, pipeline):
    """A name coded against an earlier one copies up to 4 KiB of it for a few bytes of table: the names as read
    count against MAX_NAMES_BYTES in every path of the reader (plain, coded and entry by entry), before they are
    all made."""
    from gpu_codec.format import v2

    names = [f"block{i}.layer.weight" for i in range(40)]
    p = gpu_codec.compress({n: np.arange(8, dtype=np.float32) for n in names}, fraction=0.5, pipeline=pipeline)
    blob = p.to_bytes()
    total = sum(len(n) for n in names)
    monkeypatch.setattr(v2, "MAX_NAMES_BYTES", total - 1)
    for plain in (True, False):
        with monkeypatch.context() as m:
            if not plain:
                m.setattr(v2, "_read_plain", lambda *a: None)
                m.setattr(v2, "_read_coded", lambda *a: False)
            with pytest.raises(E.PayloadLimitError, match="tensor names take more than"):
                gpu_codec.Payload.from_bytes(blob)
    monkeypatch.setattr(v2, "MAX_NAMES_BYTES", total)
    assert len(gpu_codec.Payload.from_bytes(blob).tensors) == 40  # (at the bound)


def test_compress_refuses_names_past_the_readers_bound(monkeypatch):
    from gpu_codec import payload as pl

    names = {f"{'x' * 200}{i}": np.ones(2, np.float32) for i in range(10)}
    monkeypatch.setattr(pl, "MAX_HEADER_BYTES", 1000)  # (past the cheap bound: the names are counted)
    monkeypatch.setattr(pl, "MAX_NAMES_BYTES", 2000)
    with pytest.raises(E.InvalidInputError, match="tensor names take"):
        gpu_codec.compress(names, fraction=0.5)


# a valid v2 payload (two tensors of 4 fp32 elements, one kept entry each) whose second name is written whole, not
# against the first, as another writer may write it: 60 bytes of prefix and table, 20 of data and checksum
NAMES_WRITTEN_WHOLE = bytes.fromhex(
    "475055434f44454302000000002e0101190200000002000e6c617965722e302e776569676874040401000e6c617965722e312e"
    "776569676874040401020000000000003f020000000000003f5f2948f3"
)


def test_header_length_is_read_from_the_bytes():
    from gpu_codec.cli.commands import header_split
    from gpu_codec.format import v2

    blob = NAMES_WRITTEN_WHOLE
    assert {k: v.tolist() for k, v in gpu_codec.decompress(blob).items()} == {
        "layer.0.weight": [0.0, 0.0, 0.5, 0.0],
        "layer.1.weight": [0.0, 0.0, 0.5, 0.0],
    }
    assert v2.header_length(blob) == 60 and header_split(blob) == (60, 20)
    assert gpu_codec.Payload.from_bytes(blob).header_nbytes < 60  # (this writer codes the second name shorter)
