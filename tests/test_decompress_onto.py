"""Sparse decompress onto a base: the base copied and the entries added block by block (``scatter_onto``), the same
bytes as a copy of the base and the scatter twin, on every backend, across many blocks and entry chunks."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_codec.cpu_fallback import kernels as twins

import gpu_codec
from gpu_codec import decode
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.constants import DT_BF16, DT_F16, DT_F32, DT_F64, SCATTER_ADD
from gpu_codec.errors import InvalidInputError, PayloadValueError

from .common import BACKENDS, build_payload, split_payload, use_backend

STORAGE = {DT_F32: np.float32, DT_F16: np.float16, DT_BF16: np.uint16, DT_F64: np.float64}


def _base(rng, dt: int, n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    if dt == DT_BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(STORAGE[dt])


def _copy_and_scatter(base, dt, idx, vals) -> np.ndarray:
    """The reference: a copy of the whole base, then the scatter twin in mode 1."""
    out, host = base.copy(), CpuBackend().asarray  # (a GPU payload's entries: copied to the host)
    assert CpuBackend().scatter([out], [dt], [base.size], [host(idx)], [host(vals)], SCATTER_ADD) is None
    return out


@pytest.mark.parametrize("dt", [DT_F32, DT_F16, DT_BF16, DT_F64], ids=["f32", "f16", "bf16", "f64"])
def test_scatter_onto_in_pieces_gives_the_bytes_of_copy_and_scatter(dt, monkeypatch):
    monkeypatch.setattr(twins, "ONTO_BLOCK", 256)  # about 40 blocks, most holding entries, some none
    rng = np.random.default_rng(dt)
    n = 10_000
    base = _base(rng, dt, n)
    idx = np.sort(rng.choice(n, 700, replace=False)).astype(np.uint32)
    idx[:5] = np.arange(5)  # entries at the very start, and (below) up to the last element
    idx[-1] = n - 1
    idx.sort()
    vals = rng.standard_normal(idx.size).astype(np.float64 if dt == DT_F64 else np.float32)
    want = _copy_and_scatter(base, dt, idx, vals)
    out = np.full(n, 7, STORAGE[dt])
    done = 0
    for a, b in ((0, 100), (100, 100), (100, 450), (450, idx.size)):  # ranges as the engine's entry chunks make
        stop = n if b == idx.size else int(idx[b - 1]) + 1
        assert twins.scatter_onto(out, base, done, stop, dt, n, idx[a:b], vals[a:b]) == (None, True)
        done = stop
    assert out.tobytes() == want.tobytes()


def test_scatter_onto_reports_bad_entries_and_overflow():
    base = np.array([1, 2, 60000, 4], np.float16)
    out = np.empty(4, np.float16)
    ok = np.array([1, 2], np.uint32)
    assert twins.scatter_onto(out, base, 0, 4, DT_F16, 4, ok, np.array([1, 60000], np.float32)) == (None, False)
    assert twins.scatter_onto(out, base, 0, 4, DT_F16, 4, ok, np.array([1, np.nan], np.float32))[0] == 1
    assert twins.scatter_onto(out, base, 0, 4, DT_F16, 4, np.array([2, 1], np.uint32), np.ones(2, np.float32))[0] == 1
    with pytest.raises(ValueError, match="not within"):
        twins.scatter_onto(out, base, 0, 2, DT_F16, 4, ok, np.ones(2, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_decompress_onto_a_base_over_many_chunks(backend, dtype, monkeypatch):
    monkeypatch.setattr(decode, "DECODE_CHUNK", (64, 64))  # entry chunks of 64 ...
    monkeypatch.setattr(twins, "ONTO_BLOCK", 512)  # ... each spanning several blocks
    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal(40_000).astype(dtype), "b": rng.standard_normal(300).astype(dtype)}
    new = {k: (v + rng.standard_normal(v.size).astype(dtype)).astype(dtype) for k, v in base.items()}
    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=0.03)
        out = gpu_codec.decompress(p.to_bytes(), base=base)
    for r in p.tensors:
        dt = {np.float32: DT_F32, np.float16: DT_F16, np.float64: DT_F64}[dtype]
        idx, vals = r.buffers["indices"], r.buffers["values"]
        assert idx.size > 64 * 3 or r.name == "b"
        want = _copy_and_scatter(base[r.name], dt, idx, vals)
        assert out[r.name].tobytes() == want.tobytes(), r.name
    assert not np.shares_memory(out["w"], base["w"])


def test_a_sparse_tensor_with_no_entry_decodes_to_its_base():
    base = {"w": np.arange(8, dtype=np.float32)}
    h, _ = split_payload(gpu_codec.compress({"w": base["w"] + 1}, base, fraction=0.25).to_bytes(version=1))
    t = h["tensors"][0]
    t["nnz"], h["data_length"] = 0, 0
    for b in t["buffers"]:
        b["offset"], b["nbytes"] = 0, 0
    out = gpu_codec.decompress(build_payload(h, b""), base=base)["w"]
    assert out.tobytes() == base["w"].tobytes() and not np.shares_memory(out, base["w"])


def test_overflow_onto_a_base_leaves_it_untouched(monkeypatch):
    monkeypatch.setattr(twins, "ONTO_BLOCK", 64)  # the overflowing entry in a late block, after others were written
    old, new = np.full(1000, 1.0, np.float16), np.full(1000, 1.0, np.float16)
    old[900], new[900], new[:10] = -60000, 60000, 5  # a delta of 120000: finite in fp32
    blob = gpu_codec.compress({"w": new}, {"w": old}, fraction=0.011).to_bytes()
    base = {"w": np.full(1000, 1.0, np.float16)}
    base["w"][900] = 60000  # 60000 + 120000 is past fp16's range
    with pytest.raises(PayloadValueError, match="inf or NaN"):
        gpu_codec.decompress(blob, base=base)
    assert base["w"][900] == 60000 and (np.delete(base["w"], 900) == 1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_base_in_another_order_gives_the_same_outputs_and_other_names_are_refused(backend):
    """The base is read in the payload's order where its names come in that order (no lookup a name), else by name:
    the same outputs, in the payload's order; a base that names other tensors, as many or not, is refused and names
    them."""
    rng = np.random.default_rng(11)
    base = {f"t{i}": rng.standard_normal(50 + i).astype(np.float32) for i in range(6)}
    new = {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}
    blob = gpu_codec.compress(new, base, fraction=0.2).to_bytes()
    with use_backend(backend):
        want = gpu_codec.decompress(blob, base=base)
        got = gpu_codec.decompress(blob, base=dict(reversed(base.items())))
        assert list(got) == list(want) == list(base)
        assert all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want)
        renamed = dict(base)
        renamed["zz"] = renamed.pop("t2")
        short = {k: v for k, v in base.items() if k != "t4"}
        for bad, named in ((renamed, "'t2'.*'zz'"), (short, "'t4'")):
            with pytest.raises(InvalidInputError, match=f"name different tensors.*{named}"):
                gpu_codec.decompress(blob, base=bad)
