"""fl4health adapter: packed layouts byte-compatible with fl4health's, exact selection, compat mode, pulls."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

import gpu_codec
from gpu_codec import fl4health as F
from gpu_codec.errors import InvalidInputError, PayloadError, PayloadIndexError
from tests.common import HAS_GPU, use_backend

torch = pytest.importorskip("torch")

ADAPTER_BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]
SCORE_FNS = [
    F.largest_final_magnitude_scores,
    F.smallest_final_magnitude_scores,
    F.largest_magnitude_change_scores,
    F.smallest_magnitude_change_scores,
    F.largest_increase_in_magnitude_scores,
    F.smallest_increase_in_magnitude_scores,
]


def same_arrays(got: list, want: list) -> None:
    """Byte-level equality of two packed lists: same length, and per array same type, dtype, shape and bytes."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, np.ndarray), (i, type(g))
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert g.tobytes() == w.tobytes(), i


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.fc2 = torch.nn.Linear(5, 3)


def make_pair(seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    m0, m1 = Net(), Net()
    with torch.no_grad():
        for p0, p1 in zip(m0.state_dict().values(), m1.state_dict().values()):
            if p0.is_floating_point():
                p0.copy_(torch.randn(p0.shape, generator=g))
                p1.copy_(p0 + torch.randn(p0.shape, generator=g))
    return m1.to(device), m0.to(device)


# ---------------------------------------------------------------- independent references


def ref_scores(name: str, w: np.ndarray, w0: np.ndarray) -> np.ndarray:
    w, w0 = w.astype(np.float32), w0.astype(np.float32)
    return {
        "largest_final_magnitude_scores": lambda: np.abs(w),
        "smallest_final_magnitude_scores": lambda: -np.abs(w),
        "largest_magnitude_change_scores": lambda: np.abs(w - w0),
        "smallest_magnitude_change_scores": lambda: -np.abs(w - w0),
        "largest_increase_in_magnitude_scores": lambda: np.abs(w) - np.abs(w0),
        "smallest_increase_in_magnitude_scores": lambda: -(np.abs(w) - np.abs(w0)),
    }[name]()


def ref_exact_packing(state: dict, init: dict, fn_name: str, sparsity: float) -> list:
    """Exact top-k over the tensors with a dimension, ties to the lowest (tensor, index), laid out as fl4health."""
    names = [n for n, t in state.items() if t.ndim > 0]
    scores = np.concatenate([ref_scores(fn_name, state[n], init[n]).reshape(-1) for n in names]).astype(np.float64)
    k = gpu_codec.kept_count(sparsity, scores.size)
    order = np.lexsort((np.arange(scores.size), -scores))[:k]
    keep = np.zeros(scores.size, bool)
    keep[order] = True
    values, indices, shapes, out_names, a = [], [], [], [], 0
    for n in names:
        t = state[n]
        sel = np.flatnonzero(keep[a : a + t.size])
        a += t.size
        if sel.size:
            values.append(t.reshape(-1)[sel])
            indices.append(np.stack(np.unravel_index(sel, t.shape), axis=1).astype(np.int64))
            shapes.append(np.array(t.shape, dtype=np.int64))
            out_names.append(n)
    return values + indices + shapes + [np.array(out_names)]


def ref_fl4health_packing(state: dict, init: dict, fn_name: str, sparsity: float) -> list:
    """fl4health's documented rule: threshold at the k-th score (k in float arithmetic), keep every score at or
    above it, drop zero values and 0-d tensors."""
    names = list(state)
    scores = {n: ref_scores(fn_name, state[n], init[n]) for n in names}
    flat = np.concatenate([scores[n].reshape(-1) for n in names])
    k = math.ceil(len(flat) * sparsity)
    thr = np.sort(flat)[::-1][k - 1]
    values, indices, shapes, out_names = [], [], [], []
    for n in names:
        t = state[n]
        mask = (scores[n] >= thr) & (t != 0)
        if t.ndim == 0 or not mask.any():
            continue
        values.append(t[mask])
        indices.append(np.argwhere(mask).astype(np.int64))
        shapes.append(np.array(t.shape, dtype=np.int64))
        out_names.append(n)
    return values + indices + shapes + [np.array(out_names)]


def np_state(model) -> dict:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- packers


def test_simple_packers_match_fl4health_layouts():
    w = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float64)]
    cv = [np.zeros((2, 3), np.float32)]
    same_arrays(F.ParameterPackerWithControlVariates(2).pack_parameters(w, cv), w + cv)
    got_w, got_cv = F.ParameterPackerWithControlVariates(2).unpack_parameters(w + cv)
    same_arrays(got_w, w)
    same_arrays(got_cv, cv)

    packed = F.ParameterPackerWithClippingBit().pack_parameters(w, 0.125)
    same_arrays(packed, w + [np.array(0.125, dtype=np.float64)])
    assert F.ParameterPackerWithClippingBit().unpack_parameters(packed)[1] == 0.125

    packed = F.ParameterPackerAdaptiveConstraint().pack_parameters(w, 0.01)
    same_arrays(packed, w + [np.array(0.01, dtype=np.float64)])
    assert F.ParameterPackerFedProx is F.ParameterPackerAdaptiveConstraint
    assert F.ParameterPackerAdaptiveConstraint().unpack_parameters(packed)[1] == 0.01

    names = ["fc1.weight", "b"]
    packed = F.ParameterPackerWithLayerNames().pack_parameters(w, names)
    same_arrays(packed, w + [np.array(["fc1.weight", "b"], dtype="<U10")])
    assert F.ParameterPackerWithLayerNames().unpack_parameters(packed)[1] == names


