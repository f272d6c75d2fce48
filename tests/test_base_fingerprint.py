"""The optional base fingerprint: written only when asked, in every format version, checked by decompress against
the base it is given (BaseMismatchError for another base), the same on every backend, computed from a few samples
gathered where the base lives; payloads made without it keep their bytes."""

from __future__ import annotations

import importlib
import struct

import numpy as np
import pytest

import gpu_codec
from gpu_codec import BaseMismatchError, InvalidInputError, PayloadHeaderError, Quantize, Zstd
from gpu_codec.format import fingerprint as F
from gpu_codec.format import v2

from .common import BACKENDS, build_payload, split_payload, use_backend


def model(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "conv": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "fc": rng.standard_normal(5000).astype(np.float32),
        "half": rng.standard_normal(40).astype(np.float16),
        "bias": rng.standard_normal(12),
        "scalar": np.asarray(np.float32(0.5)),
    }


def trained(base: dict) -> dict:
    rng = np.random.default_rng(9)
    return {k: (v + rng.standard_normal(v.shape) * 0.01).astype(v.dtype) for k, v in base.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", [None, 1])
@pytest.mark.parametrize("pipeline", [None, [Quantize("float16"), Zstd()]])
def test_the_right_base_decodes_another_is_refused(backend, version, pipeline):
    base = model()
    with use_backend(backend):
        p = gpu_codec.compress(trained(base), base, fraction=0.1, pipeline=pipeline, fingerprint_base=True)
        blob = p.to_bytes(version=version)
        assert len(blob) == p.nbytes or version is not None
        back = gpu_codec.Payload.from_bytes(blob)
        assert back.base_fingerprint == p.base_fingerprint and back.to_bytes(version=version) == blob
        plain = gpu_codec.compress(trained(base), base, fraction=0.1, pipeline=pipeline).to_bytes(version=version)
        for b in (base, None):
            got, want = gpu_codec.decompress(blob, base=b), gpu_codec.decompress(plain, base=b)
            assert all(np.array_equal(got[k], want[k]) for k in want)
        with pytest.raises(BaseMismatchError, match="not the one this payload was made against"):
            gpu_codec.decompress(blob, base=model(seed=1))  # another model of the same shapes
        with pytest.raises(BaseMismatchError):
            gpu_codec.decompress(blob, base=trained(base))  # the next round's model


def test_the_same_fingerprint_on_every_backend_and_kind():
    torch = pytest.importorskip("torch")
    base = model()
    fps = set()
    for backend in ("cpu", "emulated"):
        with use_backend(backend):
            fps.add(gpu_codec.compress(trained(base), base, fingerprint_base=True).base_fingerprint)
            tb = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in base.items()}
            tn = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in trained(base).items()}
            fps.add(gpu_codec.compress(tn, tb, fingerprint_base=True).base_fingerprint)
    assert len(fps) == 1
    (fp,) = fps
    tensors = [(k, str(v.dtype), v.reshape(-1)) for k, v in base.items()]
    assert fp == F.fingerprint(tensors)


def test_bfloat16_bases():
    torch = pytest.importorskip("torch")
    base = {"w": torch.linspace(-1, 1, 1000).to(torch.bfloat16)}
    new = {"w": base["w"] + 0.25}
    p = gpu_codec.compress(new, base, fraction=0.5, fingerprint_base=True)
    blob = p.to_bytes()
    assert torch.equal(gpu_codec.decompress(blob, base=base)["w"], gpu_codec.decompress(blob, base=base)["w"])
    other = {"w": base["w"].clone()}
    other["w"][int(F.sample_positions(1000)[7])] += 1
    with pytest.raises(BaseMismatchError):
        gpu_codec.decompress(blob, base=other)


def test_what_is_sampled_and_what_is_not():
    base = {"w": np.arange(10_000, dtype=np.float32)}
    fp = F.fingerprint([("w", "float32", base["w"])])
    pos = F.sample_positions(10_000)
    assert pos.size == F.SAMPLES and np.all(np.diff(pos) > 0) and pos[-1] < 10_000
    for at in (int(pos[0]), int(pos[100]), int(pos[-1])):
        w = base["w"].copy()
        w[at] = -1
        assert F.fingerprint([("w", "float32", w)]) != fp
    # documented limit: a change at a position that is not sampled is not seen (a wrong base differs everywhere)
    w = base["w"].copy()
    w[int(pos[0]) + 1] = -1
    assert F.fingerprint([("w", "float32", w)]) == fp
    # names, dtypes and element counts are hashed too; every element of a small tensor is sampled
    assert F.fingerprint([("v", "float32", base["w"])]) != fp
    assert F.sample_positions(5).tolist() == [0, 1, 2, 3, 4] and F.sample_positions(0).size == 0


