"""benchmarks/bench_device_views.py: its rows, its baseline and its refusal to overwrite results."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("cupy")

from benchmarks import bench_device_views as b


def test_rows_time_every_op_against_the_wrapping_loop(tmp_path):
    out = tmp_path / "dv.json"
    assert b.main(["--tensors", "3", "40", "--elements", "5000", "--repeat", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["tensors"] for r in doc["rows"]] == [3, 40] and doc["machine"]["simd"]
    for r in doc["rows"]:
        assert r["x_wrap"] == 1.0 and all(r[f"{op}_ms"] > 0 for op in b.OPS + b.CUPY_OPS)
        assert r["x_cupy_table"] == r["cupy_table_ms"] / r["cupy_each_ms"]
    assert "| 40 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # (an existing result is kept unless --force)
        b.main(["--tensors", "3", "--elements", "5000", "--repeat", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == doc


def test_the_baseline_makes_the_arrays_the_table_makes():
    import cupy
    import numpy as np

    from gpu_codec.backends.base import DeviceViews

    ptrs, numels = [1 << 40, (1 << 40) + 64, (1 << 40) + 128], [16, 3, 5]  # (an empty one needs a device)
    storage, owners = [np.float32, np.float16, np.float64], [object()] * 3
    old = b.wrap(cupy, ptrs, numels, storage, owners, 0)
    new = list(DeviceViews(cupy, ptrs, numels, storage, owners, [0] * 3))
    assert [(a.data.ptr, a.size, a.dtype) for a in old] == [(a.data.ptr, a.size, a.dtype) for a in new]
    assert [a.data.ptr for a in new] == ptrs and [a.dtype.itemsize for a in new] == [4, 2, 8]
