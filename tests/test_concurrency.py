"""Several clients compressing and one aggregator decompressing at once give the bytes of a serial run, on every
backend (on the GPU each thread runs on its own stream); one ErrorFeedback shared by threads stays consistent."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gpu_codec
from gpu_codec import ErrorFeedback, Int8Blockwise, Quantize, RiceIndices, Ternary, Zstd

from .common import BACKENDS, use_backend

CLIENTS = 4
ROUNDS = 3
PIPELINES = [
    [Quantize("float16"), RiceIndices(), Zstd()],
    [Ternary(), RiceIndices()],
    [Int8Blockwise(64)],
    None,
]


def base_model():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((40, 50)).astype(np.float32), "b": rng.standard_normal(700).astype(np.float32)}


def client_update(c: int, rnd: int, base: dict) -> dict:
    rng = np.random.default_rng(1000 * c + rnd)
    return {k: (v + rng.standard_t(3, v.shape).astype(np.float32) * 0.1).astype(np.float32) for k, v in base.items()}


def _stream(backend):
    """A fresh CUDA stream per thread on the GPU backend, nothing elsewhere."""
    if getattr(backend, "on_device", False):
        import cupy

        return cupy.cuda.Stream(non_blocking=True)
    return contextlib.nullcontext()


def client_blobs(c: int, base: dict, backend) -> list[bytes]:
    ef = ErrorFeedback()
    out = []
    with _stream(backend):
        for rnd in range(ROUNDS):
            p = gpu_codec.compress(
                client_update(c, rnd, base), base, fraction=0.05, pipeline=PIPELINES[c % len(PIPELINES)], residual=ef
            )
            out.append(p.to_bytes())
    return out


def aggregate(blobs: list[bytes], base: dict) -> dict:
    total = {k: np.zeros(v.size, np.float64) for k, v in base.items()}
    for blob in blobs:
        for k, v in gpu_codec.decompress(blob).items():
            total[k] += np.asarray(v, np.float64).reshape(-1)
    return total


def run_serial(base, backend):
    blobs = {c: client_blobs(c, base, backend) for c in range(CLIENTS)}
    order = [blobs[c][r] for r in range(ROUNDS) for c in range(CLIENTS)]
    return blobs, aggregate(order, base)


def run_threads(base, backend):
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []
    q: queue.Queue = queue.Queue()
    decoded: list[dict] = []

    def client(c):
        try:
            blobs = client_blobs(c, base, backend)
            results[c] = blobs
            for b in blobs:
                q.put(b)
        except BaseException as e:
            errors.append(e)

    def aggregator():
        try:
            with _stream(backend):
                for _ in range(CLIENTS * ROUNDS):
                    blob = q.get(timeout=600)
                    decoded.append({k: np.asarray(v).copy() for k, v in gpu_codec.decompress(blob).items()})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    threads.append(threading.Thread(target=aggregator))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results, decoded


@pytest.mark.parametrize("backend", BACKENDS)
def test_clients_and_aggregator_in_threads_match_a_serial_run(backend):
    base = base_model()
    with use_backend(backend) as be:
        serial, serial_sum = run_serial(base, be)
        threaded, decoded = run_threads(base, be)
    assert threaded == serial  # every client's payloads, to the byte
    total = {k: np.zeros(v.size, np.float64) for k, v in base.items()}
    for d in decoded:  # the aggregator saw them in another order: the same set of decoded updates
        for k, v in d.items():
            total[k] += np.asarray(v, np.float64).reshape(-1)
    for k in base:
        np.testing.assert_allclose(total[k], serial_sum[k], rtol=0, atol=1e-9)
    assert len(decoded) == CLIENTS * ROUNDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_error_feedback_shared_by_threads_stays_consistent(backend):
    """Threads sharing one state take turns: the payloads are those of a serial run (in some order) and the
    final residual is the serial one."""
    n_threads = 6
    u = client_update(0, 0, base_model())
    with use_backend(backend) as be:
        ef_serial = ErrorFeedback()
        serial = [
            gpu_codec.compress(u, fraction=0.05, pipeline=[Quantize("float16")], residual=ef_serial).to_bytes()
            for _ in range(n_threads)
        ]
        ef = ErrorFeedback()
        got: list[bytes] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(n_threads)

        def work():
            try:
                barrier.wait()
                with _stream(be):
                    got.append(
                        gpu_codec.compress(u, fraction=0.05, pipeline=[Quantize("float16")], residual=ef).to_bytes()
                    )
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(got) == sorted(serial)
        assert ef.to_bytes() == ef_serial.to_bytes()


@pytest.fixture
def fast_switching():
    """Threads switch at every chance, so a race shows within a few calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_one_received_payload_decoded_by_threads_at_once(fast_switching):
    # A payload read by from_bytes whose tensors share one zstd frame reads it through shared cursors: from several
    # threads at once they raised, wrote wrong bytes, gave undecodable to_bytes() and crashed the interpreter.
    rng = np.random.default_rng(0)
    update = {f"layer.{i}.w": rng.standard_normal(1000 + i).astype(np.float32) for i in range(20)}
    blob = gpu_codec.compress(update, fraction=0.05, pipeline=[Quantize("float16"), RiceIndices(), Zstd()]).to_bytes()
    ref = gpu_codec.decompress(gpu_codec.Payload.from_bytes(blob))
    for _ in range(6):
        p = gpu_codec.Payload.from_bytes(blob)
        start = threading.Barrier(8)

        def one(i, p=p, start=start):
            start.wait()
            return gpu_codec.decompress(p) if i % 2 else p.to_bytes()

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(8)))
        for i, g in enumerate(got):
            if i % 2:
                assert all(np.array_equal(g[k], ref[k]) for k in ref)
            else:
                assert g == blob