def test_sparse_coo_packer_layout_and_extract():
    dense = np.array([[0, 1.5, 0], [-2, 0, 0]], np.float32)
    vals, idx, shape = F.SparseCooParameterPacker.extract_coo_info_from_dense(torch.from_numpy(dense))
    same_arrays(
        [vals, idx, shape],
        [np.array([1.5, -2], np.float32), np.array([[0, 1], [1, 0]], np.int64), np.array([2, 3], np.int64)],
    )
    v2 = np.array([7.0], np.float64)
    packed = F.SparseCooParameterPacker().pack_parameters(
        [vals, v2], ([idx, np.array([[4]], np.int64)], [shape, np.array([9], np.int64)], ["a", "bb"])
    )
    same_arrays(
        packed,
        [vals, v2, idx, np.array([[4]], np.int64), shape, np.array([9], np.int64), np.array(["a", "bb"], dtype="<U2")],
    )
    got_vals, (got_idx, got_shapes, got_names) = F.SparseCooParameterPacker().unpack_parameters(packed)
    assert got_names == ["a", "bb"] and len(got_vals) == len(got_idx) == len(got_shapes) == 2
    with pytest.raises(F.PackedLayoutError, match="3n \\+ 1"):
        F.SparseCooParameterPacker().unpack_parameters(packed[:-2])
    for bad in (np.array(5), np.array([1, 2]), [b"a", b"bb"]):  # (names that are not strings: refused)
        with pytest.raises(F.PackedLayoutError, match="holds the tensor names"):
            F.SparseCooParameterPacker().unpack_parameters([*packed[:-1], bad])
        with pytest.raises(F.PackedLayoutError, match="holds the tensor names"):
            F.ParameterPackerWithLayerNames().unpack_parameters([vals, bad])
    assert F.SparseCooParameterPacker().unpack_parameters([vals, idx, shape, np.array("a")])[1][2] == ["a"]


