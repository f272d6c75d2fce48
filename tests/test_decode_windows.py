"""A window of small zstd records decoded at once (gpu_codec.codecs.pipeline._decoded_many: their frames read once,
their layouts by the rules' ``many``, their values by one call, their Rice streams together) against each record
decoded alone: the same outputs of decompress (onto a base and not) and of an aggregator's add, and where a record
is broken, the same error naming the same tensor."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import gpu_codec
from gpu_codec import Quantize, RiceIndices, Zstd
from gpu_codec.codecs import pipeline as P
from gpu_codec.codecs import wire_layouts
from gpu_codec.format import v2
from gpu_codec.payload import Payload

from .common import BACKENDS, use_backend

PIPES = {
    "f16+rice+zstd": lambda: [Quantize("float16"), RiceIndices(), Zstd()],
    "bf16+zstd": lambda: [Quantize("bfloat16"), Zstd(1)],
    "f32+rice+zstd": lambda: [Quantize("float32"), RiceIndices(), Zstd()],
    "rice+zstd": lambda: [RiceIndices(), Zstd()],
    "f16+rice": lambda: [Quantize("float16"), RiceIndices()],  # (no bytes stage: each record's own buffers)
    "bf16": lambda: [Quantize("bfloat16")],
    "rice": lambda: [RiceIndices()],
}


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    """The window limits scaled down with the updates below (a record of more than 128 entries is decoded alone, a
    window holds at most 512 entries), so that every limit is crossed by an update the emulator decodes fast."""
    monkeypatch.setattr(P, "RICE_MOST", 128)
    monkeypatch.setattr(P, "RICE_MANY", 512)


def update(seed: int, dtype=np.float32):
    """Uneven tensors: many small ones, a few whose entries are too many for a window, one of zeros (nothing
    kept)."""
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.choice([3, 40, 700, 2000], 90)] + [30_000, 7, 20_000]
    new = {f"t{i}": rng.standard_normal(n).astype(dtype) for i, n in enumerate(sizes)}
    new["frozen"] = np.zeros(64, dtype)
    base = {k: (rng.standard_normal(v.size) * 0.1).astype(dtype) for k, v in new.items()}
    new["frozen"] = base["frozen"].copy()
    return new, base


def outcome(fn):
    try:
        out = fn()
        return "ok", {k: (np.asarray(v).dtype.str, np.asarray(v).tobytes()) for k, v in out.items()}
    except gpu_codec.errors.PayloadError as e:
        return type(e).__name__, str(e)


def payloads(pipe: str, seed: int, dtype=np.float32):
    """The payload object, and its bytes in each data layout (one frame a record, one shared frame, plain)."""
    new, base = update(seed, dtype)
    with use_backend("cpu"):
        p = gpu_codec.compress(new, base, fraction=0.01, pipeline=PIPES[pipe]())
    lay = wire_layouts()
    modes = (v2.DATA_RECORDS, v2.DATA_ZSTD, v2.DATA_PLAIN)
    blobs = {m: v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, lay, data_mode=m)) for m in modes}
    return p, blobs, base


def runs(inputs, base, backend):
    with use_backend(backend):
        for x in inputs:
            yield outcome(lambda x=x: gpu_codec.decompress(x, base=base))
            yield outcome(lambda x=x: gpu_codec.decompress(x))
            agg = gpu_codec.Aggregator(base=base)
            yield outcome(lambda x=x, agg=agg: (agg.add(x), agg.result())[1])


def both(inputs, base, backend, monkeypatch):
    """Each input's outcomes with windows, then with every record decoded alone; the count of records the windows
    decoded."""
    seen = []
    real = P._decode_window
    monkeypatch.setattr(P, "_decode_window", lambda pipe, w, *a: seen.append(len(r := real(pipe, w, *a))) or r)
    windows = list(runs(inputs, base, backend))
    with monkeypatch.context() as m:
        m.setattr(P, "_decoded_many", lambda *a: None)
        alone = list(runs(inputs, base, backend))
    assert windows == alone
    return windows, sum(seen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_windows_decode_what_records_decoded_alone_decode(pipe, backend, monkeypatch):
    p, blobs, base = payloads(pipe, 0)
    got, decoded = both([p, *blobs.values()], base, backend, monkeypatch)
    assert {o[0] for o in got} == {"ok"}
    assert decoded >= 3 * 4 * 80  # (three calls on each of four inputs, the small records of each in windows)


def test_fp64_and_fp16_tensors_decode_in_windows_as_alone(monkeypatch):
    for dtype in (np.float64, np.float16):
        p, blobs, base = payloads("f16+rice+zstd", 1, dtype)
        got, decoded = both([p, blobs[v2.DATA_ZSTD]], base, "cpu", monkeypatch)
        assert {o[0] for o in got} == {"ok"} and decoded


def flawed(p: Payload, j: int, how: str) -> Payload:
    recs = list(p.tensors)
    r = recs[j]
    c = dict(r.codec)
    ic = dict(c["ic"]) if "ic" in c else c
    if "ic" in c:
        c["ic"] = ic
    bufs = dict(r.buffers)
    if how == "frame byte" and "compressed" in bufs:
        a = bufs["compressed"].copy()
        a[len(a) // 2] ^= 0x5A
        bufs["compressed"] = a
    elif how == "frame cut" and "compressed" in bufs:
        bufs["compressed"] = bufs["compressed"][:-1]
    elif how == "raw" and "raw" in c:
        c["raw"] += 1
    elif how == "bits" and "bits" in ic:
        ic["bits"] += 8
    elif how == "k" and "k" in ic:
        ic["k"] += 1
    elif how == "values form":
        ic["v"] = "bf16" if ic["v"] != "bf16" else "f16"
    elif how == "inner" and "inner" in c:
        c["inner"] = "coo"
    elif how == "values buffer" and "values" in bufs:
        bufs["values"] = bufs["values"][:-1]
    elif how == "indices dtype" and "indices" in bufs:
        bufs["indices"] = bufs["indices"].astype(np.int64)
    elif how == "extra field":
        ic["x"] = 1
    recs[j] = dataclasses.replace(r, codec=c, buffers=bufs)
    return Payload(recs, p.pipeline, p.metadata)


@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_a_broken_record_in_a_window_raises_what_it_raises_alone(pipe, monkeypatch):
    p, _, base = payloads(pipe, 2)
    rng = random.Random(pipe)
    small = [j for j, r in enumerate(p.tensors) if 0 < r.nnz <= P.RICE_MOST]
    inputs, names = [], []
    hows = ["frame byte", "frame cut", "raw", "bits", "k", "values form", "inner", "extra field", "values buffer"]
    for how in hows + ["indices dtype"]:
        j = rng.choice(small[1:-1])
        inputs.append(flawed(p, j, how))
        names.append(p.tensors[j].name)
    got, _ = both(inputs, base, "cpu", monkeypatch)
    refused = [o for o in got if o[0] != "ok"]
    # (a changed bit count or parameter may still decode, the same either way; without zstd, frames and raw sizes
    # are not there to break)
    assert len(refused) >= 3 * (5 if "zstd" in pipe else 2), got
    assert all(any(f"tensor {n!r}" in o[1] for n in names) for o in refused)


def test_records_that_all_hold_another_form_than_the_pipeline_are_refused_as_alone(monkeypatch):
    """Every record's values in another form than the payload's pipeline makes (a window of records that agree
    with each other): refused, as each record decoded alone is."""
    p, _, base = payloads("f16+rice+zstd", 3)
    recs = [dataclasses.replace(r, codec={**r.codec, "ic": {**r.codec["ic"], "v": "bf16"}}) for r in p.tensors]
    got, decoded = both([Payload(recs, p.pipeline, p.metadata)], base, "cpu", monkeypatch)
    assert {o[0] for o in got} == {"PayloadLayoutError"} and decoded == 0
    assert all("holds values 'bf16'" in o[1] for o in got)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pipe", [None, "bf16", "f16+rice"])
@pytest.mark.parametrize("role", ["indices", "values"])
def test_a_record_made_by_hand_with_a_buffer_short_of_its_nnz_is_refused(pipe, role, backend):
    """A payload made by hand whose record holds one index or value fewer than its nnz: a PayloadError naming the
    tensor, with and without a base and in an aggregator (not a NumPy error from a join, nor a silent decode of
    the entries it holds)."""
    rng = np.random.default_rng(5)
    new = {f"t{i}": rng.standard_normal(500).astype(np.float32) for i in range(5)}
    base = {k: np.zeros_like(v) for k, v in new.items()}
    with use_backend("cpu"):
        p = gpu_codec.compress(new, base, fraction=0.05, pipeline=PIPES[pipe]() if pipe else None)
    recs = list(p.tensors)
    bufs = dict(recs[2].buffers)
    bufs[role] = bufs[role][:-1]
    recs[2] = dataclasses.replace(recs[2], buffers=bufs)
    q = Payload(recs, p.pipeline, p.metadata)
    with use_backend(backend):
        for call in (
            lambda: gpu_codec.decompress(q, base=base),
            lambda: gpu_codec.decompress(q),
            lambda: gpu_codec.Aggregator(base=base).add(q),
        ):
            with pytest.raises(gpu_codec.errors.PayloadError, match="tensor 't2'"):
                call()
