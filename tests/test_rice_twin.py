"""The NumPy Rice coder against a bit-by-bit encoder written from the stream layout alone (cpu_fallback/rice.py's
docstring, docs/FORMAT.md): every field width path, unary codes set in bit arrays and deposited into words (long
gaps), and chunk boundaries that fall inside bytes; the coder of many tensors at once (``rice_encode_many``)
against the coder of one, stream by stream."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import rice

from gpu_codec.xp.rice import rice_decode


def spec_encode(idx: list[int], k: int) -> tuple[bytes, int]:
    """Low sections (k bits of each gap, least significant first), then per gap q zeros and a one."""
    low, unary, prev = [], [], -1
    for i in idx:
        g, prev = i - prev - 1, i
        low += [(g >> t) & 1 for t in range(k)]
        unary += [0] * (g >> k) + [1]
    stream = low + unary
    return np.packbits(np.array(stream, np.uint8), bitorder="little").tobytes(), len(stream)


def _cases(rng):
    yield "uniform", np.sort(rng.choice(50_000, 700, replace=False))
    far = np.sort(rng.choice(1 << 18, 5, replace=False))  # clusters apart: long unary runs for small k (words)
    yield "clustered", np.unique(np.concatenate([np.arange(x, x + 150) for x in far]))
    yield "dense", np.arange(3, 900)
    yield "one", np.array([12345])


@pytest.mark.parametrize("k", [0, 1, 3, 6, 8, 9, 13, 20, 40])
def test_numpy_rice_matches_the_layout_bit_for_bit(k, monkeypatch):
    monkeypatch.setattr(rice, "CHUNK", 64)  # many chunks: their low fields are whole bytes, their unary codes not
    rng = np.random.default_rng(k)
    for name, idx in _cases(rng):
        idx = idx.astype(np.uint64)
        want, nbits = spec_encode(idx.tolist(), k)
        got, bits = rice.rice_encode(idx, k)
        assert bits == nbits and got.tobytes() == want, (name, k)
        numel = int(idx[-1]) + 1
        if bits <= rice.max_bits(idx.size, numel, k):  # a k the writer would choose for this tensor
            assert rice_decode(got, bits, k, idx.size, numel).tolist() == idx.tolist(), (name, k)


def test_long_gaps_take_the_word_path_and_dense_ones_the_bit_array(monkeypatch):
    calls = []
    deposit = rice._deposit
    monkeypatch.setattr(rice, "_deposit", lambda *a: calls.append(1) or deposit(*a))
    rice.rice_encode(np.arange(0, 64_000, 100, dtype=np.uint32), 6)  # q = 1: a bit array
    assert not calls
    rice.rice_encode(np.array([5, 1 << 25, 1 << 26], np.uint32), 2)  # q ~ 2^23: words
    assert calls


def test_many_tensors_coded_at_once_give_each_ones_stream(monkeypatch):
    """rice_encode_many against rice_encode of each tensor (and the layout's encoder): empty and one-entry tensors,
    k from 0 to 40, 32- and 64-bit indices, tensors over MANY_MOST entries (alone), batches cut at MANY_BATCH
    entries, and gaps long for their k (alone: more than UNARY_DENSE unary bits an entry)."""
    monkeypatch.setattr(rice, "MANY_BATCH", 3000)
    rng = np.random.default_rng(5)
    alone = []
    real = rice.rice_encode
    monkeypatch.setattr(rice, "rice_encode", lambda i, k: alone.append(int(np.asarray(i).size)) or real(i, k))
    for trial in range(60):
        idxs, ks = [], []
        for _ in range(int(rng.integers(0, 30))):
            numel = int(rng.choice([1, 7, 300, 5000, 1 << 20, 1 << 36]))
            nnz = min(numel, int(rng.choice([0, 1, 2, 40, 700, 5000])))
            ix = np.sort(rng.choice(min(numel, 1 << 40), nnz, replace=False))
            idxs.append(ix.astype(np.uint64 if numel > 1 << 32 else np.uint32))
            k = rice.rice_param(nnz, numel) + int(rng.choice([0, 0, 1, -1, -7]))  # (-7: long gaps for k)
            ks.append(max(0, k) if numel <= 1 << 32 else rice.rice_param(nnz, numel))
        streams, bits = rice.rice_encode_many(idxs, ks)
        assert len(streams) == len(bits) == len(idxs)
        for ix, k, s, b in zip(idxs, ks, streams, bits):
            want, nbits = spec_encode(ix.tolist(), k) if ix.size <= 800 else (None, None)
            one, one_bits = real(ix, k)
            assert (b, s.dtype, s.tobytes()) == (one_bits, np.uint8, one.tobytes()), (trial, k, ix.size)
            assert want is None or (s.tobytes(), b) == (want, nbits)
    assert any(n > rice.MANY_MOST for n in alone) and any(n <= rice.MANY_MOST for n in alone)
