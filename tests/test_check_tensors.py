"""The update's checks over the whole tensor table (gpu_codec.encode._host_tables) accept exactly what the
tensor-by-tensor checks accept, with the same tensors, and leave every error to them."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_codec
from gpu_codec import encode
from gpu_codec.errors import InvalidInputError
from gpu_codec.format import MAX_NAME


class _Name(str):
    pass


def _table(n: int = 12) -> tuple[dict, dict]:
    rng = np.random.default_rng(5)
    new = {f"t{i}": rng.standard_normal((3, i + 1)).astype(np.float32) for i in range(n)}
    base = {k: (v * 0.5).astype(np.float32) for k, v in new.items()}
    return new, base


def _with_and_without_tables(monkeypatch, call):
    """(what ``call()`` returns, or the message it raises) with the table-wide checks, then with the tensor-by-tensor
    ones only."""
    out = []
    for table in (True, False):
        with monkeypatch.context() as m:
            if not table:
                m.setattr(encode, "_host_tables", lambda *a: None)
            try:
                out.append(call())
            except InvalidInputError as e:
                out.append(str(e))
    return out


def _both(monkeypatch, update, base):
    """What the checks return or raise, with and without the table-wide checks."""

    def checked():
        names, news, bases = encode._check_tensors(update, base)
        return (
            names,
            [(t.dtype, t.shape, t.kind, str(t.device), t.data.dtype, t.data.tobytes()) for t in news],
            None if bases is None else [(b.dtype, b.shape, b.kind, b.data.tobytes()) for b in bases],
            (type(news).__name__, type(bases).__name__),  # (tables either way: columns, no object a tensor)
        )

    return _with_and_without_tables(monkeypatch, checked)


def _case(name: str) -> tuple[dict, dict | None]:
    new, base = _table()
    if name == "ok":
        return new, base
    if name == "no base":
        return new, None
    if name == "mixed dtypes":
        new["t3"], base["t3"] = new["t3"].astype(np.float16), base["t3"].astype(np.float16)
        new["t4"], base["t4"] = new["t4"].astype(np.float64), base["t4"].astype(np.float64)
    elif name == "int tensor":
        new["t5"] = np.arange(6, dtype=np.int32).reshape(3, 2)
    elif name == "float scalars":  # (NumPy float scalars: 0-d tensors)
        new["s"], base["s"] = np.float32(3.5), np.float32(1.0)
        new["h"], base["h"] = np.float16(2.0), np.float16(2.0)
    elif name == "big-endian":
        new["t2"] = new["t2"].astype(">f4")
    elif name == "strided":
        new["t7"] = np.asfortranarray(np.ones((3, 8), np.float32))
    elif name == "strided base":
        base["t7"] = np.ones((8, 3), np.float32).T
    elif name == "base shape":
        base["t9"] = base["t9"].reshape(-1)
    elif name == "base dtype":
        base["t1"] = base["t1"].astype(np.float64)
    elif name == "base missing":
        del base["t6"]
    elif name == "base extra":
        base["zz"] = np.ones(2, np.float32)
    elif name == "base reordered":  # (the same names in another order: looked up by name)
        base = dict(reversed(base.items()))
    elif name == "base renamed":  # (as many names, one of them another)
        base = dict(reversed(base.items()))
        base["zz"] = base.pop("t6")
    elif name == "empty name":
        new[""] = np.ones(2, np.float32)
    elif name == "long name":
        new["x" * (MAX_NAME + 1)] = np.ones(2, np.float32)
    elif name == "str subclass name":
        new = {_Name(k): v for k, v in new.items()}
        base = {_Name(k): v for k, v in base.items()}
    elif name == "nine dimensions":
        new["t0"] = np.ones((1,) * 9, np.float32)
        base["t0"] = np.ones((1,) * 9, np.float32)
    elif name == "zero dimension":  # no elements, but the non-zero dimensions exceed the wire format's limit
        new["t0"] = np.empty((0, 1 << 21, 1 << 20), np.float32)
    elif name == "empty tensor":
        new["t0"], base["t0"] = np.empty((0, 3), np.float32), np.empty((0, 3), np.float32)
    elif name.startswith("torch"):
        torch = pytest.importorskip("torch")
        new = {k: torch.from_numpy(v) for k, v in new.items()}
        base = {k: torch.from_numpy(v) for k, v in base.items()}
        new["t3"], base["t3"] = new["t3"].bfloat16(), base["t3"].bfloat16()
        new["t4"], base["t4"] = new["t4"].half(), base["t4"].half()
        new["t5"], base["t5"] = new["t5"].double(), base["t5"].double()
        if name == "torch grad":
            new["t1"] = new["t1"].clone().requires_grad_(True)
        elif name == "torch strided":
            new["t6"] = new["t6"].T
        elif name == "torch int":
            new["t2"] = new["t2"].int()
        elif name == "torch meta":
            new["t7"] = torch.empty(new["t7"].shape, device="meta")
        elif name == "torch sparse":
            new["t8"] = new["t8"].to_sparse()
        elif name == "torch base numpy":
            base["t9"] = base["t9"].numpy()
    elif name == "list":
        new["t8"] = [1.0, 2.0, 3.0]
        base["t8"] = np.ones(3, np.float32)
    else:
        raise AssertionError(name)
    return new, base


CASES = [
    "ok",
    "no base",
    "mixed dtypes",
    "float scalars",
    "int tensor",
    "big-endian",
    "strided",
    "strided base",
    "base shape",
    "base dtype",
    "base missing",
    "base extra",
    "base reordered",
    "base renamed",
    "empty name",
    "long name",
    "str subclass name",
    "nine dimensions",
    "zero dimension",
    "empty tensor",
    "list",
    "torch",
    "torch grad",
    "torch strided",
    "torch int",
    "torch meta",
    "torch sparse",
    "torch base numpy",
]


@pytest.mark.parametrize("name", CASES)
def test_table_checks_match_the_per_tensor_checks(monkeypatch, name):
    update, base = _case(name)
    table, per_tensor = _both(monkeypatch, update, base)
    assert table == per_tensor
    taken = encode._host_tables(update, base, list(update)) is not None
    # (the table checks take these; the others go through the per-tensor checks)
    taken_names = ("ok", "no base", "mixed dtypes", "float scalars", "torch", "torch grad", "base reordered")
    assert taken == (name in taken_names)


@pytest.mark.parametrize(
    "name",
    ["ok", "int tensor", "base dtype", "zero dimension", "mixed dtypes", "float scalars", "torch", "base reordered"],
)
def test_compress_agrees_with_the_per_tensor_checks(monkeypatch, name):
    update, base = _case(name)
    out = _with_and_without_tables(monkeypatch, lambda: gpu_codec.compress(update, base, fraction=0.1).to_bytes())
    assert out[0] == out[1]
    assert isinstance(out[0], bytes) == (name in ("ok", "mixed dtypes", "float scalars", "torch", "base reordered"))
    if name == "base reordered":  # (the base in the update's order or another: the same bytes)
        assert out[0] == gpu_codec.compress(update, _case("ok")[1], fraction=0.1).to_bytes()


class _Converting(dict):
    """A dict whose lookups give what it stores, converted (its ``values()`` give what it stores as it is)."""

    def __getitem__(self, k):
        return super().__getitem__(k) * np.float32(2)


def test_a_dict_that_converts_on_lookup_is_read_by_lookup():
    """An update or a base read in one call where its names come in order is read by its values only where that is
    what a lookup gives: a dict subclass whose own lookup converts is read name by name, compress and decompress
    alike."""
    new, base = _table(6)
    lazy_new = _Converting({k: v / np.float32(2) for k, v in new.items()})  # (halves: exact in fp32)
    lazy_base = _Converting({k: v / np.float32(2) for k, v in base.items()})
    want = gpu_codec.compress(new, base, fraction=0.2).to_bytes()
    assert gpu_codec.compress(lazy_new, lazy_base, fraction=0.2).to_bytes() == want
    out, got = gpu_codec.decompress(want, base=base), gpu_codec.decompress(want, base=lazy_base)
    assert all(got[k].tobytes() == out[k].tobytes() for k in out)
