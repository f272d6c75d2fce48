"""NumPy twins of kernels/quantize.cu: the value codecs, byte for byte.

Each encoder takes the kept values of one tensor (fp32, or fp64 for fp64 tensors) and returns what the kernels
write for it; each decoder takes those buffers back to fp32. Decoders take ``xp`` (NumPy or CuPy): they are plain
array expressions, exact in both.

>>> v = np.array([0.5, -70000.0, 1e-9], np.float32)
>>> decode_f16(cast_f16(v)).tolist()                  # clamped to the largest finite fp16, like NVFlare's
[0.5, -65504.0, 0.0]
>>> q, s = int8_absmax(np.array([1.0, -2.0, 0.0, 0.0], np.float32), block=2)
>>> q.tolist(), s.tolist(), int8_decode(q, s, 2).tolist()       # an all-zero block has scale 0
([64, -127, 0, 0], [0.015748031437397003, 0.0], [1.0078740119934082, -2.0, 0.0, 0.0])
>>> float(ternary_mu(np.array([1.0, -2.0, 4.0], np.float32)))   # mean |kept value|, fp64 pairwise sum
2.3333332538604736
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_codec.constants import TOGETHER_MOST

from .elementwise import bf16_bits_to_f32, f32_to_bf16_bits, f64_to_f32

FP16_MAX = np.float32(65504.0)
BF16_MAX = np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0]
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23


def as_f32(v: np.ndarray) -> np.ndarray:
    """Kept values in fp32, as the kernels load them (fp64 rounds to nearest even)."""
    v = np.asarray(v)
    return f64_to_f32(v) if v.dtype == np.float64 else v.astype(np.float32, copy=False)


def cast_f16(v: np.ndarray) -> np.ndarray:
    """fp16 bit patterns (uint16) of the values, clamped to +-65504 first."""
    with np.errstate(over="ignore"):
        return np.clip(as_f32(v), -FP16_MAX, FP16_MAX).astype(np.float16).view(np.uint16)


def cast_bf16(v: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of the values, clamped to the largest finite bf16 first."""
    return f32_to_bf16_bits(np.clip(as_f32(v), -BF16_MAX, BF16_MAX))


def decode_f16(bits: Any, xp: Any = np) -> Any:
    return bits.view(xp.float16).astype(xp.float32)


