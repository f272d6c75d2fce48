"""Cross-stream ordering on a device backend, checked without a GPU: a NumPy backend that says it is on a device,
with a recording fake of CuPy's stream and event API (``xp.cuda``), runs the aggregator and error feedback; the
log shows which stream every wait, record and limb pass ran on."""

from __future__ import annotations

import contextlib
import itertools
import types

import numpy as np
import pytest

import gpu_codec
from gpu_codec.backends import events, using_backend
from gpu_codec.backends.cpu import CpuBackend


class FakeCuda:
    """``cupy.cuda``'s Event / get_current_stream / Stream.wait_event, logging (what, stream, event id)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = "default"
        self.finished = False  # what every Event.done answers
        ids = itertools.count(1)
        cuda = self

        class Event:
            def __init__(self, disable_timing=False):
                self.id = next(ids)

            def record(self, stream=None):
                cuda.log.append(("record", cuda.current if stream is None else stream.name, self.id))

            @property
            def done(self):
                return cuda.finished

            def synchronize(self):
                cuda.log.append(("event_sync", None, self.id))

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_event(self, ev):
                cuda.log.append(("wait", self.name, ev.id))

            def synchronize(self):
                cuda.log.append(("sync", self.name, None))

        self.Event, self._Stream = Event, Stream

    def get_current_stream(self):
        return self._Stream(self.current)


class _XP:
    """NumPy with a ``cuda`` attribute, as CuPy has."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __getattr__(self, name):
        return getattr(np, name)


class StreamedBackend(CpuBackend):
    """NumPy arithmetic, device bookkeeping: ``stream()`` makes the fake "caller" stream current (as the GPU
    backend makes a torch stream current) and synchronizes it on the way out."""

    on_device = True

    def __init__(self):
        self.cuda = FakeCuda()
        self.xp = _XP(self.cuda)

    @contextlib.contextmanager
    def stream(self, tensors):
        prev, self.cuda.current = self.cuda.current, "caller"
        try:
            with events.scope(self):  # as GpuBackend.stream ends
                yield
        finally:
            self.cuda.current = prev

    def to_host(self, a):
        self.cuda.log.append(("to_host", self.cuda.current, None))  # a blocking copy: waits for the stream
        return np.asarray(a)

    def limb_mean(self, *args):
        self.cuda.log.append(("limb_mean", self.cuda.current, None))
        super().limb_mean(*args)

    def limb_accumulate(self, *args):
        self.cuda.log.append(("limb_add", self.cuda.current, None))
        super().limb_accumulate(*args)


def _index(log, entry):
    assert entry in log, (entry, log)
    return log.index(entry)


def test_events_do_nothing_on_a_host_backend():
    assert events.record(CpuBackend()) is None
    events.wait(CpuBackend(), object())  # no cuda attribute needed


def test_aggregator_mean_waits_for_the_adds_on_the_callers_stream():
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal(64).astype(np.float32)}
    ps = [gpu_codec.compress({"w": base["w"] + rng.standard_normal(64).astype(np.float32)}, base, fraction=0.25)]
    want = gpu_codec.aggregate(ps, base=base)["w"]
    b = StreamedBackend()
    with using_backend(b):
        agg = gpu_codec.Aggregator(base=base)
        agg.add(ps[0])  # outside any call's stream: on the current ("default") stream
        log = b.cuda.log
        add = _index(log, ("limb_add", "default", None))
        rec = next(e for e in log[add:] if e[0] == "record")
        assert rec[1] == "default"
        got = agg.result()["w"]
    # the mean runs on the caller's stream, after it waited for the adds' event; the call syncs that stream
    wait = _index(log, ("wait", "caller", rec[2]))
    mean = _index(log, ("limb_mean", "caller", None))
    assert wait < mean < _index(log, ("sync", "caller", None))
    np.testing.assert_array_equal(got, want)


def test_aggregator_add_waits_for_the_previous_add():
    base = {"w": np.zeros(8, np.float32)}
    p = gpu_codec.compress({"w": np.arange(8, dtype=np.float32)}, base, fraction=0.5)
    b = StreamedBackend()
    with using_backend(b):
        agg = gpu_codec.Aggregator(base=base)
        agg.add(p)
        first = next(e for e in b.cuda.log if e[0] == "record")
        b.cuda.current = "other"
        agg.add(p)
    log = b.cuda.log
    assert _index(log, ("wait", "other", first[2])) < _index(log, ("limb_add", "other", None))


def test_error_feedback_from_bytes_upload_is_waited_for():
    rng = np.random.default_rng(1)
    u = {"w": rng.standard_normal(32).astype(np.float32)}
    ef = gpu_codec.ErrorFeedback()
    gpu_codec.compress(u, fraction=0.25, residual=ef)
    blob = ef.to_bytes()
    b = StreamedBackend()
    with using_backend(b):
        loaded = gpu_codec.ErrorFeedback.from_bytes(blob)
        rec = [e for e in b.cuda.log if e[0] == "record"]
        assert rec and rec[-1][1] == "default"  # the uploads' stream
        gpu_codec.compress(u, fraction=0.25, residual=loaded)
    log = b.cuda.log
    # the compress (on the caller's stream) waits for the upload's event before anything else on that stream
    assert ("wait", "caller", rec[-1][2]) in log
    # and the residual it stores is marked by an event on the caller's stream, after the wait
    after = log[_index(log, ("wait", "caller", rec[-1][2])) :]
    assert any(e[0] == "record" and e[1] == "caller" for e in after)
    np.testing.assert_array_equal(loaded.residual("w").shape, (32,))


