"""compression_mod and CompressedStrategy with real flwr Messages, driven hook by hook (NumPy models, no torch)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("flwr.serverapp")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

import gpu_codec
from gpu_codec.errors import InvalidInputError
from gpu_codec.flower import ACCEPT_KEY, CompressedStrategy, compression_mod, decode_record

NODES = [11, 12, 13, 14]


class Nodes:
    """The one Grid method FedAvg's sampling uses."""

    def get_node_ids(self):
        return list(NODES)


@pytest.fixture(autouse=True)
def server_identity():
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def global_model() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "w": Array(rng.standard_normal((6, 5)).astype(np.float32)),
            "b": Array(rng.standard_normal(5).astype(np.float16)),
            "steps": Array(np.array([10], np.int64)),
        }
    )


def client_arrays(node: int, rec) -> dict:
    """A client's trained model: floats moved by noise seeded with the node id, integers advanced by it."""
    rng = np.random.default_rng(node)
    new = {}
    for k in rec:
        a = rec[k].numpy()
        new[k] = a + rng.standard_normal(a.shape).astype(a.dtype) if a.dtype.kind == "f" else a + node
    return new


def local_train(node: int):
    """A ClientApp train function written against stock flwr: reads arrays, returns new ones and a weight."""

    def train(msg: Message, context: Context) -> Message:
        rec = msg.content["arrays"]
        assert all(rec[k].stype == "numpy.ndarray" and rec[k].dtype != "gpu_codec.v1" for k in rec)
        new = client_arrays(node, rec)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                "metrics": MetricRecord({"num-examples": node}),
            }
        )
        return Message(content, reply_to=msg)

    return train


def round_trip(strategy, mod, rnd=1, arrays=None):
    arrays = arrays or global_model()
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Nodes()))
    replies, contexts = [], {}
    for m in msgs:
        node = m.metadata.dst_node_id
        ctx = contexts.setdefault(node, Context(1, node, {}, RecordDict(), {}))
        replies.append(mod(m, ctx, local_train(node)) if mod else local_train(node)(decoded(m), ctx))
    return msgs, replies


def decoded(m: Message) -> Message:
    m.content["arrays"] = decode_record(m.content["arrays"])
    return m


def dense_fedavg(arrays: ArrayRecord) -> dict:
    """What the clients' full models average to, computed densely in fp64."""
    models = {n: client_arrays(n, arrays) for n in NODES}
    return {k: sum(n * models[n][k].astype(np.float64) for n in NODES) / sum(NODES) for k in arrays}


def test_lossless_round_is_fedavg_and_order_free():
    arrays = global_model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    msgs, replies = round_trip(strategy, compression_mod(1.0), arrays=arrays)
    # down: one compressed Array for the float tensors, the int tensor plain; the accept flag in the config
    down = msgs[0].content
    assert down["config"][ACCEPT_KEY] == "gpu_codec.v1"
    for r in replies:
        rec = r.content["arrays"]
        assert list(rec) == ["gpu_codec", "steps"] and rec["gpu_codec"].dtype == "gpu_codec.v1"
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None and list(new) == ["w", "b", "steps"]
    want = dense_fedavg(arrays)
    assert new["b"].numpy().dtype == np.float16 and new["steps"].numpy().dtype == np.int64
    np.testing.assert_allclose(new["w"].numpy(), want["w"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new["b"].numpy(), want["b"], rtol=2e-3, atol=2e-3)
    assert new["steps"].numpy().tolist() == [round(want["steps"][0])]
    # the same replies in another order give the same bytes
    again, _ = strategy.aggregate_train(1, replies[::-1])
    assert all(again[k].data == new[k].data for k in new)


def test_top_k_round_with_error_feedback_in_the_context():
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    mod = compression_mod(0.2, pipeline=[gpu_codec.Quantize("float16"), gpu_codec.RiceIndices()])
    msgs = list(strategy.configure_train(1, global_model(), ConfigRecord(), Nodes()))
    ctx = Context(1, 11, {}, RecordDict(), {})
    reply = mod(msgs[0], ctx, local_train(11))
    ef = gpu_codec.ErrorFeedback.from_bytes(ctx.state.config_records["gpu_codec.error_feedback.arrays"]["state"])
    assert sorted(ef.names()) == ["b", "w"]
    p = gpu_codec.flower.Array.from_flwr(reply.content["arrays"]["gpu_codec"]).payload()
    assert p.nnz == gpu_codec.kept_count(0.2, 35)


def test_plain_replies_and_stock_servers():
    # a client without the mod (its reply taken losslessly) next to clients with it gives the same model
    arrays = global_model()
    s1 = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, compressed = round_trip(s1, compression_mod(1.0), arrays=arrays)
    s2 = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, plain = round_trip(s2, None, arrays=arrays)
    a, _ = s1.aggregate_train(1, compressed)
    b, _ = s2.aggregate_train(1, plain)
    assert all(a[k].data == b[k].data for k in a)
    # a stock strategy sends no accept flag: the mod leaves the reply plain
    stock = FedAvg(min_available_nodes=4, min_train_nodes=4)
    _, replies = round_trip(stock, compression_mod(0.1), arrays=arrays)
    assert all(list(r.content["arrays"]) == ["w", "b", "steps"] for r in replies)
    new, _ = stock.aggregate_train(1, replies)
    assert list(new) == ["w", "b", "steps"]


def test_mismatched_reply_is_rejected_clearly():
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, replies = round_trip(strategy, compression_mod(0.5))
    other = gpu_codec.flower.ArrayRecord.compressed({"v": np.ones(3, np.float32)}, fraction=0.5).to_flwr()
    other["steps"] = Array(np.array([1], np.int64))
    replies[2].content["arrays"] = other
    with pytest.raises(InvalidInputError, match="reply 2: payload 2 holds a different tensor set"):
        strategy.aggregate_train(1, replies)
    with pytest.raises(InvalidInputError, match="no configure_train"):
        CompressedStrategy(object())
    with pytest.raises(InvalidInputError, match="no topk stage"):
        CompressedStrategy(FedAvg(), downlink=[{"id": "topk", "fraction": 0.1}])


def test_evaluate_messages_carry_the_compressed_model_and_replies_pass_through():
    arrays = global_model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_evaluate_nodes=4))
    msgs = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), Nodes()))
    assert len(msgs) == 4 and list(msgs[0].content["arrays"]) == ["gpu_codec", "steps"]
    seen = {}

    def evaluate(msg: Message, context: Context) -> Message:
        rec = msg.content["arrays"]
        seen.update({k: rec[k].numpy() for k in rec})
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "acc": 0.5})}), reply_to=msg)

    ctx = Context(1, 11, {}, RecordDict(), {})
    reply = compression_mod(0.1)(msgs[0], ctx, evaluate)
    assert list(seen) == ["w", "b", "steps"] and all(seen[k].tobytes() == arrays[k].numpy().tobytes() for k in seen)
    assert seen["b"].dtype == np.float16 and not ctx.state.config_records
    assert strategy.aggregate_evaluate(1, [reply])["acc"] == 0.5