def test_off_by_default_and_the_bytes_it_adds():
    base = model()
    p = gpu_codec.compress(trained(base), base, fraction=0.1)
    assert p.base_fingerprint is None
    q = gpu_codec.compress(trained(base), base, fraction=0.1, fingerprint_base=True)
    a, b = p.to_bytes(), q.to_bytes()
    assert b[12] == a[12] | v2.FLAG_FINGERPRINT and len(b) == len(a) + F.NBYTES
    assert bytes.fromhex(q.base_fingerprint) in b
    assert "base_fingerprint" not in split_payload(p.to_bytes(version=1))[0]
    assert split_payload(q.to_bytes(version=1))[0]["base_fingerprint"] == q.base_fingerprint


def test_needs_a_base():
    with pytest.raises(InvalidInputError, match="needs the base"):
        gpu_codec.compress(model(), fingerprint_base=True)


@pytest.mark.parametrize("bad", [None, 7, "", "ABCDEF0123456789", "0123456789abcde", "0123456789abcdef0", "xyz"])
def test_a_malformed_v1_fingerprint_is_a_header_error(bad):
    base = model()
    blob = gpu_codec.compress(trained(base), base, fingerprint_base=True).to_bytes(version=1)
    h, data = split_payload(blob)
    h["base_fingerprint"] = bad
    with pytest.raises(PayloadHeaderError, match="base_fingerprint"):
        gpu_codec.decompress(build_payload(h, data))


def test_a_v2_table_cut_inside_the_fingerprint():
    import zlib

    p = gpu_codec.compress({"w": np.ones(4, np.float32)}, {"w": np.zeros(4, np.float32)}, fraction=0.25)
    blob = bytearray(p.to_bytes())
    blob[12] |= v2.FLAG_FINGERPRINT  # says a fingerprint follows: the table is then misread and ends early
    body = bytes(blob[:-4])
    with pytest.raises(PayloadHeaderError):
        gpu_codec.decompress(body + struct.pack("<I", zlib.crc32(body)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aggregator_with_a_base_refuses_a_payload_made_against_another(backend, monkeypatch):
    """Aggregator.add checks a payload's base fingerprint against its base, as decompress does: another base's
    payload raises BaseMismatchError and leaves the aggregation as it was; payloads without a fingerprint, and an
    aggregator without a base, are not checked. The base's fingerprint is computed once (per order of the names)."""
    A = importlib.import_module("gpu_codec.aggregate")  # (the module: the package exports its function)
    base, other = model(), model(seed=1)
    with use_backend(backend):
        good = gpu_codec.compress(trained(base), base, fraction=0.1, fingerprint_base=True)
        plain = gpu_codec.compress(trained(other), other, fraction=0.1)
        wrong = gpu_codec.compress(trained(other), other, fraction=0.1, fingerprint_base=True).to_bytes()
        calls = []
        monkeypatch.setattr(A, "fingerprint", lambda *a: calls.append(1) or F.fingerprint(*a))
        agg = gpu_codec.Aggregator(base=base)
        agg.add(good)
        agg.add(plain, weight=2)
        before = {k: v.copy() for k, v in agg.result().items()}
        with pytest.raises(BaseMismatchError, match="payload 2 was made against another base"):
            agg.add(wrong)
        agg.add(good.to_bytes())
        assert agg.count == 3 and calls == [1]
        want = gpu_codec.Aggregator(base=base)
        for p, w in ((good, 1), (plain, 2), (good, 1)):
            want.add(p, weight=w)
        got = agg.result()
        assert all(np.array_equal(got[k], v) for k, v in want.result().items())
        assert not all(np.array_equal(got[k], v) for k, v in before.items())
        calls.clear()
        loose = gpu_codec.Aggregator()  # (no base: nothing to check against)
        loose.add(good)
        loose.add(wrong)
        assert loose.count == 2 and not calls
