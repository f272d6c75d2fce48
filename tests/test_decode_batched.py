"""Decompress onto a base on the host in batches: many sparse tensors joined, checked at once and written with their
bases in one call (``scatter_onto_bases``). The bytes are those of a copy of each base and the scatter twin, for
every dtype, across batch limits; a bad entry in any tensor of a batch still gets the error that names it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gpu_codec.cpu_fallback import kernels as twins

import gpu_codec
from gpu_codec import decode
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.constants import DT_BF16, DT_F16, DT_F32, DT_F64, SCATTER_ADD
from gpu_codec.errors import PayloadIndexError, PayloadValueError
from gpu_codec.format import TensorRecord
from gpu_codec.payload import Payload

from .common import BACKENDS, use_backend

CODE = {"float32": DT_F32, "float16": DT_F16, "bfloat16": DT_BF16, "float64": DT_F64}
# uneven sizes with empty and one-element tensors, dtypes interleaved (each dtype's tensors adjacent in its region)
SHAPES = [(300, 7), (0,), (1,), (5000,), (3, 3), (64, 65), (2,), (12000,), (0, 4), (999,), (17, 3, 2), (4096,)]
DTYPES = ["float32", "float16", "float32", "float64", "bfloat16", "float32", "float16", "float32", "float64"] * 2


def _update(kind: str = "torch", seed: int = 0) -> tuple[dict, dict, dict]:
    """(new, base, base as stored: uint16 bits for bf16) of uneven tensors of every dtype, as torch tensors (or as
    NumPy arrays, float32 in place of bf16)."""
    rng = np.random.default_rng(seed)
    new, base, stored = {}, {}, {}
    for i, shape in enumerate(SHAPES):
        dt = DTYPES[i] if kind == "torch" or DTYPES[i] != "bfloat16" else "float32"
        b = rng.standard_normal(shape).astype(np.float32)
        n = b + rng.standard_normal(shape).astype(np.float32)
        name = f"layer{i}.{dt}"
        if kind == "torch":
            tdt = getattr(torch, dt)
            base[name], new[name] = torch.from_numpy(b).to(tdt), torch.from_numpy(n).to(tdt)
            bits = base[name].view(torch.int16) if dt == "bfloat16" else base[name]
            stored[name] = bits.numpy().reshape(-1).view(np.uint16 if dt == "bfloat16" else dt)
        else:
            base[name], new[name] = b.astype(dt), n.astype(dt)
            stored[name] = base[name].reshape(-1)
    return new, base, stored


def _reference(p: Payload, stored: dict) -> dict:
    """Each tensor alone: a copy of its base, then the scatter twin in mode 1."""
    out = {}
    for r in p.tensors:
        o = stored[r.name].copy()
        if r.nnz:
            idx, vals = (CpuBackend().asarray(r.buffers[k]) for k in ("indices", "values"))  # (a GPU's: copied)
            assert CpuBackend().scatter([o], [CODE[r.dtype]], [o.size], [idx], [vals], SCATTER_ADD) is None
        out[r.name] = o
    return out


def _bits(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy().tobytes()
    return np.asarray(x).tobytes()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [None, (1, 1), (40, 40)], ids=["one-batch", "each-alone", "small-batches"])
def test_batches_give_the_bytes_of_each_tensor_alone(backend, batch, kind, monkeypatch):
    if batch is not None:
        monkeypatch.setattr(decode, "BATCH_ENTRIES", batch)
    monkeypatch.setattr(twins, "ONTO_BLOCK", 1000)  # blocks that cut tensors, and tensors that span blocks
    new, base, stored = _update(kind)
    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=0.05)
        want = _reference(p, stored)
        for src in (p, p.to_bytes()):
            out = gpu_codec.decompress(src, base=base)
            assert list(out) == list(want)
            for name, o in out.items():
                assert _bits(o) == want[name].tobytes(), name
                assert type(o) is type(base[name]) and o.shape == base[name].shape and o.dtype == base[name].dtype
    assert any(r.nnz == 0 for r in p.tensors) and sum(r.nnz > 0 for r in p.tensors) > 5


def test_outputs_are_views_of_one_allocation():
    new, base, _ = _update("numpy")
    out = gpu_codec.decompress(gpu_codec.compress(new, base, fraction=0.05).to_bytes(), base=base)
    owners = set()
    for o in out.values():
        while o.base is not None:
            o = o.base
        owners.add(id(o))
    assert len(owners) == 1
    assert not any(np.shares_memory(out[k], base[k]) for k in base)


def test_torch_outputs_are_cut_from_one_tensor_a_dtype(monkeypatch):
    """Onto torch bases, each dtype's region of the one allocation becomes one torch tensor, cut by torch.split:
    the outputs of a dtype share its storage, and no tensor goes through from_backend alone."""
    new, base, _ = _update("torch")
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    alone = []
    real = decode.from_backend
    monkeypatch.setattr(decode, "from_backend", lambda *a, **k: alone.append(a[2]) or real(*a, **k))
    out = gpu_codec.decompress(blob, base=base)
    storages: dict = {}
    for o in out.values():
        storages.setdefault(o.dtype, set()).add(o.untyped_storage().data_ptr())
    assert set(storages) == {torch.float32, torch.float16, torch.bfloat16, torch.float64}
    assert all(len(s) == 1 for s in storages.values())
    sizes = {}
    for o in out.values():
        sizes[o.dtype] = sizes.get(o.dtype, 0) + o.numel()
    assert sorted(shape for shape in alone) == sorted((n,) for n in sizes.values())  # one flat region a dtype
    assert all(out[k].shape == base[k].shape and out[k].dtype == base[k].dtype for k in base)


def _payload(new: dict, base: dict) -> Payload:
    return gpu_codec.compress(new, base, fraction=0.05)


def _tamper(p: Payload, name: str, indices=None, values=None) -> Payload:
    recs = []
    for r in p.tensors:
        bufs = dict(r.buffers)
        if r.name == name:
            if indices is not None:
                bufs["indices"] = indices(bufs["indices"].copy(), r.numel)
            if values is not None:
                bufs["values"] = values(bufs["values"].copy())
        recs.append(TensorRecord(r.name, r.dtype, r.shape, r.encoding, r.nnz, bufs))
    return Payload(recs, p.pipeline)


def _past_its_tensor(i, numel):
    i[-1] = numel  # within the batch's span (the next tensor's elements), but past its own tensor
    return i


def _repeated(i, numel):
    i[1] = i[0]
    return i


def _descending(i, numel):
    i[:2] = i[1::-1].copy()
    return i


def _nan(v):
    v[len(v) // 2] = np.nan
    return v


# (on a device backend the tensors of a batch are a run, joined from the buffers as they lie: the same errors)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "indices,values", [(_past_its_tensor, None), (_repeated, None), (_descending, None), (None, _nan)]
)
def test_a_bad_entry_in_a_batch_names_its_tensor(indices, values, backend):
    new, base, _ = _update()
    p = _payload(new, base)
    name = "layer5.float32"  # in the middle of the float32 region, followed by other float32 tensors
    bad = _tamper(p, name, indices, values)
    before = {k: _bits(v) for k, v in base.items()}
    with use_backend(backend):
        for src in (bad, bad.to_bytes()):
            with pytest.raises(PayloadIndexError, match=re.escape(f"tensor '{name}'")):
                gpu_codec.decompress(src, base=base)
    assert {k: _bits(v) for k, v in base.items()} == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_first_bad_tensor_is_named(backend):
    new, base, _ = _update()
    p = _tamper(_tamper(_payload(new, base), "layer7.float32", _repeated), "layer0.float32", values=_nan)
    with use_backend(backend), pytest.raises(PayloadIndexError, match=r"tensor 'layer0\.float32'"):
        gpu_codec.decompress(p.to_bytes(), base=base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflowing_sum_in_a_batch_names_its_tensor(backend):
    base = {f"t{i}": np.full(100, 1.0, np.float16) for i in range(6)}
    new = {k: v.copy() for k, v in base.items()}
    new["t3"][40], new["t3"][:3] = 30000, 5
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    base["t3"][40] = 60000  # 60000 + (30000 - 1) is past fp16's range
    with use_backend(backend), pytest.raises(PayloadValueError, match=r"tensor 't3'.*inf or NaN"):
        gpu_codec.decompress(blob, base=base)
    assert base["t3"][40] == 60000 and (np.delete(base["t3"], 40) == 1).all()


def _outcome(p: Payload, base: dict):
    try:
        return {k: _bits(v) for k, v in gpu_codec.decompress(p, base=base).items()}
    except Exception as e:  # compared, whatever it is
        return type(e), str(e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_and_short_index_buffers_of_a_payload_object(monkeypatch, backend):
    """A Payload made by hand: 64-bit indices of small tensors decode as 32-bit ones; buffers of another length
    than the record's nnz decode as each tensor alone decodes them."""
    new, base, stored = _update()
    p = _payload(new, base)
    want = _reference(p, stored)
    wide = _tamper(p, "layer5.float32", indices=lambda i, n: i.astype(np.uint64))
    with use_backend(backend):
        out = gpu_codec.decompress(wide, base=base)
        assert all(_bits(out[k]) == want[k].tobytes() for k in out)
        for odd in (
            _tamper(p, "layer5.float32", indices=lambda i, n: i[:-1]),
            _tamper(p, "layer5.float32", values=lambda v: v[:-1]),
            _tamper(p, "layer5.float32", indices=lambda i, n: i.astype(np.int64)),
        ):
            batched = _outcome(odd, base)
            with monkeypatch.context() as m:
                m.setattr(decode, "BATCH_ENTRIES", (0, 0))  # every tensor alone (host)
                m.setattr(decode, "SMALL_TENSOR", 0)  # (device: no runs)
                assert _outcome(odd, base) == batched