def decode_bf16(bits: Any, xp: Any = np) -> Any:
    if xp is np:
        return bf16_bits_to_f32(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def _round_even_small(x: np.ndarray) -> np.ndarray:
    return (x + _MAGIC) - _MAGIC  # as round_even_small in quantize.cu (|x| <= 127 here)


def int8_absmax(v: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax int8: ``scale = absmax / 127`` per block of ``block`` entries, ``q = round(v / scale)``."""
    x = as_f32(v)
    n = x.size
    nb = -(-n // block)
    rows = np.zeros((nb, block), np.float32)
    rows.reshape(-1)[:n] = x
    amax = np.abs(rows).max(axis=1) if nb else np.zeros(0, np.float32)
    scales = (amax / np.float32(127.0)).astype(np.float32)
    q = np.zeros_like(rows)
    np.divide(rows, scales[:, None], out=q, where=scales[:, None] > 0)  # a block with scale 0 stays 0
    q = np.clip(_round_even_small(q), -127.0, 127.0)
    return q.reshape(-1)[:n].astype(np.int8), scales


def int8_decode(q: Any, scales: Any, block: int, xp: Any = np) -> Any:
    """``q * scale`` of each entry's block, in fp32. Twin of kernels/limbs.cu ``int8_dequant``."""
    return q.astype(xp.float32) * xp.repeat(scales, block)[: q.size]


def widen_f32(x: Any) -> Any:
    """fp32 values as fp64, exactly. Twin of kernels/limbs.cu ``widen_f32``."""
    return x.astype(np.float64)


def pairwise_sum(a: np.ndarray) -> float:
    """Sum of fp64 values as a pairwise tree over adjacent entries, padded with zeros to a power of two.

    This is the order ``ternary_partial`` and ``ternary_mu`` add in, so both give the same bits.
    """
    n = a.size
    if n == 0:
        return 0.0
    m = 1 << (n - 1).bit_length()
    x = np.zeros(m, np.float64)
    x[:n] = a
    while x.size > 1:
        x = x[0::2] + x[1::2]
    return float(x[0])


def abs_pairwise_sum(v: np.ndarray) -> float:
    """The sum of |v| in fp64 as :func:`pairwise_sum` adds it, in chunks of CODEC_CHUNK (a power of two) on the
    pool: each chunk is a subtree of the one tree (the zeros padding a short chunk add nothing to sums of
    non-negative values), and the chunks' sums are added as its upper levels.

    >>> abs_pairwise_sum(np.array([1.0, 2.0**53, 1.0, 1.0, -1.0], np.float64)) == pairwise_sum(
    ...     np.array([1.0, 2.0**53, 1.0, 1.0, 1.0]))
    True
    """
    from .parallel import parallel_map, spans

    def part(c: tuple[int, int]) -> float:
        x = v[c[0] : c[1]]
        return pairwise_sum(np.abs(x if x.dtype == np.float64 else as_f32(x)).astype(np.float64))

    return pairwise_sum(np.asarray(parallel_map(part, spans(0, v.size, CODEC_CHUNK)), np.float64))


def ternary_mu(v: np.ndarray) -> np.float32:
    """mu = mean of |kept value| (sum in fp64, pairwise), rounded to fp32; 0 for no values."""
    v = np.asarray(v)
    if v.size == 0:
        return np.float32(0.0)
    with np.errstate(over="ignore"):  # (past fp32's range: inf, as the kernel's cast gives; the engine refuses it)
        return np.float32(np.float64(abs_pairwise_sum(v)) / np.float64(v.size))


def ternary_signs(v: np.ndarray) -> np.ndarray:
    """Sign bits (1 = negative), 8 per byte, least significant bit first."""
    return np.packbits(np.asarray(v) < 0, bitorder="little")


def ternary_decode(signs: Any, mu: float, n: int, xp: Any = np) -> Any:
    bits = (signs[:, None] >> xp.arange(8, dtype=xp.uint8)) & 1
    neg = bits.reshape(-1)[:n].astype(bool)
    m = xp.float32(mu)
    return xp.where(neg, -m, m).astype(xp.float32)


def fix_residual(res: np.ndarray | None, idx: Any, v: np.ndarray, dec32: np.ndarray) -> None:
    """residual[idx] = v - decoded (fp64 for fp64 tensors); ``idx`` None means entry l is element l, and a slice
    the elements it names."""
    if res is None:
        return
    d = dec32.astype(np.float64) if v.dtype == np.float64 else dec32
    where = slice(0, v.size) if idx is None else idx
    res[where] = v - d


# The encoders as the NumPy backend runs them: in chunks of CODEC_CHUNK entries (whole int8 blocks, whole sign
# bytes) on the thread pool, each chunk encoded, decoded again and its residual fixed while it is in cache, so
# temporaries are a chunk's, not the tensor's (with every element kept, a tensor's are the update's size).
CODEC_CHUNK = 1 << 16  # a power of two: ternary_mu's pairwise tree splits at chunk boundaries


def _entries(idx: np.ndarray | None, s: int, e: int) -> Any:
    """The elements entries [s, e) stand for: their indices, or (dense) the slice of elements s to e."""
    return slice(s, e) if idx is None else idx[s:e]


def _encode_in_chunks(v: np.ndarray, idx: np.ndarray | None, res: np.ndarray | None, step: int, encode) -> None:
    """``encode(s, e)`` on the pool for entries [s, e) in chunks of ``step``: it writes their code and returns a
    function that gives them decoded, called only where a residual is fixed."""
    from .parallel import parallel_map, spans

    def part(c: tuple[int, int]) -> None:
        s, e = c
        dec = encode(s, e)
        if res is not None:
            fix_residual(res, _entries(idx, s, e), v[s:e], dec())

    parallel_map(part, spans(0, v.size, step))


def encode_cast16(v: np.ndarray, dtype: str, idx: np.ndarray | None, res: np.ndarray | None) -> np.ndarray:
    """fp16 or bf16 bit patterns of the values (:func:`cast_f16`, :func:`cast_bf16`), the residual fixed.

    >>> encode_cast16(np.array([0.5, -70000.0], np.float32), "float16", None, None).tolist()
    [14336, 64511]
    """
    enc, dec = (cast_f16, decode_f16) if dtype == "float16" else (cast_bf16, decode_bf16)
    bits = np.empty(v.size, np.uint16)

    def encode(s: int, e: int):
        b = bits[s:e]
        b[...] = enc(v[s:e])
        return lambda: dec(b)

    _encode_in_chunks(v, idx, res, CODEC_CHUNK, encode)
    return bits


MANY_MOST = TOGETHER_MOST  # values of a tensor that encode_cast16_many casts with others (more: alone)


def encode_cast16_many(values: list, dtype: str, indices: list, res: list) -> list[np.ndarray]:
    """:func:`encode_cast16` of each tensor's values: those of at most MANY_MOST values and no residual to fix cast
    together, a group of one value dtype at a time of at most CODEC_CHUNK values (the cast is elementwise: the same
    bits), the others alone.

    >>> [b.tolist() for b in encode_cast16_many([np.array([0.5], np.float32), np.array([1.0, 2.0], np.float32)],
    ...                                          "float16", [None, None], [None, None])]
    [[14336], [15360, 16384]]
    """
    enc = cast_f16 if dtype == "float16" else cast_bf16
    out: list = [None] * len(values)
    groups: dict = {}  # value dtype -> the positions of its small tensors, in order
    for t, v in enumerate(map(np.asarray, values)):
        if res[t] is None and v.size <= MANY_MOST and v.ndim == 1:
            groups.setdefault(v.dtype, []).append(t)
        else:
            out[t] = encode_cast16(v, dtype, indices[t], res[t])
    for pos in groups.values():
        parts = [np.asarray(values[t]) for t in pos]
        sizes = np.fromiter(map(len, parts), np.int64, len(parts))
        ends = np.cumsum(sizes)
        first = 0
        while first < len(pos):  # (a batch of at most CODEC_CHUNK values, or one tensor)
            before = int(ends[first - 1]) if first else 0
            end = max(first + 1, int(np.searchsorted(ends, before + CODEC_CHUNK, side="right")))
            with np.errstate(over="ignore"):
                bits = enc(np.concatenate(parts[first:end]))
            for t, b in zip(pos[first:end], np.split(bits, ends[first : end - 1] - before)):
                out[t] = b
            first = end
    return out


def encode_int8(
    v: np.ndarray, block: int, idx: np.ndarray | None, res: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`int8_absmax` of the values, in chunks of whole blocks, the residual fixed.

    >>> [x.tolist() for x in encode_int8(np.array([1.0, -2.0, 0.0, 0.0], np.float32), 2, None, None)]
    [[64, -127, 0, 0], [0.015748031437397003, 0.0]]
    """
    n = v.size
    q, scales = np.empty(n, np.int8), np.empty(-(-n // block), np.float32)

    def encode(s: int, e: int):
        # (values at float32's edge give an inf scale, as the kernel's do: quiet here, the engine refuses them)
        with np.errstate(over="ignore", invalid="ignore"):
            qq, ss = int8_absmax(v[s:e], block)
        q[s:e], scales[s // block : s // block + ss.size] = qq, ss

        def decoded():
            with np.errstate(over="ignore", invalid="ignore"):
                return int8_decode(qq, ss, block)

        return decoded

    _encode_in_chunks(v, idx, res, max(1, CODEC_CHUNK // block) * block, encode)
    return q, scales


def encode_ternary(v: np.ndarray, idx: np.ndarray | None, res: np.ndarray | None) -> tuple[np.ndarray, np.float32]:
    """(sign bits, mu) of the values (:func:`ternary_signs`, :func:`ternary_mu`), the residual fixed.

    >>> signs, mu = encode_ternary(np.array([1.0, -2.0, 4.0], np.float32), None, None)
    >>> signs.tolist(), float(mu)
    ([2], 2.3333332538604736)
    """
    mu = ternary_mu(v)
    signs = np.empty(-(-v.size // 8), np.uint8)

    def encode(s: int, e: int):
        sg = signs[s // 8 : -(-e // 8)]
        sg[...] = ternary_signs(v[s:e])
        return lambda: ternary_decode(sg, mu, e - s)

    _encode_in_chunks(v, idx, res, CODEC_CHUNK, encode)
    return signs, mu
