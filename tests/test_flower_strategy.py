"""compression_mod and CompressedStrategy with real flwr Messages, driven hook by hook (NumPy models, no torch)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

pytest.importorskip("flwr.serverapp")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common import serde
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

import gpu_codec
from gpu_codec.errors import InvalidInputError
from gpu_codec.flower import (
    ACCEPT_KEY,
    CompressedStrategy,
    array_payload,
    compressed_record,
    compression_mod,
    decode_record,
    decompress_record,
    read_numpy,
)

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
    p = array_payload(reply.content["arrays"]["gpu_codec"])
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


def test_a_bad_reply_is_left_out_and_the_round_goes_on(caplog):
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, replies = round_trip(strategy, compression_mod(0.5))
    good = [replies[i] for i in (0, 1, 3)]
    want, want_metrics = strategy.aggregate_train(1, good)
    other = compressed_record({"v": np.ones(3, np.float32)}, fraction=0.5)
    other["steps"] = Array(np.array([1], np.int64))
    replies[2].content["arrays"] = other
    bad_node = replies[2].metadata.src_node_id
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, metrics = strategy.aggregate_train(1, replies)
    assert f"node {bad_node} is left out" in caplog.text and "holds a different tensor set" in caplog.text
    # the same model and metrics as a round without that reply, to the byte
    assert all(new[k].data == want[k].data for k in want) and metrics == want_metrics
    # a plain array that does not match the global model, a bad weight, a second ArrayRecord: left out too
    bads = []
    _, r = round_trip(strategy, None)
    r[0].content["arrays"]["steps"] = Array(np.array([1, 2], np.int64))
    r[1].content["metrics"]["num-examples"] = -3
    r[2].content["more"] = ArrayRecord({"x": Array(np.ones(1, np.float32))})
    bads = r[:3]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, _ = strategy.aggregate_train(1, [*bads, r[3]])
    assert new is not None and caplog.text.count("left out") == 3
    assert "int64[2], expected int64[1]" in caplog.text and "-3" in caplog.text and "2 ArrayRecords" in caplog.text
    alone, _ = strategy.aggregate_train(1, [r[3]])
    assert all(new[k].data == alone[k].data for k in alone)
    # nothing usable: no model, said so, and no exception
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        assert strategy.aggregate_train(1, bads)[0] is None
    assert "no reply" in caplog.text
    with pytest.raises(InvalidInputError, match="no configure_train"):
        CompressedStrategy(object())
    with pytest.raises(InvalidInputError, match="no topk stage"):
        CompressedStrategy(FedAvg(), downlink=[{"id": "topk", "fraction": 0.1}])


def stock_train(node: int):
    """A ClientApp without gpu_codec, run as a SuperNode runs it: an exception becomes an error reply."""

    def train(msg: Message, context: Context) -> Message:
        try:
            rec = msg.content["arrays"]
            new = client_arrays(node, rec)  # reads every Array with flwr's own Array.numpy()
        except Exception as e:
            return Message(Error(code=0, reason=str(type(e)) + ":<'" + str(e) + "'>"), reply_to=msg)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                "metrics": MetricRecord({"num-examples": node}),
            }
        )
        return Message(content, reply_to=msg)

    return train


def mixed_round(strategy, rnd, arrays, with_mod=(11, 13)):
    """Nodes in ``with_mod`` run compression_mod(1.0) (lossless), the others are stock Flower clients."""
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Nodes()))
    replies = []
    for m in msgs:
        node, m = m.metadata.dst_node_id, wire(m)
        ctx = Context(1, node, {}, RecordDict(), {})
        reply = compression_mod(1.0)(m, ctx, local_train(node)) if node in with_mod else stock_train(node)(m, ctx)
        replies.append(wire(reply))
    return msgs, replies


def wire(m: Message) -> Message:
    """The message as the other side gets it, through Flower's protobuf serialization (nothing shared)."""
    proto = ProtoMessage()
    proto.ParseFromString(serde.message_to_proto(m).SerializeToString())
    return serde.message_from_proto(proto)