@pytest.mark.parametrize("chunk", [None, 16], ids=["few-chunks", "many-chunks"])
def test_scatter_onto_bases_twin_and_default_agree(chunk, monkeypatch):
    """The NumPy backend's one pass and the default (gather_copy, then scatter) give the same bytes and verdicts,
    with the entries checked in this thread (a few chunks) or on the pool (many)."""
    if chunk is not None:
        monkeypatch.setattr(twins, "SCATTER_CHUNK", chunk)
    from gpu_codec.backends.decode import ArrayDecoders

    class Split(CpuBackend):  # the default composition over the NumPy backend's own ops
        scatter_onto_bases = ArrayDecoders.scatter_onto_bases

    rng = np.random.default_rng(5)
    sizes = [0, 3, 700, 1, 2500, 0, 40]
    for dt, store in ((DT_F32, np.float32), (DT_F16, np.float16), (DT_F64, np.float64)):
        bases = [rng.standard_normal(n).astype(store) for n in sizes]
        total = sum(sizes)
        idx = np.sort(rng.choice(total, 300, replace=False)).astype(np.uint32)
        vals = rng.standard_normal(300).astype(np.float64 if dt == DT_F64 else np.float32)
        a, b = np.empty(total, store), np.empty(total, store)
        assert CpuBackend().scatter_onto_bases(a, bases, dt, idx, vals) == (None, True)
        assert Split().scatter_onto_bases(b, bases, dt, idx, vals) == (None, True)
        assert a.tobytes() == b.tobytes() == _concat_scatter(bases, dt, idx, vals).tobytes()
        vals[250] = np.inf
        assert twins.scatter_onto_bases(a, bases, dt, idx, vals)[0] == 250
        idx[101] = idx[100]  # the lowest bad entry, whatever chunk each lies in
        assert twins.scatter_onto_bases(a, bases, dt, idx, vals)[0] == 101
    with pytest.raises(ValueError, match="hold 3 elements"):
        twins.scatter_onto_bases(np.empty(4, np.float32), [np.ones(3, np.float32)], DT_F32, idx[:0], vals[:0])


