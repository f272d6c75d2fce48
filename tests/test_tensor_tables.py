"""Tables of tensors wrapped and checked at once: torch CUDA tensors given by address (backends.base.DeviceViews), the
base's inf/NaN check in packs (xp.finite.first_nonfinite)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_codec
from gpu_codec.arrays import torch_tensors
from gpu_codec.backends.base import DeviceViews, sizes_of
from gpu_codec.constants import DT_BF16, DT_F16, DT_F32
from gpu_codec.xp import finite
from tests.common import HAS_EMULATOR, HAS_GPU, use_backend


def _stand_in_cupy():
    """What DeviceViews uses of CuPy, recording its arguments (CuPy's own signatures)."""
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
    views = DeviceViews(cupy, [4096, 0, 8192], [10, 0, 3], [np.float32, np.uint16, np.float64], owners, [2, 2, 2])
    assert made == [] and views.numels == [10, 0, 3]  # (nothing made until an item is read)
    assert views[2] is views[2] and len(made) == 1  # (an item made once)
    assert list(views) == [made[1], made[2], made[0]]  # (in order, the others made as they are read)
    assert len(made) == 3 and [v.shape for v in views] == [(10,), (0,), (3,)]
    assert [v.dtype.name for v in views] == ["float32", "uint16", "float64"]
    m0, m2 = views[0].memptr, views[2].memptr
    assert (m0.mem.ptr, m0.mem.size, m0.mem.owner, m0.mem.device_id, m0.offset) == (4096, 40, owners[0], 2, 0)
    assert (m2.mem.ptr, m2.mem.size, m2.mem.owner) == (8192, 24, owners[2])
    assert views[1].memptr is None  # (an empty tensor: its own empty array, whatever its address)
    with pytest.raises(IndexError):
        views[3]


def test_device_views_slices_and_sums_stay_columns():
    cupy, made = _stand_in_cupy()
    a = DeviceViews(cupy, [64, 128], [1, 2], [np.float32, np.float16], ["o1", "o2"], [0, 0])
    b = DeviceViews(cupy, [256], [3], [np.float64], ["o3"], [0])
    s = a + b
    assert type(s) is DeviceViews and (s.ptrs, s.numels, s.owners) == ([64, 128, 256], [1, 2, 3], ["o1", "o2", "o3"])
    assert type(s[1:]) is DeviceViews and s[1:].ptrs == [128, 256] and s[::-1].numels == [3, 2, 1]
    assert sizes_of(s) == [1, 2, 3] and made == []
    mixed = a + [None]  # (with a list: a list of the arrays)
    assert type(mixed) is list and mixed[2] is None and mixed[:2] == [a[0], a[1]]
    assert ([None] + b) == [None, b[0]]


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(0, 9), max_size=12),
    index=st.integers(-14, 14),
    cut=st.tuples(
        st.none() | st.integers(-14, 14), st.none() | st.integers(-14, 14), st.sampled_from([None, 1, 2, -1])
    ),
    picks=st.lists(st.integers(0, 11), max_size=6),
)
def test_device_views_read_as_the_list_of_their_arrays(numels, index, cut, picks):
    """Indexing, slicing, picking, summing and iterating a DeviceViews give what the list of its arrays gives (each
    array made once), without making an array for anything but a read item."""
    cupy, made = _stand_in_cupy()
    ptrs = [4096 * (i + 1) for i in range(len(numels))]
    views = DeviceViews(cupy, ptrs, numels, [np.float32] * len(numels), list(range(len(numels))), [0] * len(numels))
    want = [(p if n else None, n) for p, n in zip(ptrs, numels)]  # (address, size) of each item

    def seen(a):
        return (a.memptr.mem.ptr if a.memptr is not None else None, a.shape[0])

    part = views[slice(*cut)]
    assert type(part) is DeviceViews and list(zip(part.ptrs, part.numels)) == list(zip(ptrs, numels))[slice(*cut)]
    picked = views.pick([i for i in picks if i < len(numels)])
    assert picked.numels == [numels[i] for i in picks if i < len(numels)]
    both = views + part
    assert type(both) is DeviceViews and both.numels == numels + part.numels and made == []
    if -len(numels) <= index < len(numels):
        assert seen(views[index]) == want[index] and len(made) == 1
    else:
        with pytest.raises(IndexError):
            views[index]
    items = list(views)
    assert [seen(a) for a in items] == want and len(made) == len(numels)
    assert list(views) == items and len(made) == len(numels)  # (made once)
    assert views + [None] == items + [None] and [None] + views == [None] + items


