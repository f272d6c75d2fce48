"""The codec ops, declared once and implemented per backend (bitsandbytes style).

Each op takes lists over tensors of backend arrays: kept values (fp32, fp64 for fp64 tensors), kept indices
(``None`` for a dense tensor) and error-feedback residuals (``None`` where there is none). On the NumPy backend
the ops run the twins in :mod:`gpu_codec.cpu_fallback`; on a kernel backend (GPU, or the emulator) they launch
kernels/quantize.cu and kernels/rice.cu through the backend's runner, as gpu_codec/_kernel_ops.py does. Both
give the same bytes. The only device-to-host copies are per-tensor scalars: ternary mu and Rice bit counts.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._kernel_ops import BLOCK, CHUNK, TensorTables
from ..cpu_fallback import quantize as _q
from ..cpu_fallback import rice as _rice

Q_F16, Q_BF16 = 1, 2
RICE_SCAN_THREADS = 1024

_lock = threading.Lock()
_kernel_ops: dict[int, tuple[Any, CodecKernels]] = {}


def kernels_for(backend: Any) -> CodecKernels | None:
    """The kernel launcher of a kernel backend (cached per runner), None for the NumPy backend."""
    runner = getattr(backend, "runner", None)
    if runner is None:
        return None
    with _lock:
        hit = _kernel_ops.get(id(runner))
        if hit is None or hit[0] is not runner:
            hit = (runner, CodecKernels(runner))
            _kernel_ops[id(runner)] = hit
        return hit[1]


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.uint64)


def _split(flat: Any, counts: list[int]) -> list[Any]:
    out, a = [], 0
    for c in counts:
        out.append(flat[a : a + c])
        a += c
    return out


class CodecKernels:
    """Launches the codec kernels for a tensor list."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.xp = runner.xp

    def _up(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def _ptrs(self, arrays: list[Any]) -> Any:
        return self._up(
            np.asarray([self.runner.ptr(a) if a is not None and a.size else 0 for a in arrays], dtype=np.uint64)
        )

    def _entry_tables(self, values, indices, res):
        counts = [int(v.size) for v in values]
        return (
            counts,
            np.int32(len(values)),
            self._up(_offsets(counts)),
            self._up(np.asarray([3 if v.dtype == np.float64 else 0 for v in values], np.int32)),
            self._ptrs(values),
            self._up(np.asarray([0 if i is None else np.dtype(i.dtype).itemsize for i in indices], np.int32)),
            self._ptrs(indices),
            self._ptrs(res),
        )

    def cast(self, values, mode, indices, res) -> list[Any]:
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        total = sum(counts)
        out = self.xp.empty(max(total, 1), dtype=np.uint16)
        if total:
            self.runner.launch(
                "quantize_cast",
                -(-total // BLOCK),
                BLOCK,
                (nt, np.uint64(total), ent, vdt, vp, iw, ip, rp, np.int32(mode), out),
            )
        return _split(out, counts)

    def int8(self, values, block, indices, res) -> tuple[list[Any], list[Any]]:
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        nblk = [-(-c // block) for c in counts]
        out = self.xp.empty(max(sum(counts), 1), dtype=np.int8)
        scales = self.xp.empty(max(sum(nblk), 1), dtype=np.float32)
        if sum(nblk):
            self.runner.launch(
                "quantize_int8",
                sum(nblk),
                BLOCK,
                (nt, self._up(_offsets(nblk)), ent, np.int32(block), vdt, vp, iw, ip, rp, out, scales),
            )
        return _split(out, counts), _split(scales, nblk)

    def ternary(self, values, indices, res) -> tuple[list[Any], np.ndarray]:
        counts, nt, ent, vdt, vp, iw, ip, rp = self._entry_tables(values, indices, res)
        tb = TensorTables(counts, [0] * len(counts), 1)
        nwords = [-(-c // 32) for c in counts]
        word_off = _offsets(nwords)
        words = self.xp.zeros(max(sum(nwords), 1), dtype=np.uint32)
        partial = self.xp.zeros(max(tb.nchunks, 1), dtype=np.float64)
        mu = self.xp.zeros(max(len(counts), 1), dtype=np.float32)
        cs = self._up(tb.chunk_start)
        if tb.nchunks:
            self.runner.launch(
                "ternary_partial", tb.nchunks, BLOCK, (nt, cs, ent, vdt, vp, self._up(word_off), partial, words)
            )
        self.runner.launch("ternary_mu", -(-len(counts) // 256), 256, (nt, cs, ent, partial, mu))
        if any(r is not None for r in res) and sum(counts):
            self.runner.launch(
                "ternary_fixup",
                -(-sum(counts) // BLOCK),
                BLOCK,
                (nt, np.uint64(sum(counts)), ent, vdt, vp, iw, ip, rp, mu),
            )
        signs = [
            words[int(word_off[t]) : int(word_off[t + 1])].view(np.uint8)[: -(-c // 8)] for t, c in enumerate(counts)
        ]
        return signs, self.runner.to_host(mu)[: len(counts)].astype(np.float32)

    def rice(self, indices, ks) -> tuple[list[Any], list[int]]:
        xp, run = self.xp, self.runner
        counts = [int(i.size) for i in indices]
        wide = any(i.dtype == np.uint64 for i in indices)
        idx = [i.astype(np.uint64) if wide and i.dtype != np.uint64 else i for i in indices]
        tb = TensorTables(counts, [0] * len(counts), 1)
        nt, ent, d_ks = np.int32(len(counts)), self._up(_offsets(counts)), self._up(np.asarray(ks, np.int32))
        cs, ip = self._up(tb.chunk_start), self._ptrs(idx)
        sfx = "u64" if wide else "u32"
        bits = [0] * len(counts)
        chunk_base = xp.zeros(max(tb.nchunks, 1), dtype=np.uint64)
        if tb.nchunks:
            chunk_q = xp.zeros(tb.nchunks, dtype=np.uint64)
            tbits = xp.zeros(len(counts), dtype=np.uint64)
            run.launch("rice_count_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_q))
            run.launch(
                "rice_scan", 1, RICE_SCAN_THREADS, (nt, np.int64(tb.nchunks), cs, ent, d_ks, chunk_q, chunk_base, tbits)
            )
            bits = [int(b) for b in run.to_host(tbits)]
        nwords = [-(-b // 32) for b in bits]
        word_off = _offsets(nwords)
        words = xp.zeros(max(sum(nwords), 1), dtype=np.uint32)
        if tb.nchunks:
            run.launch(
                "rice_write_" + sfx, tb.nchunks, BLOCK, (nt, cs, ent, d_ks, ip, chunk_base, self._up(word_off), words)
            )
        streams = [
            words[int(word_off[t]) : int(word_off[t + 1])].view(np.uint8)[: -(-b // 8)] for t, b in enumerate(bits)
        ]
        return streams, bits


# --- the ops: one signature, a NumPy body and a kernel body ------------------------------------------------------


def cast16(backend, values, dtype: str, indices, res) -> list[Any]:
    """fp16 / bf16 bit patterns (uint16) of every tensor's values, clamped; residual fixed where given."""
    k = kernels_for(backend)
    if k is not None:
        return k.cast(values, Q_F16 if dtype == "float16" else Q_BF16, indices, res)
    enc, dec = (_q.cast_f16, _q.decode_f16) if dtype == "float16" else (_q.cast_bf16, _q.decode_bf16)
    out = []
    for v, i, r in zip(values, indices, res):
        bits = enc(v)
        _q.fix_residual(r, i, v, dec(bits))
        out.append(bits)
    return out


def int8(backend, values, block: int, indices, res) -> tuple[list[Any], list[Any]]:
    """Blockwise absmax int8 of every tensor's values: (q per tensor, scales per tensor)."""
    k = kernels_for(backend)
    if k is not None:
        return k.int8(values, block, indices, res)
    qs, ss = [], []
    for v, i, r in zip(values, indices, res):
        q, s = _q.int8_absmax(v, block)
        _q.fix_residual(r, i, v, _q.int8_decode(q, s, block))
        qs.append(q)
        ss.append(s)
    return qs, ss


def ternary(backend, values, indices, res) -> tuple[list[Any], np.ndarray]:
    """Ternary (STC) of every tensor's values: (packed sign bits per tensor, host fp32 mu per tensor)."""
    k = kernels_for(backend)
    if k is not None:
        return k.ternary(values, indices, res)
    signs, mus = [], []
    for v, i, r in zip(values, indices, res):
        mu = _q.ternary_mu(v)
        s = _q.ternary_signs(v)
        _q.fix_residual(r, i, v, _q.ternary_decode(s, mu, v.size))
        signs.append(s)
        mus.append(mu)
    return signs, np.asarray(mus, dtype=np.float32)


def rice(backend, indices, ks: list[int]) -> tuple[list[Any], list[int]]:
    """Rice streams (uint8) and their bit counts for every tensor's ascending indices."""
    k = kernels_for(backend)
    if k is not None:
        return k.rice(indices, ks)
    streams, bits = [], []
    for i, kk in zip(indices, ks):
        s, b = _rice.rice_encode(i, kk)
        streams.append(s)
        bits.append(b)
    return streams, bits


__all__ = ["CHUNK", "cast16", "int8", "kernels_for", "rice", "ternary"]
