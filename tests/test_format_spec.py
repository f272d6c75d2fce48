"""docs/FORMAT.md is complete and right: an independent reader written from it alone (tests/spec_reader.py, which
imports nothing from gpu_codec) decodes every golden payload and freshly written payloads of every encoding to
the same bits as gpu_codec.decompress, and rejects malformed payloads with the error class the document names.

No golden payload uses the ``nvcomp`` encoding (writing one needs a GPU with nvCOMP); its framing is checked on
payloads rewrapped by hand from ``zstd`` ones, which the document says decode the same way.
"""

from __future__ import annotations

import json
import pathlib
import struct
import zlib

import numpy as np
import pytest
import zstandard

import gpu_codec
from gpu_codec import errors as E
from tests import spec_reader
from tests.common import BACKENDS, use_backend
from tests.test_format import golden_inputs

GOLDEN = sorted((pathlib.Path(__file__).parent / "golden").glob("*_v1.bin"))  # the reader here reads version 1

KIND_TO_ERROR = {
    "header": E.PayloadHeaderError,
    "version": E.UnsupportedVersionError,
    "checksum": E.PayloadChecksumError,
    "layout": E.PayloadLayoutError,
    "dtype": E.PayloadDtypeError,
    "limit": E.PayloadLimitError,
    "index": E.PayloadIndexError,
}


def bits_of(a) -> tuple[str, tuple, bytes]:
    """dtype, shape and bytes of a decoded array (torch bfloat16 as its uint16 bit pattern)."""
    if type(a).__module__.startswith("torch"):
        import torch

        a = a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def assert_same(blob: bytes, base=None, spec_base=None) -> dict:
    """The spec reader and gpu_codec decode ``blob`` to the same bits; returns the spec reader's result."""
    ours = spec_reader.read(blob, spec_base)
    theirs = gpu_codec.decompress(blob, base=base)
    assert list(ours) == list(theirs)
    for name in theirs:
        assert bits_of(ours[name]) == bits_of(theirs[name]), name
    return ours


def header_of(blob: bytes) -> dict:
    (hlen,) = struct.unpack_from("<I", blob, 12)
    return json.loads(blob[16 : 16 + hlen])


def forms(blob: bytes) -> set[str]:
    """Every encoding, value form and index form a payload uses (inner ones of wrapped tensors too)."""
    out = set()
    for t in header_of(blob)["tensors"]:
        out.add(t["encoding"])
        c = t.get("codec", {})
        if "inner" in c:
            out.add("inner:" + c["inner"])
            c = c.get("ic", {})
        out.update(f"{key}:{c[key]}" for key in ("v", "i") if key in c)
    return out


# ----------------------------------------------------------------------------------- payload surgery, by the spec


def split(blob: bytes) -> tuple[dict, list[dict[str, bytes]]]:
    """Header and each tensor's buffers (role -> bytes)."""
    header = header_of(blob)
    (hlen,) = struct.unpack_from("<I", blob, 12)
    data = blob[16 + hlen : -4]
    bufs = [{b["role"]: data[b["offset"] : b["offset"] + b["nbytes"]] for b in t["buffers"]} for t in header["tensors"]]
    return header, bufs


def join(header: dict, bufs: list[dict[str, bytes]]) -> bytes:
    """A payload from a header and buffers, laid out as §2 and §5 say (offsets, padding, data_length, CRC)."""
    data = bytearray()
    for t, tb in zip(header["tensors"], bufs):
        entries = {b["role"]: b for b in t["buffers"]}
        t["buffers"] = []
        for role, raw in tb.items():
            data += bytes(-len(data) % 8)
            t["buffers"].append({**entries[role], "offset": len(data), "nbytes": len(raw)})
            data += raw
    header["data_length"] = len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(16 + len(hb)) % 8)
    body = b"GPUCODEC" + struct.pack("<II", 1, len(hb)) + hb + bytes(data)
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def test_surgery_helpers_round_trip():
    for path in GOLDEN:
        blob = path.read_bytes()
        assert join(*split(blob)) == blob, path.name