def test_kernel_ops_read_device_views_addresses_without_arrays():
    """The kernel backends' address table of a DeviceViews is its ptrs column (0 for an empty tensor, as an
    empty array's address reads), and the backend hands it on as it is: no array made."""
    from gpu_codec.backends.kernels import KernelOps

    cupy, made = _stand_in_cupy()
    runner = types.SimpleNamespace(xp=np, ptr=lambda a: 1 / 0, ptrs=lambda arrays: 1 / 0)
    ops = KernelOps(runner)
    views = DeviceViews(cupy, [4096, 777, 8192], [10, 0, 3], [np.float32] * 3, [None] * 3, [0] * 3)
    for skip in (False, True):
        got = ops._ptrs(views, skip_empty=skip)
        assert got.dtype == np.uint64 and got.tolist() == [4096, 0, 8192]
    assert made == []


def _host_cupy(made: list):
    """CuPy's names that DeviceViews uses, over host memory: an item is made as a NumPy array over the memory at its
    address (what the emulated kernels read, as the GPU's read a CUDA tensor's), its shape noted in ``made``."""
    import ctypes

    def ndarray(shape, dtype, memptr=None):
        made.append(shape)
        if memptr is None:
            return np.empty(shape, dtype)
        return np.frombuffer((ctypes.c_char * memptr.mem.size).from_address(memptr.mem.ptr), dtype)

    cupy, _ = _stand_in_cupy()
    cupy.ndarray = ndarray
    return cupy


def test_device_views_over_memory_read_twice_are_the_same_arrays():
    """Items made over real memory (NumPy arrays, which compare element by element) are made once: a second pass,
    whole or by index, gives the very arrays of the first."""
    xs = [np.arange(5, dtype=np.float32), np.zeros(0, np.float16), np.ones(3)]
    made: list = []
    views = DeviceViews(
        _host_cupy(made), [a.ctypes.data for a in xs], [3, 0, 2], [a.dtype.type for a in xs], xs, [0] * 3
    )
    first = views[0]
    assert first.tolist() == [0.0, 1.0, 2.0] and len(made) == 1
    whole = list(views)
    assert whole[0] is first and len(made) == 3 and [a.tolist() for a in whole] == [[0, 1, 2], [], [1.0, 1.0]]
    again = list(views)
    assert all(a is b for a, b in zip(again, whole)) and views[2] is whole[2] and len(made) == 3


def _tables_by_address(monkeypatch) -> tuple[list, list]:
    """Every NumPy table the engine wraps given by address from now on, as torch CUDA tensors are to the GPU
    backend (items made over host memory, :func:`_host_cupy`): the shapes of the items made, and the tables."""
    import gpu_codec.arrays as arrays_mod

    made: list = []
    cupy, tables, plain = _host_cupy(made), [], arrays_mod.numpy_tensors

    def by_address(xs):
        table = plain(xs)
        if table is not None:
            xs = table.data
            cols = [a.ctypes.data for a in xs], [a.size for a in xs], [a.dtype.type for a in xs]
            table.data = DeviceViews(cupy, *cols, list(xs), [0] * len(xs))
            tables.append(table.data)
        return table

    monkeypatch.setattr(arrays_mod, "numpy_tensors", by_address)
    return made, tables


@pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")
def test_aggregator_checks_a_base_given_by_address_without_its_arrays(monkeypatch):
    """Aggregator(base)'s inf/NaN check of a base given by address joins its small tensors by their addresses (one
    gather a pack): no array made for a tensor of a pack; a NaN is still found and named, and the mean is the
    arrays'."""
    rng = np.random.default_rng(8)
    sizes_dts = [(300, np.float32), (41, np.float16), (7, np.float64), (1000, np.float32), (5, np.float16)]
    base = {f"t{i}": rng.standard_normal(n).astype(dt) for i, (n, dt) in enumerate(sizes_dts)}
    new = {k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}
    bad = dict(base, t3=base["t3"].copy())
    bad["t3"][17] = np.nan
    with use_backend("emulated"):
        blob = gpu_codec.compress(new, base, fraction=0.1).to_bytes()
        agg = gpu_codec.Aggregator(base=base)
        agg.add(blob)
        want = agg.result()
        made, tables = _tables_by_address(monkeypatch)
        agg = gpu_codec.Aggregator(base=base)
        assert len(tables) == 1 and made == [(7,)]  # (the one float64 tensor, checked alone: its array made)
        agg.add(blob)
        got = agg.result()
        with pytest.raises(gpu_codec.errors.InvalidInputError, match=r"'t3'.*inf or NaN"):
            gpu_codec.Aggregator(base=bad)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


