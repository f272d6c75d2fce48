"""The value codecs as the NumPy backend runs them (in chunks on the pool, residual fixed per chunk) give the bytes and
residuals of the whole-array twins, over many chunks, with and without indices, fp32 and fp64 values."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import quantize as q


def _whole(v, codec, block):
    """The codec on the whole array, and the decoded values the residual takes."""
    if codec in ("float16", "bfloat16"):
        enc, dec = (q.cast_f16, q.decode_f16) if codec == "float16" else (q.cast_bf16, q.decode_bf16)
        bits = enc(v)
        return (bits,), dec(bits)
    if codec == "int8":
        qq, ss = q.int8_absmax(v, block)
        return (qq, ss), q.int8_decode(qq, ss, block)
    a = np.abs(v).astype(np.float64) if v.dtype == np.float64 else np.abs(v.astype(np.float32)).astype(np.float64)
    mu = np.float32(np.float64(q.pairwise_sum(a)) / np.float64(v.size))  # one tree over every entry
    signs = q.ternary_signs(v)
    return (signs, mu), q.ternary_decode(signs, mu, v.size)


def _chunked(v, codec, block, idx, res):
    if codec in ("float16", "bfloat16"):
        return (q.encode_cast16(v, codec, idx, res),)
    if codec == "int8":
        return q.encode_int8(v, block, idx, res)
    return q.encode_ternary(v, idx, res)


@pytest.mark.parametrize("codec", ["float16", "bfloat16", "int8", "ternary"])
@pytest.mark.parametrize("vdtype", [np.float32, np.float64])
@pytest.mark.parametrize("sparse", [True, False], ids=["indices", "dense"])
def test_chunked_encoders_match_the_whole_array(codec, vdtype, sparse, monkeypatch):
    monkeypatch.setattr(q, "CODEC_CHUNK", 64)  # 1,000 entries: 16 chunks, the last one short
    rng = np.random.default_rng(len(codec))
    n, numel, block = 1000, 5000, 24  # int8 chunks of two whole blocks (48 entries)
    v = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e5], n)).astype(vdtype)
    idx = np.sort(rng.choice(numel, n, replace=False)).astype(np.uint32) if sparse else None
    res_whole, res_chunk = (np.full(numel if sparse else n, 7, vdtype) for _ in range(2))
    want, dec = _whole(v, codec, block)
    q.fix_residual(res_whole, idx, v, dec)
    got = _chunked(v, codec, block, idx, res_chunk)
    for w, g in zip(want, got):
        assert np.asarray(w).tobytes() == np.asarray(g).tobytes()
    assert res_chunk.tobytes() == res_whole.tobytes()


def test_the_ternary_sum_is_one_pairwise_tree_whatever_the_chunks(monkeypatch):
    # 2^53 + 1 rounds back to 2^53 in fp64: which ones meet the large values first decides the sum
    rng = np.random.default_rng(1)
    v = np.ones(3001)
    v[rng.choice(3001, 40, replace=False)] = 2.0**53
    v[::7] *= -1.0
    one = q.pairwise_sum(np.abs(v))
    for chunk in (1, 8, 64, 1024, 4096):
        monkeypatch.setattr(q, "CODEC_CHUNK", chunk)
        assert q.abs_pairwise_sum(v) == one
    monkeypatch.setattr(q, "CODEC_CHUNK", 48)  # chunks that are no power of two would build another tree
    assert q.abs_pairwise_sum(v) != one


@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
def test_small_tensors_cast_together_give_each_ones_bits(codec, monkeypatch):
    """encode_cast16_many against encode_cast16 of each tensor: fp32 and fp64 values mixed, empty tensors, values
    past the fp16 range, groups cut at CODEC_CHUNK values, tensors over MANY_MOST values and tensors with a
    residual to fix (alone; their residuals as encode_cast16 leaves them)."""
    monkeypatch.setattr(q, "CODEC_CHUNK", 1 << 10)
    rng = np.random.default_rng(8)
    for _ in range(20):
        vals, idxs, res, want_res = [], [], [], []
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.choice([0, 1, 5, 300, 900, q.MANY_MOST + 1]))
            v = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e5])).astype(rng.choice([np.float32, np.float64]))
            vals.append(v)
            idxs.append(np.arange(n, dtype=np.uint32) * 2)
            r = np.zeros(2 * n, v.dtype) if rng.random() < 0.2 else None
            res.append(r)
            want_res.append(None if r is None else r.copy())
        got = q.encode_cast16_many(vals, codec, idxs, res)
        for v, i, r, g, w in zip(vals, idxs, res, got, want_res):
            want = q.encode_cast16(v, codec, i, w)
            assert g.dtype == np.uint16 and g.tobytes() == want.tobytes()
            assert r is None or np.array_equal(r, w)