@pytest.mark.parametrize("reader", ["residual", "compress"])
def test_error_feedback_readers_wait_for_the_stored_residual(reader):
    u = {"w": np.arange(16, dtype=np.float32)}
    b = StreamedBackend()
    with using_backend(b):
        ef = gpu_codec.ErrorFeedback()
        gpu_codec.compress(u, fraction=0.25, residual=ef)
        ev = [e for e in b.cuda.log if e[0] == "record"][-1]
        b.cuda.current = "reader"
        if reader == "residual":
            ef.residual("w")
            assert ("wait", "reader", ev[2]) in b.cuda.log
        else:
            gpu_codec.compress(u, fraction=0.25, residual=ef)
            assert ("wait", "caller", ev[2]) in b.cuda.log


def test_nonblocking_compress_records_an_event_instead_of_waiting():
    u = {"w": np.arange(64, dtype=np.float32)}
    want = gpu_codec.compress(u, fraction=0.1).to_bytes()
    b = StreamedBackend()
    with using_backend(b):
        pending = gpu_codec.compress(u, fraction=0.1, blocking=False)
    log = b.cuda.log
    assert ("sync", "caller", None) not in log  # the call did not wait for its stream
    rec = [e for e in log if e[0] == "record" and e[1] == "caller"]
    assert rec and not pending.ready() and "in flight" in repr(pending)
    b.cuda.finished = True
    assert pending.ready()
    assert pending.to_bytes() == want
    assert ("event_sync", None, rec[-1][2]) in log  # to_bytes waited on the call's event
    with using_backend(b):
        gpu_codec.compress(u, fraction=0.1)
    assert log[-1] == ("sync", "caller", None)  # a blocking call still waits at its end


def test_gpu_backend_stream_finishes_with_a_sync_or_a_deferred_event(monkeypatch):
    """GpuBackend.stream on a fake CuPy (no torch inputs): a sync at its end, an event inside events.deferred."""
    gpu = pytest.importorskip("gpu_codec.backends.gpu")
    cuda = FakeCuda()
    cuda.Device = lambda d=None: types.SimpleNamespace(id=0)
    xp = types.SimpleNamespace(cuda=cuda)
    runner = types.SimpleNamespace(xp=xp)
    backend = gpu.GpuBackend(runner)
    with backend.stream([]):
        pass
    assert cuda.log == [("sync", "default", None)]
    with events.deferred() as recorded, backend.stream([]):
        pass
    assert [e.id for e in recorded] == [1] and cuda.log[-1] == ("record", "default", 1)


def test_a_scope_ends_without_a_second_wait_after_its_one_read(monkeypatch):
    """GpuBackend.stream on a fake CuPy: a block marked as having waited for its stream (the one joined read of
    an encode's host values) ends without a sync; the mark is the block's own (a nested scope's does not carry
    out, and outside any scope it does nothing); inside events.deferred the event is still recorded."""
    gpu = pytest.importorskip("gpu_codec.backends.gpu")
    cuda = FakeCuda()
    cuda.Device = lambda d=None: types.SimpleNamespace(id=0)
    backend = gpu.GpuBackend(types.SimpleNamespace(xp=types.SimpleNamespace(cuda=cuda)))
    events.waited()  # (outside a scope: nothing to mark)
    with backend.stream([]):
        events.waited()
    assert cuda.log == []
    with backend.stream([]):
        with backend.stream([]):
            events.waited()
        assert cuda.log == []
    assert cuda.log == [("sync", "default", None)]  # the outer block was not marked
    with events.deferred() as recorded, backend.stream([]):
        events.waited()
    assert [e.id for e in recorded] == [1] and cuda.log[-1] == ("record", "default", 1)


@pytest.mark.parametrize("stages", [("rice",), ("ternary",), ("float16", "rice", "zstd")])
def test_compress_reads_its_host_values_once_and_does_not_wait_again(stages):
    """A compress whose stages need device values on the host reads them in one copy at its end, which waits
    for the caller's stream: the call does not sync that stream again; its bytes are the CPU's."""
    make = {
        "rice": gpu_codec.RiceIndices,
        "ternary": gpu_codec.Ternary,
        "float16": lambda: gpu_codec.Quantize("float16"),
    }
    make["zstd"] = gpu_codec.Zstd
    rng = np.random.default_rng(3)
    u = {f"t{i}": rng.standard_normal(500 + 100 * i).astype(np.float32) for i in range(4)}
    want = gpu_codec.compress(u, fraction=0.1, pipeline=[make[s]() for s in stages]).to_bytes()
    b = StreamedBackend()
    with using_backend(b):
        got = gpu_codec.compress(u, fraction=0.1, pipeline=[make[s]() for s in stages]).to_bytes()
    assert got == want
    log = [e for e in b.cuda.log if e[1] == "caller"]
    assert log.count(("to_host", "caller", None)) == 1 and ("sync", "caller", None) not in log
    with using_backend(b):
        gpu_codec.compress(u, fraction=0.1)
    assert b.cuda.log[-1] == ("sync", "caller", None)  # without such stages, the call's wait is its sync
