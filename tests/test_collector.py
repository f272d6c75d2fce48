"""gpu_codec.collector: the engine's calls hold automatic garbage collection off while they run and hand it back as
they found it (on, off by the caller, after an error, across threads); ``set_paused(False)`` leaves it alone."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import weakref

import numpy as np
import pytest

import gpu_codec
from gpu_codec import collector
from gpu_codec import encode as encode_mod

from .common import BACKENDS, use_backend


@pytest.fixture(autouse=True)
def restored():
    was = gc.isenabled()
    yield
    collector.set_paused(True)
    (gc.enable if was else gc.disable)()


def update(n: int = 40):
    rng = np.random.default_rng(0)
    new = {f"t{i}": rng.standard_normal(50 + i).astype(np.float32) for i in range(n)}
    return new, {k: np.zeros_like(v) for k, v in new.items()}


def calls(new, base):
    """Each call of the engine that holds the collector, made once."""
    p = gpu_codec.compress(new, base, fraction=0.1)
    blob = p.to_bytes()
    gpu_codec.Payload.from_bytes(blob)
    gpu_codec.decompress(blob, base=base)
    agg = gpu_codec.Aggregator(base=base)
    agg.add(blob)
    agg.result()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_calls_run_with_the_collector_off_and_leave_it_on(backend, monkeypatch):
    seen = []
    real = encode_mod.tensor_table
    monkeypatch.setattr(encode_mod, "tensor_table", lambda xs: seen.append(gc.isenabled()) or real(xs))
    gc.enable()
    with use_backend(backend):
        calls(*update())
    assert seen and not any(seen)
    assert gc.isenabled()


def test_no_collection_runs_inside_a_call():
    """With a collection due at nearly every allocation: none inside a compress past its tensor table when the
    collector is held, many when it is left alone."""
    new, base = update(200)
    mode, inside, during, holds = ["held"], [False], [], []

    def seen(phase, info):
        if phase == "start" and inside[0] and (collector._inside or mode[0] == "free"):  # (inside the hold)
            during.append(mode[0])

    real = encode_mod.tensor_table

    def marked(xs):
        inside[0] = True
        holds.append(collector._inside)
        return real(xs)

    old = gc.get_threshold()
    encode_mod.tensor_table = marked
    gc.callbacks.append(seen)
    gc.set_threshold(1)
    try:
        for m in ("held", "free"):
            mode[0] = m
            collector.set_paused(m == "held")
            blob = gpu_codec.compress(new, base, fraction=0.1)
            inside[0] = False
    finally:
        encode_mod.tensor_table = real
        gc.set_threshold(*old)
        gc.callbacks.remove(seen)
    half = len(holds) // 2  # (the held call ran inside the hold, the other not)
    assert half and set(holds[:half]) == {1} and set(holds[half:]) == {0}
    assert "held" not in during
    assert during.count("free") > 10
    assert len(gpu_codec.decompress(blob.to_bytes(), base=base)) == len(new)


def test_a_caller_that_turned_the_collector_off_finds_it_off():
    gc.disable()
    calls(*update())
    assert not gc.isenabled()


def test_an_error_hands_the_collector_back():
    new, base = update()
    gc.enable()
    with pytest.raises(gpu_codec.errors.InvalidInputError):
        gpu_codec.compress(new, base, fraction=2.0)
    with pytest.raises(gpu_codec.errors.PayloadError):
        gpu_codec.decompress(b"GPUCODEC" + bytes(40))
    assert gc.isenabled()


@contextlib.contextmanager
def another_thread_inside():
    """Another thread inside a held call until the block ends."""
    entered, release = threading.Event(), threading.Event()

    def long_call():
        with collector.collector_paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=long_call)
    t.start()
    entered.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join(10)


def test_threads_share_one_hold():
    gc.enable()
    states = []
    with another_thread_inside():
        with collector.collector_paused():
            states.append(gc.isenabled())
        states.append(gc.isenabled())  # (the other thread is still inside)
    states.append(gc.isenabled())
    assert states == [False, False, True]


def test_calls_that_overlap_without_a_break_do_not_starve_the_collector():
    # With one thread always inside a call, the shared hold never handed collection back: a server's threads
    # decoding back to back left every reference cycle of the process uncollected.
    class Node:
        pass

    gc.enable()
    old = gc.get_threshold()
    with another_thread_inside():
        try:
            gc.set_threshold(50)
            cycle = Node()
            cycle.me = cycle
            gone = weakref.ref(cycle)
            del cycle
            junk = [[] for _ in range(200)]  # (past the youngest generation's threshold)
            with collector.collector_paused():
                pass
            assert not gc.isenabled()  # (the other thread is still inside)
            assert gone() is None
            del junk
        finally:
            gc.set_threshold(*old)
    assert gc.isenabled()


def test_a_call_inside_another_of_its_threads_runs_no_collection():
    # (Aggregator.add reads its payload by from_bytes, a held call inside a held call: leaving it ran the owed
    # collection inside add, as if another thread were inside)
    gc.enable()
    old, seen = gc.get_threshold(), []

    def started(phase, info):
        if phase == "start":
            seen.append(info)

    gc.callbacks.append(started)
    try:
        gc.set_threshold(10)
        with collector.collector_paused():
            before = len(seen)
            junk = [[] for _ in range(200)]
            with collector.collector_paused():
                pass
            during = len(seen) - before
            del junk
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(started)
    assert during == 0 and gc.isenabled()


def test_set_paused_false_leaves_the_collector_alone(monkeypatch):
    seen = []
    real = encode_mod.tensor_table
    monkeypatch.setattr(encode_mod, "tensor_table", lambda xs: seen.append(gc.isenabled()) or real(xs))
    gc.enable()
    collector.set_paused(False)
    assert not collector.paused()
    calls(*update())
    assert seen and all(seen)
    with pytest.raises(gpu_codec.errors.InvalidInputError, match="True or False"):
        collector.set_paused(1)


def test_the_benchmark_times_both_modes(tmp_path):
    from benchmarks import bench_collector

    out = tmp_path / "collector.json"
    argv = ["--entries", "split-2^23-100", "--calls", "2", "--rounds", "2", "--max-params", "20000", "--out", str(out)]
    assert bench_collector.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["op"] for r in doc["rows"]] == list(bench_collector.OPS)
    for r in doc["rows"]:
        assert r["held"]["calls"] == r["free"]["calls"] == 4
        assert r["mean_held_over_free"] == pytest.approx(r["held"]["mean_ms"] / r["free"]["mean_ms"])
    assert doc["tracked_objects"] > 0 and doc["machine"]["simd"]
    assert "| split-2^23-100 | 100 | compress |" in out.with_suffix(".md").read_text()
    assert collector.paused()  # (set back after the run)
    with pytest.raises(SystemExit):
        bench_collector.main(argv)  # (an existing output is not replaced without --force)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_calls_leave_no_reference_cycle(backend):
    """What a call makes is freed when it returns, by reference counts alone: holding the collector off delays
    nothing (a cycle holding an update's arrays would stay until the next collection)."""
    new, base = update(60)
    with use_backend(backend):
        p = gpu_codec.compress(new, base, fraction=0.1)
        blob = p.to_bytes()
        agg = gpu_codec.Aggregator(base=base)
        steps = {
            "compress": lambda: gpu_codec.compress(new, base, fraction=0.1),
            "to_bytes": p.to_bytes,
            "from_bytes": lambda: gpu_codec.Payload.from_bytes(blob),
            "decompress": lambda: gpu_codec.decompress(blob, base=base),
            "decompress without base": lambda: gpu_codec.decompress(blob),
            "Aggregator": lambda: gpu_codec.Aggregator(base=base),
            "add": lambda: agg.add(blob),
            "result": agg.result,
        }
        left = {}
        for name, step in steps.items():
            step()  # (first calls fill caches)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                step()
                gc.collect()
                left[name] = sorted({type(o).__name__ for o in gc.garbage})
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
    assert left == {name: [] for name in steps}
