"""Bad input gets the library's own one-line errors, and unusual good input gives the right result: bases of several
array kinds, weights near the accumulator's grid, torch dtypes with no NumPy form, arguments that are not the
types asked for, and encode_coo's entries, shapes and selection."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpu_codec
from gpu_codec import ErrorFeedback, Payload, SparseEntries, encode_coo
from gpu_codec.errors import BackendUnavailableError, InvalidInputError

from .common import BACKENDS, HAS_GPU, use_backend

torch = pytest.importorskip("torch")


def _blob(values=(1.0, 3.0)):
    return gpu_codec.compress({"w": np.array(values, np.float32)}, fraction=1.0).to_bytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("torch_first", [False, True])
def test_a_base_of_several_kinds_gives_each_tensor_back_in_its_own_kind(backend, torch_first):
    items = [("y", np.ones(2, np.float32)), ("x", torch.ones(3).bfloat16())]
    base = dict(items[::-1] if torch_first else items)
    new = {"y": base["y"] + 1, "x": base["x"] + 1}
    with use_backend(backend):
        blob = gpu_codec.compress(new, base, fraction=1.0).to_bytes()
        for out in (gpu_codec.decompress(blob, base=base), gpu_codec.aggregate([blob], base=base)):
            assert isinstance(out["y"], np.ndarray) and out["y"].dtype == np.float32
            assert out["y"].tolist() == [2.0, 2.0]
            assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.bfloat16
            assert out["x"].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("weights", [[1e-300, 1e-300], [5e-324, 0.0], [1.0, 2.0**-801]])
def test_a_weight_below_the_grid_floor_is_refused(weights):
    with pytest.raises(InvalidInputError, match="at least 2\\^-800"):
        gpu_codec.aggregate([_blob(), _blob((3.0, 5.0))], weights=weights)
    agg = gpu_codec.Aggregator()
    agg.add(_blob(), 1.0)
    with pytest.raises(InvalidInputError):
        agg.add(_blob(), 2.0**-801)
    assert agg.count == 1 and agg.result()["w"].tolist() == [1.0, 3.0]


def test_weights_at_the_floor_give_the_mean_exactly():
    w = 2.0**-800
    out = gpu_codec.aggregate([_blob(), _blob((3.0, 5.0))], weights=[w, w])
    assert out["w"].tolist() == [2.0, 4.0]
    out = gpu_codec.aggregate([_blob(), _blob((3.0, 5.0))], weights=[w, 0])
    assert out["w"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "complex32"])
def test_torch_dtypes_with_no_numpy_form_are_refused(name):
    if not hasattr(torch, name):
        pytest.skip(f"torch has no {name}")
    with warnings.catch_warnings():  # (complex32: "experimental")
        warnings.simplefilter("ignore", UserWarning)
        bad = torch.zeros(3, dtype=getattr(torch, name))
    good = {"w": torch.zeros(3)}
    for call in (
        lambda: gpu_codec.compress({"w": bad}, fraction=0.5),
        lambda: gpu_codec.compress(good, {"w": bad}, fraction=0.5),
        lambda: gpu_codec.decompress(gpu_codec.compress(good, good, fraction=0.5).to_bytes(), base={"w": bad}),
        lambda: gpu_codec.Aggregator(base={"w": bad}),
        lambda: encode_coo({"w": SparseEntries(np.array([0]), bad[:1], (3,), "float32")}),
    ):
        with pytest.raises(InvalidInputError, match=f"tensor 'w': dtype {name} is not supported"):
            call()


def test_a_negated_view_is_read_as_its_values():
    # A contiguous fp32 tensor with torch's negative bit (the imaginary part of a conjugate, a _neg_view) holds its
    # values' negations in memory: .numpy() refused it (a raw RuntimeError), and given by address it would read wrong.
    values = torch.tensor([1.0, -2.0, 3.5, 0.25])
    neg = (-values)._neg_view()  # (values, as a negated view of their negations)
    assert neg.is_neg() and neg.is_contiguous()
    imag = torch.complex(torch.zeros(4), -values).conj().imag
    base = torch.zeros(4)
    for x in (neg, imag):
        want = gpu_codec.compress({"w": values.clone()}, {"w": base}, fraction=0.5).to_bytes()
        assert gpu_codec.compress({"w": x}, {"w": base}, fraction=0.5).to_bytes() == want
        assert gpu_codec.compress({"w": values.clone()}, {"w": x}, fraction=0.5).to_bytes() != want
        out = gpu_codec.decompress(want, base={"w": x})["w"]
        assert out.tolist() == (values + torch.tensor([0.0, -2.0, 3.5, 0.0])).tolist()
        agg = gpu_codec.Aggregator(base={"w": x})
        agg.add(want)
        assert agg.result()["w"].tolist() == out.tolist()


def test_torch_tensors_torch_does_not_hand_over_get_our_error():
    with warnings.catch_warnings():  # (both are prototypes: torch warns)
        warnings.simplefilter("ignore", UserWarning)
        masked = torch.masked.masked_tensor(torch.ones(2), torch.tensor([True, False]))
        nested = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])
    good = {"w": torch.zeros(2)}
    for bad, why in ((masked, "MaskedTensor"), (nested, "nested")):
        for call in (
            lambda bad=bad: gpu_codec.compress({"w": bad}, fraction=0.5),
            lambda bad=bad: gpu_codec.compress({"w": bad, "v": torch.ones(3)}, fraction=0.5),
            lambda bad=bad: gpu_codec.decompress(gpu_codec.compress(good, fraction=0.5).to_bytes(), base={"w": bad}),
            lambda bad=bad: gpu_codec.Aggregator(base={"w": bad}),
        ):
            with pytest.raises(InvalidInputError, match=f"tensor 'w': .*{why}"), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (torch warns at every use of a MaskedTensor)
                call()


@pytest.mark.parametrize("thing", [None, "abc", 3, [1, 2], "tensor", "strided"])
def test_a_payload_that_is_not_a_contiguous_buffer_is_refused(thing):
    blob = _blob()
    made = {"tensor": lambda: torch.zeros(8, dtype=torch.uint8), "strided": lambda: memoryview(blob)[::2]}
    x = made[thing]() if isinstance(thing, str) and thing in made else thing
    calls = [gpu_codec.decompress, Payload.from_bytes, ErrorFeedback.from_bytes, lambda b: gpu_codec.aggregate([b])]
    for call in calls:
        with pytest.raises(InvalidInputError, match=r"a payload is bytes|expected a gpu_codec Payload"):
            call(x)


def test_bytes_like_payloads_still_read():
    blob = _blob()
    for b in (bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8)):
        assert gpu_codec.decompress(b)["w"].tolist() == [1.0, 3.0]
        agg = gpu_codec.Aggregator()
        agg.add(b)  # (any contiguous buffer, as decompress takes)
        assert agg.result()["w"].tolist() == [1.0, 3.0]


def test_aggregate_takes_any_iterables_and_refuses_other_arguments():
    blobs = [_blob(), _blob((3.0, 5.0))]
    assert gpu_codec.aggregate(iter(blobs), weights=(w for w in (1, 3)))["w"].tolist() == [2.5, 4.5]
    assert gpu_codec.aggregate(blobs, weights=np.array([3, 1]))["w"].tolist() == [1.5, 3.5]
    for args, match in (
        ((5,), "payloads must be an iterable"),
        ((blobs[0],), "payloads must be an iterable"),
        ((Payload.from_bytes(blobs[0]),), "payloads must be an iterable"),
        ((blobs, 3), "weights must be a sequence"),
        ((blobs, "ab"), "weights must be a sequence"),
        ((blobs, [1]), "1 weights for 2 payloads"),
    ):
        with pytest.raises(InvalidInputError, match=match):
            gpu_codec.aggregate(*args)


def test_encode_coo_refuses_a_value_past_its_dtype_range_after_the_cast():
    with pytest.raises(InvalidInputError, match="not finite in float32"):
        encode_coo({"w": SparseEntries(np.array([1]), np.array([1e300]), (3,), "float32")})
    p = encode_coo({"w": SparseEntries(np.array([1]), np.array([1e300]), (3,), "float64")})
    assert gpu_codec.decompress(p.to_bytes())["w"].tolist() == [0.0, 1e300, 0.0]


@pytest.mark.parametrize(
    "selection, match",
    [
        ({"id": "nope"}, "not registered"),
        ({"id": "topk", "fraction": 5}, "fraction must be in"),
        ({"id": "topk", "f": 1}, "unknown field"),
        ({"id": "zstd", "level": 3}, "a selection stage"),
        ("topk", "must be a mapping"),
    ],
)
def test_encode_coo_refuses_a_selection_no_reader_could_rebuild(selection, match):
    with pytest.raises(InvalidInputError, match=match):
        encode_coo({"w": SparseEntries(np.array([0]), np.array([1.0]), (3,), "float32")}, selection=selection)


def test_encode_coo_records_a_valid_selection_as_given():
    sel = {"id": "topk", "fraction": 0.5, "scope": "global", "score": "magnitude"}
    p = encode_coo({"w": SparseEntries(np.array([0]), np.array([1.0]), (3,), "float32")}, selection=sel)
    back = Payload.from_bytes(p.to_bytes())
    assert back.pipeline[0] == sel
    assert gpu_codec.decompress(p.to_bytes())["w"].tolist() == [1.0, 0.0, 0.0]


def test_encode_coo_takes_bfloat16_values_and_names_a_bad_values_dtype():
    e = SparseEntries(torch.tensor([0, 2]), torch.tensor([1.5, -2.25], dtype=torch.bfloat16), (3,), "bfloat16")
    assert gpu_codec.decompress(encode_coo({"w": e}).to_bytes())["w"].tolist() == [1.5, 0.0, -2.25]
    with pytest.raises(InvalidInputError, match="got int32\\[1\\]"):
        encode_coo({"w": SparseEntries(np.array([0]), np.array([1], np.int32), (3,), "float32")})


@pytest.mark.parametrize("shape", [(3.7,), "3", (True,), 3, None])
def test_encode_coo_refuses_a_shape_that_is_not_integers(shape):
    with pytest.raises(InvalidInputError, match="is not a tuple of integers"):
        encode_coo({"w": SparseEntries(np.array([0]), np.array([1.0]), shape, "float32")})
    ok = encode_coo({"w": SparseEntries(np.array([0]), np.array([1.0]), [np.int64(3)], "float32")})
    assert gpu_codec.decompress(ok.to_bytes())["w"].shape == (3,)


@pytest.mark.parametrize("args", [("x", 30), (0.5, -3), (0.5, 3.0), (0.0, 3), (0.5, True)])
def test_kept_count_refuses_what_is_not_a_fraction_and_a_count(args):
    with pytest.raises(InvalidInputError):
        gpu_codec.kept_count(*args)
    assert gpu_codec.kept_count(0.01, np.int64(101)) == 2


@pytest.mark.parametrize("cap", ["x", -1, 1.5, True])
def test_decompress_checks_its_deprecated_cap_too(cap):
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidInputError, match="max_elements must be"):
        gpu_codec.decompress(_blob(), max_elements=cap)


@pytest.mark.skipif(HAS_GPU, reason="a CUDA GPU is usable here")
def test_cupy_outputs_without_a_device_are_refused_up_front():
    for call in (lambda: gpu_codec.decompress(_blob(), like="cupy"), lambda: gpu_codec.Aggregator(like="cupy")):
        with pytest.raises(BackendUnavailableError, match="like='cupy' needs CuPy and a CUDA device"):
            call()


def test_a_torch_tensor_subclass_reads_as_a_tensor():
    class Sub(torch.Tensor):
        pass

    new, base = torch.arange(6.0).as_subclass(Sub), torch.zeros(6).as_subclass(Sub)
    p = gpu_codec.compress({"w": new}, {"w": base}, fraction=0.5)
    assert p.to_bytes() == gpu_codec.compress({"w": torch.arange(6.0)}, {"w": torch.zeros(6)}, fraction=0.5).to_bytes()
    assert gpu_codec.decompress(p.to_bytes(), base={"w": base})["w"].tolist() == [0.0, 0.0, 0.0, 3.0, 4.0, 5.0]


def test_a_masked_array_is_refused_not_read_without_its_mask():
    m = np.ma.masked_array(np.arange(4, dtype=np.float32), mask=[0, 1, 0, 0])
    with pytest.raises(InvalidInputError, match="tensor 'w': a masked array"):
        gpu_codec.compress({"w": m}, fraction=0.5)
    with pytest.raises(InvalidInputError, match="tensor 'w': a masked array"):
        gpu_codec.compress({"w": m.data}, {"w": m}, fraction=0.5)


def test_an_empty_payload_cannot_fix_an_aggregation_s_tensors():
    """A payload with no tensor reads (the format allows it), but as an aggregation's first payload it would fix an
    empty tensor set and every later client would be refused: it is refused itself, and the round goes on."""
    from gpu_codec.errors import PayloadLayoutError
    from gpu_codec.format import pack

    empty = pack([], pipeline=[])
    assert gpu_codec.decompress(empty) == {}
    agg = gpu_codec.Aggregator()
    with pytest.raises(PayloadLayoutError, match="payload 0 holds no tensor"):
        agg.add(empty)
    agg.add(_blob())
    assert agg.count == 1 and agg.result()["w"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ternary_of_values_past_float32_is_refused_and_the_residual_kept(backend):
    """Dense float64 values past float32's range (the route top-k's refusal points to) under ternary made mu inf:
    compress returned, its residual became -inf and to_bytes raised a bare ValueError. Now compress refuses it and
    the error-feedback state is as it was."""
    with use_backend(backend):
        ef = ErrorFeedback()
        gpu_codec.compress({"w": np.array([3.0, -1.0])}, fraction=None, pipeline=[gpu_codec.Ternary()], residual=ef)
        before = ef.to_bytes()
        with pytest.raises(InvalidInputError, match="tensor 'w': the ternary codec's mu is inf"):
            gpu_codec.compress({"w": np.array([1e39, 1.0])}, fraction=None, pipeline=[gpu_codec.Ternary()], residual=ef)
        assert ef.to_bytes() == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "values, fraction",
    [(np.array([np.finfo(np.float32).max, 1.0], np.float32), 1.0), (np.array([1e39, 1.0]), None)],
    ids=["float32 max, top-k", "float64 past float32, dense"],
)
def test_int8_blocks_at_float32_s_edge_are_refused_and_the_residual_kept(backend, values, fraction):
    """A block whose largest magnitude is float32's max (or a float64 value past it) got a scale whose 127x is
    inf: the payload decoded to inf (the reader refused it) and the residual took the inf. Now compress refuses
    it, naming the tensor, and the error-feedback state is as it was; 3e38 still goes."""
    with use_backend(backend):
        ef = ErrorFeedback()
        pipe = [gpu_codec.Int8Blockwise(256)]
        gpu_codec.compress({"w": np.array([3.0, -1.0], values.dtype)}, fraction=fraction, pipeline=pipe, residual=ef)
        before = ef.to_bytes()
        with pytest.raises(InvalidInputError, match="tensor 'w': the int8 codec's scale x 127 is inf"):
            gpu_codec.compress({"w": values}, fraction=fraction, pipeline=pipe, residual=ef)
        assert ef.to_bytes() == before
        ok = gpu_codec.compress({"w": np.array([3e38, 0.0], values.dtype)}, fraction=fraction, pipeline=pipe)
        assert np.isfinite(gpu_codec.decompress(ok.to_bytes())["w"]).all()


@pytest.mark.parametrize("version", [2.0, 3.0, 1.0, True, "2"])
def test_a_wire_version_is_an_int_of_1_2_or_3(version):
    p = gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, fraction=0.5)
    ef = ErrorFeedback()
    gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, fraction=0.5, residual=ef)
    for obj in (p, ef):
        with pytest.raises(InvalidInputError, match="version must be 1, 2 or 3"):
            obj.to_bytes(version=version)


def test_what_no_reader_takes_is_not_written_and_a_saved_state_stays_whole(tmp_path, monkeypatch):
    from gpu_codec.format import MAX_TENSORS, TensorRecord, pack

    one = np.zeros(1, np.float32)
    many = [TensorRecord(f"t{i}", "float32", (1,), "dense", 1, {"values": one}) for i in range(MAX_TENSORS + 1)]
    for version in (None, 1, 2):  # (v2 cannot hold them; v1 could, and no reader would read it)
        with pytest.raises(InvalidInputError, match="at most 100000"):
            pack(many, pipeline=[], version=version)
    # an error-feedback state that cannot be written leaves the file saved before as it was
    ef = ErrorFeedback()
    gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, fraction=0.5, residual=ef)
    path = tmp_path / "site.gcef"
    ef.save(path)
    before = path.read_bytes()

    def refused(*a, **k):
        raise InvalidInputError("no")

    monkeypatch.setattr(ErrorFeedback, "to_bytes", refused)
    with pytest.raises(InvalidInputError):
        ef.save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["site.gcef"]
    monkeypatch.undo()
    assert ErrorFeedback.load(path).layout() == {"w": ("float32", (8,))}


def test_encode_coo_takes_numpy_numbers_in_its_selection():
    e = SparseEntries(np.array([1, 3]), np.array([1.0, 2.0], np.float32), (4,), "float32")
    for value in (np.float32(0.5), np.float64(0.5)):
        p = encode_coo({"w": e}, selection={"id": "topk", "fraction": value})
        again = Payload.from_bytes(p.to_bytes())
        assert again.pipeline[0]["fraction"] == 0.5 and type(again.pipeline[0]["fraction"]) is float