def test_mixed_fleet_with_a_plain_downlink_aggregates_every_reply():
    arrays = global_model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), downlink=None)
    _, replies = mixed_round(strategy, 1, arrays)
    kinds = sorted((r.metadata.src_node_id, list(r.content["arrays"])) for r in replies)
    assert kinds == [
        (11, ["gpu_codec", "steps"]),
        (12, ["w", "b", "steps"]),
        (13, ["gpu_codec", "steps"]),
        (14, ["w", "b", "steps"]),
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None and list(new) == ["w", "b", "steps"]
    # lossless on both sides: the model an all-plain fleet gives, to the byte
    plain_strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), downlink=None)
    _, plain = round_trip(plain_strategy, None, arrays=arrays)
    want, want_metrics = plain_strategy.aggregate_train(1, plain)
    assert all(new[k].data == want[k].data for k in want) and metrics == want_metrics
    np.testing.assert_allclose(new["w"].numpy(), dense_fedavg(arrays)["w"], rtol=1e-6, atol=1e-6)


def test_nodes_that_cannot_read_the_compressed_model_get_it_plain_from_the_next_round(caplog):
    arrays = global_model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        _, replies = mixed_round(strategy, 1, arrays)
        assert sorted(r.metadata.src_node_id for r in replies if r.has_error()) == [12, 14]
        new, _ = strategy.aggregate_train(1, replies)
    assert new is not None
    for node in (12, 14):
        assert f"round 1: node {node} could not read the compressed global model" in caplog.text
    # round 2: nodes 12 and 14 are sent the model as it is, the others compressed; every node trains
    msgs, replies = mixed_round(strategy, 2, new)
    down = {m.metadata.dst_node_id: list(m.content["arrays"]) for m in msgs}
    assert down == {
        11: ["gpu_codec", "steps"],
        12: ["w", "b", "steps"],
        13: ["gpu_codec", "steps"],
        14: ["w", "b", "steps"],
    }
    assert not any(r.has_error() for r in replies)
    new2, _ = strategy.aggregate_train(2, replies)
    want = {k: sum(n * client_arrays(n, new)[k].astype(np.float64) for n in NODES) / sum(NODES) for k in ("w",)}
    np.testing.assert_allclose(new2["w"].numpy(), want["w"], rtol=1e-6, atol=1e-6)
    # evaluation messages follow the same rule, and the warning is given once per node
    evals = list(strategy.configure_evaluate(2, new2, ConfigRecord(), Nodes()))
    assert {m.metadata.dst_node_id: "gpu_codec" in m.content["arrays"] for m in evals} == {
        11: True,
        12: False,
        13: True,
        14: False,
    }
    assert caplog.text.count("could not read") == 2


