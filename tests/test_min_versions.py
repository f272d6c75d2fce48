"""What the oldest declared dependency versions lack or do differently, each path taken without it (CI installs the
newest versions, so these stand in for the oldest: torch 2.1 and NumPy 1.24)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from gpu_codec.errors import InvalidInputError

torch = pytest.importorskip("torch")


def test_fl4health_coordinates_without_torch_unravel_index(monkeypatch):
    # (torch 2.1 has no torch.unravel_index: the engine-backed selection raised AttributeError there)
    from gpu_codec.fl4health import _unravel

    rng = np.random.default_rng(0)
    for shape in [(7,), (3, 4), (2, 3, 5), (1, 9, 1)]:
        idx = torch.from_numpy(rng.integers(0, int(np.prod(shape)), 20))
        want = torch.stack(torch.unravel_index(idx, shape), dim=1)
        monkeypatch.delattr(torch, "unravel_index")
        assert torch.equal(_unravel(idx, shape), want)
        monkeypatch.undo()
    assert _unravel(torch.tensor([0]), ()).shape == (1, 0)


def test_clara_loads_a_checkpoint_where_torch_load_warns(tmp_path, monkeypatch):
    # (torch 2.1's weights-only load warns that TypedStorage is deprecated; under warnings as errors the saver
    # called a good checkpoint not weights-only)
    from gpu_codec import clara as C

    path = str(tmp_path / "m.pt")
    torch.save({"model": {"w": torch.arange(3.0)}}, path)
    real = torch.load

    def warning_load(*args, **kwargs):
        warnings.warn("TypedStorage is deprecated", UserWarning, stacklevel=2)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", warning_load)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = C.PTModelSaver(ckpt_preload_path=path).load_model()
    assert got["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_pt_output_torch_has_no_dtype_for_is_our_error(monkeypatch):
    from gpu_codec.cli import checkpoints

    real = torch.from_numpy

    def old_from_numpy(a):
        if a.dtype == np.uint32:
            raise TypeError("can't convert np.ndarray of type numpy.uint32")
        return real(a)

    monkeypatch.setattr(torch, "from_numpy", old_from_numpy)
    assert checkpoints.as_torch(np.ones(2, np.float32)).dtype == torch.float32
    with pytest.raises(InvalidInputError, match=r"no uint32 tensor for a \.pt file"):
        checkpoints.as_torch(np.ones(2, np.uint32))


@pytest.mark.parametrize("message", ["Unsupported class collections.OrderedDict", "unsupported GLOBAL os.system"])
def test_a_refused_checkpoint_names_the_class_in_either_torchs_words(message):
    from gpu_codec.cli import checkpoints

    e = checkpoints._torch_refusal("x.pt", b"PK\x03\x04", pickle.UnpicklingError(message))
    assert message.split()[-1] in str(e)


def test_the_scatter_twins_take_uint64_indices_as_intp():
    # (NumPy 1.24's take refuses uint64 indices, which tensors over 2^32 elements use; the twins convert them:
    # NumPy 2 takes them either way, so this checks the values, not that conversion)
    from gpu_codec.cpu_fallback import kernels

    from gpu_codec.backends.cpu import CpuBackend

    out = np.arange(6, dtype=np.float32)
    w = kernels._written(out, np.array([1, 4], np.uint64), np.array([10, 20], np.float32), 0, 1)
    assert w.tolist() == [11.0, 24.0]
    got = np.empty(3, np.float32)
    CpuBackend().gather_entries(got, [np.arange(5, dtype=np.float32)], [0], np.array([0, 2, 4], np.uint64), [3])
    assert got.tolist() == [0.0, 2.0, 4.0]
