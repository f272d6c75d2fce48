"""The NumPy backend's blocked, threaded top-k: the same bytes as the definition, for any block size and thread
count, nothing written on error, and no full-size temporaries (a memory property, measured with tracemalloc)."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from gpu_codec.cpu_fallback import parallel
from gpu_codec.cpu_fallback import select as sel
from gpu_codec.cpu_fallback.elementwise import DT_F64, decoded, delta, nonfinite, score_key, scores_f32

import gpu_codec
from gpu_codec.errors import InvalidInputError
from gpu_codec.testing import kernel_cases as kc
from tests.common import use_backend

TOPK = kc.topk_cases()


def brute_force(inp: dict, res_out: list) -> tuple[list, list, int | None, list]:
    """(indices, values, bad, residuals) by a stable sort of every key: the definition, not an algorithm."""
    nt = len(inp["new"])
    deltas, keys, bad = [], [], []
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(nt):
            new, base, res, dt = inp["new"][t], inp["base"][t], inp["res"][t], inp["dtypes"][t]
            d = delta(new, base, res, dt)
            s = scores_f32(inp["crit"], new, base, d, dt, inp["ext"][t], inp["ext_dtypes"][t])
            if nonfinite(d) or nonfinite(s):
                bad.append(t)
            deltas.append(d)
            keys.append(score_key(s).astype(np.int64))
    if bad:
        return [], [], min(bad), []
    indices, values, resid = [None] * nt, [None] * nt, [None] * nt
    for seg, k in zip(inp["segments"], inp["ks"]):
        allk = np.concatenate([keys[t] for t in seg]) if seg else np.zeros(0, np.int64)
        chosen = np.zeros(allk.size, bool)
        chosen[np.argsort(-allk, kind="stable")[:k]] = True
        a = 0
        for t in seg:
            n = keys[t].size
            idx = np.flatnonzero(chosen[a : a + n])
            a += n
            d = deltas[t]
            indices[t] = idx.astype(sel.index_dtype(n))
            values[t] = d[idx]
            if res_out[t] is not None:
                r = d.copy()
                r[idx] = d[idx] - decoded(d[idx], inp["qmode"])
                resid[t] = r
    return indices, values, None, resid


SELECT_REST = ("dtypes", "ext", "ext_dtypes", "crit", "segments", "ks", "qmode")


def run_blocked(inp: dict) -> tuple:
    res = [None if r is None else r.copy() for r in inp["res"]]
    if inp["res_out"] == "alias":
        res_out = res
    elif inp["res_out"] == "none":
        res_out = [None] * len(res)
    else:
        res_out = [
            np.full(a.size, -3.0, np.float64 if dt == DT_F64 else np.float32)
            for a, dt in zip(inp["new"], inp["dtypes"])
        ]
    args = (inp["dtypes"], inp["ext"], inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    idx, val, bad = sel.topk_select(inp["new"], inp["base"], res, res_out, *args)
    return idx, val, bad, res_out


def assert_same(inp: dict, got: tuple) -> None:
    idx, val, bad, res_out = got
    widx, wval, wbad, wres = brute_force(inp, res_out)
    assert bad == wbad
    if bad is not None:
        return
    for t in range(len(inp["new"])):
        assert idx[t].dtype == widx[t].dtype and idx[t].tobytes() == widx[t].tobytes(), f"indices of tensor {t}"
        assert val[t].dtype == wval[t].dtype and val[t].tobytes() == wval[t].tobytes(), f"values of tensor {t}"
        if res_out[t] is not None:
            assert res_out[t].tobytes() == wres[t].tobytes(), f"residual of tensor {t}"


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 64 elements (sub-blocks of 16), tasks of 256 and a sample of runs: every path of the blocked scan
    on small inputs."""
    monkeypatch.setattr(sel, "BLOCK", 64)
    monkeypatch.setattr(sel, "MIN_BLOCK", 64)
    monkeypatch.setattr(sel, "PARALLEL_BLOCK", 64)
    monkeypatch.setattr(sel, "SCORE_BLOCK", 32)
    monkeypatch.setattr(sel, "SUB", 16)
    monkeypatch.setattr(sel, "RUN", 4)
    monkeypatch.setattr(sel, "TASK", 256)
    monkeypatch.setattr(sel, "MIN_TASK", 128)
    monkeypatch.setattr(sel, "SAMPLE", 32)
    monkeypatch.setattr(sel, "SAMPLE_MIN", 8)
    monkeypatch.setattr(sel, "SAMPLE_STRIDE", 16)
    monkeypatch.setenv(parallel.ENV, "3")