# ----------------------------------------------------------------------------------- golden payloads


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_payloads_decode_to_the_same_bits(path):
    blob = path.read_bytes()
    assert_same(blob)
    _, base = golden_inputs()
    out = assert_same(blob, base, base)
    assert any(not np.array_equal(out[k], base[k]) for k in base)


def test_golden_payloads_cover_every_v1_encoding_but_nvcomp():
    seen = set().union(*(forms(p.read_bytes()) for p in GOLDEN))
    want = {"coo", "sparse", "dense_q", "zstd", "inner:sparse", "v:f16", "v:bf16", "v:int8", "v:ternary"}
    assert want | {"i:raw", "i:rice"} <= seen
    assert "nvcomp" not in seen


# ----------------------------------------------------------------------------------- fresh payloads


def update(rng, dtypes=("float32", "float16", "float64"), size=(17, 33)):
    new, base = {}, {}
    for j, dt in enumerate(dtypes):
        shape = size if j % 2 == 0 else (size[0] * size[1] // 3,)
        b = rng.standard_normal(shape).astype(dt)
        new[f"t{j}.{dt}"] = (b + rng.standard_normal(shape).astype(dt) * 3).astype(dt)
        base[f"t{j}.{dt}"] = b
    return new, base


FRESH = {
    "coo_global": (dict(fraction=0.03), {"coo"}),
    "coo_per_tensor": (dict(fraction=0.2, scope="per_tensor"), {"coo"}),
    "dense": (dict(fraction=None), {"dense"}),
    "f32_fp64": (dict(fraction=0.1, pipeline=[{"id": "quantize", "dtype": "float32"}]), {"sparse", "v:f32", "i:raw"}),
    "f16_rice": (dict(fraction=0.05, pipeline=[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}]), {"i:rice"}),
    "bf16_per_tensor": (
        dict(fraction=0.3, scope="per_tensor", pipeline=[{"id": "quantize", "dtype": "bfloat16"}]),
        {"v:bf16", "i:raw"},
    ),
    "int8_odd_block_rice": (
        dict(fraction=0.25, pipeline=[{"id": "int8", "block_size": 7}, {"id": "rice"}]),
        {"v:int8", "i:rice"},
    ),
    "ternary_raw": (dict(fraction=0.1, pipeline=[{"id": "ternary"}]), {"v:ternary", "i:raw"}),
    "rice_only": (dict(fraction=0.01, pipeline=[{"id": "rice"}]), {"v:f32", "i:rice"}),
    "zstd_coo": (dict(fraction=0.05, pipeline=[{"id": "zstd", "level": 1}]), {"zstd", "inner:coo"}),
    "zstd_dense": (dict(fraction=None, pipeline=[{"id": "zstd"}]), {"zstd", "inner:dense"}),
    "dense_q_f16": (dict(fraction=None, pipeline=[{"id": "quantize", "dtype": "float16"}]), {"dense_q", "v:f16"}),
    "dense_q_ternary": (dict(fraction=None, pipeline=[{"id": "ternary"}]), {"dense_q", "v:ternary"}),
    "dense_q_int8_zstd": (
        dict(fraction=None, pipeline=[{"id": "int8", "block_size": 64}, {"id": "zstd", "level": 5}]),
        {"zstd", "inner:dense_q", "v:int8"},
    ),
    "ternary_rice_zstd_per_tensor": (
        dict(fraction=0.15, scope="per_tensor", pipeline=[{"id": "ternary"}, {"id": "rice"}, {"id": "zstd"}]),
        {"zstd", "inner:sparse", "v:ternary", "i:rice"},
    ),
}