# ---------------------------------------------------------------- exchanger, engine mode


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
@pytest.mark.parametrize("fn", SCORE_FNS, ids=lambda f: f.__name__)
def test_engine_selection_matches_exact_reference(backend, fn):
    device = "cuda" if backend == "gpu" else "cpu"
    model, initial = make_pair(1, device)
    with use_backend(backend):
        got = F.SparseCooParameterExchanger(0.07, fn).push_parameters(model, initial)
    want = ref_exact_packing(np_state(model), np_state(initial), fn.__name__, 0.07)
    same_arrays(got, want)
    assert sum(a.size for a in got[: len(got) // 3]) == gpu_codec.kept_count(0.07, 6 * 5 + 5 + 5 * 4 + 5 * 3 + 3)


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_pull_replaces_sent_tensors_and_keeps_the_rest(backend):
    device = "cuda" if backend == "gpu" else "cpu"
    model, initial = make_pair(2, device)
    ex = F.SparseCooParameterExchanger(0.2, F.largest_magnitude_change_scores)
    with use_backend(backend):
        packed = ex.push_parameters(model, initial)
        receiver, _ = make_pair(3, device)
        before = {k: v.clone() for k, v in receiver.state_dict().items()}
        ex.pull_parameters(packed, receiver)
    vals, (idx, shapes, names) = F.SparseCooParameterPacker().unpack_parameters(packed)
    after = receiver.state_dict()
    for name, t in after.items():
        assert t.device.type == device
        if name in names:
            i = names.index(name)
            want = np.zeros(tuple(shapes[i]), np.float32)
            want[tuple(idx[i].T)] = vals[i]
            np.testing.assert_array_equal(t.cpu().numpy(), want)
        else:
            assert torch.equal(t, before[name])


def test_custom_score_function_and_fl4health_functions_by_name():
    model, initial = make_pair(4)

    def random_scores(m, m0):
        g = torch.Generator().manual_seed(9)
        return {n: torch.rand(t.shape, generator=g) for n, t in m.state_dict().items()}

    got = F.SparseCooParameterExchanger(0.1, random_scores).push_parameters(model, initial)
    state = np_state(model)
    sc = random_scores(model, initial)
    names = [n for n, t in state.items() if t.ndim > 0]
    flat = np.concatenate([sc[n].numpy().reshape(-1) for n in names]).astype(np.float64)
    k = gpu_codec.kept_count(0.1, flat.size)
    assert sum(a.size for a in got[: len(got) // 3]) == k
    kept = np.sort(
        np.concatenate(
            [sc[n].numpy()[tuple(i.T)] for n, i in zip(got[-1].tolist(), got[len(got) // 3 : 2 * len(got) // 3])]
        )
    )
    np.testing.assert_array_equal(kept, np.sort(flat)[-k:].astype(np.float32))

    # fl4health's own function objects (same name, fl4health's module) run as kernel criteria too
    clone = types.FunctionType(
        F.largest_magnitude_change_scores.__code__,
        F.largest_magnitude_change_scores.__globals__,
        "largest_magnitude_change_scores",
    )
    clone.__module__ = "fl4health.parameter_exchange.parameter_selection_criteria"
    assert F._engine_criterion(clone) == "largest_magnitude_change"
    same_arrays(
        F.SparseCooParameterExchanger(0.1, clone).push_parameters(model, initial),
        F.SparseCooParameterExchanger(0.1, F.largest_magnitude_change_scores).push_parameters(model, initial),
    )


def test_exact_k_and_zeros_versus_compat_mode():
    """Ties and zeros: engine mode keeps exactly k (zeros included); compat mode reproduces fl4health."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, 0.0, 2.0, 1.0], [0.0, 2.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0]]))
        model.bias.copy_(torch.tensor([0.0, 0.0, 3.0]))
    initial = torch.nn.Linear(4, 3)
    with torch.no_grad():
        initial.weight.zero_()
        initial.bias.copy_(torch.tensor([1.0, 0.0, 1.0]))
    for fn in SCORE_FNS:
        for sparsity in (0.07, 0.2, 0.5, 1.0):
            state, init = np_state(model), np_state(initial)
            exact = F.SparseCooParameterExchanger(sparsity, fn).push_parameters(model, initial)
            same_arrays(exact, ref_exact_packing(state, init, fn.__name__, sparsity))
            compat = F.SparseCooParameterExchanger(sparsity, fn, fl4health_compat=True).push_parameters(model, initial)
            same_arrays(compat, ref_fl4health_packing(state, init, fn.__name__, sparsity))
    # 15 entries, sparsity 0.2: k = 3; the weight holds four 2.0s tied at the threshold
    compat = F.SparseCooParameterExchanger(0.2, F.largest_final_magnitude_scores, fl4health_compat=True)
    assert sum(a.size for a in compat.push_parameters(model)[:2]) == 5  # 3.0 and all four 2.0s
    exact = F.SparseCooParameterExchanger(0.2, F.largest_final_magnitude_scores)
    assert sum(a.size for a in exact.push_parameters(model)[:2]) == 3
    # smallest magnitudes are the zeros: fl4health sends nothing of them, we send exactly k zeros
    z = F.SparseCooParameterExchanger(0.2, F.smallest_final_magnitude_scores).push_parameters(model)
    assert sum(a.size for a in z[: len(z) // 3]) == 3 and all((a == 0).all() for a in z[: len(z) // 3])


def test_pull_reads_a_stock_fl4health_packing():
    """A packing built by hand in fl4health's layout, entries in any order, loads into the model."""
    model = torch.nn.Linear(3, 2)
    packed = [
        np.array([5.0, -1.0], np.float32),
        np.array([2.5], np.float32),
        np.array([[1, 2], [0, 0]], np.int64),
        np.array([[1]], np.int64),
        np.array([2, 3], np.int64),
        np.array([2], np.int64),
        np.array(["weight", "bias"]),
    ]
    F.SparseCooParameterExchanger(0.5, F.largest_final_magnitude_scores).pull_parameters(packed, model)
    assert model.weight.tolist() == [[-1.0, 0.0, 0.0], [0.0, 0.0, 5.0]] and model.bias.tolist() == [0.0, 2.5]


@pytest.mark.parametrize(
    "bad, err",
    [
        ("out_of_range", PayloadIndexError),
        ("repeated", PayloadIndexError),
        ("count", F.PackedLayoutError),
        ("shape", F.PackedLayoutError),
        ("name", F.PackedLayoutError),
        ("idx_cols", F.PackedLayoutError),
    ],
)
def test_pull_rejects_bad_packings_and_leaves_the_model_alone(bad, err):
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    vals, idx, shape, names = (
        [np.array([1.0, 2.0], np.float32)],
        [np.array([[0, 0], [1, 2]], np.int64)],
        [np.array([2, 3], np.int64)],
        ["weight"],
    )
    if bad == "out_of_range":
        idx = [np.array([[0, 0], [2, 0]], np.int64)]
    elif bad == "repeated":
        idx = [np.array([[1, 2], [1, 2]], np.int64)]
    elif bad == "shape":
        shape = [np.array([3, 2], np.int64)]
    elif bad == "name":
        names = ["nope"]
    elif bad == "idx_cols":
        idx = [np.array([[0], [1]], np.int64)]
    packed = vals + idx + shape + [np.array(names)]
    if bad == "count":
        packed = vals + vals + idx + shape + [np.array(names)]
    with pytest.raises(err):
        F.SparseCooParameterExchanger(0.5, F.largest_final_magnitude_scores).pull_parameters(packed, model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="sparsity_level"):
        F.SparseCooParameterExchanger(0.0, F.largest_final_magnitude_scores)
    with pytest.raises(InvalidInputError, match="initial_model"):
        F.SparseCooParameterExchanger(0.1, F.largest_magnitude_change_scores).push_parameters(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- compact exchanger


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_compact_exchanger_round_trip_matches_sparse_coo(backend):
    device = "cuda" if backend == "gpu" else "cpu"
    model, initial = make_pair(5, device)
    with use_backend(backend):
        compact = F.CompactSparseExchanger(0.1, F.largest_increase_in_magnitude_scores)
        coo = F.SparseCooParameterExchanger(0.1, F.largest_increase_in_magnitude_scores)
        if backend == "gpu":
            p = compact.select_payload(model, initial)
            assert type(p.tensors[0].buffers["values"]).__module__.startswith("cupy")
        (blob,) = compact.push_parameters(model, initial)
        packed = coo.push_parameters(model, initial)
        a, _ = make_pair(6, device)
        b, _ = make_pair(6, device)
        compact.pull_parameters([blob], a)
        coo.pull_parameters(packed, b)
    assert blob.dtype == np.uint8 and blob.ndim == 1  # (smaller than fl4health's layout on real models: doctest)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    bad = blob.copy()
    bad[len(bad) // 2] ^= 1
    with pytest.raises(PayloadError):
        compact.pull_parameters([bad], a)
    other = np.frombuffer(gpu_codec.compress({"weight": np.ones(3, np.float32)}, fraction=1.0).to_bytes(), np.uint8)
    with pytest.raises(F.PackedLayoutError, match="marker"):
        compact.pull_parameters([other], a)


def test_compact_exchanger_with_a_codec_pipeline_round_trips():
    import torch

    from gpu_codec import Quantize, RiceIndices, Zstd
    from gpu_codec.fl4health import CompactSparseExchanger, largest_final_magnitude_scores

    torch.manual_seed(0)
    src, dst = torch.nn.Linear(200, 50), torch.nn.Linear(200, 50)
    raw = CompactSparseExchanger(0.05, largest_final_magnitude_scores)
    coded = CompactSparseExchanger(
        0.05, largest_final_magnitude_scores, pipeline=[Quantize("float16"), RiceIndices(), Zstd()]
    )
    (a,), (b,) = raw.push_parameters(src), coded.push_parameters(src)
    assert b.nbytes < a.nbytes / 2
    coded.pull_parameters([b], dst)
    raw_dst = torch.nn.Linear(200, 50)
    raw.pull_parameters([a], raw_dst)
    for (n, x), (_, y) in zip(dst.state_dict().items(), raw_dst.state_dict().items()):
        assert torch.equal(x, y.half().float()), n  # fp16 rounding of the same kept values, zeros elsewhere


def test_packers_refuse_what_a_hostile_client_packs():
    w = [np.ones(3, np.float32)]
    for bound in (np.ones(3), [0.5], np.array("abc"), np.array(None, dtype=object), np.array(np.nan), "inf"):
        with pytest.raises(F.PackedLayoutError, match="one finite number"):
            F.ParameterPackerWithClippingBit().unpack_parameters(w + [bound])
        with pytest.raises(F.PackedLayoutError, match="one finite number"):
            F.ParameterPackerAdaptiveConstraint().unpack_parameters(w + [bound])
    assert F.ParameterPackerAdaptiveConstraint().unpack_parameters(w + [np.array(2)])[1] == 2.0
    with pytest.raises(F.PackedLayoutError, match="3 names for 1 arrays"):
        F.ParameterPackerWithLayerNames().unpack_parameters(w + [np.array(["a", "b", "c"])])
    with pytest.raises(F.PackedLayoutError, match="at least the model's 3 arrays"):
        F.ParameterPackerWithControlVariates(3).unpack_parameters(w)