@pytest.mark.parametrize("case", TOPK, ids=[c.name for c in TOPK])
def test_blocked_matches_brute_force(tiny_blocks, case):
    inp = kc.make_topk_inputs(case)
    assert_same(inp, run_blocked(inp))


def _many_small(n: int, seed: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Sizes (0 to 300, a few over a block) and dtypes (fp32 mostly, fp16 and bf16, one fp64) of a table of many
    small tensors: the packed tasks' every path (tensors across blocks and parts, empty ones, dtype changes)."""
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(0, 300, n)]
    sizes[3], sizes[7], sizes[8] = 0, 1, 90  # (an empty tensor, a single element)
    dts = [str(x) for x in rng.choice(["f32", "f32", "f32", "f16", "bf16"], n)]
    dts[n // 2] = "f64"  # (a tensor the packed tasks leave out)
    return tuple(sizes), tuple(dts)


def _case(name: str, sizes, dts, scope: str, pattern: str, res_out: str, q: int, k, seed: int) -> kc.TopkCase:
    """A selection case with a residual read where ``res_out`` is not "none"."""
    return kc.TopkCase(
        name, sizes, dts, scope=scope, k=k, res=res_out != "none", res_out=res_out, qmode=q, pattern=pattern, seed=seed
    )


PACKED = [
    _case(f"packed_{scope}_{pattern}_{res_out}_q{q}", *_many_small(61, seed), scope, pattern, res_out, q, k, seed)
    for seed, (scope, pattern, res_out, q, k) in enumerate(
        [
            ("global", "normal", "none", 0, 0.05),
            ("global", "ties", "new", 1, 0.3),
            ("global", "zeros", "alias", 2, 0.1),
            ("global", "equal", "new", 0, 0.02),
            ("global", "normal", "alias", 1, "random"),
            ("tensor", "ties", "new", 2, 0.2),
            ("tensor", "normal", "alias", 0, 0.05),
            ("pairs", "signed_zero", "new", 1, 0.4),
        ]
    )
] + [kc.TopkCase("packed_crit3_res", *_many_small(40, 9), crit=3, k=0.1, res=True, res_out="new", qmode=2)]


SMALL = [
    _case(
        f"small_{pattern}_{res_out}",
        (5000, 12000, 7001, 300, 20000),
        ("f32", "f16", "bf16", "f32", "f32"),
        "tensor",
        pattern,
        res_out,
        q,
        k,
        seed,
    )
    for seed, (pattern, res_out, q, k) in enumerate(
        [
            ("normal", "none", 0, 0.01),
            ("ties", "alias", 1, 0.02),
            ("zeros", "new", 2, 0.01),
            ("equal", "alias", 0, 0.05),
            ("signed_zero", "new", 0, 0.01),
            ("huge", "none", 0, 0.003),
        ]
    )
]


SMALL += [
    kc.TopkCase(
        f"small_{p}",
        (5000, 9000, 7001, 12000, 3000),
        ("f32", "bf16", "f32", "f16", "f32"),
        scope="tensor",
        k=0.01,
        pattern=p,
        res=True,
        res_out="new",
    )
    for p in ("nonfinite_inf", "nonfinite_nan")
]


@pytest.mark.parametrize("table", [1 << 18, 16_000])
@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_small_tensors_table_by_table_match_brute_force(monkeypatch, case, table):
    """Per-tensor selections of small tensors, table by table (one table, or a table of one or two tensors each):
    the same entries, residuals and first non-finite tensor as the definition."""
    monkeypatch.setattr(sel, "SMALL_TABLE", table)
    inp = kc.make_topk_inputs(case)
    assert_same(inp, run_blocked(inp))


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("together", [0, sel.PACKED_PARALLEL])
@pytest.mark.parametrize("case", PACKED + SMALL, ids=[c.name for c in PACKED + SMALL])
def test_many_small_tensors_match_brute_force(tiny_blocks, monkeypatch, case, together, apart):
    """Tables of many small tensors, packed end to end into the scan's tasks, and per-tensor selections of small
    tensors (bracketed from a strided sample of their keys): the same entries and residuals as the definition,
    with ties, exact zeros, fp16 and bf16, residual rounding, in every scope; with the tables of small tensors
    spread over the threads (``together`` 0) or run in turn by one, and the packed blocks' keys in a buffer of their
    own (whole blocks, ``apart``) or in the delta's buffer's second half."""
    monkeypatch.setattr(sel, "PACKED_PARALLEL", together)
    monkeypatch.setattr(sel._Call, "keys_apart", lambda self: apart)
    inp = kc.make_topk_inputs(case)
    assert_same(inp, run_blocked(inp))


def test_items_together_run_in_turn_on_one_thread(monkeypatch):
    """parallel_map's ``together`` items: one thread runs them all, in their order (the other threads may take the
    rest meanwhile); results stay in item order, and an error is raised for the lowest failing item once every item
    has run."""
    import threading
    import time

    monkeypatch.setenv(parallel.ENV, "3")
    together = [i % 3 == 0 for i in range(12)]
    ran: list = []

    def fn(i: int) -> int:
        ran.append((i, threading.get_ident()))
        time.sleep(0.001)  # (so the other threads may take items meanwhile)
        return i * i

    assert parallel.parallel_map(fn, range(12), 3, together) == [i * i for i in range(12)]
    marked = [(i, tid) for i, tid in ran if together[i]]
    assert [i for i, _ in marked] == [0, 3, 6, 9] and len({tid for _, tid in marked}) == 1

    seen: list = []

    def failing(i: int) -> int:
        seen.append(i)
        if i in (3, 7):
            raise ValueError(f"item {i}")
        return i

    with pytest.raises(ValueError, match="item 3"):
        parallel.parallel_map(failing, range(12), 3, together)
    assert sorted(seen) == list(range(12))


@pytest.mark.parametrize(
    ("sizes", "span"), [((1 << 24,), 1 << 21), ((1 << 22,), 1 << 20), ((3 << 21, 5 << 21), 1 << 21)]
)
def test_task_spans(sizes, span):
    """Tasks of TASK elements, or of MIN_TASK where a segment has fewer than TASK_SPLIT x TASK (so that candidates in
    flight stay a small share of a smaller update); whole blocks, every element in exactly one task."""
    new = [np.broadcast_to(np.float32(0), (m,)) for m in sizes]  # sizes only: nothing is allocated
    c = sel._Call(
        new,
        [None] * len(new),
        [None] * len(new),
        [None] * len(new),
        [0] * len(new),
        [None] * len(new),
        [0] * len(new),
        0,
    )
    c.block = 3 << 12
    tasks = sel._tasks(c, list(range(len(new))))
    want = -(-span // c.block) * c.block
    assert {p.b - p.a for p in tasks if p.b < sizes[p.t]} == {want}
    for t, m in enumerate(sizes):
        mine = [(p.a, p.b) for p in tasks if p.t == t]
        assert mine[0][0] == 0 and mine[-1][1] == m and all(x[1] == y[0] for x, y in itertools.pairwise(mine))


@pytest.mark.parametrize("align", [12, 48, 80])
def test_blocks_of_any_multiple_of_align(monkeypatch, align):
    """Blocks that are no power of two, and that split sub-blocks (SUB = 16 here): the same bytes as the
    definition, for every criterion path (|delta| on fp32 and bf16, and a score of its own)."""
    monkeypatch.setattr(sel, "ALIGN", align)
    monkeypatch.setattr(sel, "MIN_BLOCK", align)
    monkeypatch.setattr(sel, "BLOCK", 200)
    monkeypatch.setattr(sel, "SCORE_BLOCK", 100)
    monkeypatch.setattr(sel, "SUB", 16)
    monkeypatch.setattr(sel, "TASK", 300)
    monkeypatch.setattr(sel, "MIN_TASK", 150)
    monkeypatch.setattr(sel, "PARALLEL_BLOCK", align)
    monkeypatch.setattr(sel, "BUFFER_SHARE", 0.04)
    monkeypatch.setattr(sel, "BUFFER_FLOOR", 0)
    monkeypatch.setenv(parallel.ENV, "3")
    for crit in (0, 4):
        inp = _inputs(sizes=(7_001, 33, 2_050), crit=crit, k=0.03, seed=align)
        nbytes = sum(a.nbytes for a in inp["new"])
        block = sel.plan(nbytes, 3)[1]
        assert block % align == 0 and block & (block - 1) and block < 200, block  # not a power of two
        assert_same(inp, run_blocked(inp))


def _inputs(sizes=(70_000, 1_234, 50_001), crit=0, res_out="alias", k=0.01, seed=5, dtypes=None):
    dtypes = dtypes or ("f32", "bf16", "f64")
    ext = ("f32", "f16", "bf16")[: len(sizes)] if crit == 7 else None
    case = kc.TopkCase("t", tuple(sizes), dtypes, crit=crit, k=k, res=True, res_out=res_out, ext_dtypes=ext, seed=seed)
    return kc.make_topk_inputs(case)


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("lo", ["above_threshold", "at_threshold"])
def test_bracket_that_misses_or_lands_on_the_threshold(tiny_blocks, monkeypatch, lo, apart):
    """A bracket above the k-th key (the scan runs again from the lowest key) or exactly on it (the entries equal
    to it are computed again, lowest index first) gives the same result, with the packed blocks' keys in a buffer
    of their own or in the delta's buffer."""
    monkeypatch.setattr(sel._Call, "keys_apart", lambda self: apart)
    inp = _inputs(sizes=(3000, 5000), dtypes=("f32", "f16"), k=0.05)
    inp["new"][0][100:400] = inp["new"][0][0]  # ties at several keys
    want = brute_force(inp, [np.zeros(3000, np.float32), np.zeros(5000, np.float32)])
    keys = np.concatenate(
        [
            np.abs(delta(n, b, r, dt)).view(np.uint32)
            for n, b, r, dt in zip(inp["new"], inp["base"], inp["res"], inp["dtypes"])
        ]
    )
    kth = np.sort(keys)[::-1][inp["ks"][0] - 1]
    calls = []

    def brackets(*a):
        calls.append(a)
        return [np.uint32(kth + 1000) if lo == "above_threshold" else np.uint32(kth), np.uint32(0)]

    monkeypatch.setattr(sel, "_brackets", brackets)
    got = run_blocked(inp)
    assert calls and want[2] is None
    assert_same(inp, got)


@pytest.mark.parametrize("crit", [0, 1])
def test_sample_takes_the_runs_of_every_tensor(crit):
    """The sample's keys (runs of fp32, fp16 and bf16 |delta| tensors batched by dtype, views made over the table)
    are the keys of the runs at every stride-th element of the tensors laid end to end (those whole inside a
    tensor: a tensor smaller than the stride has one or none), empty tensors included."""
    sizes, dts = _many_small(40, 2)
    case = kc.TopkCase("sample", sizes + (5000, 3, 4099), dts + ("f32", "f16", "bf16"), crit=crit, res=True)
    inp = kc.make_topk_inputs(case)
    nt = len(inp["new"])
    c = sel._Call(inp["new"], inp["base"], inp["res"], [None] * nt, inp["dtypes"], inp["ext"], inp["ext_dtypes"], crit)
    seg, n = list(range(nt)), sum(x.size for x in inp["new"])
    stride = sel._stride(n)
    want, at = [], 0
    with np.errstate(over="ignore", invalid="ignore"):
        for t in seg:  # runs at every stride-th element of the tensors laid end to end, whole inside a tensor
            m = inp["new"][t].size
            first = -(-at // stride) * stride
            pos = np.array([p - at + j for p in range(first, at + m - sel.RUN + 1, stride) for j in range(sel.RUN)])
            at += m
            if pos.size:
                nw, bs, rs, ex = (
                    None if x is None else x[pos] for x in (inp["new"][t], inp["base"][t], inp["res"][t], inp["ext"][t])
                )
                want.append(sel._keys(t, nw, bs, rs, inp["dtypes"][t], crit, ex, inp["ext_dtypes"][t])[1])
    assert np.array_equal(np.sort(sel._sample(c, seg, n)), np.sort(np.concatenate(want)))


def test_a_sample_that_misses_is_widened(monkeypatch, small_parallel_blocks):
    """Every sampled element above every other but a band: the first bracket misses (too few entries at or above
    it), the second, reaching four times as far down the sample, holds, so the scan runs twice, not down to the
    lowest key; the result is exact."""
    monkeypatch.setattr(sel, "SAMPLE", 4096)
    monkeypatch.setattr(sel, "SAMPLE_MIN", 1024)
    monkeypatch.setattr(sel, "SAMPLE_STRIDE", 16)
    monkeypatch.setenv(parallel.ENV, "2")
    n, k = 100_000, 1_000
    stride = sel._stride(n)
    sampled = sel._runs(np.arange(n), stride, 0).ravel()
    rng = np.random.default_rng(4)
    new = (rng.random(n) * 1e-3).astype(np.float32)
    new[sampled] = 1000 + rng.permutation(sampled.size).astype(np.float32)
    top = 1000.0 + sampled.size
    others = rng.choice(np.setdiff1d(np.arange(n), sampled), 2000, replace=False)
    new[others] = rng.uniform(top - 250, top - 150, others.size).astype(np.float32)
    inp = {"new": [new], "base": [None], "res": [None], "dtypes": [0], "ext": [None], "ext_dtypes": [0], "crit": 0}
    inp.update(segments=[[0]], ks=[k], qmode=0, res_out="none")
    scans, ladders = [], []
    scan, brackets = sel._scan, sel._brackets
    monkeypatch.setattr(sel, "_scan", lambda c, p, lo, w: scans.append(int(lo)) or scan(c, p, lo, w))
    monkeypatch.setattr(sel, "_brackets", lambda *a: ladders.append(brackets(*a)) or ladders[-1])
    got = run_blocked(inp)
    (ladder,) = ladders
    assert len(ladder) > 2 and 0 < ladder[1] < ladder[0], ladder
    assert sorted(set(scans)) == sorted(int(b) for b in ladder[:2])  # the first two brackets, not the lowest key
    assert_same(inp, got)
    with use_backend("cpu") as backend:  # the miss, as the CPU backend counts it for the zoo benchmark
        before = backend.bracket_misses
        gpu_codec.compress({"w": new}, fraction=k / n)
        assert backend.bracket_misses == before + 1


def test_small_tensors_weigh_their_share_of_the_sample(monkeypatch):
    """A large tensor of small deltas beside 200 small tensors of large ones (BatchNorm's beside convolutions): the
    small tensors are sampled at the large one's rate, not a whole run each (which weighed them 16 times as much
    here and put the bracket above the k-th largest key), so every task is scanned once; the result is exact."""
    monkeypatch.setenv(parallel.ENV, "2")
    rng = np.random.default_rng(5)
    new = [(rng.standard_normal(1 << 20) * 0.01).astype(np.float32)]
    new += [rng.standard_normal(64).astype(np.float32) for _ in range(200)]
    nt = len(new)
    n = sum(x.size for x in new)
    assert all(x.size < sel._stride(n) for x in new[1:])
    inp = {"new": new, "base": [None] * nt, "res": [None] * nt, "dtypes": [0] * nt, "ext": [None] * nt}
    inp.update(ext_dtypes=[0] * nt, crit=0, segments=[list(range(nt))], ks=[gpu_codec.kept_count(0.01, n)])
    inp.update(qmode=0, res_out="none")
    scans, tasks = [], []
    scan, make = sel._scan, sel._tasks
    monkeypatch.setattr(sel, "_scan", lambda c, p, lo, w: scans.append(int(lo)) or scan(c, p, lo, w))
    monkeypatch.setattr(sel, "_tasks", lambda c, seg: tasks.append(make(c, seg)) or tasks[-1])
    got = run_blocked(inp)
    assert len(scans) == len(tasks[0]) and len(set(scans)) == 1, scans
    assert_same(inp, got)
    stats: dict = {}  # (the count the zoo benchmark reports: no scan ran again)
    sel.topk_select(new, *(inp[f] for f in ("base", "res")), [None] * nt, *(inp[f] for f in SELECT_REST), stats=stats)
    assert stats == {"misses": 0}


def test_bracket_widens_down_to_the_lowest_key():
    sample = np.random.default_rng(0).permutation(50_000).astype(np.uint32)
    los = [int(x) for x in sel._brackets(sample, 10**6, 10_000, 0)]
    assert len(los) > 3 and all(a > b for a, b in itertools.pairwise(los)), los
    assert 50_000 - 1000 < los[0] < 50_000 - 500 and los[-1] == 0
    assert np.array_equal(sample, np.random.default_rng(0).permutation(50_000))  # the sample is not reordered


def test_brackets_stop_where_widening_gains_nothing():
    """Keys with few distinct values: a wider bracket that is not lower than the last is not tried (the next scan
    takes every key), and a non-finite key never lifts the |delta| bracket above inf."""
    sample = np.full(10_000, 7, np.uint32)
    assert [int(x) for x in sel._brackets(sample, 10**6, 1_000, 0)] == [7, 0]
    assert [int(x) for x in sel._brackets(np.full(10_000, 0xFFC00000, np.uint32), 10**6, 1_000, 0)] == [
        int(sel._INF_BITS),
        0,
    ]


@pytest.fixture
def small_parallel_blocks(monkeypatch):
    """Threads even on small updates (by default a call uses no more threads than leave each 2^17-element
    blocks)."""
    monkeypatch.setattr(sel, "PARALLEL_BLOCK", sel.MIN_BLOCK)


@pytest.mark.parametrize("crit", [0, 1, 4, 7])
def test_thread_count_changes_no_byte(monkeypatch, small_parallel_blocks, crit):
    """1, 2 and 3 threads (and default-sized blocks): identical indices, values and residuals."""
    inp = _inputs(sizes=(300_000, 7, 140_003), crit=crit, k=0.02)
    outs = []
    nbytes = sum(a.nbytes for a in inp["new"])
    for n in ("1", "2", "3"):
        monkeypatch.setenv(parallel.ENV, n)
        assert parallel.thread_count() == int(n) == sel.plan(nbytes, int(n))[0]
        outs.append(run_blocked(inp))
    assert outs[0][2] is None
    for got in outs[1:]:
        for a, b in zip(outs[0][:2] + (outs[0][3],), got[:2] + (got[3],)):
            assert [x.tobytes() for x in a] == [y.tobytes() for y in b]
    assert_same(inp, outs[0])


def test_threads_used_only_where_each_gets_a_large_block():
    def budget(nbytes):  # the block buffers of all threads together
        floor = sel.BUFFER_FLOOR if nbytes >= 2 * sel.MIN_TASK * 4 else 0
        return max(sel.BUFFER_SHARE * nbytes, floor)

    assert sel.plan(4 << 20, 2)[0] == 1  # 1M fp32, one task: one thread, its block the share's
    assert sel.plan(4 << 20, 2)[1] * sel.BLOCK_BYTES <= budget(4 << 20)
    # from two tasks' worth up: the floor, two threads' blocks whatever the update's size
    assert sel.plan(4 << 21, 2) == sel.plan(4 << 24, 2) == sel.plan(4 << 21, 16) == (2, sel.PARALLEL_BLOCK)
    for nbytes, threads in ((4 * 30_000_000, 16), (4 << 26, 16), (4 * 300_000_000, 64)):
        workers, block = sel.plan(nbytes, threads)  # blocks fill the budget in ALIGN steps
        assert 1 < workers < threads and block >= sel.PARALLEL_BLOCK and block % sel.ALIGN == 0
        assert workers * block * sel.BLOCK_BYTES <= budget(nbytes)
        assert block == sel.BLOCK or workers * (block + sel.ALIGN) * sel.BLOCK_BYTES > budget(nbytes)
        assert sel.block_size(nbytes, workers + 1) < sel.PARALLEL_BLOCK  # one more thread would leave too little


def test_compress_bytes_and_residual_independent_of_threads(monkeypatch, small_parallel_blocks):
    rng = np.random.default_rng(11)
    base = {
        "a": rng.standard_normal(400_000).astype(np.float32),
        "b": rng.standard_normal((300, 301)).astype(np.float32),
    }
    new = {n: v + rng.standard_normal(v.shape).astype(np.float32) for n, v in base.items()}
    blobs = []
    with use_backend("cpu"):
        for n in ("1", "2", "3"):
            monkeypatch.setenv(parallel.ENV, n)
            ef = gpu_codec.ErrorFeedback()
            p1 = gpu_codec.compress(new, base, fraction=0.01, residual=ef).to_bytes()
            p2 = gpu_codec.compress(
                new, base, fraction=0.01, residual=ef, pipeline=[gpu_codec.Quantize("float16"), gpu_codec.RiceIndices()]
            ).to_bytes()
            blobs.append((p1, p2, ef.to_bytes()))
    assert blobs[0] == blobs[1] == blobs[2]


@pytest.mark.parametrize("where", [0, 69_999, 35_000])
def test_nonfinite_in_any_block_is_reported_and_nothing_is_written(where):
    inp = _inputs(sizes=(70_000, 1_234, 50_001), dtypes=("f32", "f32", "f32"))
    inp["new"][0][where] = np.nan if where else np.inf
    before = [r.copy() for r in inp["res"]]
    res = inp["res"]
    args = (inp["dtypes"], inp["ext"], inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    _, _, bad = sel.topk_select(inp["new"], inp["base"], res, res, *args)
    assert bad == 0
    assert all(a.tobytes() == b.tobytes() for a, b in zip(res, before))


def test_thread_count_setting(monkeypatch):
    monkeypatch.setenv(parallel.ENV, "0")
    with pytest.raises(InvalidInputError, match="positive integer"):
        parallel.thread_count()
    monkeypatch.setenv(parallel.ENV, "two")
    with pytest.raises(InvalidInputError, match="'two'"):
        parallel.thread_count()
    monkeypatch.delenv(parallel.ENV)
    assert parallel.thread_count() >= 1


@pytest.mark.parametrize(("tensors", "share"), [(1, 0.05), (100, 0.07)])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_compress_allocates_no_full_size_temporary(monkeypatch, threads, tensors, share):
    """Peak extra allocation of a whole compress of 2^24 fp32 at fraction 0.01, output included: under 5% of the
    dense update's bytes (block buffers, candidates, output, 2%, and every temporary) in one tensor, under 7% in 100
    (packed tasks, whose blocks hold their keys in buffers of their own: 5.9%, as before they did)."""
    from benchmarks.traffic import update

    monkeypatch.setenv(parallel.ENV, threads)
    n = 1 << 24
    new, base = update(n, tensors, 3)
    nbytes = sum(a.nbytes for a in new.values())
    with use_backend("cpu"):
        gpu_codec.compress(new, base, fraction=0.01)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
            p = gpu_codec.compress(new, base, fraction=0.01)
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
    assert p.nnz == gpu_codec.kept_count(0.01, n)
    assert peak < share * nbytes, f"peak {peak} bytes ({100 * peak / nbytes:.2f}%) for a {nbytes}-byte update"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dense_compress_of_one_large_tensor_takes_it_a_block_at_a_time(dtype):
    """Dense mode (every element kept, int8) of one 2^22-element tensor: the deltas' fp32 array, the payload and a
    block's temporaries, under 10 bytes an element at the peak; the whole tensor's temporaries at once took 17
    (fp32) to 22 (fp16), and about 20 for a bf16 embedding of 2^28."""
    n = 1 << 22
    rng = np.random.default_rng(0)
    base = {"w": (rng.standard_normal(n) * 0.02).astype(dtype)}
    new = {"w": (base["w"] + rng.standard_normal(n).astype(np.float32) * 1e-3).astype(dtype)}
    with use_backend("cpu"):
        tracemalloc.start()
        try:
            p = gpu_codec.compress(new, base, fraction=None, pipeline=[gpu_codec.Int8Blockwise(256)])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        out = gpu_codec.decompress(p.to_bytes(), base=base)["w"]
    assert peak < 10 * n, f"peak {peak / n:.2f} bytes an element"
    assert np.abs(out.astype(np.float32) - new["w"].astype(np.float32)).max() < 1e-3


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dt", [0, 1, 2, 3])
@pytest.mark.parametrize("flaw", [None, "repeat_at_chunk_edge", "out_of_range", "nan"])
def test_chunked_scatter_matches_one_piece(monkeypatch, mode, dt, flaw):
    """The scatter twin on 100-entry chunks and 3 threads against one piece in entry order: same outputs, and
    the lowest bad entry, also where the flaw sits on a chunk boundary."""
    from gpu_codec.cpu_fallback import kernels

    rng = np.random.default_rng(dt + 10 * mode)
    numel, k = 20_000, 1_000
    idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.uint32)
    vals = rng.standard_normal(k)
    if flaw == "repeat_at_chunk_edge":
        idx[300] = idx[299]
    elif flaw == "out_of_range":
        idx[-1] = numel
    elif flaw == "nan":
        vals[555] = np.nan
    storage = {0: np.float32, 1: np.float16, 2: np.uint16, 3: np.float64}[dt]
    base = rng.standard_normal(numel).astype(np.float32)
    base = base.view(np.uint32) >> 16 if dt == 2 else base
    vals32, vals64 = vals.astype(np.float32), vals.astype(np.float64)

    def run(chunk):
        monkeypatch.setattr(kernels, "SCATTER_CHUNK", chunk)
        out = [base.astype(storage)]
        err = np.full(1, kernels.U64_MAX, np.uint64)
        ent = np.array([0, k], np.uint64)
        kernels._scatter(1, k, ent, [numel], [dt], out, idx, vals32, vals64, mode, err)
        return out[0], int(err[0])

    monkeypatch.setenv(parallel.ENV, "3")
    (got, gerr), (want, werr) = run(100), run(1 << 30)
    assert gerr == werr
    assert (gerr == int(kernels.U64_MAX)) == (flaw is None)
    assert got.tobytes() == want.tobytes()


def _rice_by_bits(idx: np.ndarray, k: int) -> tuple[bytes, int]:
    """The stream as the format describes it, one bit at a time."""
    g = np.diff(idx.astype(np.int64), prepend=-1) - 1
    bitlist = [(int(x) >> j) & 1 for x in g for j in range(k)]
    for x in g:
        bitlist += [0] * (int(x) >> k) + [1]
    return np.packbits(np.array(bitlist, np.uint8), bitorder="little").tobytes(), len(bitlist)


@pytest.fixture
def numpy_alias():
    """NumPy under another name: rice_decode then takes its array-generic path (the one CuPy runs)."""
    import types

    alias = types.ModuleType("numpy_alias")
    alias.__dict__.update({n: getattr(np, n) for n in dir(np) if not n.startswith("__")})
    return alias


@pytest.mark.parametrize("k_shift", [-3, 0, 2])
@pytest.mark.parametrize("density", [0.5, 0.01, 0.0003])
def test_rice_in_chunks_matches_the_format(monkeypatch, numpy_alias, density, k_shift):
    from gpu_codec.cpu_fallback import rice

    from gpu_codec.xp.rice import rice_decode

    monkeypatch.setattr(rice, "CHUNK", 7)
    monkeypatch.setenv(parallel.ENV, "3")
    rng = np.random.default_rng([round(density * 1e5), k_shift + 5])
    numel = 200_000
    idx = np.flatnonzero(rng.random(numel) < density).astype(np.uint32)
    k = max(0, rice.rice_param(idx.size, numel) + k_shift)
    stream, bits = rice.rice_encode(idx, k)
    assert (stream.tobytes(), bits) == _rice_by_bits(idx, k)
    for xp in (np, numpy_alias):
        assert rice_decode(stream, bits, k, idx.size, numel, xp).tolist() == idx.tolist()


def test_rice_decoders_reject_alike(monkeypatch, numpy_alias):
    """Flipped bits, cut streams and wrong counts: the NumPy decoder and the array-generic one raise the same
    error with the same message (or decode the same indices)."""
    from gpu_codec.cpu_fallback import rice

    from gpu_codec.xp.rice import rice_decode

    monkeypatch.setattr(rice, "CHUNK", 5)
    rng = np.random.default_rng(9)
    numel = 5_000
    idx = np.flatnonzero(rng.random(numel) < 0.02).astype(np.uint32)
    k = rice.rice_param(idx.size, numel)
    stream, bits = rice.rice_encode(idx, k)
    outcomes = set()
    for trial in range(300):
        s, b, n, m = stream.copy(), bits, idx.size, numel
        what = trial % 4
        if what == 0:
            pos = int(rng.integers(0, 8 * s.size))
            s[pos >> 3] ^= np.uint8(1 << (pos & 7))
        elif what == 1:
            b -= int(rng.integers(1, 9))
            s = s[: -(-b // 8)].copy()
        elif what == 2:
            n += int(rng.integers(-2, 3))
        else:
            m = int(idx[-1]) + int(rng.integers(0, 2))
        got = []
        for xp in (np, numpy_alias):
            try:
                got.append(("ok", rice_decode(s, b, k, n, m, xp).tolist()))
            except gpu_codec.PayloadError as e:
                got.append((type(e).__name__, str(e)))
        assert got[0] == got[1]
        outcomes.add(got[0][0])
    assert len(outcomes) >= 3  # the trials reach several checks


def test_fp16_loads_as_numpys_cast_for_every_bit_pattern():
    """load_f32 reads fp16 through a table of NumPy's own cast: every one of the 65,536 patterns (NaNs, infinities,
    subnormals, -0.0) gives the cast's bits, from uint16 storage or float16, contiguous or strided."""
    from gpu_codec.cpu_fallback.elementwise import DT_F16, load_f32

    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    for x in (bits, bits.view(np.float16), bits[::-1][::-1], bits[::3]):
        got = load_f32(x, DT_F16)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), x.view(np.float16).astype(np.float32).view(np.uint32))
    assert np.array_equal(load_f32(bits, DT_F16).view(np.uint32), want)
    assert load_f32(np.array(0x3C00, np.uint16), DT_F16) == 1.0  # (0-d)
