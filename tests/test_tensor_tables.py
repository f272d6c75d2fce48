"""Tables of tensors wrapped and checked at once: torch CUDA tensors as CuPy views (arrays.device_views), the
base's inf/NaN check in packs (xp.finite.first_nonfinite)."""

from __future__ import annotations

import types

import numpy as np
import pytest

import gpu_codec
from gpu_codec.arrays import device_views, torch_tensors
from gpu_codec.constants import DT_BF16, DT_F16, DT_F32
from gpu_codec.xp import finite
from tests.common import HAS_GPU, use_backend


def _stand_in_cupy():
    """What device_views uses of CuPy, recording its arguments (CuPy's own signatures)."""
    made = []

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.offset = mem, offset

    class ndarray:  # (CuPy's name)
        def __init__(self, shape, dtype, memptr=None):
            self.shape, self.dtype, self.memptr = shape, np.dtype(dtype), memptr
            made.append(self)

    cuda = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer)
    return types.SimpleNamespace(cuda=cuda, ndarray=ndarray), made


def test_device_views_cover_each_owner_memory_exactly():
    cupy, made = _stand_in_cupy()
    owners = [object(), object(), object()]
    views = device_views(cupy, [4096, 0, 8192], [10, 0, 3], [np.float32, np.uint16, np.float64], owners, 2)
    assert views == made and [v.shape for v in views] == [(10,), (0,), (3,)]
    assert [v.dtype.name for v in views] == ["float32", "uint16", "float64"]
    m0, m2 = views[0].memptr, views[2].memptr
    assert (m0.mem.ptr, m0.mem.size, m0.mem.owner, m0.mem.device_id, m0.offset) == (4096, 40, owners[0], 2, 0)
    assert (m2.mem.ptr, m2.mem.size, m2.mem.owner) == (8192, 24, owners[2])
    assert views[1].memptr is None  # (an empty tensor: its own empty array, whatever its address)


def _naive_first(arrays, dts):
    for i, (a, dt) in enumerate(zip(arrays, dts)):
        if not finite.all_finite(a, dt):
            return i
    return None


@pytest.mark.parametrize("seed", range(6))
def test_first_nonfinite_in_packs_names_the_first_bad_tensor(monkeypatch, seed):
    """Tensors alone and in packs (small limits, so that packs fill and close), of three dtypes, with inf or NaN
    in none, one or several: the same tensor as a check of each in turn, and one read-back where none is bad."""
    monkeypatch.setattr(finite, "PACK_ALONE", 64)
    monkeypatch.setattr(finite, "PACK_MAX", 100)
    rng = np.random.default_rng(seed)
    storage = {DT_F32: np.float32, DT_F16: np.float16, DT_BF16: np.uint16}
    dts = [int(rng.choice([DT_F32, DT_F16, DT_BF16])) for _ in range(40)]
    arrays = []
    for dt in dts:
        n = int(rng.choice([0, 1, 7, 30, 63, 64, 90]))
        a = rng.standard_normal(n).astype(np.float32)
        arrays.append((a.view(np.uint32) >> 16).astype(np.uint16) if dt == DT_BF16 else a.astype(storage[dt]))
    reads = []

    def to_host(a):
        reads.append(a)
        return np.asarray(a)

    assert finite.first_nonfinite(arrays, dts, np, to_host) is None and len(reads) == 1
    for _ in range(4):
        i = int(rng.integers(len(arrays)))
        if arrays[i].size:
            arrays[i][int(rng.integers(arrays[i].size))] = 0x7F80 if dts[i] == DT_BF16 else rng.choice([np.inf, np.nan])
        assert finite.first_nonfinite(arrays, dts) == _naive_first(arrays, dts)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_torch_cuda_tables_are_views_of_the_tensors_and_give_the_cpu_bytes():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (), (0,), (700,), (8, 2)]
    base = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    base["h"] = torch.randn(33, generator=g).to(torch.bfloat16)
    new = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in base.items()}
    dev_new, dev_base = ({k: v.cuda() for k, v in d.items()} for d in (new, base))
    table = torch_tensors(list(dev_new.values()))
    assert table is not None
    for t, x in zip(table, dev_new.values()):
        assert t.shape == tuple(x.shape) and (x.numel() == 0 or t.data.data.ptr == x.data_ptr())
    with use_backend("cpu"):
        want = gpu_codec.compress(new, base, fraction=0.3).to_bytes()
        want_out = gpu_codec.decompress(want, base=base)
    with use_backend("gpu"):
        got = gpu_codec.compress(dev_new, dev_base, fraction=0.3).to_bytes()
        out = gpu_codec.decompress(got, base=dev_base)
        agg = gpu_codec.Aggregator(base=dev_base)
        agg.add(got)
    assert got == want
    for k, v in want_out.items():
        assert out[k].shape == v.shape and torch.equal(out[k].cpu(), v)
    dev_base["t3"][5] = float("nan")
    with use_backend("gpu"), pytest.raises(gpu_codec.errors.InvalidInputError, match=r"'t3'.*inf or NaN"):
        gpu_codec.Aggregator(base=dev_base)


@pytest.mark.parametrize(
    ("segments", "ok"),
    [
        ([[0, 1], [2]], True),
        ([[0, 1], [], [2]], True),
        ([[0, 1, 2]], True),
        ([[1, 0], [2]], False),  # (not in order within a segment)
        ([[0], [2], [1]], False),  # (segments out of order)
        ([[0, 2], [1]], False),  # (not a run)
        ([[0, 1]], False),  # (a tensor in no segment)
        ([[0, 1], [1, 2]], False),  # (a tensor in two)
    ],
)
def test_segments_must_be_runs_covering_the_tensors_in_order(segments, ok):
    """The kernels' selection takes segments that are consecutive runs of tensors 0..n-1, in order (the chunk scan
    ranks ties in launch order); anything else is refused before a launch."""
    from gpu_codec.backends.kernels import _check_segments

    if ok:
        _check_segments(segments, 3)
    else:
        with pytest.raises(ValueError, match="consecutive runs"):
            _check_segments(segments, 3)