@pytest.mark.skipif(not HAS_EMULATOR, reason="no C++20 compiler")
def test_tables_given_by_address_give_the_same_bytes_and_compress_makes_no_array(monkeypatch):
    """Every table the engine wraps given by address (as a model's CUDA tensors are), on the emulated backend: the
    payloads (global, per-tensor, error feedback), decompress onto the base and an aggregate equal the arrays'; a
    compress reads only addresses and sizes (no array made)."""
    rng = np.random.default_rng(3)
    shapes = [(3, 5), (), (0,), (300,), (8, 2), (41,)]
    dts = [np.float32, np.float32, np.float16, np.float32, np.float64, np.float16]
    base = {f"t{i}": rng.standard_normal(s).astype(dt) for i, (s, dt) in enumerate(zip(shapes, dts))}
    new = {k: (v + rng.standard_normal(v.shape).astype(v.dtype)).astype(v.dtype) for k, v in base.items()}

    def run():
        out = {}
        for scope in ("global", "per_tensor"):
            out[scope] = gpu_codec.compress(new, base, fraction=0.2, scope=scope).to_bytes()
        ef = gpu_codec.ErrorFeedback()
        out["ef"] = [gpu_codec.compress(new, base, fraction=0.1, residual=ef).to_bytes() for _ in range(2)]
        out["onto"] = gpu_codec.decompress(out["global"], base=base)
        agg = gpu_codec.Aggregator(base=base)
        agg.add(out["global"])
        agg.add(out["per_tensor"])
        out["mean"] = agg.result()
        return out

    with use_backend("emulated"):
        want = run()
        made, tables = _tables_by_address(monkeypatch)
        full = [k for k, v in new.items() if v.size]  # (an empty tensor takes the checks a tensor at a time)
        got = gpu_codec.compress({k: new[k] for k in full}, {k: base[k] for k in full}, fraction=0.2).to_bytes()
        assert len(tables) == 2 and all(type(t) is DeviceViews for t in tables) and made == []
        got_all = run()
    with use_backend("emulated"):
        assert got == gpu_codec.compress({k: new[k] for k in full}, {k: base[k] for k in full}, fraction=0.2).to_bytes()
    for key in ("global", "per_tensor", "ef"):
        assert got_all[key] == want[key], key
    for key in ("onto", "mean"):
        assert want[key].keys() == got_all[key].keys()
        for k, v in want[key].items():
            assert got_all[key][k].dtype == v.dtype and np.array_equal(got_all[key][k], v, equal_nan=True), (key, k)


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


def _cupy_over(shapes_dtypes: list, device_id: int = 0) -> list:
    """CuPy arrays over device addresses nothing reads (CuPy makes them without a device)."""
    cupy = pytest.importorskip("cupy")
    out, addr = [], 1 << 40
    for shape, dt in shapes_dtypes:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        mem = cupy.cuda.UnownedMemory(addr, max(nbytes, 1), None, device_id)
        out.append(cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0)))
        addr += (nbytes + 511) // 512 * 512
    return out


def test_cupy_tables_are_given_by_address_as_to_tensor_wraps_each():
    """CuPy arrays (C-contiguous floats on one device) as a table of addresses: every column as to_tensor gives it
    tensor by tensor, and no CuPy array made; anything else is left to to_tensor."""
    from gpu_codec.arrays import cupy_tensors, tensor_table, to_tensor

    xs = _cupy_over([((3, 5), np.float32), ((), np.float64), ((7,), np.float16), ((2, 2, 2), np.float32)], 1)
    table = tensor_table(xs)
    assert table is not None and type(table.data) is DeviceViews and table.data._made is None
    one = [to_tensor(x, f"t{i}") for i, x in enumerate(xs)]
    assert table.dtypes == [t.dtype for t in one] and table.shapes == [t.shape for t in one]
    assert table.kinds == ["cupy"] * 4 and table.devices == [t.device for t in one] == [1] * 4
    assert table.data.ptrs == [t.data.data.ptr for t in one] and table.sizes() == [15, 1, 7, 8]
    assert [a.data.ptr for a in table.data] == table.data.ptrs and table.data[2].dtype == np.float16
    assert cupy_tensors([xs[0], xs[0].T]) is None  # (not contiguous)
    assert cupy_tensors(xs[:1] + _cupy_over([((4,), np.float32)], 0)) is None  # (two devices)
    assert cupy_tensors(xs[:1] + _cupy_over([((4,), np.int32)])) is None  # (not a float)
    assert cupy_tensors([xs[0], np.zeros(3, np.float32)]) is None  # (two kinds)