def test_caps_on_the_strategy_the_mod_and_the_records(caplog):
    from gpu_codec.aggregate import held_bytes
    from gpu_codec.errors import PayloadLayoutError, PayloadLimitError

    # a record: 4 MB of output declared in a few hundred bytes, refused before it is decoded
    big = compressed_record({"w": np.zeros(10**6, np.float32)}, fraction=1e-6)
    assert big.count_bytes() < 1024
    with pytest.raises(PayloadLimitError, match="max_output_bytes=1048576"):
        decompress_record(big, max_output_bytes=1 << 20)
    with pytest.raises(PayloadLimitError):
        decode_record(big, max_output_bytes=1 << 20)
    assert decode_record(big, max_output_bytes=4 << 20)["w"].numpy().shape == (10**6,)
    # plain arrays count toward the same cap, and their .npy header is checked against their bytes
    rec = ArrayRecord({"a": Array(np.ones(1000, np.float32)), "b": Array(np.ones(10, np.float32))})
    assert sorted(decompress_record(rec, max_output_bytes=4040)) == ["a", "b"]
    with pytest.raises(PayloadLimitError):
        decompress_record(rec, max_output_bytes=4039)
    blob = bytearray(rec["b"].data)
    blob[blob.index(b"(10,)") : blob.index(b"(10,)") + 5] = b"(99,)"
    lying = Array(dtype="float32", shape=(10,), stype="numpy.ndarray", data=bytes(blob))
    with pytest.raises(PayloadLayoutError, match="396 bytes"):
        read_numpy(lying)
    # the mod: a downlink declaring more than its cap fails on the client, before it is decoded
    msgs = list(
        CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4)).configure_train(
            1, global_model(), ConfigRecord(), Nodes()
        )
    )
    ctx = Context(1, 11, {}, RecordDict(), {})
    with pytest.raises(PayloadLimitError):
        compression_mod(0.5, max_output_bytes=64)(msgs[0], ctx, local_train(11))
    # the strategy: a reply sending every entry as a sparse pair needs more than a cap set for dense replies
    arrays = global_model()
    model = gpu_codec.compress({"w": arrays["w"].numpy(), "b": arrays["b"].numpy()}, fraction=None).tensors
    cap = held_bytes(model, with_base=True)
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), max_output_bytes=cap)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), Nodes()))
    replies = []
    for m in msgs:
        node = m.metadata.dst_node_id
        ctx = Context(1, node, {}, RecordDict(), {})
        replies.append(compression_mod(1.0 if node == 12 else None)(m, ctx, local_train(node)))
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, _ = strategy.aggregate_train(1, replies)
    assert new is not None and "node 12 is left out" in caplog.text and "max_output_bytes" in caplog.text
    with pytest.raises(InvalidInputError, match="max_output_bytes"):
        CompressedStrategy(FedAvg(), max_output_bytes=-1)
    small = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), max_output_bytes=cap - 1)
    list(small.configure_train(1, arrays, ConfigRecord(), Nodes()))
    with pytest.raises(InvalidInputError, match="over this base"):  # the operator's cap, not a client's fault
        small.aggregate_train(1, replies)


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


def _other_rules():
    from flwr.serverapp.strategy import FedAdam, FedMedian, FedTrimmedAvg

    return {
        "fedmedian": lambda: FedMedian(min_available_nodes=4, min_train_nodes=4),
        "fedtrimmedavg": lambda: FedTrimmedAvg(min_available_nodes=4, min_train_nodes=4, beta=0.25),
        "fedadam": lambda: FedAdam(min_available_nodes=4, min_train_nodes=4),
    }


@pytest.mark.parametrize("rule", ["fedmedian", "fedtrimmedavg", "fedadam"])
def test_a_wrapped_strategy_with_its_own_rule_aggregates_the_decoded_models(rule):
    """A strategy that does not aggregate by FedAvg's rule gets the replies' models, decoded onto the global model
    the clients received: its result is what it gives on the plain replies (a lossless round), not FedAvg's mean."""
    make = _other_rules()[rule]
    arrays = global_model()
    stock = make()
    _, plain = round_trip(stock, None, arrays=arrays)
    want, want_metrics = stock.aggregate_train(1, plain)
    wrapped = CompressedStrategy(make())
    _, replies = round_trip(wrapped, compression_mod(1.0), arrays=arrays)
    assert all(r.content["arrays"]["gpu_codec"].dtype == "gpu_codec.v1" for r in replies)
    new, metrics = wrapped.aggregate_train(1, replies)
    assert list(new) == list(want) and metrics == want_metrics
    for k in want:
        tol = 2e-3 if arrays[k].numpy().dtype == np.float16 else 1e-5  # (base + delta rounds to float16)
        np.testing.assert_allclose(new[k].numpy(), want[k].numpy(), rtol=tol, atol=tol)
    mean = dense_fedavg(arrays)["w"]
    assert not np.allclose(new["w"].numpy(), mean, rtol=1e-4, atol=1e-4)  # (another rule than FedAvg's)


