"""A codec of one's own, defined here and not in the package, is written in the current wire version with the
fields it declares, read back, and refused by a reader that does not know it; the built-in codecs' tables come from
their declarations alone."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec import errors as E
from gpu_codec.codecs import register_codec, wire_layouts
from gpu_codec.codecs.base import Form, ValueCodec
from gpu_codec.codecs.registry import _REGISTRY, BUILTIN
from gpu_codec.format import TensorRecord, pack, unpack
from gpu_codec.format.schema import Field


def _layout(rec, n):
    return {"levels": (("uint8",), n)}


def _decode(rec, bufs, n, backend):
    q = backend.xp.asarray(bufs["levels"]).astype(np.float32)
    step = np.float32(rec.codec["scale"]) / np.float32(127)
    return (q - np.float32(127)) * step * np.float32(rec.codec["gain"])


class Linear8(ValueCodec):
    """Kept values as 255 uniform levels in [-scale, scale] (scale: the tensor's largest |value|), times a gain
    stored once with the form."""

    codec_id = "test_linear8"
    forms = (
        Form(
            "lin8",
            (Field("gain", "varint", lo=1, hi=8, per="form"), Field("scale", "f32", empty=0.0)),
            _layout,
            _decode,
        ),
    )

    def __init__(self, gain: int = 1):
        self.gain = gain

    @property
    def lossless(self) -> bool:
        return False

    def encode_values(self, values, indices, res, backend):
        out = []
        for v, i, r in zip(values, indices, res):
            v = np.asarray(v, np.float32)
            scale = float(np.float32(np.abs(v).max() / self.gain)) if v.size else 0.0
            step = np.float32(scale) / np.float32(127)
            q = np.clip(np.rint(v / np.float32(self.gain) / step) + 127, 0, 254) if scale else np.full(v.size, 127)
            q = q.astype(np.uint8)
            if r is not None:  # the residual of each kept entry: value - decoded
                r[i] = v - (q.astype(np.float32) - np.float32(127)) * step * np.float32(self.gain)
            out.append(({"gain": self.gain, "scale": scale}, {"levels": q}, {}))
        return out


def _unregister(cls) -> None:
    import gpu_codec.codecs.registry as reg

    _REGISTRY.pop(cls.codec_id, None)
    reg._layouts = None  # the tables are built again without it


@pytest.fixture
def linear8():
    register_codec(Linear8)
    try:
        yield Linear8
    finally:
        _unregister(Linear8)


def _update():
    rng = np.random.default_rng(3)
    return {
        "a": rng.standard_normal(3000).astype(np.float32),
        "b": rng.standard_normal((20, 30)).astype(np.float32),
        "c": np.zeros(50, np.float32),
    }


def test_a_registered_value_codec_is_written_in_the_current_version(linear8):
    u = _update()
    p = gpu_codec.compress(u, fraction=0.05, scope="per_tensor", pipeline=[linear8(gain=2)])
    blob = p.to_bytes()
    assert blob[8] == 2  # version 2, not the JSON header of version 1
    assert b"lin8" in blob and b'"test_linear8"' in blob  # the form by its tag, the config as a JSON stage
    header, records = unpack(blob, wire_layouts())
    assert header["pipeline"][1:] == [{"id": "test_linear8", "gain": 2}]
    by_name = {r.name: r for r in records}
    for r in p.tensors:  # every field back as written: the form's gain, each tensor's scale (none where empty)
        assert by_name[r.name].codec == r.codec
        np.testing.assert_array_equal(by_name[r.name].buffers["levels"], r.buffers["levels"])
    assert by_name["c"].codec["scale"] == 0.0 and by_name["c"].nnz == 3  # zeros are kept too (k of 50)
    # decoded as the codec says, through the engine
    got = gpu_codec.decompress(blob)
    for r in p.tensors:
        idx = np.asarray(r.buffers.get("indices"))
        levels = r.buffers["levels"].astype(np.float32)
        want = (levels - 127) * (np.float32(r.codec["scale"]) / np.float32(127)) * np.float32(2)
        np.testing.assert_array_equal(got[r.name].reshape(-1)[idx], want)
    # smaller than version 1, which spells every field in JSON
    assert len(blob) < len(p.to_bytes(version=1))


def test_error_feedback_through_a_registered_codec(linear8):
    ef = gpu_codec.ErrorFeedback()
    u = _update()
    p = gpu_codec.compress(u, fraction=0.05, pipeline=[linear8()], residual=ef)
    dec = gpu_codec.decompress(p.to_bytes())
    for name, a in u.items():  # update = decoded + residual, exactly where kept and elsewhere
        np.testing.assert_allclose(dec[name] + ef.residual(name), a, rtol=0, atol=1e-6)


def test_a_reader_without_the_codec_refuses_its_payload(linear8):
    blob = gpu_codec.compress(_update(), fraction=0.05, pipeline=[linear8()]).to_bytes()
    _unregister(linear8)
    try:
        with pytest.raises(E.PayloadHeaderError, match="'lin8' is not known to this reader"):
            gpu_codec.decompress(blob)
    finally:
        register_codec(linear8)


def test_a_value_its_declaration_cannot_hold_falls_back_to_version_1(linear8):
    """A field value outside what the codec declares (here a negative scale for an ``f32`` field, which holds
    finite non-negative values) has no place in the compact table: the writer falls back to version 1."""
    rec = TensorRecord(
        "w",
        "float32",
        (4,),
        "sparse",
        1,
        {"indices": np.array([2], np.uint32), "levels": np.array([200], np.uint8)},
        {"v": "lin8", "gain": 1, "scale": -1.0, "i": "raw"},
    )
    w = wire_layouts()
    assert pack([rec], pipeline=[], layouts=w)[8] == 1
    rec.codec["scale"] = 1.0
    assert pack([rec], pipeline=[], layouts=w)[8] == 2
    assert unpack(pack([rec], pipeline=[], layouts=w), w)[1][0].codec == rec.codec


def test_wire_codes_belong_to_the_built_in_codecs():
    class Coded(Linear8):
        codec_id = "test_coded"
        wire_code = 9

    with pytest.raises(E.CodecConfigError, match="wire codes are fixed for the built-in codecs"):
        register_codec(Coded)

    class CodedForm(Linear8):
        codec_id = "test_coded_form"
        forms = (Form("lin8c", (), _layout, _decode, code=7),)

    with pytest.raises(E.CodecConfigError, match="wire codes"):
        register_codec(CodedForm)


def test_the_built_in_tables_come_from_the_codecs_declarations():
    w = wire_layouts()
    declared = {c.codec_id: c.wire_code for c in BUILTIN}
    assert {s.codec_id: code for code, s in w.stages.items()} == declared
    assert sorted(w.value_codes) == [0, 1, 2, 3, 4] and sorted(w.index_codes) == [0, 1]
    assert [w.value_codes[c].tag for c in range(5)] == ["f32", "f16", "bf16", "int8", "ternary"]
