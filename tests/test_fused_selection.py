"""The fused one-pass selection on real distributions (kernels/topk.cu, "Fused selection"): real trained updates
with and without error feedback, exact zeros, ties and fewer non-zeros than k select without falling back to the
unfused passes, within the traffic targets by the emulator's count and to the same bytes as the NumPy backend; a
candidate pool too short still gives the same bytes through the fallback."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gpu_codec.cpu_fallback.select import topk_select

import gpu_codec
from benchmarks import bench_zoo
from benchmarks.zoo import ZOO, Update
from gpu_codec.backends import emulated as emu
from gpu_codec.backends import kernels as K
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.testing import kernel_cases as kc

from .common import HAS_EMULATOR, logged_launches

pytestmark = pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")

TARGET = {False: 10.0, True: 18.0}  # B/elem of one compress, without and with error feedback (issue 26)


@functools.cache
def update(name: str, elements: int):
    entry = ZOO[name]
    return entry.build(bench_zoo.scale_for(entry, elements))


def _same_bytes_as_numpy(u, fraction: float, scope: str) -> None:
    """One compress with an error-feedback residual carried from the update's earlier rounds, on the emulated and
    the NumPy backends: the same payload and the same residual afterwards."""
    out = []
    for backend in (CpuBackend(), emu.EmulatedBackend()):
        with using_backend(backend):
            ef = bench_zoo.warm_residual(u, fraction, scope)
            blob = gpu_codec.compress(u.new, u.base, fraction=fraction, scope=scope, residual=ef).to_bytes()
            out.append((blob, {k: np.asarray(ef.residual(k)).copy() for k in u.new}))
    (b_cpu, r_cpu), (b_emu, r_emu) = out
    assert b_cpu == b_emu
    assert all(np.array_equal(r_cpu[k], r_emu[k]) for k in r_cpu)


@pytest.mark.parametrize(("name", "elements"), [("digits-cnn-sgd", 1 << 19), ("char-transformer", 1 << 16)])
def test_real_updates_select_in_one_pass(name, elements):
    """1% and 0.1%, global and per tensor, with and without error feedback (the residual of the earlier rounds):
    no fallback, and the traffic targets by the emulator's count (digits: all 281,674 parameters; the NumPy and
    emulated bytes of every entry are compared at a small scale in tests/test_zoo.py)."""
    u = update(name, elements)
    rows = bench_zoo.emulated_rows(u)
    assert len(rows) == len(bench_zoo.EMU_CONFIGS) == 8
    for r in rows:
        cfg = (r["fraction"], r["scope"], r["residual"])
        assert (r["fallbacks"], r["fused"]) == (0, 1), cfg
        assert r["bytes_per_element"] <= TARGET[r["residual"]], cfg
    if name == "char-transformer":
        _same_bytes_as_numpy(u, 0.01, "global")
        _same_bytes_as_numpy(u, 0.001, "per_tensor")


def _recurrent_rounds(rounds: int = 3, steps: int = 12) -> Update:
    """A federated run of a model the zoo does not hold: a two-layer LSTM language model (its gates' four weight
    blocks stacked in each matrix, a frozen embedding, LayerNorm, a head) really trained with SGD and momentum on a
    periodic token sequence, each round's base the model the round began from."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    vocab = 40

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 32)
            self.lstm = torch.nn.LSTM(32, 64, 2, batch_first=True)
            self.norm = torch.nn.LayerNorm(64)
            self.head = torch.nn.Linear(64, vocab)

        def forward(self, x):
            return self.head(self.norm(self.lstm(self.emb(x))[0]))

    model = LM()
    model.emb.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    seq = (torch.arange(16 * 25).reshape(16, 25) * 7 + torch.arange(16)[:, None]) % vocab  # (each row periodic)
    state = lambda: {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}  # noqa: E731
    losses, out = [], []
    for _ in range(rounds):
        base = state()
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, vocab), seq[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out.append((base, state()))
    assert losses[-1] < 0.5 * losses[0]  # (it learned)
    base, new = out[-1]
    assert np.array_equal(base["emb.weight"], new["emb.weight"])  # (frozen: an all-zero delta)
    return Update(base, new, out)


def test_an_unseen_recurrent_models_update_selects_in_one_pass():
    """The selection holds on an architecture the zoo was not built from: every configuration of the zoo's
    emulated rows (1% and 0.1%, global and per tensor, with and without the residual of the earlier rounds)
    without a fallback and within the traffic targets, and the NumPy backend's bytes and residual."""
    u = _recurrent_rounds()
    for r in bench_zoo.emulated_rows(u):
        cfg = (r["fraction"], r["scope"], r["residual"])
        assert (r["fallbacks"], r["fused"]) == (0, 1), cfg
        assert r["bytes_per_element"] <= TARGET[r["residual"]], cfg
    _same_bytes_as_numpy(u, 0.01, "global")
    _same_bytes_as_numpy(u, 0.001, "per_tensor")


@pytest.mark.parametrize("name", ["zeros-99", "zeros-100", "three-level", "fewer-than-k"])
def test_zeros_and_ties_select_in_one_pass(name):
    """A bracket on a value that many elements share (exact zeros, three levels, fewer non-zeros than k): the
    equal keys are counted rather than stored, and the few chunks that supply the kept ones are read again."""
    u = update(name, 1 << 18)
    rows = bench_zoo.emulated_rows(u)
    for r in rows:
        cfg = (r["fraction"], r["scope"], r["residual"])
        assert (r["fallbacks"], r["fused"]) == (0, 1), cfg
        assert r["bytes_per_element"] <= TARGET[r["residual"]], cfg
    _same_bytes_as_numpy(u, 0.01, "global")


def test_tied_segments_take_tie_write(emulated_runner_log):
    """All-zero and three-level tensors kept by their first keys equal to the threshold: tie_write runs, and the
    result is the NumPy backend's to the byte."""
    log, runner = emulated_runner_log
    case = kc.TopkCase("zeros_and_levels", (9000, 20_000), ("f32", "f32"), scope="tensor", k=0.01, pattern="zeros")
    assert kc.topk_vs_reference(runner, case) == []
    assert "tie_write_u32" in log


@pytest.fixture
def emulated_runner_log():
    runner = emu.EmulatorRunner(schedule="shuffle", seed=11)
    return logged_launches(runner), runner


def test_a_pool_too_short_falls_back_to_the_same_bytes(monkeypatch):
    """Candidate pools a third of their planned size: the pool overflows (chunks placed in shuffled order, some
    stored and some not), the unfused passes run, counted, and the bytes are the NumPy backend's."""
    bracket = K.bracket

    def short(*args):
        lo, cap = bracket(*args)
        return lo, cap // 3

    monkeypatch.setattr(K, "bracket", short)
    case = kc.TopkCase("short_pool", (50_000, 30_000), ("f32", "f16"), k=0.01, res=True, res_out="new")
    inp = kc.make_topk_inputs(case)
    runner = emu.EmulatorRunner(schedule="shuffle", seed=3)
    ops = K.KernelOps(runner, fused=True)
    res_out = [np.zeros(n, np.float32) for n in case.sizes]
    want_ro = [np.zeros(n, np.float32) for n in case.sizes]
    rest = (inp["dtypes"], inp["ext"], inp["ext_dtypes"], inp["crit"], inp["segments"], inp["ks"], inp["qmode"])
    got = ops.topk_select(inp["new"], inp["base"], [r.copy() for r in inp["res"]], res_out, *rest)
    want = topk_select(inp["new"], inp["base"], [r.copy() for r in inp["res"]], want_ro, *rest)
    assert (ops.fused_selections, ops.fused_fallbacks) == (0, 1)
    assert got[2] is None and want[2] is None
    for a, b in zip(got[0] + got[1] + res_out, want[0] + want[1] + want_ro):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_one_chunk_segments_select_in_the_scan(emulated_runner_log):
    """Per-tensor segments of one chunk each (ties, every dtype): fused_scan's block selects each whole, with no
    sample and no fallback, to the NumPy backend's bytes."""
    log, runner = emulated_runner_log
    sizes, dtypes = (4096, 1000, 3000, 17, 2500), ("f32", "f16", "bf16", "f64", "f32")
    for pattern in ("ties", "normal"):
        case = kc.TopkCase("one_chunk_segments", sizes, dtypes, scope="tensor", k=0.05, pattern=pattern, res=True)
        assert kc.topk_vs_reference(runner, case.with_(res_out="new")) == []
    assert "fused_scan" in log and "sample_keys" not in log and "score_keys" not in log


def test_segments_of_a_few_chunks_are_selected_by_their_chunks(emulated_runner_log):
    """Per-tensor segments of two to OWN_CHUNKS chunks, whose last chunk holds fewer elements than k (it keeps them
    all), with ties across chunks and residuals: each chunk keeps its own k best, no sample is taken, and the
    bytes are the NumPy backend's."""
    log, runner = emulated_runner_log
    sizes = (2 * 4096 + 5, 3 * 4096, 4 * 4096 - 1, 4096 + 4097)
    for pattern in ("ties", "normal", "equal"):
        case = kc.TopkCase("own_chunks", sizes, ("f32", "bf16", "f16", "f64"), scope="tensor", k=0.05, pattern=pattern)
        assert kc.topk_vs_reference(runner, case.with_(res=True, res_out="new")) == [], pattern
    assert "fused_scan" in log and "sample_keys" not in log and "score_keys" not in log


TIED = [
    kc.TopkCase("equal_global", (3000, 5000, 17), ("f32", "f16", "f64"), k=0.01, pattern="equal", res=True),
    kc.TopkCase("zeros_tensor", (9000, 20_000), ("bf16", "f32"), scope="tensor", k=0.02, pattern="zeros"),
    kc.TopkCase("ties_global", (30_000, 7000), ("f32", "f64"), k=0.3, pattern="ties", res=True, res_out="alias"),
]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("case", TIED, ids=[c.name for c in TIED])
def test_tie_write_matches_twins_stepwise(case, wide):
    """Segments kept by their first keys equal to lo, launch by launch against the twins, in shuffled block
    order, and against the NumPy backend (every segment bracketed: a small one would otherwise be selected by its
    chunks, with no bracket)."""
    runner = emu.EmulatorRunner(schedule="shuffle", seed=2)
    assert kc.topk_fused_stepwise(runner, case, wide=wide, own="one") == []
    if case.pattern in ("equal", "zeros"):  # (the ties of ties_global fall above its bracket)
        assert runner.launch_counts["tie_write_u64" if wide else "tie_write_u32"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_bracket_sorting_a_prefix_picks_what_sorting_all_picks(monkeypatch, seed):
    """bracket sorts only the sample's largest keys (BRACKET_TOP_MIN or a few times the keys it expects above the
    k-th) and sorts them all where the pick lies past them: (lo, pool) as a full sort's."""
    from gpu_codec.backends import kernels as K

    rng = np.random.default_rng(seed)
    ms = int(rng.integers(5_000, 40_000))
    levels = int(rng.choice([3, 50, 1 << 20]))  # heavy ties to distinct keys
    sample = rng.integers(0, levels, ms).astype(np.uint32)
    # small tensors' runs weigh less; a few heavy ones make the prefix fall short and the full sort run
    weight = rng.choice([0.5, 3.0, 40.0, 4000.0], ms, p=[0.3, 0.5, 0.19, 0.01])
    n = int(weight.sum())
    for k in (1, n // 1000, n // 100, n // 3):
        got = K.bracket(sample, weight, n, k, False)
        with monkeypatch.context() as m:
            m.setattr(K, "BRACKET_TOP_MIN", 1 << 40)
            want = K.bracket(sample, weight, n, k, False)
        assert got == want, (seed, k)
    # the order is a stable argsort's reversed, whole or its first keys, heavy ties (three levels) included
    full = np.argsort(sample, kind="stable")[::-1]
    assert np.array_equal(K._descending(sample, ms), full)
    for top in (1, 777, ms - 1):
        assert np.array_equal(K._descending(sample, top), full[:top])
    # the design effect's key, read off the sorted prefix, is the one a partition finds
    order = K._descending(sample, 4096)
    for rank in (0, 64, 1000, 4095):
        assert K.design_effect(sample, rank, sample[order[rank]]) == K.design_effect(sample, rank)
    # a run's hits counted as the set bits of its flags' word, as a sum of its flags counts them
    effects = [K.design_effect(sample, r) for r in (0, 64, 1000)]
    monkeypatch.delattr(np, "bitwise_count", raising=False)
    assert effects == [K.design_effect(sample, r) for r in (0, 64, 1000)]


def test_bracket_sorts_the_whole_sample_where_its_largest_keys_weigh_too_little(monkeypatch):
    """The largest sampled keys come from tiny tensors (their runs weigh little): the pick lies past the sorted
    prefix, so bracket sorts every key, and picks what a full sort picks."""
    from gpu_codec.backends import kernels as K

    rng = np.random.default_rng(7)
    sample = rng.permutation(30_000).astype(np.uint32)
    weight = np.where(sample >= 24_000, 0.01, 50.0)  # the top fifth of the keys stands for almost nothing
    n = int(weight.sum())
    seen = []
    real = K._descending
    monkeypatch.setattr(K, "_descending", lambda s, top: seen.append(top) or real(s, top))
    got = K.bracket(sample, weight, n, n // 100, False)
    assert seen[0] < sample.size and seen[-1] == sample.size  # the prefix fell short, then all were sorted
    monkeypatch.setattr(K, "BRACKET_TOP_MIN", 1 << 40)
    assert got == K.bracket(sample, weight, n, n // 100, False)