def test_client_side_dp_noise_is_the_wrapped_strategy_s():
    """Client-side fixed clipping adds its noise at the server's aggregation: with the models decoded, the wrapped
    strategy adds it (FedAvg's mean alone would drop it, and the privacy guarantee with it)."""
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    arrays = global_model()
    fedavg = FedAvg(min_available_nodes=4, min_train_nodes=4)
    dp = DifferentialPrivacyClientSideFixedClipping(
        fedavg, noise_multiplier=1.0, clipping_norm=100.0, num_sampled_clients=4
    )
    wrapped = CompressedStrategy(dp)
    _, replies = round_trip(wrapped, compression_mod(1.0), arrays=arrays)
    new, _ = wrapped.aggregate_train(1, replies)
    plain_mean = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, again = round_trip(plain_mean, compression_mod(1.0), arrays=arrays)
    mean, _ = plain_mean.aggregate_train(1, again)
    noise = new["w"].numpy().astype(np.float64) - mean["w"].numpy()
    assert np.abs(noise).max() > 1.0  # (noise of standard deviation 100 / 4 a coordinate)


def _broken_metrics(r: Message, how: str) -> None:
    """Damage one reply's metric records as a client might."""
    if how == "no key":
        r.content["metrics"] = MetricRecord({"loss": 1.0})
    elif how == "no record":
        del r.content["metrics"]
    elif how == "two records":
        r.content["more"] = MetricRecord({"num-examples": 3})
    elif how == "list weight":
        r.content["metrics"]["num-examples"] = [1, 2]
    else:  # "extra key": a metric the other replies do not have
        r.content["metrics"]["extra"] = 1.0


@pytest.mark.parametrize("rule", ["fedavg", "fedmedian", "fedadam"])
@pytest.mark.parametrize("how", ["no key", "no record", "two records", "list weight", "extra key"])
def test_a_reply_with_bad_metrics_is_left_out_whatever_the_rule(rule, how, caplog):
    """flwr's own check refuses the whole round for one such reply (or the rule raises a KeyError): the wrapper
    leaves that reply out and aggregates the others as it would without it."""
    rules = {"fedavg": lambda: FedAvg(min_available_nodes=4, min_train_nodes=4), **_other_rules()}
    arrays = global_model()
    strategy = CompressedStrategy(rules[rule]())
    _, replies = round_trip(strategy, compression_mod(0.5), arrays=arrays)
    alike = CompressedStrategy(rules[rule]())  # (a rule may keep state between rounds: FedAdam does)
    alike.configure_train(1, arrays, ConfigRecord(), Nodes())
    want, want_metrics = alike.aggregate_train(1, [replies[i] for i in (0, 1, 3)])
    _broken_metrics(replies[2], how)
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, metrics = strategy.aggregate_train(1, replies)
    assert f"node {replies[2].metadata.src_node_id} is left out" in caplog.text
    assert all(new[k].data == want[k].data for k in want) and metrics == want_metrics


@pytest.mark.parametrize("rule", ["fedavg", "fedmedian", "fedadam"])
def test_a_round_with_no_positive_weight_gives_no_model_and_no_exception(rule, caplog):
    rules = {"fedavg": lambda: FedAvg(min_available_nodes=4, min_train_nodes=4), **_other_rules()}
    strategy = CompressedStrategy(rules[rule]())
    _, replies = round_trip(strategy, compression_mod(0.5))
    for r in replies[1:]:
        r.content["metrics"]["num-examples"] = 0
    replies[0].content["arrays"] = compressed_record({"v": np.ones(3, np.float32)}, fraction=0.5)  # unusable
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        assert strategy.aggregate_train(1, replies) == (None, None)
    assert "no reply with a positive weight" in caplog.text


def test_a_weight_near_the_fp64_range_averages_the_integer_arrays_within_their_range():
    """One reply's weight of 1e307 (a valid double) beside weights of 11 to 14: its float arrays unchanged (so the
    Aggregator takes it: no weight x value past its range), the integer array's mean is the heavy reply's, where
    w * a overflowed fp64 and came back INT64_MIN."""
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    arrays = global_model()
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), Nodes()))
    replies = []
    for m in msgs:
        node = m.metadata.dst_node_id

        def train(msg: Message, context: Context, node=node) -> Message:
            rec = msg.content["arrays"]
            new = {k: rec[k].numpy() + (0 if rec[k].dtype.startswith("float") else node) for k in rec}
            weight = 1e307 if node == NODES[2] else node
            content = RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                    "metrics": MetricRecord({"num-examples": weight}),
                }
            )
            return Message(content, reply_to=msg)

        replies.append(compression_mod(0.5)(m, Context(1, node, {}, RecordDict(), {}), train))
    new, _ = strategy.aggregate_train(1, replies)
    assert new["steps"].numpy().tolist() == [10 + NODES[2]]


