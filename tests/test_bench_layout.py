"""benchmarks/bench_layout.py: the one-allocation twin of an update, its rows, and its refusal to overwrite."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_layout as b


def test_one_allocation_holds_the_same_tensors_in_one_buffer():
    d = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    one = b.one_allocation(d)
    assert list(one) == ["a", "b"] and all(one[k].shape == d[k].shape and np.array_equal(one[k], d[k]) for k in d)
    assert one["a"].base is one["b"].base is not None  # (views of one allocation)
    assert one["b"].ctypes.data == one["a"].ctypes.data + 24


def test_a_row_times_both_layouts_against_the_subtract_pass(tmp_path):
    row = b.measure(1 << 14, 10, 2)
    ms = row["ms"]
    assert row["tensors"] == 10 and all(ms[k] > 0 for k in ("subtract", "compress_one", "decompress_separate"))
    assert row["decompress_one_x_subtract"] == ms["decompress_one"] / ms["subtract"]
    assert row["copy_separate_x_one"] == ms["copy_separate"] / ms["copy_one"]
    out = tmp_path / "layout.json"
    out.write_text("{}")
    with pytest.raises(SystemExit):  # (an existing result is kept unless --force)
        b.main(["--out", str(out)])
    assert json.loads(out.read_text()) == {}