def test_calls_asking_for_different_thread_counts_share_the_pool(monkeypatch):
    # The pool was shut down and made again whenever a call asked for another size: a call in another thread that
    # had taken the old one then failed with "cannot schedule new futures after shutdown".
    from gpu_codec.cpu_fallback.parallel import parallel_map

    monkeypatch.setenv("GPU_CODEC_THREADS", "8")
    errors = []

    def caller(k):
        for j in range(300):
            items = range(2 + (j + k) % 7)
            try:
                assert parallel_map(lambda x: x * x, items) == [x * x for x in items]
            except Exception as e:
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_backend_info_while_another_thread_resets_the_choice(fast_switching, monkeypatch):
    # backend_info read the choice's record apart from the choice: a reset in between raised KeyError.
    from gpu_codec.backends import reset_backend

    monkeypatch.setenv("GPU_CODEC_BACKEND", "cpu")
    stop, errors = threading.Event(), []

    def resetter():
        while not stop.is_set():
            reset_backend()

    def reader():
        for _ in range(20000):
            try:
                assert gpu_codec.backend_info()["backend"] == "cpu"
            except Exception as e:
                errors.append(repr(e))
                return

    t = threading.Thread(target=resetter)
    t.start()
    readers = [threading.Thread(target=reader) for _ in range(2)]
    try:
        for r in readers:
            r.start()
        for r in readers:
            r.join()
    finally:
        stop.set()
        t.join()
        reset_backend()
    assert errors == []


def test_backend_info_reads_the_choice_and_its_record_together(monkeypatch):
    # (the race above made certain: a reset lands between the choice and the read of its record)
    from gpu_codec import backends

    monkeypatch.setenv("GPU_CODEC_BACKEND", "cpu")
    real = backends.get_backend

    def then_reset():
        b = real()
        backends.reset_backend()
        return b

    monkeypatch.setattr(backends, "get_backend", then_reset)
    try:
        assert backends.backend_info()["backend"] == "cpu"
    finally:
        backends.reset_backend()