def test_an_integer_weight_past_the_fp64_range_leaves_its_reply_out(caplog):
    """An in-process message may carry any Python int: 10**400 (past fp64's range, its digits longer than a log
    line) leaves that reply out, where the round raised OverflowError."""
    arrays = global_model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, replies = round_trip(strategy, compression_mod(0.5), arrays=arrays)
    alike = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    alike.configure_train(1, arrays, ConfigRecord(), Nodes())
    want, _ = alike.aggregate_train(1, [replies[i] for i in (0, 1, 3)])
    replies[2].content["metrics"]["num-examples"] = 10**400
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, _ = strategy.aggregate_train(1, replies)
    assert "is an integer of 1329 bits, not" in caplog.text and "0000000000" not in caplog.text
    assert all(new[k].data == want[k].data for k in want)


def test_error_feedback_starts_over_where_the_strategy_changes_the_model_s_dtype(caplog):
    """flwr's FedAdam returns a float32 model as float64: each client's float32 residual would be refused from the
    second round on, every round after; it starts over, once, and the clients keep replying compressed."""
    from flwr.serverapp.strategy import FedAdam

    strategy = CompressedStrategy(FedAdam(min_available_nodes=4, min_train_nodes=4))
    mod = compression_mod(0.5)
    contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in NODES}
    arrays = ArrayRecord({"w": Array(np.ones((6, 5), np.float32))})
    dtypes = []
    for rnd in (1, 2, 3):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Nodes()))
        replies = []
        with caplog.at_level("WARNING", logger="gpu_codec.flower"):
            for m in msgs:
                node = m.metadata.dst_node_id
                replies.append(mod(m, contexts[node], local_train(node)))
        assert all(not r.has_error() and "gpu_codec" in r.content["arrays"] for r in replies)
        arrays, _ = strategy.aggregate_train(rnd, replies)
        dtypes.append(arrays["w"].numpy().dtype)
    assert dtypes[0] == np.float64  # (what FedAdam does to the model)
    assert caplog.text.count("error-feedback residual starts over") == len(NODES)  # (round 2 only)
    state = contexts[11].state.config_records["gpu_codec.error_feedback.arrays"]["state"]
    assert gpu_codec.ErrorFeedback.from_bytes(state).layout() == {"w": ("float64", (6, 5))}


def test_a_layer_gone_from_the_model_drops_its_residual_and_keeps_the_others(caplog):
    """Round 2's model lacks 'v': each client's residual of 'v' is dropped, that of 'w' kept (its reply differs
    from a client's without a residual), and the warning says so (it said the whole residual started over)."""
    mod = compression_mod(0.5)
    contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in NODES}
    key = "gpu_codec.error_feedback.arrays"
    rng = np.random.default_rng(1)
    w, v = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    for rnd, arrays in ((1, {"w": w, "v": v}), (2, {"w": w})):
        strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
        record = ArrayRecord({k: Array(a) for k, a in arrays.items()})
        with caplog.at_level("WARNING", logger="gpu_codec.flower"):
            for m in strategy.configure_train(rnd, record, ConfigRecord(), Nodes()):
                node = m.metadata.dst_node_id
                fresh = mod(copy.deepcopy(m), Context(1, node, {}, RecordDict(), {}), local_train(node))
                reply = mod(m, contexts[node], local_train(node))
                ef = gpu_codec.ErrorFeedback.from_bytes(contexts[node].state.config_records[key]["state"])
                assert ef.names() == list(arrays)
                sent = [r.content["arrays"]["gpu_codec"].data for r in (reply, fresh)]
                assert (sent[0] != sent[1]) == (rnd == 2)  # (round 2: 'w''s residual carried on)
    assert caplog.text.count("('v' is gone): their residuals are dropped") == len(NODES)
    assert "starts over" not in caplog.text