def test_cupy_inputs_take_the_table_checks_of_the_whole_update():
    """compress's checks of a CuPy update and base read them as two tables (no tensor wrapped one by one), and
    refuse a base whose shape differs as the tensor-by-tensor checks do."""
    from gpu_codec import encode

    xs = _cupy_over([((3, 5), np.float32), ((40,), np.float32)])
    ys = _cupy_over([((3, 5), np.float32), ((40,), np.float32)])
    names, news, bases = encode._check_tensors(dict(zip("ab", xs)), dict(zip("ab", ys)))
    assert names == ["a", "b"] and type(news.data) is DeviceViews and type(bases.data) is DeviceViews
    assert bases.data.ptrs == [y.data.ptr for y in ys] and news.data._made is None
    zs = _cupy_over([((5, 3), np.float32), ((40,), np.float32)])
    with pytest.raises(gpu_codec.errors.InvalidInputError, match=r"'a'.*shape \(3, 5\) differs"):
        encode._check_tensors(dict(zip("ab", xs)), dict(zip("ab", zs)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_cupy_inputs_give_the_cpu_bytes_and_outputs():
    """CuPy update and base (given by address): the CPU backend's payloads, decompress onto the base and mean."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    shapes = [(3, 5), (), (700,), (8, 2)]
    base = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    base["h"] = rng.standard_normal(33).astype(np.float16)
    new = {k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}
    dev_new, dev_base = ({k: cupy.asarray(v) for k, v in d.items()} for d in (new, base))
    with use_backend("cpu"):
        want = [gpu_codec.compress(new, base, fraction=0.3, scope=s).to_bytes() for s in ("global", "per_tensor")]
        want_out = gpu_codec.decompress(want[0], base=base)
    with use_backend("gpu"):
        got = [
            gpu_codec.compress(dev_new, dev_base, fraction=0.3, scope=s).to_bytes() for s in ("global", "per_tensor")
        ]
        out = gpu_codec.decompress(got[0], base=dev_base)
        agg = gpu_codec.Aggregator(base=dev_base)
        agg.add(got[0])
        mean = agg.result()
    assert got == want
    for k, v in want_out.items():
        assert type(out[k]) is cupy.ndarray and np.array_equal(out[k].get(), v)
        assert np.array_equal(cupy.asnumpy(mean[k]), v)


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_torch_cuda_compress_reads_the_tensors_addresses_only(monkeypatch):
    """A compress of torch CUDA tensors (global, per-tensor, with error feedback) makes no CuPy array of the update
    or the base: the kernels read their addresses and sizes. Its bytes are the CPU's."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (), (700,), (8, 2), (40, 3)]
    base = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    base["h"] = torch.randn(33, generator=g).to(torch.bfloat16)
    base["f"] = torch.randn(65, generator=g).to(torch.float16)
    new = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in base.items()}
    dev_new, dev_base = ({k: v.cuda() for k, v in d.items()} for d in (new, base))
    assert type(torch_tensors(list(dev_new.values())).data) is DeviceViews
    made, make = [], DeviceViews._made_all
    monkeypatch.setattr(DeviceViews, "_made_all", lambda self, which: made.extend(which) or make(self, which))

    def run(n, b):
        out = [gpu_codec.compress(n, b, fraction=0.3, scope=s).to_bytes() for s in ("global", "per_tensor")]
        ef = gpu_codec.ErrorFeedback()
        return out + [gpu_codec.compress(n, b, fraction=0.1, residual=ef).to_bytes() for _ in range(2)]

    with use_backend("gpu"):
        got = run(dev_new, dev_base)
    assert made == []
    with use_backend("cpu"):
        assert got == run(new, base)


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
