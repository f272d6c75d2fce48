"""A selection's outputs as shared arrays: records hold ranges of them (SegmentBuffers), no array is made per tensor
until one is read, and the writer copies each shared array off the device once."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends import using_backend
from gpu_codec.backends.cpu import CpuBackend
from gpu_codec.format import v2
from gpu_codec.format.common import SegmentBuffers, Segmented, SegmentPart


def _update(nt=40, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 3000, nt)
    new = {f"t{i}": rng.standard_normal(int(n)).astype(np.float32) for i, n in enumerate(sizes)}
    new["f64"] = rng.standard_normal(500)  # float64: its values come from the second shared array
    base = {k: np.zeros_like(v) for k, v in new.items()}
    return new, base


def test_kernel_path_records_are_lazy_and_write_the_cpu_bytes(emulated_backend):
    new, base = _update()
    with using_backend(emulated_backend):
        p = gpu_codec.compress(new, base, fraction=0.02)
        assert all(type(r.buffers) is SegmentBuffers and r.buffers._made is None for r in p.tensors)
        blob = p.to_bytes()
        assert all(r.buffers._made is None for r in p.tensors)  # the writer took ranges, not slices
        assert p.nbytes == len(blob)
    with using_backend(CpuBackend()):
        assert gpu_codec.compress(new, base, fraction=0.02).to_bytes() == blob
    # reading a record's buffers slices them, with the dtypes and sizes the record declares
    r = p.tensors[-1]
    assert r.name == "f64" and r.buffers["values"].dtype == np.float64 and r.buffers["values"].size == r.nnz
    assert r.buffers["indices"] is r.buffers["indices"]  # sliced once
    out = gpu_codec.decompress(blob, base=base)
    got = gpu_codec.decompress(p, base=base)
    assert all(np.array_equal(out[k], got[k]) for k in new)


def test_segmented_reads_like_the_list_it_stands_for():
    s = Segmented((np.arange(6), np.arange(6) * 10.0), [0, 2, 2, 6], which=[0, 1, 0])
    assert [a.tolist() for a in s] == [[0, 1], [], [2, 3, 4, 5]]
    assert s[-2].dtype == np.float64 and [a.tolist() for a in s[1:]] == [[], [2, 3, 4, 5]]
    assert [a.tolist() for a in s + [np.array([9])]][-1] == [9]
    assert len([np.array([9])] + s) == 4
    with pytest.raises(IndexError):
        s[3]


class _DeviceArray(np.ndarray):
    """An array standing for CuPy's (the writer tells device arrays by their module)."""


_DeviceArray.__module__ = "cupy._core.core"


def _fake_cupy(copies: list):
    def asnumpy(a):
        copies.append(int(a.nbytes))
        return np.array(a).view(np.ndarray)

    def dev(f):
        return lambda *a, **k: np.asarray(f(*a, **k)).view(_DeviceArray)

    return types.SimpleNamespace(
        asnumpy=asnumpy,
        asarray=dev(np.asarray),
        ascontiguousarray=dev(np.ascontiguousarray),
        concatenate=dev(np.concatenate),
        uint8=np.uint8,
    )


def test_device_gather_copies_each_shared_array_once(monkeypatch):
    copies: list[int] = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(copies))
    idx = np.arange(100, dtype=np.uint32).view(_DeviceArray)
    vals = (np.arange(100, dtype=np.float32) / 7).view(_DeviceArray)
    loose = np.full(5, 3.5, np.float64).view(_DeviceArray)
    parts = [
        SegmentPart(idx, 10, 30),
        SegmentPart(vals, 10, 30),
        b"head",
        loose,
        SegmentPart(idx, 40, 40),  # empty
        SegmentPart(idx, 60, 90),
        SegmentPart(vals, 60, 90),
        np.array([1, 2], np.uint16),
    ]
    want = b"".join(
        np.asarray(p.source)[p.start : p.stop].tobytes()
        if type(p) is SegmentPart
        else bytes(np.asarray(p).data)
        if not isinstance(p, bytes)
        else p
        for p in parts
    )
    got = v2._gather(parts, len(want))
    assert got == want
    # one copy per shared array (only the range the parts cover: 10..90) and one of the loose device arrays
    assert sorted(copies) == sorted([80 * 4, 80 * 4, 5 * 8])


@pytest.fixture
def emulated_backend():
    from gpu_codec.backends.emulated import EmulatedBackend

    return EmulatedBackend()
