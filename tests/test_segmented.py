"""Updates of many uneven tensors: the NumPy selection packs small tensors end to end into its blocks, and decompress
writes runs of small sparse tensors with one scatter into one allocation. Both must give exactly what the
definition (and the kernels, through the emulated backend) give, ties, zeros, residuals and bad entries included."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from gpu_codec.cpu_fallback import select

import gpu_codec
from gpu_codec import ErrorFeedback
from gpu_codec.errors import PayloadIndexError, PayloadValueError

from .common import BACKENDS, HAS_EMULATOR, build_payload, reference_topk, split_payload, use_backend

SIZES = [0, 1, 7, 100, 4095, 4096, 5000, 70_000, 1, 300_000, 33, 0, 2048]


def uneven(kind: str, seed: int, count: int = 120, dtype=np.float32):
    """``count`` tensors of uneven sizes (cycling SIZES, empty ones included) and a base."""
    rng = np.random.default_rng(seed)
    upd, base = {}, {}
    for i in range(count):
        n = SIZES[(i * 7 + seed) % len(SIZES)]
        b = rng.standard_normal(n).astype(dtype)
        if kind == "zeros":  # 99 % of the delta exactly zero
            d = np.where(rng.random(n) < 0.99, 0.0, rng.standard_normal(n))
        elif kind == "ties":  # three levels
            d = rng.choice([-0.5, 0.0, 0.5], n)
        elif kind == "scales":  # tiny and huge tensors side by side
            d = rng.standard_normal(n) * 10.0 ** ((i % 5) * 8 - 16)
        else:
            d = rng.standard_normal(n)
        upd[f"blocks.{i}.w"] = (b + d).astype(dtype)
        base[f"blocks.{i}.w"] = b
    return upd, base


@pytest.mark.parametrize("kind", ["normal", "zeros", "ties", "scales"])
@pytest.mark.parametrize("scope", ["global", "per_tensor"])
@pytest.mark.parametrize("fraction", [0.01, 0.3])
def test_selection_of_many_small_tensors_is_the_definition(kind, scope, fraction):
    upd, base = uneven(kind, 1)
    with use_backend("cpu"):
        p = gpu_codec.compress(upd, base, fraction=fraction, scope=scope)
    ref = reference_topk(upd, base, fraction, scope)
    assert [r.name for r in p.tensors] == list(upd)
    for r in p.tensors:
        idx, vals = ref[r.name]
        assert np.array_equal(r.buffers["indices"].astype(np.int64), idx), r.name
        assert r.buffers["values"].tobytes() == np.asarray(vals, np.float32).tobytes(), r.name


def test_small_tensors_are_packed_into_shared_tasks():
    upd, base = uneven("normal", 2)
    arrays = [a.reshape(-1) for a in upd.values()]
    c = select._Call(
        arrays,
        list(base.values()),
        [None] * len(arrays),
        [None] * len(arrays),
        [0] * len(arrays),
        [None] * len(arrays),
        [0] * len(arrays),
        0,
    )
    parts = select._tasks(c, list(range(len(arrays))))
    packed = [p for p in parts if p.ts is not None]
    assert packed and len(parts) < len(arrays) // 4  # one task for many tensors, not one each
    covered = [t for p in parts for t in (p.ts if p.ts is not None else (p.t,))]
    nonempty = [t for t in dict.fromkeys(covered) if arrays[t].size]  # a large tensor's parts name it again
    assert nonempty == [t for t in range(len(arrays)) if arrays[t].size]  # in order, none lost


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("qmode", [0, 1])
def test_residuals_of_packed_tensors(inplace, qmode):
    """Error feedback over many small tensors: the residual is the delta where not kept and delta - decoded(delta)
    where kept, whether it is written during the scan or after the selection (in place)."""
    from gpu_codec.cpu_fallback.elementwise import decoded

    upd, base = uneven("normal", 3, count=60)
    rng = np.random.default_rng(0)
    new = [a.reshape(-1) for a in upd.values()]
    bas = [a.reshape(-1) for a in base.values()]
    res = [(rng.standard_normal(a.size) * 0.1).astype(np.float32) for a in new]
    want = [(n - b) + r for n, b, r in zip(new, bas, res)]
    out = res if inplace else [np.empty_like(r) for r in res]
    nt = len(new)
    k = gpu_codec.kept_count(0.02, sum(a.size for a in new))
    idx, vals, bad = select.topk_select(
        new, bas, res, out, [0] * nt, [None] * nt, [0] * nt, 0, [list(range(nt))], [k], qmode
    )
    assert bad is None and sum(i.size for i in idx) == k
    for t in range(nt):
        w = want[t].copy()
        kept = idx[t].astype(np.int64)
        assert vals[t].tobytes() == want[t][kept].tobytes()
        w[kept] = want[t][kept] - decoded(want[t][kept], qmode)
        assert out[t].tobytes() == w.tobytes(), t


@pytest.mark.parametrize("kind", ["normal", "zeros", "ties"])
@pytest.mark.parametrize("residual", [False, True])
def test_shared_outputs_are_the_per_tensor_outputs_in_one_array(kind, residual):
    """With ``shared`` (what the CPU backend asks for), a global selection writes every tensor's entries into one
    uint32 index array and one fp32 value array (tensor t's a range of each), the same entries and residuals as the
    per-tensor arrays; per-tensor scope and fp64 tensors keep an array a tensor."""
    upd, base = uneven(kind, 6, count=80)
    new = [a.reshape(-1) for a in upd.values()]
    bas = [a.reshape(-1) for a in base.values()]
    nt = len(new)
    rng = np.random.default_rng(1)
    res = [(rng.standard_normal(a.size) * 0.1).astype(np.float32) for a in new] if residual else [None] * nt
    k = gpu_codec.kept_count(0.01, sum(a.size for a in new))
    got = {}
    for shared in (False, True):
        out = [np.empty(a.size, np.float32) for a in new] if residual else [None] * nt
        rest = [0] * nt, [None] * nt, [0] * nt, 0, [list(range(nt))], [k], 0
        idx, vals, bad = select.topk_select(new, bas, res, out, *rest, shared=shared)
        assert bad is None
        if shared:  # (one array a role, and each tensor's range of it)
            (i_src, offsets), (v_src, v_offsets) = idx, vals
            assert i_src.dtype == np.uint32 and v_src.dtype == np.float32 and i_src.size == v_src.size == k
            assert offsets == v_offsets and len(offsets) == nt + 1 and offsets[-1] == k
            idx = [i_src[a:b] for a, b in pairwise(offsets)]
            vals = [v_src[a:b] for a, b in pairwise(offsets)]
        written = [o.tobytes() for o in out if o is not None]
        got[shared] = ([i.tobytes() for i in idx], [v.tobytes() for v in vals], written)
    assert got[True] == got[False]
    # per-tensor scope, and an fp64 tensor beside fp32 ones: an array a tensor
    per = select.topk_select(
        new,
        bas,
        [None] * nt,
        [None] * nt,
        [0] * nt,
        [None] * nt,
        [0] * nt,
        0,
        [[t] for t in range(nt)],
        [1] * nt,
        0,
        shared=True,
    )
    assert type(per[0]) is list
    f64 = [new[0].astype(np.float64)] + new[1:]
    fb = [bas[0].astype(np.float64)] + bas[1:]
    mixed = select.topk_select(
        f64,
        fb,
        [None] * nt,
        [None] * nt,
        [3] + [0] * (nt - 1),
        [None] * nt,
        [0] * nt,
        0,
        [list(range(nt))],
        [k],
        0,
        shared=True,
    )
    assert type(mixed[0]) is list and mixed[1][0].dtype == np.float64


def test_the_cpu_backend_compresses_a_global_update_into_one_index_and_one_value_array():
    """The CPU backend's global compress hands the payload records that are ranges of two shared arrays (no array
    made a tensor), as the GPU path's; the bytes are those of the per-tensor arrays."""
    upd, base = uneven("normal", 7, count=50)
    with use_backend("cpu"):
        p = gpu_codec.compress(upd, base, fraction=0.01)
        per = gpu_codec.compress(upd, base, fraction=0.01, scope="per_tensor")
    roles = {id(r.buffers.roles["indices"]) for r in p.tensors}
    assert len(roles) == 1 and type(per.tensors[0].buffers) is dict
    flat = {r.name: (r.buffers["indices"].copy(), r.buffers["values"].copy()) for r in p.tensors}
    rebuilt = gpu_codec.Payload.from_bytes(p.to_bytes())
    assert {r.name: (r.buffers["indices"].tobytes(), r.buffers["values"].tobytes()) for r in rebuilt.tensors} == {
        n: (i.tobytes(), v.tobytes()) for n, (i, v) in flat.items()
    }


@pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")
@pytest.mark.parametrize("kind", ["normal", "zeros", "ties"])
def test_packed_selection_matches_the_kernels(kind):
    upd, base = uneven(kind, 4, count=60)
    small = [n for n in upd if upd[n].size <= 5000]  # the emulator runs each thread of a kernel: keep it small
    upd, base = {n: upd[n] for n in small}, {n: base[n] for n in small}
    blobs = []
    for be in ("cpu", "emulated"):
        ef = ErrorFeedback()
        with use_backend(be):
            blobs.append([gpu_codec.compress(upd, base, fraction=0.01, residual=ef).to_bytes() for _ in range(2)])
    assert blobs[0] == blobs[1]


def test_first_bad_tensor_is_named():
    upd, base = uneven("normal", 5, count=40)
    names = [n for n in upd if upd[n].size > 10]
    for bad in (names[3], names[-1]):
        u = dict(upd)
        u[bad] = u[bad].copy()
        u[bad][5] = np.nan
        with use_backend("cpu"), pytest.raises(gpu_codec.InvalidInputError, match=bad.replace(".", r"\.")):
            gpu_codec.compress(u, base, fraction=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_base", [False, True])
def test_decompress_many_small_tensors(backend, with_base):
    upd, base = uneven("normal", 6)
    with use_backend("cpu"):
        p = gpu_codec.compress(upd, base, fraction=0.05)
    with use_backend(backend):
        got = gpu_codec.decompress(p.to_bytes(), base=base if with_base else None)
    assert list(got) == list(upd)
    for r in p.tensors:  # the definition: the base (or zeros) with the kept entries added
        d = np.zeros(r.numel, np.float32)
        d[r.buffers["indices"].astype(np.int64)] = r.buffers["values"]
        want = (base[r.name] + d).astype(np.float32) if with_base else d
        assert np.asarray(got[r.name]).tobytes() == want.tobytes(), r.name
    if backend == "cpu":  # onto a base, views of one allocation; a delta's, one allocation a run of small tensors
        owners = {id(np.asarray(v).base) for v in got.values() if np.asarray(v).size}
        nonempty = sum(1 for v in got.values() if np.asarray(v).size)
        assert len(owners) == 1 if with_base else 1 < len(owners) < nonempty / 2


@pytest.mark.parametrize("past", [1, 10**6])
def test_decompress_run_names_the_bad_tensor(past):
    """An index past its own tensor's end (but inside the run the tensor is decoded with): nothing is returned, and
    the error names that tensor."""
    upd, base = uneven("normal", 7, count=30)
    p = gpu_codec.compress(upd, base, fraction=0.05)
    pos, victim = next((i, r) for i, r in enumerate(p.tensors) if i > 5 and r.nnz >= 2 and i < len(p.tensors) - 2)
    h, data = split_payload(p.to_bytes(version=1))
    b = h["tensors"][pos]["buffers"][0]
    d = bytearray(data)
    last = b["offset"] + b["nbytes"] - 4
    d[last : last + 4] = (victim.numel - 1 + past).to_bytes(4, "little")
    with pytest.raises(PayloadIndexError, match=victim.name.replace(".", r"\.")):
        gpu_codec.decompress(build_payload(h, bytes(d)), base=base)


def test_decompress_run_names_the_tensor_whose_sum_overflows():
    rng = np.random.default_rng(8)
    upd = {f"t{i}": rng.standard_normal(50).astype(np.float16) for i in range(12)}
    base = {k: v.copy() for k, v in upd.items()}
    upd["t7"][3] = np.float16(60000.0)
    p = gpu_codec.compress(upd, base, fraction=0.05)
    hot = {k: v.copy() for k, v in base.items()}
    hot["t7"][3] = np.float16(60000.0)  # base + delta = 120000: not finite in fp16
    with pytest.raises(PayloadValueError, match="'t7'"):
        gpu_codec.decompress(p, base=hot)
