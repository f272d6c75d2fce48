"""The Flower example end to end: ClientApp and ServerApp driven with real messages through Flower's wire format."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("flwr.serverapp")
pytest.importorskip("torch")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.common import serde
from flwr.proto.message_pb2 import Message as ProtoMessage

import gpu_codec
from gpu_codec.flower import _GUARD, STYPE_GPU_CODEC, array_payload

ROUNDS, CLIENTS = 3, 3


def load_example():
    name = "gpu_codec_example_flower_app"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flower" / "app.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def parsed(blob: bytes):
    proto = ProtoMessage()
    proto.ParseFromString(blob)
    return serde.message_from_proto(proto)


def model_bytes(record) -> bytes:
    return b"".join(record[k].data for k in record)


@pytest.fixture(scope="module")
def runs():
    app = load_example()
    return {c: app.run(c, ROUNDS, CLIENTS) for c in (True, False)}


def test_accuracy_matches_an_uncompressed_run(runs):
    comp, plain = runs[True], runs[False]
    assert len(comp["history"]) == ROUNDS + 1 and comp["history"][0] < 0.3  # starts near chance
    assert plain["accuracy"] > 0.9
    assert comp["accuracy"] >= plain["accuracy"] - 0.03, (comp["history"], plain["history"])


def test_bytes_on_the_wire(runs):
    app = load_example()
    comp, plain = runs[True], runs[False]
    ups = [parsed(b) for d, b in comp["grid"].messages if d == "up"]
    downs = [parsed(b) for d, b in comp["grid"].messages if d == "down"]
    assert len(ups) == len(downs) == ROUNDS * CLIENTS
    for m in ups:
        (rec,) = m.content.array_records.values()
        assert list(rec) == ["gpu_codec"]
        a = rec["gpu_codec"]
        assert (a.dtype, a.stype) == (STYPE_GPU_CODEC, "numpy.ndarray") and a.data.startswith(_GUARD)
        p = gpu_codec.Payload.from_bytes(a.data[len(_GUARD) :])
        assert [s["id"] for s in p.pipeline] == ["topk", "quantize", "rice", "zstd"]
        assert p.nnz == gpu_codec.kept_count(0.1, sum(r.numel for r in p.tensors))
    assert comp["up_bytes"] < 0.3 * plain["up_bytes"]
    # the global model goes down compressed and losslessly: round 1 decodes to the initial model, bit for bit
    first = downs[0].content["arrays"]
    assert first["gpu_codec"].dtype == STYPE_GPU_CODEC
    sd = app.net().state_dict()
    dense = gpu_codec.decompress(array_payload(first["gpu_codec"]))
    assert list(dense) == list(sd)
    assert all(np.array_equal(dense[k], sd[k].numpy()) for k in sd)
    assert downs[0].content["config"]["gpu_codec.accept"] == STYPE_GPU_CODEC
    # error feedback lives in each client's Context state between rounds
    for ctx in comp["grid"]._contexts.values():
        blob = ctx.state.config_records["gpu_codec.error_feedback.arrays"]["state"]
        assert gpu_codec.ErrorFeedback.from_bytes(blob).names() == list(sd)


def test_server_aggregate_is_independent_of_reply_order(runs):
    app = load_example()

    class ReversedGrid(app.InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            return super().send_and_receive(messages, timeout=timeout)[::-1]

    orig = app.InProcessGrid
    app.InProcessGrid = ReversedGrid
    try:
        rev = app.run(True, ROUNDS, CLIENTS)
    finally:
        app.InProcessGrid = orig
    assert model_bytes(rev["arrays"]) == model_bytes(runs[True]["arrays"])


def test_stock_server_gets_plain_replies_from_the_mod(runs):
    app = load_example()
    mixed = app.run(False, ROUNDS, CLIENTS, client_app=app.make_client_app(True))
    for d, blob in mixed["grid"].messages:
        (rec,) = parsed(blob).content.array_records.values()
        assert all(rec[k].dtype == "float32" for k in rec), d
    # without the server's accept flag the mod sends the reply as it is: the run is the uncompressed one
    assert model_bytes(mixed["arrays"]) == model_bytes(runs[False]["arrays"])


def test_stock_client_is_told_what_to_install():
    app = load_example()
    out = app.run(True, 1, 2, client_app=app.make_client_app(False))
    ups = [parsed(b) for d, b in out["grid"].messages if d == "up"]
    assert ups and all(m.has_error() for m in ups)
    for m in ups:
        assert m.error.reason.startswith("ValueError") and "pip install 'gpu_codec[flower]'" in m.error.reason
