"""Engine parity: every backend against an independent brute-force reference, and round trips."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec.errors import BackendUnavailableError, InvalidInputError, PayloadIndexError
from tests.common import BACKENDS, HAS_GPU, as_numpy, dense_from, reference_topk, use_backend

CRITERIA = [
    "magnitude",
    "largest_final_magnitude",
    "smallest_final_magnitude",
    "largest_magnitude_change",
    "smallest_magnitude_change",
    "largest_increase_in_magnitude",
    "smallest_increase_in_magnitude",
]
DTYPES = ["float32", "float16", "bfloat16", "float64"]


def make(rng, shape, dtype, kind="normal"):
    n = int(np.prod(shape))
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "ties":
        x = rng.integers(-3, 4, n).astype(np.float64)
    elif kind == "equal":
        x = np.full(n, 0.5)
    else:
        x = np.zeros(n)
    x = x.reshape(shape)
    if dtype == "bfloat16":
        return np.asarray((x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    return np.asarray(x.astype(dtype))


def model(rng, dtype, kind="normal", shapes=((37, 5), (4096 + 3,), (3, 3, 2), (), (0,), (1,))):
    new = {f"t{i}": make(rng, s, dtype, kind) for i, s in enumerate(shapes)}
    base = {f"t{i}": make(rng, s, dtype, "normal" if kind == "normal" else "zeros") for i, s in enumerate(shapes)}
    return new, base


def run_compress(new, base, dtype, **kw):
    if dtype == "bfloat16":  # travel as torch bf16 so the logical dtype is known
        torch = pytest.importorskip("torch")
        tn = {k: torch.from_numpy(np.asarray(v).view(np.int16)).view(torch.bfloat16) for k, v in new.items()}
        tb = (
            {k: torch.from_numpy(np.asarray(v).view(np.int16)).view(torch.bfloat16) for k, v in base.items()}
            if base is not None
            else None
        )
        return gpu_codec.compress(tn, tb, **kw)
    return gpu_codec.compress(new, base, **kw)


def check_against_reference(p, new, base, dtype, fraction, scope, crit):
    ref = reference_topk(new, base, fraction, scope, crit, dict.fromkeys(new, dtype))
    assert [r.name for r in p.tensors] == list(new)
    for r in p.tensors:
        idx, vals = ref[r.name]
        got_i = as_numpy(r.buffers["indices"])
        got_v = as_numpy(r.buffers["values"])
        assert got_i.dtype == np.uint32
        np.testing.assert_array_equal(got_i, idx, err_msg=r.name)
        assert got_v.dtype == (np.float64 if dtype == "float64" else np.float32)
        assert got_v.tobytes() == vals.tobytes(), r.name
    return ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_random_against_reference(backend, dtype, scope):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{scope}".encode()))  # reproducible across runs
    new, base = model(rng, dtype)
    with use_backend(backend):
        for fraction in (0.01, 0.3, 1.0):
            p = run_compress(new, base, dtype, fraction=fraction, scope=scope)
            check_against_reference(p, new, base, dtype, fraction, scope, "magnitude")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("crit", CRITERIA)
def test_every_criterion(backend, crit):
    rng = np.random.default_rng(7)
    new, base = model(rng, "float32", shapes=((50, 20), (300,)))
    with use_backend(backend):
        for scope in ("global", "per_tensor"):
            p = gpu_codec.compress(new, base, fraction=0.05, scope=scope, score=crit)
            check_against_reference(p, new, base, "float32", 0.05, scope, crit)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ties", "equal", "zeros"])
@pytest.mark.parametrize("fraction", [1e-9, 0.1, 0.5, 1.0])
def test_adversarial(backend, kind, fraction):
    """Ties, all-equal and all-zero deltas; k = 1 (tiny fraction) and k = N; 0-d, empty and 1-element tensors."""
    rng = np.random.default_rng(3)
    new, base = model(rng, "float32", kind)
    with use_backend(backend):
        for scope in ("global", "per_tensor"):
            p = gpu_codec.compress(new, base, fraction=fraction, scope=scope)
            check_against_reference(p, new, base, "float32", fraction, scope, "magnitude")
            total = sum(v.size for v in new.values())
            if scope == "global":
                assert p.nnz == gpu_codec.kept_count(fraction, total)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_values_are_kept(backend):
    """fl4health drops kept values of exactly 0.0; we keep them so k is exact."""
    new = {"w": np.array([0.0, 0.0, 0.0, 2.0], np.float32)}
    with use_backend(backend):
        p = gpu_codec.compress(new, fraction=0.75)
    r = p.tensors[0]
    assert as_numpy(r.buffers["indices"]).tolist() == [0, 1, 3]
    assert as_numpy(r.buffers["values"]).tolist() == [0.0, 0.0, 2.0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(backend, dtype):
    rng = np.random.default_rng(11)
    new, base = model(rng, dtype)
    with use_backend(backend):
        p = run_compress(new, base, dtype, fraction=0.1)
        blob = p.to_bytes()
        assert len(blob) == p.nbytes
        dense = gpu_codec.decompress(blob)
    ref = reference_topk(new, base, 0.1, "global", "magnitude", dict.fromkeys(new, dtype))
    want = dense_from(ref, {n: v.shape for n, v in new.items()}, dict.fromkeys(new, dtype))
    for n in new:
        assert dense[n].shape == want[n].shape
        assert dense[n].tobytes() == want[n].tobytes(), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_onto_base_rounds_to_base_dtype(backend):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        base = {"w": torch.randn(64, 9, generator=g).to(dt), "b": torch.randn(9, generator=g).to(dt)}
        new = {k: (v.float() + torch.randn(v.shape, generator=g)).to(dt) for k, v in base.items()}
        with use_backend(backend):
            out = gpu_codec.decompress(gpu_codec.compress(new, base, fraction=1.0).to_bytes(), base=base)
        for k in base:
            assert isinstance(out[k], torch.Tensor) and out[k].dtype == dt and out[k].shape == base[k].shape
            wd = torch.float64 if dt == torch.float64 else torch.float32
            want = (base[k].to(wd) + (new[k].to(wd) - base[k].to(wd))).to(dt)
            assert torch.equal(out[k], want), (k, dt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_give_the_same_bytes(backend):
    rng = np.random.default_rng(5)
    new, base = model(rng, "float32", shapes=((40, 30), (10000,), (7,)))
    with use_backend("cpu"):
        want = gpu_codec.compress(new, base, fraction=0.02, scope="per_tensor").to_bytes()
    with use_backend(backend):
        got = gpu_codec.compress(new, base, fraction=0.02, scope="per_tensor").to_bytes()
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_score_function(backend):
    rng = np.random.default_rng(9)
    new, base = model(rng, "float32", shapes=((20, 10), (50,)))

    def score(update, base_):
        return {n: -np.abs(np.asarray(update[n])) for n in update}  # keep the smallest weights

    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=0.1, score=score)
    ref = reference_topk(new, base, 0.1, "global", "smallest_final_magnitude")
    for r in p.tensors:
        np.testing.assert_array_equal(as_numpy(r.buffers["indices"]), ref[r.name][0])
    assert p.pipeline[0]["score"] == "custom"


def test_torch_in_torch_out_same_device():
    torch = pytest.importorskip("torch")
    base = {"w": torch.zeros(5, 4)}
    new = {"w": torch.arange(20, dtype=torch.float32).reshape(5, 4)}
    out = gpu_codec.decompress(gpu_codec.compress(new, base, fraction=0.1), base=base)
    assert isinstance(out["w"], torch.Tensor) and out["w"].device == base["w"].device
    assert out["w"].flatten().tolist() == [0.0] * 18 + [18.0, 19.0]
    assert isinstance(gpu_codec.decompress(gpu_codec.compress(new, fraction=0.1), like="torch")["w"], torch.Tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_cuda_tensors_stay_on_device():
    torch = pytest.importorskip("torch")
    base = {"w": torch.randn(1000, 100, device="cuda")}
    new = {"w": base["w"] + torch.randn(1000, 100, device="cuda")}
    p = gpu_codec.compress(new, base, fraction=0.01)
    assert type(p.tensors[0].buffers["values"]).__module__.startswith("cupy")
    out = gpu_codec.decompress(p.to_bytes(), base=base)
    assert out["w"].is_cuda


# ---------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    ok = {"w": np.ones(4, np.float32)}
    cases = [
        (({},), {}, "empty"),
        ((ok,), {"fraction": 0.0}, r"\(0, 1\]"),
        ((ok,), {"fraction": 1.5}, r"\(0, 1\]"),
        ((ok,), {"fraction": float("nan")}, r"\(0, 1\]"),
        ((ok,), {"fraction": True}, "number"),
        ((ok,), {"scope": "layer"}, "scope"),
        ((ok,), {"score": "biggest"}, "score"),
        (({"w": np.ones(4, np.int64)},), {}, "'w'.*not a float"),
        (({"w": np.array([1.0, np.inf], np.float32)},), {}, "'w'.*non-finite"),
        (({"w": np.array([1.0, np.nan], np.float16)},), {}, "'w'.*non-finite"),
        ((ok, {"w": np.ones(5, np.float32)}), {}, "'w'.*shape"),
        ((ok, {"w": np.ones(4, np.float64)}), {}, "'w'.*dtype"),
        ((ok, {"v": np.ones(4, np.float32)}), {}, "different tensors"),
        (([1, 2],), {}, "mapping"),
        (({"w": [1.0, 2.0]},), {}, None),  # a list is accepted as a NumPy array of float64
    ]
    for args, kw, msg in cases:
        if msg is None:
            gpu_codec.compress(*args, **kw)
            continue
        with pytest.raises(InvalidInputError, match=msg):
            gpu_codec.compress(*args, **kw)


def test_overflowing_delta_is_rejected():
    big = np.finfo(np.float32).max
    with pytest.raises(InvalidInputError, match=r"'w'.*non-finite"):
        gpu_codec.compress({"w": np.array([big], np.float32)}, {"w": np.array([-big], np.float32)})


def test_decompress_base_mismatch():
    p = gpu_codec.compress({"w": np.ones(4, np.float32)}, fraction=0.5)
    with pytest.raises(InvalidInputError, match="'w'"):
        gpu_codec.decompress(p.to_bytes(), base={"w": np.ones(5, np.float32)})
    with pytest.raises(InvalidInputError, match="different tensors"):
        gpu_codec.decompress(p.to_bytes(), base={"x": np.ones(4, np.float32)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_rejects_bad_indices_without_output(backend):
    from gpu_codec.format import TensorRecord

    for idx in ([1, 7], [2, 2], [3, 1]):
        rec = TensorRecord(
            "w", "float32", (5,), "coo", 2, {"indices": np.array(idx, np.uint32), "values": np.ones(2, np.float32)}
        )
        with use_backend(backend), pytest.raises(PayloadIndexError, match="'w'"):
            gpu_codec.decompress(gpu_codec.Payload([rec], []))


def test_forcing_backends(monkeypatch):
    monkeypatch.setenv("GPU_CODEC_BACKEND", "tpu")
    gpu_codec.reset_backend()
    with pytest.raises(InvalidInputError, match="GPU_CODEC_BACKEND"):
        gpu_codec.get_backend()
    if not HAS_GPU:
        monkeypatch.setenv("GPU_CODEC_BACKEND", "gpu")
        gpu_codec.reset_backend()
        with pytest.raises(BackendUnavailableError, match="no GPU"):
            gpu_codec.get_backend()
    monkeypatch.setenv("GPU_CODEC_BACKEND", "cpu")
    gpu_codec.reset_backend()
    info = gpu_codec.backend_info()
    assert info["backend"] == "cpu" and "forced" in info["reason"]
    monkeypatch.delenv("GPU_CODEC_BACKEND")
    gpu_codec.reset_backend()
    info = gpu_codec.backend_info()
    assert info["backend"] == ("gpu" if HAS_GPU else "cpu")
    if HAS_GPU:
        assert "name" in info["device"]


def test_kept_count_uses_the_decimal_fraction():
    assert gpu_codec.kept_count(0.01, 100) == 1
    assert gpu_codec.kept_count(0.1, 30) == 3
    assert gpu_codec.kept_count(1e-12, 5) == 1
    assert gpu_codec.kept_count(0.3, 10) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_mixed_dtype_models(backend):
    """Many small random models mixing dtypes, sizes around the chunk size and tie-heavy values."""
    torch = pytest.importorskip("torch")
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    rng = np.random.default_rng(1234)
    for trial in range(6):
        nt = int(rng.integers(1, 6))
        names = [f"p{i}" for i in range(nt)]
        dts = [DTYPES[int(rng.integers(0, 4))] for _ in names]
        sizes = [int(rng.choice([0, 1, 255, 4095, 4097, 9000])) for _ in names]
        kind = ["normal", "ties"][trial % 2]
        new_np = {n: make(rng, (s,), "float32" if d == "bfloat16" else d, kind) for n, d, s in zip(names, dts, sizes)}
        base_np = {
            n: make(rng, (s,), "float32" if d == "bfloat16" else d, "normal") for n, d, s in zip(names, dts, sizes)
        }
        new = {n: torch.from_numpy(np.asarray(new_np[n])).to(tdt[d]) for n, d in zip(names, dts)}
        base = {n: torch.from_numpy(np.asarray(base_np[n])).to(tdt[d]) for n, d in zip(names, dts)}
        ref_new = {
            n: (new[n].view(torch.int16).numpy().view(np.uint16) if d == "bfloat16" else new[n].numpy())
            for n, d in zip(names, dts)
        }
        ref_base = {
            n: (base[n].view(torch.int16).numpy().view(np.uint16) if d == "bfloat16" else base[n].numpy())
            for n, d in zip(names, dts)
        }
        fraction = float(rng.choice([0.001, 0.05, 0.5]))
        scope = ["global", "per_tensor"][int(rng.integers(0, 2))]
        with use_backend(backend):
            p = gpu_codec.compress(new, base, fraction=fraction, scope=scope)
        ref = reference_topk(ref_new, ref_base, fraction, scope, "magnitude", dict(zip(names, dts)))
        for r in p.tensors:
            np.testing.assert_array_equal(as_numpy(r.buffers["indices"]), ref[r.name][0], err_msg=f"{trial} {r.name}")
            assert as_numpy(r.buffers["values"]).tobytes() == ref[r.name][1].tobytes(), (trial, r.name)


def test_encode_coo_runs_its_checks_and_stages_under_the_inputs_stream(monkeypatch):
    """encode_coo hands every input to the backend's stream context (device, caller's stream, allocator), and
    reads the entries only inside it."""
    import contextlib

    from gpu_codec.engine import SparseEntries, encode_coo

    be = gpu_codec.get_backend()
    seen, inside = [], []
    asarray = be.asarray

    @contextlib.contextmanager
    def stream(tensors):
        seen.append([t.data for t in tensors])
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    def checked_asarray(a):
        assert inside, "an entry was read outside the stream context"
        return asarray(a)

    monkeypatch.setattr(be, "stream", stream)
    monkeypatch.setattr(be, "asarray", checked_asarray)
    idx, val = np.array([1, 3]), np.array([0.5, -2.0], np.float32)
    idx2, val2 = np.array([0]), np.array([1.0], np.float32)
    p = encode_coo(
        {"a": SparseEntries(idx, val, (2, 2), "float32"), "b": SparseEntries(idx2, val2, (3,), "float32")},
        pipeline=[gpu_codec.Quantize("float16")],
    )
    assert len(seen) == 1 and [np.shares_memory(x, y) for x, y in zip(seen[0], (idx, val, idx2, val2))] == [True] * 4
    assert gpu_codec.decompress(p.to_bytes())["a"].tolist() == [[0.0, 0.5], [0.0, -2.0]]
