"""Kernel test cases and checks shared by the emulated tests (CPU CI) and the GPU suite (a real device).

Everything here is runner-agnostic: a *runner* is gpu_codec's ``EmulatorRunner`` (NumPy memory, CUDA sources run
on the CPU) or ``CupyRunner`` (a GPU). Each check runs the kernels through the runner and the NumPy twins of
cpu_fallback/ on the same inputs, and returns a list of mismatches (empty: equal to the byte). NumPy only, no
pytest, so that benchmarks/gpu_suite.py can run the very same cases on a device where pytest may be missing.

Used by tests/test_emulated_kernels.py and benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_codec.backends.base import DeltaRequest
from gpu_codec.backends.kernels import BLOCK, CHUNK, U64_MAX, KernelOps, TensorTables, initial_state
from gpu_codec.constants import CHUNK_SCAN_PART, CHUNK_SCAN_THREADS, SCAN_THREADS, index_dtype
from gpu_codec.cpu_fallback import kernels as twins
from gpu_codec.cpu_fallback.elementwise import f32_to_bf16_bits
from gpu_codec.cpu_fallback.select import topk_select

DT = {"f32": 0, "f16": 1, "bf16": 2, "f64": 3}
_FILL32 = 0xDEADBEEF  # written into outputs before a launch, so that stray or missing writes show
_PAD = 64  # extra elements after every output of topk_stepwise: a write past the end shows as a difference


# ---------------------------------------------------------------------------------------------------- top-k


@dataclass(frozen=True)
class TopkCase:
    """One top-k selection over a tensor list.

    ``k``: a fraction of each segment, or "zero", "one", "all", "random"; ``res_out``: "none", "new" (separate
    output arrays) or "alias" (written over the residual inputs, as the engine does in place); ``shift``: every
    array on the runner starts this many elements into its allocation (1: fp32 tensors 4 bytes past a 16-byte
    boundary, which fused_scan_f32 reads with scalar loads).
    """

    name: str
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    crit: int = 0
    scope: str = "global"
    k: float | str = 0.1
    base: bool = True
    res: bool = False
    res_out: str = "none"
    qmode: int = 0
    ext_dtypes: tuple[str, ...] | None = None
    pattern: str = "normal"
    seed: int = 0
    shift: int = 0

    def with_(self, **kw) -> TopkCase:
        return dataclasses.replace(self, **kw)


def _store(x: np.ndarray, dt: str) -> np.ndarray:
    """float64 values -> storage of logical dtype ``dt`` (bf16 as uint16 bits, rounded to nearest even)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if dt == "f64":
            return x.astype(np.float64)
        if dt == "f32":
            return x.astype(np.float32)
        if dt == "f16":
            return x.astype(np.float32).astype(np.float16)
        return f32_to_bf16_bits(x.astype(np.float32))


def _values(rng: np.random.Generator, n: int, pattern: str) -> np.ndarray:
    if pattern == "normal":
        return rng.standard_normal(n) * 3.0
    if pattern == "ties":  # few distinct magnitudes: many ties at the threshold
        return rng.integers(-4, 5, n) * 0.25
    if pattern == "equal":
        return np.full(n, 0.5)
    if pattern == "zeros":
        return np.zeros(n)
    if pattern == "signed_zero":  # -0.0 and +0.0 must get the same key
        return rng.choice(np.array([-0.0, 0.0, 0.0, -0.0, 1.0, -1.0]), n)
    if pattern == "subnormal":  # fp32, fp16 and bf16 subnormals, and the fp16 underflow boundary
        return rng.choice(np.array([1e-40, -3e-39, 6e-8, -3e-8, 2.98e-8, 1e-45, 5.96e-8, 0.0]), n) * rng.integers(
            1, 4, n
        )
    if pattern == "rounding":  # exact midpoints between fp16 (and bf16) neighbours: round-half-even
        m = rng.integers(0, 1024, n)
        e = rng.integers(-26, 16, n).astype(np.float64)
        fp16_mid = (1.0 + (2 * m + 1) * 2.0**-11) * 2.0**e
        bf16_mid = (1.0 + (2 * (m % 128) + 1) * 2.0**-8) * 2.0**e
        v = np.where(rng.integers(0, 2, n) == 1, fp16_mid, bf16_mid)
        return v * rng.choice(np.array([-1.0, 1.0]), n)
    if pattern == "huge":  # near and past the fp16 range (the residual of an fp16-coded value overflows)
        return rng.choice(np.array([65504.0, 65519.0, 65520.0, 1e5, -7e4, 1e30, -1.0]), n)
    if pattern in ("nonfinite_inf", "nonfinite_nan", "f64_overflow"):
        return rng.standard_normal(n)
    raise ValueError(pattern)


def make_topk_inputs(case: TopkCase) -> dict[str, Any]:
    """Host (NumPy) inputs of ``case`` in the argument layout of ``topk_select``."""
    rng = np.random.default_rng(case.seed)
    nt = len(case.sizes)
    new, base, res, ext = [], [], [], []
    for t, (n, dt) in enumerate(zip(case.sizes, case.dtypes)):
        pattern = case.pattern if case.pattern not in ("huge",) or dt != "f16" else "normal"
        w = _values(rng, n, pattern)
        w0 = _values(rng, n, pattern) * 0.5 if case.pattern not in ("equal", "zeros") else np.zeros(n)
        if case.pattern in ("nonfinite_inf", "nonfinite_nan", "f64_overflow") and n and t == nt // 2:
            pos = int(rng.integers(0, n))
            if case.pattern == "f64_overflow":
                w[pos] = 1e300 if dt == "f64" else np.inf  # fp64 delta is finite, its fp32 score is not
            else:
                w[pos] = np.inf if case.pattern == "nonfinite_inf" else np.nan
        new.append(_store(w, dt))
        base.append(_store(w0, dt) if case.base else None)
        vd = np.float64 if dt == "f64" else np.float32
        if case.res:
            r = rng.standard_normal(n) * 0.01 if case.pattern not in ("equal", "zeros") else np.zeros(n)
            res.append(r.astype(vd))
        else:
            res.append(None)
        if case.crit == 7:
            edt = (case.ext_dtypes or ("f32",) * nt)[t]
            ext.append(_store(_values(rng, n, "ties" if case.pattern == "ties" else "normal"), edt))
        else:
            ext.append(None)
    if case.scope == "global":
        segments = [list(range(nt))]
    elif case.scope == "tensor":
        segments = [[t] for t in range(nt)]
    else:  # "pairs": contiguous runs of two tensors
        segments = [list(range(t, min(t + 2, nt))) for t in range(0, nt, 2)]
    ks = []
    for seg in segments:
        n = sum(case.sizes[t] for t in seg)
        if case.k == "zero":
            ks.append(0)
        elif case.k == "one":
            ks.append(min(1, n))
        elif case.k == "all":
            ks.append(n)
        elif case.k == "random":
            ks.append(int(rng.integers(0, n + 1)))
        else:
            ks.append(min(n, round(n * float(case.k))))
    return {
        "new": new,
        "base": base,
        "res": res,
        "ext": ext,
        "dtypes": [DT[d] for d in case.dtypes],
        "ext_dtypes": [DT[d] for d in (case.ext_dtypes or ("f32",) * nt)],
        "crit": case.crit,
        "segments": segments,
        "ks": ks,
        "qmode": case.qmode,
        "res_out": case.res_out,
    }


def _res_out(inp: dict, res: list, copy) -> list:
    if inp["res_out"] == "none":
        return [None] * len(res)
    if inp["res_out"] == "alias":
        return res
    return [
        copy(np.full(a.size, -3.0, dtype=np.float64 if dt == 3 else np.float32))
        for a, dt in zip(inp["new"], inp["dtypes"])
    ]