def _concat_scatter(bases, dt, idx, vals):
    out = np.concatenate(bases)
    assert CpuBackend().scatter([out], [dt], [out.size], [idx], [vals], SCATTER_ADD) is None
    return out


@pytest.mark.parametrize("itype", [np.uint32, np.uint64])
def test_an_index_that_wraps_past_the_span_is_refused(itype):
    """Tensor b's first index, added to b's start in the batch's span, wraps (32 bits) to a place in tensor a:
    the entries would ascend there, so each tensor's indices are checked before they are placed."""
    base = {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)}
    pipeline = gpu_codec.compress(base, fraction=0.5).pipeline
    one = np.ones(2, np.float32)

    def rec(name, idx):
        return TensorRecord(
            name, "float32", (100,), "coo", len(idx), {"indices": np.asarray(idx, itype), "values": one[: len(idx)]}
        )

    p = Payload([rec("a", [10]), rec("b", [(1 << 32) - 100 + 20, 5])], pipeline)
    for src in (p, p.to_bytes()):
        with pytest.raises(PayloadIndexError, match="tensor 'b'"):
            gpu_codec.decompress(src, base=base)


def test_a_joined_run_past_2_to_the_32_elements_places_its_entries_in_64_bits():
    """A device run's span has no element bound (only its entries are), so tensors after the 2^32-th element of a
    run are placed with 64-bit positions: 32-bit ones would wrap onto the first tensor."""
    big = (1 << 32) + 10
    idx = [np.array([3, big - 1], np.uint64), np.array([0, 7], np.uint32)]
    vals = [np.ones(2, np.float32), np.full(2, 2, np.float32)]
    gi, v, counts, ok = decode.join_entries(idx, vals, [big, 8], [5, 5 + big, 13 + big], CpuBackend(), True)
    assert bool(ok) and counts == [2, 2] and gi.dtype == np.uint64
    assert gi.tolist() == [3, big - 1, big, big + 7] and v.tolist() == [1, 1, 2, 2]
    idx[0] = np.array([3, 9], np.uint32)  # (32-bit indices, a wide span)
    gi, _, _, ok = decode.join_entries(idx, vals, [big, 8], [5, 5 + big, 13 + big], CpuBackend(), True)
    assert bool(ok) and gi.dtype == np.uint64 and gi.tolist() == [3, 9, big, big + 7]