@pytest.mark.parametrize("downlink", ["default", None])
def test_a_global_model_changed_in_place_between_rounds_goes_down_anew(downlink):
    # The record sent was cached by the ArrayRecord object: a ServerApp that writes the new model into the same
    # record sent the clients the old one (default downlink), or added their deltas to the old one (no downlink).
    kw = {} if downlink == "default" else {"downlink": None}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), **kw)
    plain = FedAvg(min_available_nodes=4, min_train_nodes=4)
    arrays, ref = global_model(), global_model()
    for rnd in (1, 2):
        _, replies = round_trip(strategy, compression_mod(1.0), rnd=rnd, arrays=arrays)
        new, _ = strategy.aggregate_train(rnd, replies)
        _, plain_replies = round_trip(plain, None, rnd=rnd, arrays=ref)
        want, _ = plain.aggregate_train(rnd, plain_replies)
        tol = 2e-3 if downlink == "default" else 1e-6  # (the default downlink sends fp16)
        np.testing.assert_allclose(new["w"].numpy(), want["w"].numpy(), rtol=tol, atol=tol)
        for k in arrays:  # (the same records, written in place)
            arrays[k], ref[k] = new[k], want[k]


def test_an_evaluation_configured_before_the_training_replies_come_leaves_their_base_alone():
    # (the deltas were added to whatever model was sent down last: here the evaluated one)
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), downlink=None)
    current = global_model()
    best = ArrayRecord({k: Array(np.zeros_like(current[k].numpy())) for k in current})
    _, replies = round_trip(strategy, compression_mod(1.0), arrays=current)
    list(strategy.configure_evaluate(1, best, ConfigRecord(), Nodes()))
    new, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(new["w"].numpy(), dense_fedavg(current)["w"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("downlink", ["zstd", None])
def test_the_model_keeps_its_order_with_a_non_float_array_among_the_floats(downlink):
    # (a BatchNorm counter between two layers: a client loading arrays by position, and flwr's fixedclipping_mod,
    # which refuses a reply whose keys are in another order, need the order sent)
    rng = np.random.default_rng(1)
    names = ["0.weight", "1.num_batches_tracked", "1.running_mean", "2.weight"]
    arrays = ArrayRecord(
        {
            "0.weight": Array(rng.standard_normal((4, 3)).astype(np.float32)),
            "1.num_batches_tracked": Array(np.array([7], np.int64)),
            "1.running_mean": Array(rng.standard_normal(4).astype(np.float32)),
            "2.weight": Array(rng.standard_normal((2, 4)).astype(np.float32)),
        }
    )
    kwargs = {} if downlink else {"downlink": None}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4), **kwargs)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), Nodes()))
    seen = list(decode_record(msgs[0].content["arrays"]))
    assert seen == names
    _, replies = round_trip(strategy, compression_mod(0.5), arrays=arrays)
    new, _ = strategy.aggregate_train(1, replies)
    assert list(new) == names
    assert new["1.num_batches_tracked"].numpy().dtype == np.int64 and new["1.num_batches_tracked"].numpy().shape == (1,)


@pytest.mark.parametrize("shape", [(-1, -1), (0, -1), (-2, -4), (True,)])
def test_a_reply_whose_npy_header_lies_about_its_shape_is_left_out(shape, caplog):
    import struct

    strategy = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=4))
    _, replies = round_trip(strategy, compression_mod(0.5))
    good, _ = strategy.aggregate_train(1, [replies[i] for i in (0, 1, 3)])
    header = repr({"descr": "<i8", "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    data = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(8)  # (-1 x -1 x 8: 8 bytes)
    replies[2].content["arrays"]["steps"] = Array(dtype="int64", shape=(1,), stype="numpy.ndarray", data=data)
    with caplog.at_level("WARNING", logger="gpu_codec.flower"):
        new, _ = strategy.aggregate_train(1, replies)
    assert "left out" in caplog.text and "shape no array can have" in caplog.text
    assert all(new[k].data == good[k].data for k in good)
    with pytest.raises(gpu_codec.PayloadError, match="shape no array can have"):
        read_numpy(replies[2].content["arrays"]["steps"])