@pytest.mark.parametrize("case", sorted(FRESH))
def test_fresh_payloads_decode_to_the_same_bits(case):
    kwargs, want = FRESH[case]
    new, base = update(np.random.default_rng(sorted(FRESH).index(case)))
    blob = gpu_codec.compress(new, base, **kwargs).to_bytes(version=1)
    assert want <= forms(blob)
    assert_same(blob)
    assert_same(blob, base, base)


KERNEL_BACKENDS = [p for p in BACKENDS if p.id != "cpu"]
KERNEL_CASES = ("int8_odd_block_rice", "ternary_rice_zstd_per_tensor", "dense_q_ternary", "bf16_per_tensor")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_written_payloads(backend):
    """Payloads written by the CUDA kernels (or their emulation) follow the document as well."""
    for case in KERNEL_CASES:
        kwargs, want = FRESH[case]
        new, base = update(np.random.default_rng(100 + KERNEL_CASES.index(case)))
        with use_backend(backend):
            blob = gpu_codec.compress(new, base, **kwargs).to_bytes(version=1)
        assert want <= forms(blob)
        assert_same(blob, base, base)


def test_rice_parameters_over_a_range_of_densities():
    """Large and small k, gaps of every size, and nnz = numel (every gap 0)."""
    rng = np.random.default_rng(7)
    u = {"big": rng.standard_normal(200_003).astype(np.float32), "small": rng.standard_normal(5).astype(np.float32)}
    ks = set()
    for fraction in (0.0004, 0.003, 0.05, 0.4, 1.0):
        for scope in ("global", "per_tensor"):
            blob = gpu_codec.compress(u, fraction=fraction, scope=scope, pipeline=[{"id": "rice"}]).to_bytes(version=1)
            for t in header_of(blob)["tensors"]:
                assert t["codec"]["k"] == spec_reader.rice_k(t["nnz"], int(np.prod(t["shape"])))
                ks.add(t["codec"]["k"])
            assert_same(blob)
    assert {0, 1, 7, 10} <= ks


def test_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    base = {"a": torch.randn(12, 11, generator=g).bfloat16(), "b": torch.randn(40, generator=g).bfloat16()}
    new = {k: (v.float() + torch.randn(v.shape, generator=g) * 2).bfloat16() for k, v in base.items()}
    spec_base = {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in base.items()}
    pipes = ([], [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}], [{"id": "int8", "block_size": 16}])
    for pipe in pipes:
        for fraction in (0.1, None) if not any(p["id"] == "rice" for p in pipe) else (0.1,):
            blob = gpu_codec.compress(new, base, fraction=fraction, pipeline=pipe).to_bytes(version=1)
            assert {t["dtype"] for t in header_of(blob)["tensors"]} == {"bfloat16"}
            assert_same(blob)
            out = assert_same(blob, base, spec_base)
            assert out["a"].dtype == np.uint16


def test_worked_rice_example():
    """The example of §8.2, through both readers."""
    u = {"w": np.zeros(256, np.float32)}
    u["w"][[3, 4, 90, 200]] = [1.0, 2.0, 3.0, 4.0]
    blob = gpu_codec.compress(u, fraction=4 / 256, pipeline=[{"id": "rice"}]).to_bytes(version=1)
    header, bufs = split(blob)
    assert header["tensors"][0]["codec"] == {"v": "f32", "i": "rice", "k": 5, "bits": 29}
    assert bufs[0]["indices"] == bytes.fromhex("03d43611")
    assert np.flatnonzero(assert_same(blob)["w"]).tolist() == [3, 4, 90, 200]


# ----------------------------------------------------------------------------------- nvcomp framing


