"""fused_scan_f32, the fused selection's scan for fp32 tensors scored by the magnitude of their delta (kernels/topk.cu):
128-bit loads where a tensor's addresses are 16-byte aligned, scalar loads for the tail and for misaligned tensors.

Launched on the emulator beside fused_scan and the NumPy twin with the same arguments, it gives the same outputs
to the bit (candidates per chunk, counts of keys equal to lo, check word, early residual) over aligned and
misaligned tensors, odd sizes and tails, with and without base and residual; with lo = 0 every element is a
candidate exactly once, in index order; nothing past a tensor's end is written; its counted traffic is not above
fused_scan's; the backend launches it for fp32 and the magnitude criteria only, to the NumPy backend's bytes; and
planted bugs in its vector path (an element dropped and another duplicated, vectors run past the tail) fail these
checks, while misaligned tensors, read with scalar loads, do not reach them."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gpu_codec.cpu_fallback.elementwise import score_key

import gpu_codec
from gpu_codec.backends import emulated as emu
from gpu_codec.backends import kernels as K
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.constants import BLOCK, CHUNK, CRIT_LARGEST_CHANGE, CRIT_MAGNITUDE, DT_F32, U64_MAX
from gpu_codec.testing import kernel_cases as kc

from .common import HAS_EMULATOR, logged_launches

pytestmark = pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")

# odd sizes, sizes around a vector (4), a round (BLOCK * 4) and a chunk, and a tensor of several chunks with a tail
SIZES = (1, 3, 4, 5, 7, 1023, 1025, 4095, CHUNK, CHUNK + 1, 3 * CHUNK + 6)
GUARD = 8  # elements after each early residual that the scan must leave alone
SENTINEL = np.float32(-7.25)
# which stream of which tensors is misaligned (by 4, 8 or 12 bytes from a 16-byte boundary)
LAYOUTS = ("aligned", "new", "base", "res", "early", "mixed")


def placed(values: np.ndarray, shift: int) -> np.ndarray:
    """A float32 copy of ``values`` at an address 4 * shift bytes past a 16-byte boundary (0: aligned)."""
    buf = np.empty(values.size + 8, np.float32)
    head = (-(buf.ctypes.data // 4)) % 4
    a = buf[head + shift : head + shift + values.size]
    a[...] = values
    assert a.ctypes.data % 16 == 4 * shift
    return a


def shifts(layout: str, t: int) -> dict[str, int]:
    """The misalignment (in elements) of tensor t's new, base, res and early arrays under ``layout``."""
    s = {"new": 0, "base": 0, "res": 0, "early": 0}
    if layout == "mixed":  # every other tensor misaligned, a different stream each time
        if t % 2:
            s[("new", "base", "res", "early")[(t // 2) % 4]] = 1 + t % 3
    elif layout != "aligned":
        s[layout] = 1 + t % 3
    return s


@functools.cache
def inputs(layout: str, base: bool, res: bool, pattern: str = "normal", sizes=SIZES, seed: int = 0, bad=(4, 9)):
    """Per tensor (new, base, res, early shift): fp32 values, some deltas exactly zero, at the layout's places;
    pattern "inf" or "nan": such a value in the tensors ``bad``, in the tail of tensor 4 (7 elements) and in a
    vector elsewhere."""
    rng = np.random.default_rng(seed)
    out = []
    for t, n in enumerate(sizes):
        sh = shifts(layout, t)
        w0 = rng.standard_normal(n).astype(np.float32)
        w = (w0 + rng.standard_normal(n).astype(np.float32) * 0.1).astype(np.float32)
        zero = rng.random(n) < 0.05
        w[zero] = w0[zero]  # exact zero deltas where there is no residual: keys equal to key(0)
        if pattern in ("inf", "nan") and t in bad:
            w[n - 1 if t == 4 else n // 2] = np.inf if pattern == "inf" else np.nan
        b = placed(w0, sh["base"]) if base else None
        r = placed((rng.standard_normal(n) * 0.01).astype(np.float32), sh["res"]) if res else None
        out.append((placed(w, sh["new"]), b, r, sh["early"]))
    return tuple(out)


def _keys(t) -> np.ndarray:
    new, base, res, _ = t
    d = new - (base if base is not None else np.float32(0))
    if res is not None:
        d = d + res
    return score_key(np.abs(d))


def lo_for(tensors, which: str, key_of=_keys) -> int:
    keys = np.concatenate([key_of(t) for t in tensors])
    return {
        "all": 0,  # every element a candidate
        "mid": int(np.sort(keys)[keys.size * 9 // 10]),
        "zero": int(score_key(np.zeros(1, np.float32))[0]),  # the exact zeros counted, not stored
        "none": K.NO_LO,
    }[which]


def scan_args(runner, tensors, lo, scope="global", own_k=None, pool_cap=None, dtypes=None) -> tuple[tuple, list]:
    """The arguments of a scan over ``tensors`` (its outputs cleared) and the early residuals with their guards;
    ``dtypes``: each tensor's dtype code (default fp32)."""
    numels = [t[0].size for t in tensors]
    nt = len(tensors)
    codes = np.full(nt, DT_F32, np.int32) if dtypes is None else np.asarray(dtypes, np.int32)
    segments = [list(range(nt))] if scope == "global" else [[t] for t in range(nt)]
    seg_of = [s for s, seg in enumerate(segments) for _ in seg]
    tb = K.TensorTables(numels, seg_of, len(segments))
    early = [
        None if sh is None else placed(np.full(n + GUARD, SENTINEL, np.float32), sh)
        for n, (*_, sh) in zip(numels, tensors)
    ]
    cap = sum(numels) if pool_cap is None else pool_cap
    nseg, grid = len(segments), tb.nchunks
    ptrs = lambda arrays: np.asarray([0 if a is None else runner.ptr(a) for a in arrays], np.uint64)  # noqa: E731
    args = (
        np.int32(nt),
        tb.chunk_start,
        tb.numel,
        codes,
        tb.seg_of,
        ptrs([t[0] for t in tensors]),
        ptrs([t[1] for t in tensors]),
        ptrs([t[2] for t in tensors]),
        np.zeros(nt, np.uint64),
        codes,
        np.int32(CRIT_MAGNITUDE),
        ptrs([None if e is None else e[:n] for e, n in zip(early, numels)]),
        np.full(nseg, lo, np.uint64),
        np.zeros(nseg, np.uint64) if own_k is None else np.asarray(own_k, np.uint64),
        np.uint64(cap),
        np.zeros(grid, np.uint64),  # cand_base
        np.zeros(grid, np.uint32),  # cand_cnt
        np.zeros(max(cap, 1), np.uint16),  # cand_idx
        np.zeros(max(cap, 1), np.uint32),  # cand_key
        np.zeros(grid, np.uint32),  # eq_cnt
        np.concatenate([np.asarray([U64_MAX, 0], np.uint64), np.zeros(2 * nseg, np.uint64)]),  # status
    )
    return args, early


def launch_scan(runner, name, args, early) -> dict:
    """One launch of ``name``; returns every output: the check and fill words, per chunk its candidates (indices,
    keys) and keys equal to lo, and each early residual with its guard."""
    runner.launch(name, int(args[1][-1]), BLOCK, args)  # a block per chunk
    cand_base, cand_cnt, cand_idx, cand_key, eq_cnt, status = args[15:]
    cands = [
        (cand_idx[b : b + m].copy(), cand_key[b : b + m].copy())
        for b, m in zip(cand_base.astype(np.int64).tolist(), cand_cnt.astype(np.int64).tolist())
    ]
    return {"status": status, "cand_cnt": cand_cnt, "eq_cnt": eq_cnt, "cands": cands, "early": early}


def run_scan(runner, name, tensors, lo, **kw) -> dict:
    return launch_scan(runner, name, *scan_args(runner, tensors, lo, **kw))


def assert_same(got: dict, want: dict, label: str = "") -> None:
    assert got["status"].tolist() == want["status"].tolist(), label
    assert got["cand_cnt"].tolist() == want["cand_cnt"].tolist(), label
    assert got["eq_cnt"].tolist() == want["eq_cnt"].tolist(), label
    for c, ((gi, gk), (wi, wk)) in enumerate(zip(got["cands"], want["cands"])):
        assert gi.tolist() == wi.tolist() and gk.tolist() == wk.tolist(), f"{label} chunk {c}"
    for t, (g, w) in enumerate(zip(got["early"], want["early"])):
        assert (g is None) == (w is None) and (g is None or g.tobytes() == w.tobytes()), f"{label} early {t}"


@functools.cache
def runner() -> emu.EmulatorRunner:
    return emu.EmulatorRunner()


def with_early(tensors, early: bool):
    return tuple((n, b, r, sh if early else None) for n, b, r, sh in tensors)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("base", "res"), [(True, False), (True, True), (False, True)])
def test_same_outputs_as_fused_scan_and_its_twin(layout, base, res):
    """Every output of fused_scan_f32 is fused_scan's and the twin's, at every lo, with and without the early
    residual (written whole, and nothing past the end of a tensor)."""
    tensors = with_early(inputs(layout, base, res), res)
    for which in ("all", "mid", "zero", "none"):
        lo = lo_for(tensors, which)
        got = run_scan(runner(), "fused_scan_f32", tensors, lo)
        assert_same(got, run_scan(runner(), "fused_scan", tensors, lo), f"{layout} {which} vs fused_scan")
        assert_same(got, run_scan(kc.TwinRunner(), "fused_scan_f32", tensors, lo), f"{layout} {which} vs twin")
        for e in got["early"]:
            assert e is None or np.all(e[-GUARD:] == SENTINEL)


@pytest.mark.parametrize("layout", ["aligned", "mixed"])
def test_every_element_is_a_candidate_once_in_index_order(layout):
    """With lo = 0 every element's key is above lo: each chunk's candidates are its elements 0 .. m - 1 exactly
    once, in order, with their own keys, and the early residual is every delta."""
    tensors = inputs(layout, True, True)
    got = run_scan(runner(), "fused_scan_f32", tensors, 0)
    tb = K.TensorTables([t[0].size for t in tensors], [0] * len(tensors), 1)
    assert int(got["status"][0]) == U64_MAX and int(got["status"][1]) == tb.total
    for t, tensor in enumerate(tensors):
        keys = _keys(tensor)
        c0, c1 = int(tb.chunk_start[t]), int(tb.chunk_start[t + 1])
        for c in range(c0, c1):
            e0 = (c - c0) * CHUNK
            m = min(CHUNK, keys.size - e0)
            idx, key = got["cands"][c]
            assert idx.tolist() == list(range(m)), (t, c)
            assert key.tolist() == keys[e0 : e0 + m].tolist(), (t, c)
        new, base, res, _ = tensor
        assert got["early"][t][: keys.size].tobytes() == ((new - base) + res).tobytes()


@pytest.mark.parametrize("pattern", ["inf", "nan"])
def test_non_finite_deltas_are_reported_like_fused_scan(pattern):
    """An infinite or NaN delta in a tail (tensor 4) and in a vector (tensor 9): the lowest such tensor in the check
    word, as fused_scan reports it (the keys of the rejected inputs are not compared)."""
    for layout in ("aligned", "mixed"):
        tensors = inputs(layout, True, False, pattern)
        got = run_scan(runner(), "fused_scan_f32", tensors, 0)
        want = run_scan(runner(), "fused_scan", tensors, 0)
        assert int(got["status"][0]) == int(want["status"][0]) == 4
        for t in (4, 9):
            one = inputs(layout, True, False, pattern, bad=(t,))
            assert int(run_scan(runner(), "fused_scan_f32", one, 0)["status"][0]) == t


def test_one_chunk_segments_are_selected_whole_in_the_block():
    """Per-tensor segments of one chunk each with their own k (ties among exact zeros): fused_scan's outputs."""
    sizes = (1, 5, 1023, 4095, CHUNK)
    for layout in ("aligned", "mixed"):
        tensors = with_early(inputs(layout, True, True, sizes=sizes, seed=4), True)
        own_k = [max(1, n // 10) for n in sizes]
        got = run_scan(runner(), "fused_scan_f32", tensors, 0, scope="tensor", own_k=own_k)
        assert_same(got, run_scan(runner(), "fused_scan", tensors, 0, scope="tensor", own_k=own_k), layout)
        assert got["cand_cnt"].tolist() == own_k


def test_a_short_pool_places_the_same_chunks():
    """A pool shorter than the candidates (blocks in launch order): the same chunks stored, the same fill."""
    tensors = inputs("mixed", True, False)
    lo = lo_for(tensors, "mid")
    cap = int(run_scan(runner(), "fused_scan", tensors, lo)["status"][1]) // 2
    got = run_scan(runner(), "fused_scan_f32", tensors, lo, pool_cap=cap)
    assert_same(got, run_scan(runner(), "fused_scan", tensors, lo, pool_cap=cap))
    assert 0 in got["cand_cnt"].tolist() and int(got["status"][1]) > cap


@pytest.mark.parametrize("schedule", ["reverse", "shuffle"])
def test_block_and_thread_order_do_not_matter(schedule):
    tensors = with_early(inputs("mixed", True, True), True)
    lo = lo_for(tensors, "mid")
    r = emu.EmulatorRunner(schedule=schedule, seed=5)
    assert_same(run_scan(r, "fused_scan_f32", tensors, lo), run_scan(runner(), "fused_scan", tensors, lo), schedule)


@pytest.mark.parametrize("layout", ["aligned", "new", "early"])
def test_counted_traffic_is_not_above_fused_scans(layout):
    """The emulator's count of distinct 32-byte sectors, both kernels on the same buffers: fused_scan_f32 writes what
    fused_scan writes, and reads what it reads less the per-tensor tables it has no use for (dtypes and scores:
    the host checked them)."""
    tensors = with_early(inputs(layout, True, True), True)
    r = emu.EmulatorRunner(trace=True)
    args, early = scan_args(r, tensors, lo_for(tensors, "mid"))
    launch_scan(r, "fused_scan_f32", args, early)
    for a in args[15:20]:
        a[...] = 0
    args[20][:] = [U64_MAX, 0, 0, 0]
    launch_scan(r, "fused_scan", args, early)
    vec, gen = r.traffic
    assert (vec["kernel"], gen["kernel"]) == ("fused_scan_f32", "fused_scan")
    assert vec["write_bytes"] == gen["write_bytes"]
    unread = {a.ctypes.data // 32 + j for a in (args[3], args[8], args[9]) for j in range(-(-a.nbytes // 32) + 1)}
    assert 0 <= gen["read_bytes"] - vec["read_bytes"] <= 32 * len(unread)
    n = sum(t[0].size for t in tensors)
    assert vec["read_bytes"] >= 12 * n and vec["write_bytes"] >= 4 * n  # new, base, res read; residual written


# ------------------------------------------------------------------------------------------- the backend's choice


def test_scan_kernel_routes_by_dtype_criterion_and_score():
    f = np.zeros(1, np.float32)
    assert K.scan_kernel([DT_F32, DT_F32], CRIT_MAGNITUDE, [None, None]) == "fused_scan_f32"
    assert K.scan_kernel([DT_F32], CRIT_LARGEST_CHANGE, [None]) == "fused_scan_f32"
    assert K.scan_kernel([DT_F32, 1], CRIT_MAGNITUDE, [None, None]) == "fused_scan"  # an fp16 tensor among them
    assert K.scan_kernel([DT_F32], 1, [None]) == "fused_scan"  # largest final: not the delta's magnitude
    assert K.scan_kernel([DT_F32], 7, [f]) == "fused_scan"  # the caller's scores


@pytest.mark.parametrize(
    ("case", "scan"),
    [
        (kc.TopkCase("f32_magnitude", (5000, 4097, 3), ("f32",) * 3, k=0.02, res=True, res_out="new"), "_f32"),
        (kc.TopkCase("f32_change", (9000, 7), ("f32", "f32"), crit=3, scope="tensor", k=0.05), "_f32"),
        (kc.TopkCase("f32_final", (9000, 7), ("f32", "f32"), crit=1, k=0.05), ""),
        (kc.TopkCase("f32_scores", (9000, 7), ("f32", "f32"), crit=7, k=0.05), ""),
        (kc.TopkCase("mixed", (9000, 4097), ("f32", "bf16"), k=0.05, res=True, res_out="alias"), ""),
        (kc.TopkCase("f64", (9000,), ("f64",), k=0.05, res=True, res_out="new"), ""),
    ],
    ids=lambda x: x.name if isinstance(x, kc.TopkCase) else x,
)
def test_backend_launches_the_f32_scan_where_it_applies(case, scan):
    """The fused selection through KernelOps on the emulator: the scan the plan picks, and the NumPy backend's
    outputs and residuals."""
    r = emu.EmulatorRunner()
    log = logged_launches(r)
    assert kc.topk_vs_reference(r, case) == []
    assert "fused_scan" + scan in log and "fused_scan" + ("" if scan else "_f32") not in log


def test_compress_of_misaligned_views_with_error_feedback_matches_numpy():
    """fp32 tensors, some of them views 4, 8 or 12 bytes past a 16-byte boundary (odd sizes, tails), compressed
    over three rounds with error feedback on the emulated and NumPy backends: the same payloads and residuals,
    through fused_scan_f32 without a fallback."""
    rng = np.random.default_rng(7)
    sizes = {"a": 10_001, "b": 4096, "c": 37, "d": 12_290}
    base = {k: placed(rng.standard_normal(n).astype(np.float32), i % 4) for i, (k, n) in enumerate(sizes.items())}
    rounds = [
        {k: placed((v + rng.standard_normal(v.size).astype(np.float32) * 0.1).astype(np.float32), 3 - i % 4)
         for i, (k, v) in enumerate(base.items())}
        for _ in range(3)
    ]  # fmt: skip
    emulated = emu.EmulatedBackend()
    log = logged_launches(emulated.runner)
    out = []
    for backend in (CpuBackend(), emulated):
        with using_backend(backend):
            ef = gpu_codec.ErrorFeedback()
            blobs = [gpu_codec.compress(new, base, fraction=0.01, residual=ef).to_bytes() for new in rounds]
            out.append((blobs, {k: np.asarray(ef.residual(k)).copy() for k in sizes}))
    assert out[0][0] == out[1][0]
    assert all(out[0][1][k].tobytes() == out[1][1][k].tobytes() for k in sizes)
    assert log.count("fused_scan_f32") == 3 and "fused_scan" not in log and "score_keys" not in log


# ----------------------------------------------------------------------------------------------- planted bugs

TOPK = emu.package_sources()["topk.cu"]
PLANTS = {
    # the fourth element of a vector replaced by the third: one element dropped, another duplicated
    "duplicate": ("d[3] = a.w;", "d[3] = a.z;"),
    # vectors up to the chunk's end, past the tensor's last element: reads and writes beyond the tail
    "past_tail": ("if (vec && ib + SCAN_VEC_F32 <= m) {", "if (vec && ib < m) {"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_bugs_in_the_vector_path_are_caught(plant):
    old, new = PLANTS[plant]
    assert TOPK.count(old) == 1
    bad = emu.EmulatorRunner({"topk.cu": TOPK.replace(old, new)}, package=False)
    tensors = with_early(inputs("aligned", True, True), True)
    with pytest.raises(AssertionError):
        assert_same(run_scan(bad, "fused_scan_f32", tensors, 0), run_scan(runner(), "fused_scan", tensors, 0))
    # a misaligned tensor takes the scalar loads: the vector path's bug does not reach it
    misaligned = with_early(inputs("new", True, True, sizes=(1025, 4099), seed=2), True)
    for which in ("all", "mid"):
        lo = lo_for(misaligned, which)
        assert_same(run_scan(bad, "fused_scan_f32", misaligned, lo), run_scan(runner(), "fused_scan", misaligned, lo))


def test_forced_general_scan_gives_the_same_bytes():
    """kernel_cases.forced(scan="fused_scan") (what the GPU suite compares against) launches the general scan on
    fp32 inputs, to the same outputs; any other name is refused."""
    case = kc.TopkCase("f32_forced", (5000, 4097, 3), ("f32",) * 3, k=0.02, res=True, res_out="new")
    r = emu.EmulatorRunner()
    log = logged_launches(r)
    with kc.forced(scan="fused_scan"):
        assert kc.topk_fused_stepwise(r, case) == []
    assert "fused_scan" in log and "fused_scan_f32" not in log
    with pytest.raises(ValueError, match="scan must be"), kc.forced(scan="fused_scan_f64"):
        pass