def _cmp(where: str, got: Any, want: Any, out: list[str]) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        out.append(f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
        return
    if got.tobytes() != want.tobytes():
        g, w = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
        first = int(np.flatnonzero(g != w)[0]) // max(1, got.itemsize)
        out.append(
            f"{where}: differs first at element {first}: {got.reshape(-1)[first]!r} != "
            f"{want.reshape(-1)[first]!r} ({int(np.count_nonzero(got.reshape(-1) != want.reshape(-1)))} "
            f"elements differ)"
        )


def _uploader(runner, shift: int = 0):
    xp = runner.xp

    def up(a):
        if a is None or not shift:
            return None if a is None else xp.array(a, copy=True)
        out = xp.empty(a.size + shift, dtype=a.dtype)[shift:]
        out[...] = xp.asarray(a)
        return out

    return up


def topk_vs_reference(runner, case: TopkCase) -> list[str]:
    """KernelOps(runner).topk_select against the NumPy backend's cpu_fallback.select.topk_select."""
    inp = make_topk_inputs(case)
    up = _uploader(runner, case.shift)
    d = {k: [up(a) for a in inp[k]] for k in ("new", "base", "res", "ext")}
    h = {k: [None if a is None else a.copy() for a in inp[k]] for k in ("new", "base", "res", "ext")}
    d_ro, h_ro = _res_out(inp, d["res"], up), _res_out(inp, h["res"], np.copy)
    common = (inp["dtypes"], None, inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    gi, gv, gbad = KernelOps(runner).topk_select(d["new"], d["base"], d["res"], d_ro, common[0], d["ext"], *common[2:])
    wi, wv, wbad = topk_select(h["new"], h["base"], h["res"], h_ro, common[0], h["ext"], *common[2:])
    out: list[str] = []
    if gbad != wbad:
        return [f"{case.name}: bad tensor {gbad} != {wbad}"]
    if wbad is not None:
        return out
    for t in range(len(case.sizes)):
        _cmp(f"{case.name}: indices[{t}]", runner.to_host(gi[t]), wi[t], out)
        _cmp(f"{case.name}: values[{t}]", runner.to_host(gv[t]), wv[t], out)
        if h_ro[t] is not None:
            _cmp(f"{case.name}: res_out[{t}]", runner.to_host(d_ro[t]), h_ro[t], out)
    return out


def dense_vs_reference(runner, case: TopkCase) -> list[str]:
    """Dense mode: KernelOps(runner).dense_delta and dense_apply (onto the base and into zeros) against the NumPy
    backend's twins (cpu_fallback/dense.py), residuals included."""
    from gpu_codec.backends.cpu import CpuBackend

    inp = make_topk_inputs(case)
    up = _uploader(runner, case.shift)
    d = {k: [up(a) for a in inp[k]] for k in ("new", "base", "res", "ext")}
    h = {k: [None if a is None else a.copy() for a in inp[k]] for k in ("new", "base", "res", "ext")}
    args = (inp["dtypes"], None, inp["ext_dtypes"], inp["crit"])
    gv, gbad = KernelOps(runner).dense_delta(d["new"], d["base"], d["res"], d["res"], args[0], d["ext"], *args[2:])
    req = DeltaRequest(h["new"], h["base"], h["res"], h["res"], args[0], h["ext"], *args[2:])
    wv, wbad = CpuBackend().dense_delta(req)
    out: list[str] = []
    if gbad != wbad:
        return [f"{case.name}: dense bad tensor {gbad} != {wbad}"]
    for t in range(len(case.sizes)):
        if h["res"][t] is not None:
            _cmp(f"{case.name}: dense residual[{t}]", runner.to_host(d["res"][t]), h["res"][t], out)
    if wbad is not None:
        return out
    for t in range(len(case.sizes)):
        _cmp(f"{case.name}: dense values[{t}]", runner.to_host(gv[t]), wv[t], out)
    for mode, bases in ((1, inp["base"]), (0, [None] * len(case.sizes))):
        if mode == 1 and any(b is None for b in bases):
            continue
        outs_h = [np.zeros_like(n) for n in inp["new"]]
        outs_d = [up(o) for o in outs_h]
        gb = KernelOps(runner).dense_apply(outs_d, inp["dtypes"], [up(b) for b in bases], [up(v) for v in wv], mode)
        wb = CpuBackend().dense_apply(outs_h, inp["dtypes"], bases, wv, mode)
        if gb != wb:
            out.append(f"{case.name}: dense_apply mode {mode} bad entry {gb} != {wb}")
        for t in range(len(case.sizes)):
            _cmp(f"{case.name}: dense_apply mode {mode} out[{t}]", runner.to_host(outs_d[t]), outs_h[t], out)
    return out


GATHER_SIZES = (0, 1, 700, 0, 256, 1025, 3)  # empty tensors first, between and (with the last dropped) at the end


def gather_copy_vs_twin(runner, sizes: tuple[int, ...] = GATHER_SIZES, seed: int = 0) -> list[str]:
    """KernelOps(runner).gather_copy against its twin (cpu_fallback/kernels.py) for 2-, 4- and 8-byte elements:
    tensors of uneven sizes (empty ones included) copied end to end, every bit kept (NaN payloads, -0.0,
    subnormals: the bits are random); the output's tail past the sources must stay as it was."""
    from gpu_codec.backends.cpu import CpuBackend

    rng = np.random.default_rng(seed)
    up = _uploader(runner)
    out: list[str] = []
    for word in (np.uint16, np.uint32, np.uint64):
        for n_src in (len(sizes), len(sizes) - 1):
            srcs = [rng.integers(0, np.iinfo(word).max, size=n, dtype=word, endpoint=True) for n in sizes[:n_src]]
            total = sum(sizes[:n_src])
            host = np.zeros(total, word)
            dev = up(np.zeros(total, word))
            KernelOps(runner).gather_copy(dev, [up(a) for a in srcs])
            CpuBackend().gather_copy(host, srcs)
            want = np.concatenate(srcs) if srcs else host
            _cmp(f"gather_copy {np.dtype(word).name} x{n_src}: kernel", runner.to_host(dev), want, out)
            _cmp(f"gather_copy {np.dtype(word).name} x{n_src}: twin", host, want, out)
    return out


def gather_entries_vs_twin(runner, sizes: tuple[int, ...] = GATHER_SIZES, seed: int = 0) -> list[str]:
    """KernelOps(runner).gather_entries (both index widths) against its twin (cpu_fallback/kernels.py) and the
    NumPy backend, for 2-, 4- and 8-byte elements: tensors of uneven sizes (empty ones included) read at a few
    ascending positions each of a run's span, every bit kept; an entry outside its tensor leaves its output as it
    was (the kernel reads nothing there)."""
    from gpu_codec.backends.cpu import CpuBackend
    from gpu_codec.cpu_fallback import kernels as twins

    rng = np.random.default_rng(seed)
    up = _uploader(runner)
    out: list[str] = []
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint64)
    for word in (np.uint16, np.uint32, np.uint64):
        srcs = [rng.integers(0, np.iinfo(word).max, size=n, dtype=word, endpoint=True) for n in sizes]
        picks = [np.sort(rng.choice(n, size=min(n, 1 + n // 5), replace=False)) for n in sizes]
        counts = [int(p.size) for p in picks]
        want = np.concatenate([s[p] for s, p in zip(srcs, picks)])
        for itype in (np.uint32, np.uint64):
            idx = np.concatenate([p + int(a) for p, a in zip(picks, starts)]).astype(itype)
            dev = up(np.zeros(want.size, word))
            KernelOps(runner).gather_entries(dev, [up(a) for a in srcs], starts.tolist(), up(idx), counts)
            host = np.zeros(want.size, word)
            CpuBackend().gather_entries(host, srcs, starts.tolist(), idx, counts)
            twin = np.zeros(want.size, word)
            ent = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
            fn = twins.gather_entries_u64 if itype == np.uint64 else twins.gather_entries_u32
            fn(len(sizes), want.size, ent, starts, srcs, idx, np.dtype(word).itemsize, twin)
            what = f"gather_entries {np.dtype(word).name} {np.dtype(itype).name}"
            _cmp(f"{what}: kernel", runner.to_host(dev), want, out)
            _cmp(f"{what}: NumPy backend", host, want, out)
            _cmp(f"{what}: twin", twin, want, out)
            if want.size:  # the first entry moved past its tensor's end: nothing read, nothing written
                first = next(t for t, c in enumerate(counts) if c)
                bad = idx.copy()
                bad[0] = itype(int(starts[first + 1]))
                dev = up(np.full(want.size, 7, word))
                KernelOps(runner).gather_entries(dev, [up(a) for a in srcs], starts.tolist(), up(bad), counts)
                twin = np.full(want.size, 7, word)
                fn(len(sizes), want.size, ent, starts, srcs, bad, np.dtype(word).itemsize, twin)
                expect = want.copy()
                expect[0] = 7
                _cmp(f"{what} outside: kernel", runner.to_host(dev), expect, out)
                _cmp(f"{what} outside: twin", twin, expect, out)
    return out


def topk_stepwise(runner, case: TopkCase, wide: bool = False) -> list[str]:
    """Every top-k kernel launched on its own and compared, buffer by buffer, with its twin after each launch.

    ``wide`` uses chunk_write_u64 (64-bit output indices) whatever the tensor sizes.
    """
    inp = make_topk_inputs(case)
    up = _uploader(runner, case.shift)
    nt = len(case.sizes)
    seg_of = [0] * nt
    for s, seg in enumerate(inp["segments"]):
        for t in seg:
            seg_of[t] = s
    tb = TensorTables(list(case.sizes), seg_of, len(inp["segments"]))
    out: list[str] = []
    if tb.nchunks == 0:
        return out
    d = {k: [up(a) for a in inp[k]] for k in ("new", "base", "res", "ext")}
    h = {k: [None if a is None else a.copy() for a in inp[k]] for k in ("new", "base", "res", "ext")}
    d_ro, h_ro = _res_out(inp, d["res"], up), _res_out(inp, h["res"], np.copy)

    def table(arrs):
        return up(np.asarray([runner.ptr(a) if a is not None else 0 for a in arrs], dtype=np.uint64))

    def pair(host):  # (device copy, host copy)
        return up(host), host.copy()

    nt32, grid = np.int32(nt), tb.nchunks
    dtypes, ext_dt = np.asarray(inp["dtypes"], np.int32), np.asarray(inp["ext_dtypes"], np.int32)
    keys = pair(np.full(tb.total + _PAD, _FILL32, np.uint32))
    err = pair(np.full(1, U64_MAX, np.uint64))
    cs, eo, nm, so = tb.chunk_start, tb.elem_off, tb.numel, tb.seg_of
    runner.launch(
        "score_keys",
        grid,
        BLOCK,
        (
            nt32,
            up(cs),
            up(eo),
            up(nm),
            up(dtypes),
            table(d["new"]),
            table(d["base"]),
            table(d["res"]),
            table(d["ext"]),
            up(ext_dt),
            np.int32(inp["crit"]),
            keys[0],
            err[0],
        ),
    )
    twins.score_keys(
        nt32,
        cs,
        eo,
        nm,
        dtypes,
        h["new"],
        h["base"],
        h["res"],
        h["ext"],
        ext_dt,
        np.int32(inp["crit"]),
        keys[1],
        err[1],
    )
    _cmp(f"{case.name}: score_keys err", runner.to_host(err[0]), err[1], out)
    if int(err[1][0]) != int(U64_MAX):
        return out  # keys of rejected inputs may hold NaN patterns that differ by device; the caller drops them
    _cmp(f"{case.name}: score_keys keys", runner.to_host(keys[0]), keys[1], out)
    if out:
        return out
    state = pair(initial_state(inp["ks"]))
    hist = pair(np.zeros(256 * max(tb.nseg, 1) + _PAD, np.uint64))
    for shift in (24, 16, 8, 0):
        runner.launch(
            "radix_hist",
            grid,
            BLOCK,
            (nt32, up(cs), up(eo), up(nm), up(so), keys[0], state[0], np.int32(shift), hist[0]),
        )
        twins.radix_hist(nt32, cs, eo, nm, so, keys[1], state[1], np.int32(shift), hist[1])
        _cmp(f"{case.name}: radix_hist({shift}) hist", runner.to_host(hist[0]), hist[1], out)
        runner.launch(
            "radix_pick", (tb.nseg + 255) // 256, 256, (np.int32(tb.nseg), np.int32(shift), hist[0], state[0])
        )
        twins.radix_pick(np.int32(tb.nseg), np.int32(shift), hist[1], state[1])
        _cmp(f"{case.name}: radix_pick({shift}) state", runner.to_host(state[0]), state[1], out)
        _cmp(f"{case.name}: radix_pick({shift}) hist", runner.to_host(hist[0]), hist[1], out)
        if out:
            return out
    cnt = pair(np.full(2 * grid + _PAD, _FILL32, np.uint32))
    runner.launch("chunk_count", grid, BLOCK, (nt32, up(cs), up(eo), up(nm), up(so), keys[0], state[0], cnt[0]))
    twins.chunk_count(nt32, cs, eo, nm, so, keys[1], state[1], cnt[1])
    _cmp(f"{case.name}: chunk_count cnt", runner.to_host(cnt[0]), cnt[1], out)
    eq_base = pair(np.full(grid + _PAD, U64_MAX, np.uint64))
    out_base = pair(np.full(grid + 1 + _PAD, U64_MAX, np.uint64))
    counts = pair(np.full(nt + _PAD, U64_MAX, np.uint64))
    out += chunk_scan_stepwise(runner, case.name, tb, state, cnt, eq_base, out_base, counts)
    if out:
        return out
    K = int(sum(inp["ks"]))
    idx_dt = np.uint64 if wide else np.uint32
    idx = pair(np.full(K + _PAD, _FILL32, idx_dt))
    v32 = pair(np.full(K + _PAD, -9.0, np.float32))
    v64 = pair(np.full(K + _PAD, -9.0, np.float64))
    name = "chunk_write_u64" if wide else "chunk_write_u32"
    runner.launch(
        name,
        grid,
        BLOCK,
        (
            nt32,
            up(cs),
            up(eo),
            up(nm),
            up(dtypes),
            up(so),
            table(d["new"]),
            table(d["base"]),
            table(d["res"]),
            table(d_ro),
            np.int32(inp["qmode"]),
            keys[0],
            state[0],
            eq_base[0],
            out_base[0],
            idx[0],
            v32[0],
            v64[0],
        ),
    )
    getattr(twins, name)(
        nt32,
        cs,
        eo,
        nm,
        dtypes,
        so,
        h["new"],
        h["base"],
        h["res"],
        h_ro,
        np.int32(inp["qmode"]),
        keys[1],
        state[1],
        eq_base[1],
        out_base[1],
        idx[1],
        v32[1],
        v64[1],
    )
    _cmp(f"{case.name}: {name} out_idx", runner.to_host(idx[0]), idx[1], out)
    _cmp(f"{case.name}: {name} vals32", runner.to_host(v32[0]), v32[1], out)
    _cmp(f"{case.name}: {name} vals64", runner.to_host(v64[0]), v64[1], out)
    for t in range(nt):
        if h_ro[t] is not None:
            _cmp(f"{case.name}: {name} res_out[{t}]", runner.to_host(d_ro[t]), h_ro[t], out)
    return out


def chunk_scan_stepwise(runner, name: str, tb: TensorTables, state, cnt, eq_base, out_base, counts) -> list[str]:
    """chunk_scan_reduce, chunk_scan_eq and chunk_scan_out launched on their own against their twins, every
    buffer compared after every launch. The array arguments are (device, host) pairs; the host ones are updated
    by the twins."""
    up = _uploader(runner)
    out: list[str] = []
    nblk = -(-tb.nchunks // CHUNK_SCAN_THREADS)
    host_part = np.full(CHUNK_SCAN_PART * nblk + _PAD, U64_MAX, np.uint64)
    part = (up(host_part), host_part.copy())
    nt32, nch, nseg = np.int32(tb.nt), np.int64(tb.nchunks), np.int32(tb.nseg)
    cs, sfc = tb.chunk_start, tb.seg_first_chunk
    steps = (
        ("chunk_scan_reduce", (nch, nseg, sfc, cnt, part), (part,)),
        ("chunk_scan_eq", (nt32, nch, cs, nseg, sfc, state, cnt, part, eq_base, out_base), (part, eq_base, out_base)),
        ("chunk_scan_out", (nt32, nch, cs, part, out_base, counts), (out_base, counts)),
    )
    for kernel, args, outputs in steps:
        dev = [a[0] if isinstance(a, tuple) else up(a) if isinstance(a, np.ndarray) else a for a in args]
        host = [a[1] if isinstance(a, tuple) else a for a in args]
        runner.launch(kernel, nblk, CHUNK_SCAN_THREADS, tuple(dev))
        getattr(twins, kernel)(*host)
        for j, p in enumerate(outputs):
            _cmp(f"{name}: {kernel} output {j}", runner.to_host(p[0]), p[1], out)
        if out:
            return out
    return out


@dataclass(frozen=True)
class ChunkScanCase:
    """Per-chunk counts of many chunks, in tensors of ``chunks`` chunks each (0: empty) grouped into segments of
    ``segs`` tensors each, for the chunk scan alone (no elements behind the chunks). ``take``: "random", "none"
    (k = 0 segments: threshold above every key, nothing taken at it), "all" (every equal key taken)."""

    name: str
    chunks: tuple[int, ...]
    segs: tuple[int, ...]
    take: str = "random"
    seed: int = 0


def chunk_scan_cases() -> list[ChunkScanCase]:
    """Tables that span several chunk-scan blocks: segments and tensors across block boundaries, a segment over
    more than two blocks, empty tensors at the ends and at a boundary, one-chunk tensors and segments."""
    S = CHUNK_SCAN_THREADS
    rng = np.random.default_rng(5)
    small = tuple(int(x) for x in rng.integers(0, 4, 400))
    return [
        ChunkScanCase("one_tensor", (3 * S + 7,), (1,)),
        ChunkScanCase("exact_blocks", (S, S, 0, S), (1, 2, 1)),
        ChunkScanCase("boundaries", (0, S - 1, 1, 2, S + 3, 0, 2 * S + 1, 5, 0), (2, 1, 3, 1, 2)),
        ChunkScanCase("many_small_global", small, (len(small),)),
        ChunkScanCase("many_small_tensor", small, (1,) * len(small), seed=1),
        ChunkScanCase("many_small_runs", small, (7, 150, 1, 0, 3, 239), seed=2),
        ChunkScanCase("take_none", (S + 9, 2 * S), (1, 1), take="none"),
        ChunkScanCase("take_all", (5, 3 * S - 2), (2,), take="all"),
    ]


def chunk_scan_inputs(case: ChunkScanCase) -> tuple[TensorTables, np.ndarray, np.ndarray]:
    """(tables, state, cnt): random counts of keys above and at each segment's threshold per chunk."""
    rng = np.random.default_rng(case.seed)
    seg_of = [s for s, m in enumerate(case.segs) for _ in range(m)]
    assert len(seg_of) == len(case.chunks), case.name
    tb = TensorTables([m * CHUNK for m in case.chunks], seg_of, len(case.segs))
    cnt = rng.integers(0, 40, 2 * tb.nchunks).astype(np.uint32)
    cnt[1::2][rng.random(tb.nchunks) < 0.3] = 0  # chunks without keys at the threshold
    state = initial_state([1] * tb.nseg)
    for s in range(tb.nseg):
        a, b = int(tb.seg_first_chunk[s]), int(tb.seg_first_chunk[s + 1]) if s + 1 < tb.nseg else tb.nchunks
        eq = int(cnt[2 * a + 1 : 2 * b : 2].sum())
        take = {"none": 0, "all": eq}.get(case.take, int(rng.integers(0, eq + 2)))
        state[2 * s : 2 * s + 2] = (int(rng.integers(1, 0xFFFFFFFF)), take)  # a threshold key, and k at it
    return tb, state, cnt


def chunk_scan_reference(tb: TensorTables, state: np.ndarray, cnt: np.ndarray) -> tuple[np.ndarray, ...]:
    """eq_base, out_base and tensor counts chunk by chunk, from their definitions."""
    seg = [int(tb.seg_of[t]) for t in range(tb.nt) for _ in range(int(tb.chunk_start[t + 1] - tb.chunk_start[t]))]
    eq_base = np.zeros(tb.nchunks, np.uint64)
    out_base = np.zeros(tb.nchunks + 1, np.uint64)
    seen, pos = [0] * tb.nseg, 0
    for c in range(tb.nchunks):
        s, gt, eq = seg[c], int(cnt[2 * c]), int(cnt[2 * c + 1])
        eq_base[c], out_base[c] = seen[s], pos
        pos += gt + min(eq, max(0, int(state[2 * s + 1]) - seen[s]))
        seen[s] += eq
    out_base[tb.nchunks] = pos
    counts = out_base[tb.chunk_start[1:]] - out_base[tb.chunk_start[:-1]]
    return eq_base, out_base, counts


def chunk_scan_vs_twins(runner, case: ChunkScanCase) -> list[str]:
    """The chunk scan kernels launch by launch against their twins, and the result against its definition."""
    tb, state, cnt = chunk_scan_inputs(case)
    up = _uploader(runner)

    def pair(host):
        return up(host), host.copy()

    eq_base = pair(np.full(tb.nchunks + _PAD, U64_MAX, np.uint64))
    out_base = pair(np.full(tb.nchunks + 1 + _PAD, U64_MAX, np.uint64))
    counts = pair(np.full(tb.nt + _PAD, U64_MAX, np.uint64))
    out = chunk_scan_stepwise(runner, case.name, tb, pair(state), pair(cnt), eq_base, out_base, counts)
    if out:
        return out
    for what, got, want in zip(
        ("eq_base", "out_base", "tensor_counts"), (eq_base, out_base, counts), chunk_scan_reference(tb, state, cnt)
    ):
        _cmp(f"{case.name}: {what} against its definition", got[1][: want.size], want, out)
    return out


class _Filled:
    """An array module whose ``empty`` fills every byte with 0xA5: unwritten slots are equal in two runs, and
    stray writes show."""

    def __init__(self, xp=np):
        self._xp = xp

    def __getattr__(self, name):
        return getattr(self._xp, name)

    def empty(self, shape, dtype=np.float64):
        a = self._xp.empty(shape, dtype=dtype)
        a.view(np.uint8)[...] = 0xA5
        return a


class TwinRunner:
    """A runner whose launches call the NumPy twins (cpu_fallback.kernels and cpu_fallback.fused): tables of
    addresses (arguments named ``*_ptrs``) become the lists of arrays they point to."""

    def __init__(self):
        self.xp = _Filled()
        self._arrays: dict[int, np.ndarray] = {}

    def ptr(self, a) -> int:
        addr = int(a.__array_interface__["data"][0])
        self._arrays[addr] = a
        return addr

    def to_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def launch(self, name, grid, block, args) -> None:
        from gpu_codec.backends.sources import kernel_signatures
        from gpu_codec.cpu_fallback import fused

        params = kernel_signatures()[name][1]
        conv = [
            [self._arrays[int(p)] if int(p) else None for p in a] if pname.endswith("_ptrs") else a
            for (_, pname), a in zip(params, args)
        ]
        (getattr(fused, name) if hasattr(fused, name) else getattr(twins, name))(*conv)


class _Stop(Exception):
    """A launch's buffers differ from the twins': stop before later kernels run on inconsistent inputs."""


def _by_chunk(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The arrays of one launch, the candidate pool (cand_idx, cand_key) as its chunks' candidates in chunk order
    and cand_base as where they start in that order: fused_scan places chunks in the pool in the order its blocks
    finish, which later kernels never see (they find a chunk's candidates through cand_base and cand_cnt)."""
    if {"cand_base", "cand_cnt"} <= arrays.keys():
        base, cnt = arrays["cand_base"].astype(np.int64), arrays["cand_cnt"].astype(np.int64)
        for p in {"cand_idx", "cand_key"} & arrays.keys():
            a = arrays[p]
            arrays[p] = np.concatenate([a[:0]] + [a[b : b + m] for b, m in zip(base.tolist(), cnt.tolist()) if m])
        arrays["cand_base"] = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.uint64)
    return list(arrays.values())


class RecordingRunner:
    """Wraps a runner: after every launch, a host copy of each array argument that is not a table of addresses
    (name, [arrays]). With ``expect`` (another RecordingRunner's log), each launch is compared with the same launch
    there and the first difference stops the run (raises _Stop)."""

    def __init__(self, inner, xp=None, expect=None, label=""):
        self.inner = inner
        self.xp = xp if xp is not None else inner.xp
        self.log: list[tuple[str, list[np.ndarray]]] = []
        self.expect, self.label = expect, label
        self.skip_keys = False  # keys of rejected inputs may hold NaN patterns that differ by device

    def ptr(self, a) -> int:
        return self.inner.ptr(a)

    def to_host(self, a) -> np.ndarray:
        return self.inner.to_host(a)

    def launch(self, name, grid, block, args) -> None:
        from gpu_codec.backends.sources import kernel_signatures

        self.inner.launch(name, grid, block, args)
        params = kernel_signatures()[name][1]
        kept = [(p, a) for (_, p), a in zip(params, args) if not isinstance(a, np.generic) and not p.endswith("_ptrs")]
        step = len(self.log)
        self.log.append((name, _by_chunk({p: self.inner.to_host(a) for p, a in kept})))
        if self.expect is None:
            return
        if step >= len(self.expect) or self.expect[step][0] != name:
            want = self.expect[step][0] if step < len(self.expect) else "no launch"
            raise _Stop(f"{self.label}: launch {step} is {name}, the twins launched {want}")
        if self.skip_keys and name in ("score_keys", "fused_scan", "fused_scan_f32", "fused_scan_h16", "sample_keys"):
            return
        out: list[str] = []
        for j, (g, w) in enumerate(zip(self.log[step][1], self.expect[step][1])):
            _cmp(f"{self.label}: launch {step} {name} array argument {j}", g, w, out)
        if out:
            raise _Stop("; ".join(out))


@contextlib.contextmanager
def forced(fallback: str = "", wide: bool = False, select: str = "", scan: str = "", own: str = "") -> Iterator[None]:
    """The fused selection driven where a test needs it, for the block: the plan functions of
    :mod:`gpu_codec.backends.kernels` replaced (nothing in the production classes knows about tests).
    ``fallback``: "miss" (lo above every key of every segment with k > 0) or "overflow" (an empty candidate pool);
    ``wide``: 64-bit indices whatever the sizes; ``select``: "one" (cand_select) or "multi" (cand_hist and
    radix_pick) whatever the segments' sizes; ``scan``: "fused_scan" (the general scan) where the plan would
    launch fused_scan_f32 (a comparison of the two on the same inputs); ``own``: "one" (only a segment of one
    chunk is selected by its block, every other is sampled and bracketed, so small cases take the bracket's path)."""
    from gpu_codec.backends import kernels as K

    saved: dict[str, Any] = {}

    def patch(name: str, fn: Any) -> None:
        saved[name] = getattr(K, name)
        setattr(K, name, fn)

    if fallback:
        plan = K.candidate_plan

        def forced_plan(host_sample, samp_off, st, segments):
            lo, own_k, pool = plan(host_sample, samp_off, st, segments)
            if fallback == "overflow":
                return lo, own_k, 0
            for s, k in enumerate(st.k.tolist()):
                if k > 0:
                    lo[s], own_k[s] = K.NO_LO - 1, 0
            return lo, own_k, pool

        patch("candidate_plan", forced_plan)
    if wide:
        patch("wide_indices", lambda numels: True)
    if select:
        patch("hist_select", lambda widest, chunks, nseg: select == "multi")
    if scan:
        if scan != "fused_scan":
            raise ValueError(f"scan must be 'fused_scan', got {scan!r}")
        patch("scan_kernel", lambda dtypes, crit, ext_scores: scan)
    if own:
        patch("own_rule", lambda chunks, tensors: (chunks == 1) & (tensors == 1))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(K, name, fn)


def topk_fused_stepwise(
    runner, case: TopkCase, wide: bool = False, force: str = "", select: str = "", own: str = ""
) -> list[str]:
    """The fused selection (KernelOps with fused=True) on the twins, then on ``runner`` launch by launch: every
    array argument compared after every launch (the first difference stops the run), then the outputs and
    residuals of both against the NumPy backend.

    ``force``: "miss" or "overflow" forces the fallback to the unfused passes; ``wide`` 64-bit indices;
    ``select``: "one" (cand_select) or "multi" (cand_hist and radix_pick) for the selection on the candidates;
    ``own``: "one", only one-chunk segments selected by their blocks (see :func:`forced`)."""
    from gpu_codec.backends.kernels import KernelOps as Ops

    inp = make_topk_inputs(case)
    h = {k: [None if a is None else a.copy() for a in inp[k]] for k in ("new", "base", "res", "ext")}
    h_ro = _res_out(inp, h["res"], np.copy)
    ri, rv, rbad = topk_select(h["new"], h["base"], h["res"], h_ro, inp["dtypes"], h["ext"], *_rest(inp))
    twin = RecordingRunner(TwinRunner())
    dev = RecordingRunner(runner, _Filled(runner.xp), expect=twin.log, label=case.name)
    dev.skip_keys = rbad is not None
    results = []
    for rr in (twin, dev):
        up = _uploader(rr, case.shift)
        d = {k: [up(a) for a in inp[k]] for k in ("new", "base", "res", "ext")}
        d_ro = _res_out(inp, d["res"], up)
        ops = Ops(rr, fused=True)
        try:
            with forced(force, wide, select, own=own):
                gi, gv, gbad = ops.topk_select(
                    d["new"], d["base"], d["res"], d_ro, inp["dtypes"], d["ext"], *_rest(inp)
                )
        except _Stop as e:
            return [str(e)]
        results.append((gi, gv, gbad, d_ro, rr, ops))
    out: list[str] = []
    if len(dev.log) != len(twin.log):
        return [f"{case.name}: {len(dev.log)} launches, the twins made {len(twin.log)}"]
    for tag, (gi, gv, gbad, g_ro, rr, ops) in zip(("twins", "kernels"), results):
        if gbad != rbad:
            out.append(f"{case.name}: {tag} bad tensor {gbad} != reference {rbad}")
            continue
        if force and ops.fused_selections:
            out.append(f"{case.name}: {tag} forced {force} completed the fused selection")
        for t in range(len(case.sizes)):
            if rbad is not None:
                if inp["res_out"] == "alias" and h["res"][t] is not None:  # nothing written to it on error
                    _cmp(f"{case.name}: {tag} residual after error [{t}]", rr.to_host(g_ro[t]), inp["res"][t], out)
                continue
            _cmp(f"{case.name}: {tag} indices[{t}]", rr.to_host(gi[t]), ri[t], out)
            _cmp(f"{case.name}: {tag} values[{t}]", rr.to_host(gv[t]), rv[t], out)
            if h_ro[t] is not None:
                _cmp(f"{case.name}: {tag} res_out[{t}]", rr.to_host(g_ro[t]), h_ro[t], out)
    return out


def _rest(inp: dict) -> tuple:
    return (inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])


# -------------------------------------------------------------------------------------------------- scatter


@dataclass(frozen=True)
class ScatterCase:
    """Dense reconstruction of a tensor list from sorted sparse entries.

    ``bad``: "none", or "range" / "dup" / "desc" planted at entry ``bad_at`` of tensor ``bad_tensor`` (a second
    bad entry is planted later in the last tensor, so the lowest one must be reported).
    """

    name: str
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    fraction: float = 0.3
    mode: int = 0
    wide: bool = False
    bad: str = "none"
    bad_tensor: int = 0
    bad_at: int = 1
    seed: int = 0

    def with_(self, **kw) -> ScatterCase:
        return dataclasses.replace(self, **kw)


def make_scatter_inputs(case: ScatterCase) -> dict[str, Any]:
    rng = np.random.default_rng(case.seed)
    idx, vals, outs = [], [], []
    for n, dt in zip(case.sizes, case.dtypes):
        c = min(n, round(n * case.fraction))
        i = np.sort(rng.choice(n, size=c, replace=False)) if c else np.zeros(0, np.int64)
        idx.append(i.astype(np.uint64 if case.wide else index_dtype(n)))
        v = rng.standard_normal(c) * 2.0
        vals.append(v.astype(np.float64 if dt == "f64" else np.float32))
        if case.mode == 1:
            outs.append(_store(rng.standard_normal(n), dt))
        else:
            outs.append(np.zeros(n, dtype=_store(np.zeros(1), dt).dtype))

    def plant(t: int, at: int, kind: str) -> None:
        i = idx[t]
        if i.size == 0:
            return
        at = min(at, i.size - 1)
        if kind == "range":
            i[at] = case.sizes[t] + at
        elif kind == "dup" and at > 0:
            i[at] = i[at - 1]
        elif kind == "desc" and at > 0:
            i[at - 1], i[at] = i[at], i[at - 1]
        elif kind in ("nan", "inf"):  # a non-finite value is as bad as a bad index
            vals[t][at] = np.nan if kind == "nan" else -np.inf
        elif kind in ("dup", "desc") and i.size > 1:  # at 0 there is no predecessor: plant it at entry 1
            if kind == "dup":
                i[1] = i[0]
            else:
                i[0], i[1] = i[1], i[0]

    if case.bad != "none":
        plant(case.bad_tensor, case.bad_at, case.bad)
        plant(len(case.sizes) - 1, 10**9, "range")
    return {"idx": idx, "vals": vals, "outs": outs, "dtypes": [DT[d] for d in case.dtypes]}


def scatter_vs_reference(runner, case: ScatterCase) -> list[str]:
    """KernelOps(runner).scatter against the NumPy backend's scatter (the twin of the scatter kernels)."""
    from gpu_codec.backends.cpu import CpuBackend

    inp = make_scatter_inputs(case)
    up = _uploader(runner)
    d_outs = [up(o) for o in inp["outs"]]
    h_outs = [o.copy() for o in inp["outs"]]
    gbad = KernelOps(runner).scatter(
        d_outs, inp["dtypes"], list(case.sizes), [up(i) for i in inp["idx"]], [up(v) for v in inp["vals"]], case.mode
    )
    wbad = CpuBackend().scatter(h_outs, inp["dtypes"], list(case.sizes), inp["idx"], inp["vals"], case.mode)
    out: list[str] = []
    if gbad != wbad:
        out.append(f"{case.name}: bad entry {gbad} != {wbad}")
    for t in range(len(case.sizes)):
        _cmp(f"{case.name}: out[{t}]", runner.to_host(d_outs[t]), h_outs[t], out)
    return out


def scatter_stepwise(runner, case: ScatterCase) -> list[str]:
    """scatter_u32 / scatter_u64 launched directly against the twin of the same name."""
    inp = make_scatter_inputs(case)
    up = _uploader(runner)
    nt = len(case.sizes)
    counts = [int(i.size) for i in inp["idx"]]
    total = sum(counts)
    if total == 0:
        return []
    ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
    idx = np.concatenate([i.astype(np.uint64 if case.wide else np.uint32) for i in inp["idx"]])
    vals32 = np.concatenate([v if v.dtype == np.float32 else np.zeros(v.size, np.float32) for v in inp["vals"]])
    vals64 = np.concatenate([v if v.dtype == np.float64 else np.zeros(v.size, np.float64) for v in inp["vals"]])
    numel = np.asarray(case.sizes, np.int64)
    odt = np.asarray(inp["dtypes"], np.int32)
    d_outs = [up(o) for o in inp["outs"]]
    h_outs = [o.copy() for o in inp["outs"]]
    d_err, h_err = up(np.full(1, U64_MAX, np.uint64)), np.full(1, U64_MAX, np.uint64)
    table = up(np.asarray([runner.ptr(o) for o in d_outs], np.uint64))
    name = "scatter_u64" if case.wide else "scatter_u32"
    grid = (total + BLOCK - 1) // BLOCK
    runner.launch(
        name,
        grid,
        BLOCK,
        (
            np.int32(nt),
            np.uint64(total),
            up(ent_start),
            up(numel),
            up(odt),
            table,
            up(idx),
            up(vals32),
            up(vals64),
            np.int32(case.mode),
            d_err,
        ),
    )
    getattr(twins, name)(
        np.int32(nt), np.uint64(total), ent_start, numel, odt, h_outs, idx, vals32, vals64, np.int32(case.mode), h_err
    )
    out: list[str] = []
    _cmp(f"{case.name}: {name} err", runner.to_host(d_err), h_err, out)
    for t in range(nt):
        _cmp(f"{case.name}: {name} out[{t}]", runner.to_host(d_outs[t]), h_outs[t], out)
    return out


# ------------------------------------------------------------------------------------------------ the cases

_MIXED = ("f32", "f16", "bf16", "f64")
_ODD = (1, 255, 257, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 77)


def topk_cases() -> list[TopkCase]:
    """Small, adversarial top-k cases: every dtype, criterion, scope, k edge, pattern and residual mode."""
    c: list[TopkCase] = []
    c.append(TopkCase("mixed_global", (5000, 257, 9000, 31), _MIXED))
    c.append(TopkCase("mixed_tensor", (5000, 257, 9000, 31), _MIXED, scope="tensor"))
    c.append(TopkCase("pairs", (3000, 4100, 700, 5000), _MIXED, scope="pairs", k=0.3))
    c.append(TopkCase("odd_sizes", _ODD, ("f32",) * len(_ODD), k=0.05))
    c.append(TopkCase("odd_sizes_tensor", _ODD, ("f16",) * len(_ODD), scope="tensor", k="random", seed=3))
    c.append(TopkCase("empty_tensors", (0, 300, 0, 5000, 0), ("f32", "f64", "f16", "bf16", "f32"), k=0.2))
    c.append(TopkCase("all_empty", (0, 0), ("f32", "f32"), k="all"))
    c.append(TopkCase("single_element", (1,), ("f32",), k="one"))
    for dt in _MIXED:
        c.append(TopkCase(f"one_block_{dt}", (BLOCK,), (dt,), k=0.5))
        c.append(TopkCase(f"multi_chunk_{dt}", (2 * CHUNK + 5,), (dt,), k=0.01, seed=1))
    for k in ("zero", "one", "all", "random"):
        c.append(TopkCase(f"k_{k}_global", (4000, 4097, 10), ("f32", "bf16", "f64"), k=k))
        c.append(TopkCase(f"k_{k}_tensor", (4000, 4097, 10), ("f32", "bf16", "f64"), scope="tensor", k=k))
    for p in ("ties", "equal", "zeros", "signed_zero", "subnormal", "rounding", "huge"):
        c.append(TopkCase(f"pattern_{p}", (4100, 900, 8200), ("f32", "f16", "bf16"), k=0.37, pattern=p))
        c.append(TopkCase(f"pattern_{p}_f64", (3000, 5000), ("f64", "f32"), scope="tensor", k=0.61, pattern=p))
    for crit in range(8):
        c.append(
            TopkCase(
                f"crit_{crit}",
                (3000, 5000, 600),
                ("f32", "f16", "f64"),
                crit=crit,
                k=0.2,
                ext_dtypes=("f32", "bf16", "f16") if crit == 7 else None,
            )
        )
        c.append(
            TopkCase(
                f"crit_{crit}_ties",
                (5000, 600),
                ("bf16", "f64"),
                crit=crit,
                k=0.3,
                pattern="ties",
                scope="tensor",
                ext_dtypes=("f64", "f32") if crit == 7 else None,
            )
        )
    c.append(TopkCase("no_base", (5000, 300), ("f32", "f64"), base=False, crit=5))
    for q in (0, 1, 2):
        c.append(TopkCase(f"residual_q{q}", (5000, 700, 300, 1000), _MIXED, res=True, res_out="new", qmode=q))
        c.append(
            TopkCase(
                f"residual_alias_q{q}",
                (4096, 4097),
                ("bf16", "f64"),
                res=True,
                res_out="alias",
                qmode=q,
                scope="tensor",
                pattern="rounding",
            )
        )
        c.append(
            TopkCase(f"residual_out_only_q{q}", (3000, 500), ("f32", "bf16"), res_out="new", qmode=q, pattern="huge")
        )
    for p in ("nonfinite_inf", "nonfinite_nan", "f64_overflow"):
        c.append(TopkCase(f"reject_{p}", (1000, 2000, 3000), ("f32", "f64", "f16"), pattern=p))
    # fp32 with the delta's magnitude (fused_scan_f32 in the fused selection): residuals, ties, misaligned arrays
    f32 = ("f32",) * 4
    c.append(TopkCase("f32_residual_q1", (5000, 4097, 700, 3), f32, res=True, res_out="new", qmode=1, k=0.05))
    c.append(TopkCase("f32_alias_tensor", (4096, 4097), f32[:2], res=True, res_out="alias", scope="tensor"))
    c.append(TopkCase("f32_zeros", (4100, 900, 8200), f32[:3], k=0.37, pattern="zeros"))
    c.append(TopkCase("f32_change_ties", (5000, 600), f32[:2], crit=3, k=0.3, pattern="ties", scope="tensor"))
    c.append(TopkCase("f32_misaligned", (5000, 4097, 700, 3), f32, res=True, res_out="new", k=0.05, shift=1))
    c.append(TopkCase("f32_reject_nan", (1000, 2000, 3000), f32[:3], pattern="nonfinite_nan"))
    return c


def scatter_cases() -> list[ScatterCase]:
    c: list[ScatterCase] = []
    for mode in (0, 1):
        for wide in (False, True):
            c.append(
                ScatterCase(
                    f"mixed_m{mode}_{'u64' if wide else 'u32'}", (5000, 300, 9000, 1), _MIXED, mode=mode, wide=wide
                )
            )
    c.append(ScatterCase("all_kept", (700, 256), ("f16", "f64"), fraction=1.0, mode=1))
    c.append(ScatterCase("none_kept", (700, 256), ("f16", "f64"), fraction=0.0))
    c.append(ScatterCase("some_empty", (0, 600, 0, 513), ("f32", "bf16", "f64", "f16"), fraction=0.5, mode=1))
    for bad in ("range", "dup", "desc"):
        for at in (0, 1, 255, 256):
            c.append(
                ScatterCase(
                    f"bad_{bad}_at{at}",
                    (3000, 2000, 700),
                    ("f32", "f16", "f64"),
                    bad=bad,
                    bad_tensor=1,
                    bad_at=at,
                    mode=at % 2,
                    wide=at == 255,
                )
            )
    c.append(ScatterCase("bad_first_tensor", (600, 600), ("bf16", "f32"), bad="range", bad_tensor=0, bad_at=0))
    for bad in ("nan", "inf"):
        for t in (0, 2):  # an fp32-valued and an fp64-valued tensor
            c.append(
                ScatterCase(
                    f"bad_{bad}_t{t}",
                    (3000, 2000, 700),
                    ("f32", "f16", "f64"),
                    bad=bad,
                    bad_tensor=t,
                    bad_at=17,
                    mode=t % 2,
                )
            )
    return c


def large_topk_cases(max_n: int) -> list[TopkCase]:
    """Large random cases for GPU-vs-CPU parity (benchmarks/gpu_suite.py), the biggest with ``max_n`` elements."""
    n = int(max_n)
    return [
        TopkCase(f"large_f32_global_{n}", (n // 2, n // 4, n - n // 2 - n // 4), ("f32",) * 3, k=0.01, seed=11),
        TopkCase(
            f"large_bf16_tensor_{n // 4}",
            (n // 8, n // 8 + 12345),
            ("bf16", "bf16"),
            scope="tensor",
            k=0.05,
            res=True,
            res_out="alias",
            qmode=2,
            seed=12,
        ),
        TopkCase(f"large_f16_ties_{n // 4}", (n // 4,), ("f16",), k=0.1, pattern="ties", seed=13),
        TopkCase(f"large_f64_{n // 10}", (n // 10, 77), ("f64", "f32"), crit=5, k=0.001, seed=14),
        TopkCase(
            f"large_mixed_res_{n // 10}",
            (n // 20, n // 40, 99999, n // 40),
            _MIXED,
            res=True,
            res_out="new",
            qmode=1,
            k=0.02,
            seed=15,
        ),
    ]


def large_scatter_cases(max_n: int) -> list[ScatterCase]:
    n = int(max_n)
    return [
        ScatterCase(f"large_scatter_{n // 4}", (n // 8, n // 8 + 3), ("f32", "bf16"), fraction=0.01, mode=1, seed=16),
        ScatterCase(f"large_scatter_u64_{n // 10}", (n // 10,), ("f64",), fraction=0.02, wide=True, seed=17),
    ]


# ------------------------------------------------------------------------------------------- value codecs


@dataclass(frozen=True)
class QuantCase:
    """Kept values of a tensor list through every codec of kernels/quantize.cu (fp16 and bf16 casts, int8
    absmax, ternary), with error-feedback residuals, against cpu_fallback/quantize.py.

    ``idx``: per tensor "u32", "u64" (kept entries index a residual of ``spread`` x as many elements) or "dense"
    (entry l is element l).
    """

    name: str
    sizes: tuple[int, ...]
    vdts: tuple[str, ...]
    idx: tuple[str, ...]
    res: bool = True
    pattern: str = "normal"
    block: int = 256
    spread: int = 3
    seed: int = 0

    def with_(self, **kw) -> QuantCase:
        return dataclasses.replace(self, **kw)


def _quant_values(rng: np.random.Generator, n: int, pattern: str) -> np.ndarray:
    if pattern == "clamp":  # beyond fp16's and bf16's largest finite values (bf16 max < fp32 max)
        return rng.choice(np.array([7e4, -65505.0, 65520.0, 3.3961e38, -3.4e38, 1.0, -0.0, 1e-30]), n)
    if pattern == "int8_ties":  # v / scale lands exactly on .5: round half to even; blocks of zeros: scale 0
        v = rng.choice(np.array([127.0, 0.5, 1.5, -2.5, 63.5, 0.0, -0.0]), n)
        v[: n // 4] = 0.0
        return v
    return _values(rng, n, pattern)


def make_quant_inputs(case: QuantCase) -> dict[str, Any]:
    rng = np.random.default_rng(case.seed)
    vals, idx, res = [], [], []
    for n, vdt, kind in zip(case.sizes, case.vdts, case.idx):
        vd = np.float64 if vdt == "f64" else np.float32
        with np.errstate(over="ignore"):
            vals.append(_quant_values(rng, n, case.pattern).astype(vd))
        numel = n if kind == "dense" else n * case.spread + 1
        if kind == "dense":
            idx.append(None)
        else:
            i = np.sort(rng.choice(numel, size=n, replace=False))
            idx.append(i.astype(np.uint64 if kind == "u64" else np.uint32))
        res.append((rng.standard_normal(numel) * 0.01).astype(vd) if case.res else None)
    return {"vals": vals, "idx": idx, "res": res}


def quant_stepwise(runner, case: QuantCase) -> list[str]:
    """quantize_cast (fp16, bf16), quantize_int8 and ternary_partial/mu/fixup against cpu_fallback/quantize.py."""
    from gpu_codec.cpu_fallback import quantize as qt

    inp = make_quant_inputs(case)
    up = _uploader(runner)
    nt = len(case.sizes)
    counts = list(case.sizes)
    total = sum(counts)
    out: list[str] = []
    if total == 0:
        return out
    ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
    vdt = np.asarray([DT[v] for v in case.vdts], np.int32)
    idx_w = np.asarray([0 if i is None else i.itemsize for i in inp["idx"]], np.int32)
    d_vals = [up(v) for v in inp["vals"]]
    d_idx = [up(i) for i in inp["idx"]]

    def table(arrs):
        return up(np.asarray([runner.ptr(a) if a is not None else 0 for a in arrs], dtype=np.uint64))

    def fresh_res():
        d = [up(r) for r in inp["res"]]
        return d, table(d), [None if r is None else r.copy() for r in inp["res"]]

    def cmp_res(tag, d_res, h_res):
        for t in range(nt):
            if h_res[t] is not None:
                _cmp(f"{case.name}: {tag} residual[{t}]", runner.to_host(d_res[t]), h_res[t], out)

    nt32, p_vals, p_idx = np.int32(nt), table(d_vals), table(d_idx)
    # casts
    for mode, enc, dec in ((1, qt.cast_f16, qt.decode_f16), (2, qt.cast_bf16, qt.decode_bf16)):
        d_res, p_res, h_res = fresh_res()
        o = up(np.full(total + _PAD, 0xABCD, np.uint16))
        runner.launch(
            "quantize_cast",
            (total + BLOCK - 1) // BLOCK,
            BLOCK,
            (nt32, np.uint64(total), up(ent_start), up(vdt), p_vals, up(idx_w), p_idx, p_res, np.int32(mode), o),
        )
        want = np.full(total + _PAD, 0xABCD, np.uint16)
        for t in range(nt):
            bits = enc(inp["vals"][t])
            want[int(ent_start[t]) : int(ent_start[t + 1])] = bits
            qt.fix_residual(h_res[t], inp["idx"][t], inp["vals"][t], dec(bits))
        _cmp(f"{case.name}: quantize_cast mode {mode}", runner.to_host(o), want, out)
        cmp_res(f"quantize_cast mode {mode}", d_res, h_res)
    # int8 absmax
    d_res, p_res, h_res = fresh_res()
    nblk = [-(-n // case.block) for n in counts]
    blk_start = np.concatenate([[0], np.cumsum(nblk)]).astype(np.uint64)
    nb = int(blk_start[-1])
    o8 = up(np.full(total + _PAD, 99, np.int8))
    sc = up(np.full(nb + _PAD, -1.0, np.float32))
    if nb:
        runner.launch(
            "quantize_int8",
            nb,
            BLOCK,
            (
                nt32,
                up(blk_start),
                up(ent_start),
                np.int32(case.block),
                up(vdt),
                p_vals,
                up(idx_w),
                p_idx,
                p_res,
                o8,
                sc,
            ),
        )
    w8, wsc = np.full(total + _PAD, 99, np.int8), np.full(nb + _PAD, -1.0, np.float32)
    for t in range(nt):
        q, s = qt.int8_absmax(inp["vals"][t], case.block)
        w8[int(ent_start[t]) : int(ent_start[t + 1])] = q
        wsc[int(blk_start[t]) : int(blk_start[t + 1])] = s
        qt.fix_residual(h_res[t], inp["idx"][t], inp["vals"][t], qt.int8_decode(q, s, case.block))
    _cmp(f"{case.name}: quantize_int8 q", runner.to_host(o8), w8, out)
    _cmp(f"{case.name}: quantize_int8 scales", runner.to_host(sc), wsc, out)
    cmp_res("quantize_int8", d_res, h_res)
    # ternary
    d_res, p_res, h_res = fresh_res()
    nch = [-(-n // CHUNK) for n in counts]
    chunk_start = np.concatenate([[0], np.cumsum(nch)]).astype(np.int64)
    nchunks = int(chunk_start[-1])
    nwords = [-(-n // 32) for n in counts]
    word_off = np.concatenate([[0], np.cumsum(nwords)]).astype(np.uint64)
    partial = up(np.full(nchunks + _PAD, -1.0, np.float64))
    words = up(np.full(int(word_off[-1]) + _PAD, _FILL32, np.uint32))
    mu = up(np.full(nt + _PAD, -1.0, np.float32))
    if nchunks:
        runner.launch(
            "ternary_partial",
            nchunks,
            BLOCK,
            (nt32, up(chunk_start), up(ent_start), up(vdt), p_vals, up(word_off), partial, words),
        )
    runner.launch("ternary_mu", max(nt, 1), BLOCK, (nt32, up(chunk_start), up(ent_start), partial, mu))
    runner.launch(
        "ternary_fixup",
        (total + BLOCK - 1) // BLOCK,
        BLOCK,
        (nt32, np.uint64(total), up(ent_start), up(vdt), p_vals, up(idx_w), p_idx, p_res, mu),
    )
    wwords = np.full(int(word_off[-1]) + _PAD, _FILL32, np.uint32)
    wmu = np.full(nt + _PAD, -1.0, np.float32)
    for t in range(nt):
        v = inp["vals"][t]
        signs = qt.ternary_signs(v)
        packed = np.zeros(4 * nwords[t], np.uint8)
        packed[: signs.size] = signs
        wwords[int(word_off[t]) : int(word_off[t + 1])] = packed.view("<u4")
        wmu[t] = qt.ternary_mu(v)
        qt.fix_residual(h_res[t], inp["idx"][t], v, qt.ternary_decode(signs, wmu[t], v.size))
    _cmp(f"{case.name}: ternary sign words", runner.to_host(words), wwords, out)
    _cmp(f"{case.name}: ternary mu", runner.to_host(mu), wmu, out)
    cmp_res("ternary_fixup", d_res, h_res)
    return out


@dataclass(frozen=True)
class RiceCase:
    """Ascending indices of a tensor list Rice-coded by kernels/rice.cu against cpu_fallback/rice.py.

    ``ks``: per tensor Rice parameter, or None for ``rice_param(nnz, numel)``.
    """

    name: str
    nnz: tuple[int, ...]
    numel: tuple[int, ...]
    wide: bool = False
    ks: tuple[int | None, ...] | None = None
    seed: int = 0


def rice_stepwise(runner, case: RiceCase) -> list[str]:
    from gpu_codec.cpu_fallback import rice as rc

    rng = np.random.default_rng(case.seed)
    up = _uploader(runner)
    nt = len(case.nnz)
    idx, ks = [], []
    for t, (n, numel) in enumerate(zip(case.nnz, case.numel)):
        if numel < 1 << 24:
            i = np.sort(rng.choice(numel, size=n, replace=False))
        else:  # sparse picks from a huge range (64-bit gaps)
            i = np.unique(rng.integers(0, numel, size=n, dtype=np.uint64))
            while i.size < n:
                i = np.unique(np.concatenate([i, rng.integers(0, numel, size=n - i.size, dtype=np.uint64)]))
        idx.append(i.astype(np.uint64 if case.wide else np.uint32))
        k = None if case.ks is None else case.ks[t]
        ks.append(rc.rice_param(n, numel) if k is None else k)
    counts = [int(i.size) for i in idx]
    ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
    nch = [-(-n // CHUNK) for n in counts]
    chunk_start = np.concatenate([[0], np.cumsum(nch)]).astype(np.int64)
    nchunks = int(chunk_start[-1])
    out: list[str] = []
    if nchunks == 0:
        return out
    d_idx = [up(i) for i in idx]
    p_idx = up(np.asarray([runner.ptr(a) for a in d_idx], np.uint64))
    ks32 = np.asarray(ks, np.int32)
    sfx = "u64" if case.wide else "u32"
    chunk_q = up(np.full(nchunks + _PAD, U64_MAX, np.uint64))
    runner.launch(
        f"rice_count_{sfx}", nchunks, BLOCK, (np.int32(nt), up(chunk_start), up(ent_start), up(ks32), p_idx, chunk_q)
    )
    # expected intermediates: q per gap summed per chunk; unary bits of earlier chunks of the same tensor
    wq = np.full(nchunks + _PAD, U64_MAX, np.uint64)
    wbase = np.full(nchunks + _PAD, U64_MAX, np.uint64)
    wbits = np.full(nt + _PAD, U64_MAX, np.uint64)
    streams = []
    for t in range(nt):
        g = rc.gaps(idx[t])
        q = g >> np.uint64(ks[t])
        c0, m = int(chunk_start[t]), nch[t]
        per = np.add.reduceat(q, np.arange(0, counts[t], CHUNK)) if m else np.zeros(0, np.uint64)
        lens = per + np.minimum(np.uint64(CHUNK), np.uint64(counts[t]) - np.arange(m, dtype=np.uint64) * CHUNK)
        wq[c0 : c0 + m] = per
        wbase[c0 : c0 + m] = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64) if m else lens
        s, bits = rc.rice_encode(idx[t], ks[t])
        streams.append(s)
        wbits[t] = bits
    _cmp(f"{case.name}: rice_count_{sfx} chunk_q", runner.to_host(chunk_q), wq, out)
    if out:
        return out
    chunk_base = up(np.full(nchunks + _PAD, U64_MAX, np.uint64))
    tbits = up(np.full(nt + _PAD, U64_MAX, np.uint64))
    runner.launch(
        "rice_scan",
        1,
        SCAN_THREADS,
        (np.int32(nt), np.int64(nchunks), up(chunk_start), up(ent_start), up(ks32), chunk_q, chunk_base, tbits),
    )
    _cmp(f"{case.name}: rice_scan chunk_base", runner.to_host(chunk_base), wbase, out)
    _cmp(f"{case.name}: rice_scan tensor_bits", runner.to_host(tbits), wbits, out)
    if out:
        return out
    nwords = [-(-int(b) // 32) for b in wbits[:nt]]
    word_off = np.concatenate([[0], np.cumsum(nwords)]).astype(np.uint64)
    words = up(np.zeros(int(word_off[-1]) + _PAD, np.uint32))
    runner.launch(
        f"rice_write_{sfx}",
        nchunks,
        BLOCK,
        (np.int32(nt), up(chunk_start), up(ent_start), up(ks32), p_idx, chunk_base, up(word_off), words),
    )
    want = np.zeros(int(word_off[-1]) + _PAD, np.uint32)
    for t in range(nt):
        b = np.zeros(4 * nwords[t], np.uint8)
        b[: streams[t].size] = streams[t]
        want[int(word_off[t]) : int(word_off[t + 1])] = b.view("<u4")
    _cmp(f"{case.name}: rice_write_{sfx} words", runner.to_host(words), want, out)
    return out


def quant_cases() -> list[QuantCase]:
    c = [
        QuantCase("mixed", (5000, 300, 9000, 1), ("f32", "f64", "f32", "f64"), ("u32", "u64", "dense", "u32")),
        QuantCase("no_residual", (4097, 700), ("f32", "f64"), ("dense", "u32"), res=False),
        QuantCase("empty_tensors", (0, 1000, 0, 4096), ("f32", "f32", "f64", "f64"), ("u32", "dense", "u64", "u32")),
        QuantCase("multi_chunk", (3 * CHUNK + 5,), ("f32",), ("u32",), block=4096),
        QuantCase("odd_block", (2000, 513), ("f64", "f32"), ("u64", "dense"), block=1000),
        QuantCase("small_block", (1000, 77), ("f32", "f32"), ("u32", "u32"), block=32),
        QuantCase("big_block", (2500,), ("f32",), ("dense",), block=2048),
    ]
    for p in ("ties", "zeros", "signed_zero", "subnormal", "rounding", "clamp", "int8_ties"):
        c.append(QuantCase(f"pattern_{p}", (3000, 600), ("f32", "f64"), ("u32", "dense"), pattern=p))
    return c


def rice_cases() -> list[RiceCase]:
    return [
        RiceCase("mixed", (300, 5000, 0, 9000, 1), (30000, 5000, 10, 400000, 7)),
        RiceCase("mixed_u64", (300, 5000, 1, 9000), (30000, 6000, 7, 400000), wide=True),
        RiceCase("multi_chunk", (3 * CHUNK + 5,), (50 * CHUNK,)),
        RiceCase("forced_k", (3000, 3000, 3000, 3000), (9000, 9000, 90000, 6000), ks=(0, 1, 7, 33)),
        RiceCase("dense_all", (5000, 4096), (5000, 4096)),
        RiceCase("huge_gaps_u64", (200, 5000), (1 << 40, 1 << 36), wide=True),
    ]


# ------------------------------------------------------------------------------------------ float steps (limbs.cu)


def subnormal_mix(n: int, dtype: Any, seed: int) -> np.ndarray:
    """Values of every class a flush would change: subnormals of both signs (the smallest, and random ones), the
    smallest normals, signed zeros, and ordinary values, shuffled."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    fi = np.finfo(dt)
    m, n = n, max(n, 16)  # (any n: the first m of a mix of at least 16)
    ut = np.uint64 if dt.itemsize == 8 else np.uint32
    sub_bits = rng.integers(1, 1 << (fi.nmant - 1), size=n // 3, dtype=np.int64).astype(ut)
    parts = [
        sub_bits.view(dt) * np.where(rng.random(n // 3) < 0.5, -1, 1).astype(dt),
        np.asarray([fi.smallest_subnormal, -fi.smallest_subnormal, fi.smallest_normal, -0.0, 0.0], dt),
        (rng.standard_normal(n - n // 3 - 5) * 10.0 ** rng.integers(-3, 3, n - n // 3 - 5)).astype(dt),
    ]
    v = np.concatenate(parts).astype(dt)
    rng.shuffle(v)
    return v[:m]


def float_steps(runner, name: str = "floats", n: int = 3001) -> list[str]:
    """limb_accumulate_*, limb_shift, segment_abs_max_*, limb_mean_f32/_f64, int8_dequant and widen_f32
    (KernelFloatOps on ``runner``) against their twins (cpu_fallback/limbs.py, cpu_fallback/quantize.py), on
    subnormal-rich inputs: the limb passes over several tensors at once (an empty one among them), each on its own
    grid, sparse (32- and 64-bit indices) and dense."""
    from gpu_codec.backends.float_ops import KernelFloatOps
    from gpu_codec.cpu_fallback import limbs as lt
    from gpu_codec.cpu_fallback import quantize as qt

    ops = KernelFloatOps()
    ops.runner, ops.xp = runner, runner.xp
    up, host = _uploader(runner), runner.to_host
    out: list[str] = []
    from gpu_codec.aggregate import LIMB_BITS, LIMBS, _grid_exponent

    rows = (LIMBS - 1 - np.arange(LIMBS)) * LIMB_BITS
    counts = [n // 3, 0, n - n // 3 - 1, 1]  # entries of each tensor, in turn
    numels = [2 * c + 5 for c in counts]
    starts = np.concatenate([[7], 7 + np.cumsum(numels)[:-1]]).astype(np.int64)  # (the accumulator's first 7 unused)
    size = int(starts[-1]) + numels[-1]
    rng = np.random.default_rng(19)
    # each tensor's entries at distinct ascending elements of its own range, counted from the first tensor's start
    idx = np.concatenate(
        [np.sort(rng.choice(m, c, replace=False)) + a - starts[0] for c, m, a in zip(counts, numels, starts)]
    )
    for k, dt in enumerate((np.float32, np.float64)):
        v = subnormal_mix(n, dt, 11 + k)
        tiny = v[np.abs(v) < (2.0**-120 if dt == np.float32 else 2.0**-1000)]
        # sparse tensors (32- and 64-bit indices), dense tensors end to end, one dense tensor of subnormals only
        for vals, cs, forms in ((v, counts, (np.uint32, np.uint64, None)), (tiny, [tiny.size], (None,))):
            ends = np.cumsum(cs)
            for w in (1.0, 0.75, 3.0):
                # each tensor's grid as the aggregator picks it: fine enough for subnormals where they are all there is
                m = [float(np.abs(vals[e - c : e]).max()) if c else 0.0 for c, e in zip(cs, ends)]
                exps = np.asarray([_grid_exponent(w * x) or 0 for x in m], np.int64)[:, None] + rows
                for form in forms:
                    ix = None if form is None else idx.astype(form)
                    limbs = rng.integers(-(1 << 20), 1 << 20, size=(LIMBS, size), dtype=np.int32)
                    want, d_limbs = limbs.copy(), up(limbs)
                    lt.limb_accumulate(want, int(starts[0]), cs, exps, vals, ix, w)
                    ops.limb_accumulate(d_limbs, int(starts[0]), cs, exps, up(vals), None if ix is None else up(ix), w)
                    what = f"{name}: limb_accumulate {np.dtype(dt)}[{vals.size}] {'dense' if ix is None else ix.dtype}"
                    _cmp(f"{what} w={w}", host(d_limbs), want, out)
        sub = v.view(np.uint64 if dt == np.float64 else np.uint32)
        _cmp(
            f"{name}: segment_abs_max {np.dtype(dt)}",
            host(ops.segment_abs_max(up(v), counts)),
            lt.segment_abs_max(sub, counts),
            out,
        )
        limbs = rng.integers(-(1 << 17), 1 << 17, size=(3, size), dtype=np.int32)
        limbs[:, : size // 2] = rng.integers(-3, 4, size=(3, size // 2), dtype=np.int32)
        beta = -162 if dt == np.float32 else -1008  # fp32: small limbs give subnormal means
        scales = np.asarray([np.ldexp(1.0, beta + s + rows) for s in (0, 18, 36, 0)])
        scales[1] = 0.0  # a tensor with no grid yet
        for total in (1.0, 3.0, 7.25):
            want = np.empty(sum(numels), dt)
            lt.limb_mean(limbs, starts, numels, scales, total, want)
            d_out = up(np.empty(sum(numels), dt))
            ops.limb_mean(up(limbs), starts, numels, scales, total, d_out)
            _cmp(f"{name}: limb_mean {np.dtype(dt)} total={total}", host(d_out), want, out)
    shifts = np.asarray([1, 0, 2, 5], np.int64)
    limbs = rng.integers(-(1 << 20), 1 << 20, size=(LIMBS, size), dtype=np.int32)
    want, d_limbs = limbs.copy(), up(limbs)
    lt.limb_shift(want, starts, numels, shifts)
    ops.limb_shift(d_limbs, starts, numels, shifts)
    _cmp(f"{name}: limb_shift", host(d_limbs), want, out)
    rng = np.random.default_rng(30)
    q = rng.integers(-127, 128, size=n, dtype=np.int8)
    for block in (1, 64, 256):
        nb = -(-n // block)
        scales = np.abs(subnormal_mix(nb, np.float32, 31 + block))
        _cmp(
            f"{name}: int8_dequant block={block}",
            host(ops.int8_decode(up(q), up(scales), block)),
            qt.int8_decode(q, scales, block),
            out,
        )
    x = subnormal_mix(n, np.float32, 40)
    _cmp(f"{name}: widen_f32", host(ops.as_values(up(x), np.float64)), qt.widen_f32(x), out)
    return out