def as_nvcomp(blob: bytes, content_size: bool = True) -> bytes:
    """A zstd payload rewritten as nvcomp (§8.3); optionally with frames that omit Frame_Content_Size."""
    header, bufs = split(blob)
    header["pipeline"][-1] = {"id": "nvcomp", "algorithm": "zstd"}
    for t, tb in zip(header["tensors"], bufs):
        assert t["encoding"] == "zstd"
        t["encoding"] = "nvcomp"
        if not content_size:
            raw = zstandard.ZstdDecompressor().decompress(tb["compressed"])
            frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
            assert zstandard.get_frame_parameters(frame).content_size == zstandard.CONTENTSIZE_UNKNOWN
            tb["compressed"] = frame
            t["codec"]["zbytes"] = len(frame)
        t["codec"] = {"algo": "zstd", **t["codec"]}
    return join(header, bufs)


@pytest.mark.parametrize("content_size", [True, False])
def test_nvcomp_framing(content_size):
    new, base = update(np.random.default_rng(11))
    pipe = [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd"}]
    blob = gpu_codec.compress(new, base, fraction=0.05, pipeline=pipe).to_bytes(version=1)
    nv = as_nvcomp(blob, content_size)
    assert {"nvcomp", "inner:sparse"} <= forms(nv)
    out = assert_same(nv)
    ref = gpu_codec.decompress(blob)
    assert all(out[k].tobytes() == ref[k].tobytes() for k in ref)


# ----------------------------------------------------------------------------------- what a reader must reject


def _tensor(h, name):
    return next(i for i, t in enumerate(h["tensors"]) if t["name"] == name)


def _edit(path: str, fn):
    def run():
        header, bufs = split((pathlib.Path(__file__).parent / "golden" / path).read_bytes())
        out = fn(header, bufs)
        return out if isinstance(out, bytes) else join(header, bufs)

    return run


def _set(h, b, name, role, byte, value):
    i = _tensor(h, name)
    raw = bytearray(b[i][role])
    raw[byte] = value
    b[i][role] = bytes(raw)


def _codec(h, name, **kw):
    h["tensors"][_tensor(h, name)]["codec"].update(kw)


def _flip_crc(h, b):
    blob = join(h, b)
    return blob[:-1] + bytes([blob[-1] ^ 1])


def _version_4(h, b):
    blob = join(h, b)
    return blob[:8] + struct.pack("<I", 4) + blob[12:]


def _pad_gap(h, b):
    blob = bytearray(join(h, b))
    (hlen,) = struct.unpack_from("<I", blob, 12)
    blob[16 + hlen + 9] = 1  # between conv.weight's 9 Rice bytes and its values at offset 16
    body = bytes(blob[:-4])
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def _zstd_trailing(h, b):
    i = _tensor(h, "fc.weight")
    b[i]["compressed"] += b"\x00"
    h["tensors"][i]["codec"]["zbytes"] += 1


def _zstd_second_frame(h, b):
    i = _tensor(h, "fc.bias")
    b[i]["compressed"] += zstandard.ZstdCompressor().compress(b"")
    h["tensors"][i]["codec"]["zbytes"] = len(b[i]["compressed"])


def _zstd_short(h, b):
    i = _tensor(h, "fc.bias")
    raw = zstandard.ZstdDecompressor().decompress(b[i]["compressed"])
    b[i]["compressed"] = zstandard.ZstdCompressor(write_content_size=False).compress(raw[:-1])
    h["tensors"][i]["codec"]["zbytes"] = len(b[i]["compressed"])


def _coo_index(h, b):
    i = _tensor(h, "fc.weight")
    b[i]["indices"] = b[i]["indices"][:-4] + struct.pack("<I", 320)


def _coo_repeat(h, b):
    i = _tensor(h, "fc.weight")
    b[i]["indices"] = b[i]["indices"][:4] + b[i]["indices"][:-4]


def _f16_inf(h, b):
    _set(h, b, "conv.weight", "values", 1, 0x7C)
    _set(h, b, "conv.weight", "values", 0, 0x00)


def _dense_q_nnz(h, b):
    h["tensors"][_tensor(h, "fc.bias")]["nnz"] = 9


def _pipeline_unknown(h, b):
    h["pipeline"].append({"id": "lzma"})


def _pipeline_order(h, b):
    h["pipeline"][1], h["pipeline"][2] = h["pipeline"][2], h["pipeline"][1]


def _value_form(h, b):
    t = h["tensors"][_tensor(h, "fc.bias")]
    t["codec"]["v"] = "f16"
    t["buffers"][1]["dtype"] = "float16"


def _wrong_inner_dtype(h, b):
    h["tensors"][_tensor(h, "conv.weight")]["buffers"][1]["dtype"] = "uint16"


REJECT = {
    "crc": (_edit("topk_global_v1.bin", _flip_crc), "checksum"),
    "unknown version 4": (_edit("topk_global_v1.bin", _version_4), "version"),
    "non-zero gap byte": (_edit("fp16_rice_v1.bin", _pad_gap), "layout"),
    "coo index out of range": (_edit("topk_global_v1.bin", _coo_index), "index"),
    "coo index repeated": (_edit("topk_global_v1.bin", _coo_repeat), "index"),
    "f16 infinity": (_edit("fp16_rice_v1.bin", _f16_inf), "index"),
    "rice padding bit": (_edit("fp16_rice_v1.bin", lambda h, b: _set(h, b, "fc.bias", "indices", 0, 0xFF)), "layout"),
    "rice k": (_edit("fp16_rice_v1.bin", lambda h, b: _codec(h, "fc.weight", k=5)), "header"),
    "rice bits": (_edit("fp16_rice_v1.bin", lambda h, b: _codec(h, "fc.weight", bits=79)), "layout"),
    "rice index past numel": (
        _edit("fp16_rice_v1.bin", lambda h, b: _set(h, b, "fc.bias", "indices", 0, 0x13)),
        "index",
    ),
    "extra codec field": (_edit("fp16_rice_v1.bin", lambda h, b: _codec(h, "fc.weight", block=4)), "header"),
    "buffer dtype": (_edit("bf16_v1.bin", _wrong_inner_dtype), "dtype"),
    "ternary mu not binary32": (_edit("ternary_rice_v1.bin", lambda h, b: _codec(h, "fc.weight", mu=0.1)), "header"),
    "int8 block vs pipeline": (_edit("int8_dense_v1.bin", lambda h, b: _codec(h, "fc.bias", block=32)), "layout"),
    "dense_q nnz": (_edit("int8_dense_v1.bin", _dense_q_nnz), "layout"),
    "value form vs pipeline": (_edit("bf16_v1.bin", _value_form), "layout"),
    "pipeline unknown codec": (_edit("ternary_rice_v1.bin", _pipeline_unknown), "header"),
    "pipeline order": (_edit("ternary_rice_v1.bin", _pipeline_order), "header"),
    "zstd raw size": (_edit("fp16_rice_zstd_v1.bin", lambda h, b: _codec(h, "fc.weight", raw=35)), "layout"),
    "zstd trailing byte": (_edit("fp16_rice_zstd_v1.bin", _zstd_trailing), "layout"),
    "zstd second frame": (_edit("fp16_rice_zstd_v1.bin", _zstd_second_frame), "layout"),
    "zstd frame too short": (_edit("fp16_rice_zstd_v1.bin", _zstd_short), "layout"),
    "zstd inner ic": (_edit("fp16_rice_zstd_v1.bin", lambda h, b: _codec(h, "scale", inner="coo")), "header"),
}


@pytest.mark.parametrize("case", sorted(REJECT))
def test_both_readers_reject_with_the_documented_error(case):
    make, kind = REJECT[case]
    blob = make()
    with pytest.raises(spec_reader.SpecError) as ours:
        spec_reader.read(blob)
    assert ours.value.kind == kind, str(ours.value)
    with pytest.raises(E.PayloadError) as theirs:
        gpu_codec.decompress(blob)
    assert type(theirs.value) is KIND_TO_ERROR[kind], str(theirs.value)
