"""fused_scan_h16, the fused selection's scan for fp16 and bf16 tensors scored by the magnitude of their delta
(kernels/topk.cu, the 16-bit side of scan_vec): new and base read with one 64-bit load a thread where 8-byte
aligned, the fp32 residual with one 128-bit load and the early residual written with one 128-bit store where 16-byte
aligned; scalar accesses for tails and misaligned tensors.

On the emulator, beside fused_scan and the NumPy twin with the same arguments, it gives the same outputs to the bit
(candidates per chunk, counts of keys equal to lo, check word, early residual, nothing written past a tensor) over
fp16 and bf16 tensors mixed, aligned and misaligned streams, odd sizes and tails, with and without base and
residual, and non-finite values (fp16 infinities from a value past its range, NaN); the backend launches it where
every tensor is 16-bit and scored by the delta's magnitude, to the NumPy backend's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback.elementwise import f32_to_bf16_bits, score_key

from gpu_codec.backends import emulated as emu
from gpu_codec.constants import DT_BF16, DT_F16
from gpu_codec.testing import kernel_cases as kc

from . import test_fused_scan_f32 as f32
from .common import HAS_EMULATOR, logged_launches
from .test_fused_scan_f32 import GUARD, SENTINEL, SIZES, assert_same, placed

pytestmark = pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")

LAYOUTS = ("aligned", "new", "base", "res", "early", "mixed")


def placed16(bits: np.ndarray, shift: int) -> np.ndarray:
    """A uint16 copy of ``bits`` at an address 2 * shift bytes past an 8-byte boundary (0: aligned)."""
    buf = np.empty(bits.size + 8, np.uint16)
    head = (-(buf.ctypes.data // 2)) % 4
    a = buf[head + shift : head + shift + bits.size]
    a[...] = bits
    assert a.ctypes.data % 8 == 2 * shift
    return a


def _bits(x: np.ndarray, dt: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # (a value past fp16's range is inf there, as planted)
        return x.astype(np.float16).view(np.uint16) if dt == DT_F16 else f32_to_bf16_bits(x.astype(np.float32))


def _widen(b: np.ndarray, dt: int) -> np.ndarray:
    if dt == DT_F16:
        return b.view(np.float16).astype(np.float32)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def inputs(layout: str, base: bool, res: bool, pattern: str = "normal", seed: int = 0):
    """Per tensor (dtype code, (new bits, base bits, fp32 residual, early shift)), fp16 and bf16 alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for t, n in enumerate(SIZES):
        dt = DT_BF16 if t % 2 else DT_F16
        sh = {"new": 0, "base": 0, "res": 0, "early": 0}
        if layout == "mixed" and t % 2:
            sh[("new", "base", "res", "early")[(t // 2) % 4]] = 1 + t % 3
        elif layout not in ("aligned", "mixed"):
            sh[layout] = 1 + t % 3
        w0 = rng.standard_normal(n).astype(np.float32)
        w = w0 + rng.standard_normal(n).astype(np.float32) * 0.1
        zero = rng.random(n) < 0.05
        w[zero] = w0[zero]  # exact zero deltas: keys equal to key(0)
        if pattern == "inf" and t in (4, 9):
            w[n - 1 if t == 4 else n // 2] = 1e6 if dt == DT_F16 else np.inf  # fp16: past its range, inf
        if pattern == "nan" and t in (4, 9):
            w[n - 1 if t == 4 else n // 2] = np.nan
        b = placed16(_bits(w0, dt), sh["base"]) if base else None
        r = placed((rng.standard_normal(n) * 0.01).astype(np.float32), sh["res"]) if res else None
        out.append((dt, (placed16(_bits(w, dt), sh["new"]), b, r, sh["early"] if res else None)))
    return out


def _keys16(t) -> np.ndarray:
    dt, (nw, bs, rs, _) = t
    d = _widen(nw, dt) - (_widen(bs, dt) if bs is not None else np.float32(0))
    return score_key(np.abs(d + rs if rs is not None else d))


def lo_for(tensors, which: str) -> int:
    return f32.lo_for(tensors, which, key_of=_keys16)


def run_scan(runner, name, tensors, lo):
    """One launch of ``name`` over ``tensors``, (dtype code, (new, base, res, early shift)) each."""
    args, early = f32.scan_args(runner, [t for _, t in tensors], lo, dtypes=[dt for dt, _ in tensors])
    return f32.launch_scan(runner, name, args, early)


RUNNER = None


def _runner() -> emu.EmulatorRunner:
    global RUNNER
    if RUNNER is None:
        RUNNER = emu.EmulatorRunner()
    return RUNNER


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("base", "res"), [(True, False), (True, True), (False, True)])
def test_same_outputs_as_fused_scan_and_its_twin(layout, base, res):
    tensors = inputs(layout, base, res)
    for which in ("all", "mid", "zero", "none"):
        lo = lo_for(tensors, which)
        got = run_scan(_runner(), "fused_scan_h16", tensors, lo)
        assert_same(got, run_scan(_runner(), "fused_scan", tensors, lo), f"{layout} {which} vs fused_scan")
        assert_same(got, run_scan(kc.TwinRunner(), "fused_scan_h16", tensors, lo), f"{layout} {which} vs twin")
        for e in got["early"]:
            assert e is None or np.all(e[-GUARD:] == SENTINEL)
        if which == "all":  # every element a candidate exactly once, in index order
            for (idx, _), m in zip(got["cands"], got["cand_cnt"].tolist()):
                assert idx.tolist() == list(range(m))


@pytest.mark.parametrize("pattern", ["inf", "nan"])
@pytest.mark.parametrize("layout", ["aligned", "mixed"])
def test_non_finite_deltas_are_reported_like_fused_scan(pattern, layout):
    tensors = inputs(layout, True, True, pattern)
    got = run_scan(_runner(), "fused_scan_h16", tensors, 0)
    want = run_scan(_runner(), "fused_scan", tensors, 0)
    assert_same(got, want, pattern)
    assert int(got["status"][0]) == 4  # the lowest tensor with a non-finite delta


def test_block_and_thread_order_do_not_matter():
    tensors = inputs("mixed", True, True)
    lo = lo_for(tensors, "mid")
    want = run_scan(_runner(), "fused_scan_h16", tensors, lo)
    for schedule in ("reverse", "shuffle"):
        assert_same(run_scan(emu.EmulatorRunner(schedule=schedule, seed=3), "fused_scan_h16", tensors, lo), want)


@pytest.mark.parametrize(
    ("case", "scan"),
    [
        (
            kc.TopkCase(
                "h16_magnitude",
                (5000, 4097, 3, 20_000),
                ("bf16", "f16", "bf16", "bf16"),
                k=0.02,
                res=True,
                res_out="new",
            ),
            "_h16",
        ),
        (
            kc.TopkCase(
                "h16_tensor", (9000, 7, 17_000), ("bf16", "bf16", "f16"), crit=3, scope="tensor", k=0.05, pattern="ties"
            ),
            "_h16",
        ),
        (
            kc.TopkCase("h16_misaligned", (9000, 4099), ("bf16", "f16"), k=0.05, res=True, res_out="alias", shift=1),
            "_h16",
        ),
        (kc.TopkCase("h16_final", (9000, 7), ("bf16", "f16"), crit=1, k=0.05), ""),
        (kc.TopkCase("mixed", (9000, 4097), ("f32", "bf16"), k=0.05, res=True, res_out="alias"), ""),
    ],
    ids=lambda x: x.name if isinstance(x, kc.TopkCase) else x,
)
def test_backend_launches_the_h16_scan_where_it_applies(case, scan):
    """The fused selection through KernelOps on the emulator: the scan the plan picks, and the NumPy backend's
    outputs and residuals."""
    r = emu.EmulatorRunner()
    log = logged_launches(r)
    assert kc.topk_vs_reference(r, case) == []
    assert ("fused_scan_h16" in log) == (scan == "_h16"), log
