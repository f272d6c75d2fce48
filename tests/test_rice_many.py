"""Rice streams of many small tensors decoded at once (gpu_codec.xp.rice.rice_decode_many, and the window of a
payload's records that Pipeline.decode_stream decodes that way) against each stream decoded alone: the same
indices, and where any stream is bad, nothing taken from the batch, so that each record's own decode raises the
error that names it."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import rice as R

import gpu_codec
from gpu_codec import Quantize, RiceIndices, Zstd
from gpu_codec.codecs import pipeline as P
from gpu_codec.errors import PayloadError
from gpu_codec.payload import Payload
from gpu_codec.xp import rice as X

from .common import BACKENDS, use_backend


def _streams(rng, count):
    out = []
    for _ in range(count):
        numel = int(rng.choice([1, 7, 300, 5000, 1 << 20, 1 << 33]))
        nnz = min(numel, int(rng.choice([0, 1, 2, 40, 700])))
        ix = np.sort(rng.choice(numel, nnz, replace=False))
        k = R.rice_param(nnz, numel)
        s, b = R.rice_encode(ix, k)
        out.append([s, b, k, nnz, numel])
    return out


def _alone(s, b, k, n, m):
    try:
        return X.rice_decode(s, b, k, n, m)
    except PayloadError as e:
        return type(e)


def _flaw(rng, case):
    """One stream of ``case`` broken one way: a bit flipped, a padding bit set, its bit count or nnz changed, a
    byte cut, its numel lowered under its last index."""
    j = int(rng.integers(len(case)))
    s, b, k, n, m = case[j]
    how = int(rng.integers(6))
    if how == 0 and s.size:
        s = s.copy()
        bit = int(rng.integers(8 * s.size))
        s[bit // 8] ^= np.uint8(1 << bit % 8)
    elif how == 1 and b % 8:
        s = s.copy()
        s[-1] |= np.uint8(0x80)
    elif how == 2:
        b += int(rng.choice([-9, -1, 1, 8]))
    elif how == 3:
        n += 1 if n == 0 else int(rng.choice([-1, 1]))
    elif how == 4 and s.size:
        s = s[:-1]
    elif how == 5 and n:
        m = max(n, m // 2)
    case[j] = [s, b, k, n, m]


@pytest.mark.parametrize("seed", range(4))
def test_streams_decoded_at_once_are_each_ones_or_none_where_any_is_bad(seed):
    rng = np.random.default_rng(seed)
    taken = refused = 0
    for trial in range(120):
        case = _streams(rng, int(rng.integers(1, 25)))
        if trial % 2:
            _flaw(rng, case)
        alone = [_alone(*c) for c in case]
        got = X.rice_decode_many(*map(list, zip(*case)))
        if got is None:
            refused += 1
            assert trial % 2  # (valid streams are never refused)
            continue
        taken += 1
        for g, a in zip(got, alone):
            assert isinstance(a, np.ndarray) and g.dtype == a.dtype and np.array_equal(g, a)
    assert taken > 60 and refused > 10


def _update(tensors=60, seed=0):
    rng = np.random.default_rng(seed)
    base = {f"t{i}": rng.standard_normal(int(rng.integers(1, 4000))).astype(np.float32) for i in range(tensors)}
    new = {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}
    return new, base


def _outcome(fn):
    try:
        return "ok", {k: np.asarray(v).tobytes() for k, v in fn().items()}
    except PayloadError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zstd", [False, True], ids=["rice", "rice+zstd"])
def test_a_payloads_rice_records_decode_as_they_do_one_by_one(backend, zstd, monkeypatch):
    """decompress (with and without a base) and an aggregator's add of Rice payloads: the same outputs with the
    window's streams decoded at once as with each decoded alone, and the same error naming the same tensor where
    one record's stream is broken."""
    new, base = _update()
    pipeline = [Quantize("float16"), RiceIndices()] + ([Zstd()] if zstd else [])
    with use_backend("cpu"):
        blob = gpu_codec.compress(new, base, fraction=0.05, pipeline=pipeline).to_bytes()
    calls = []
    real = X.rice_decode_many
    monkeypatch.setattr(P, "rice_decode_many", lambda *a: calls.append(1) or real(*a))

    def bad(j: int, how: str) -> Payload:
        p = Payload.from_bytes(blob)
        rec = p.tensors[j]
        if how == "bits":  # a bit count its stream's bytes do not hold
            (rec.codec["ic"] if zstd else rec.codec)["bits"] += 8
        elif zstd:
            rec.codec["ic"]["bits"] -= 1  # (a stream whose last code no longer ends at its last bit, or so)
        else:  # a bit of the stream flipped (which may leave it valid: other indices)
            s = rec.buffers["indices"].copy()
            s[-1] ^= np.uint8(1)
            rec.buffers["indices"] = s
        return p

    def runs():
        with use_backend(backend):
            agg = gpu_codec.Aggregator(base=base)
            yield _outcome(lambda: gpu_codec.decompress(blob, base=base))
            yield _outcome(lambda: gpu_codec.decompress(blob))
            yield _outcome(lambda: (agg.add(blob), agg.result())[1])
            for how in ("bits", "flip"):
                for j in (0, 17, 59):
                    yield _outcome(lambda j=j, how=how: gpu_codec.decompress(bad(j, how), base=base))
                    yield _outcome(lambda j=j, how=how: gpu_codec.Aggregator(base=base).add(bad(j, how)) or {})

    batched = list(runs())
    assert calls
    monkeypatch.setattr(P, "RICE_MOST", 0)  # every stream decoded alone
    calls.clear()
    alone = list(runs())
    assert not calls
    assert batched == alone
    assert [o[0] for o in batched[:3]] == ["ok"] * 3 and all(o[0] != "ok" for o in batched[3:9])
    assert all(f"tensor 't{j}'" in o[1] for j, o in zip((0, 0, 17, 17, 59, 59), batched[3:9]))


def test_a_record_made_by_hand_with_a_bit_count_that_is_no_integer_is_refused_as_alone():
    """A payload built by hand whose Rice record's bit count is not an integer: the error of the record decoded
    alone (a PayloadError naming it), not a failure of the window's decode."""
    new, base = _update(20)
    p = gpu_codec.compress(new, base, fraction=0.05, pipeline=[Quantize("float16"), RiceIndices()])
    p.tensors[3].codec["bits"] = "many"
    with pytest.raises(PayloadError, match="tensor 't3'"):
        gpu_codec.decompress(p, base=base)