def _run_update(seed: int = 4) -> tuple[dict, dict]:
    """Small float32 tensors in a row (one run on a device backend), with an empty one among them."""
    rng = np.random.default_rng(seed)
    sizes = [700, 33, 0, 1200, 5, 980, 64, 2500]
    base = {f"r{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    return {k: v + rng.standard_normal(v.size).astype(np.float32) for k, v in base.items()}, base


def _device(onto: bool):
    """A device backend: the GPU path's code on the emulator (the recording backend, outside a recording) onto a
    base; the emulated backend for deltas."""
    from gpu_codec.backends import using_backend
    from gpu_codec.backends.emulated import EmulatorRunner
    from gpu_codec.testing.recording import RecordingBackend

    return using_backend(RecordingBackend(EmulatorRunner())) if onto else use_backend("emulated")


@pytest.mark.parametrize("onto", [True, False], ids=["onto-base", "delta"])
@pytest.mark.parametrize("flaw", [None, _past_its_tensor, _repeated, _descending, "nan"])
def test_a_device_run_read_from_bytes_joins_the_buffers_as_they_lie(flaw, onto, monkeypatch):
    """A plain payload read from bytes, on a device backend: a run of small tensors is joined straight from the
    records' buffers (no decoder per tensor), with the bytes of each tensor decoded alone and of the NumPy
    backend, and a bad entry's error names its tensor."""
    pytest.importorskip("gpu_codec.backends.emulated")
    new, base = _run_update()
    p = _payload(new, base)
    if flaw == "nan":
        p = _tamper(p, "r3", values=_nan)
    elif flaw is not None:
        p = _tamper(p, "r3", indices=flaw)
    blob = p.to_bytes()
    on = base if onto else None
    joins = []
    real = decode.join_entries
    monkeypatch.setattr(decode, "join_entries", lambda *a: joins.append(len(a[0])) or real(*a))
    with _device(onto):
        got = _outcome(Payload.from_bytes(blob), on)
        assert joins and max(joins) == len(base)  # (every tensor in one run)
        with monkeypatch.context() as m:
            m.setattr(decode, "SMALL_TENSOR", 0)  # each tensor alone
            assert _outcome(Payload.from_bytes(blob), on) == got
    if flaw is None:
        with use_backend("cpu"):
            assert got == _outcome(Payload.from_bytes(blob), on)
    else:
        assert got[0] is PayloadIndexError and "tensor 'r3'" in got[1], got


@pytest.mark.parametrize("onto", [True, False], ids=["onto-base", "delta"])
def test_numpy_outputs_of_a_device_decode_are_copied_once_a_region(onto, monkeypatch):
    """A device decode asked for NumPy outputs copies each storage dtype's region to the host once, not each tensor
    (the host would wait for every copy), and gives the NumPy backend's bytes in plain host arrays."""
    pytest.importorskip("gpu_codec.backends.emulated")
    from gpu_codec.backends import using_backend
    from gpu_codec.backends.emulated import EmulatorRunner
    from gpu_codec.testing.recording import DeviceArray, RecordingBackend

    rng = np.random.default_rng(8)
    base = {
        f"t{i}": rng.standard_normal(50 + 37 * i).astype(np.float64 if i % 7 == 3 else np.float32) for i in range(30)
    }
    new = {k: v + rng.standard_normal(v.size).astype(v.dtype) for k, v in base.items()}
    blob = gpu_codec.compress(new, base, fraction=0.05).to_bytes()
    on = base if onto else None
    with use_backend("cpu"):
        want = {k: _bits(v) for k, v in gpu_codec.decompress(blob, base=on).items()}
    device = RecordingBackend(EmulatorRunner())
    copies = []
    real = device.to_host
    monkeypatch.setattr(device, "to_host", lambda a: copies.append(a.size) or real(a))
    monkeypatch.setattr(decode, "is_device_array", lambda a: isinstance(a, DeviceArray))  # (stands for CuPy's)
    with using_backend(device):
        out = gpu_codec.decompress(blob, base=on)
    assert {k: _bits(v) for k, v in out.items()} == want
    assert all(type(v) is np.ndarray for v in out.values())
    assert len(copies) == 2 and sum(copies) == sum(v.size for v in base.values())  # (fp32 and fp64)
