"""Flower with gpu_codec: FedAvg of a small torch classifier with compressed updates and a compressed global model.

The ``ClientApp`` and ``ServerApp`` below are ordinary Flower apps; gpu_codec adds one client mod
(:func:`gpu_codec.flower.compression_mod`: top-k of the update, fp16 values, Rice-coded indices, zstd, error
feedback across rounds) and one strategy wrapper (:class:`gpu_codec.flower.CompressedStrategy`: the global model
goes down zstd-compressed, the replies are averaged straight from their sparse form).

The data set is synthetic and deterministic (Gaussian classes, generated in code), so the run needs nothing
beyond numpy, torch and flwr. ``run()`` drives the apps in one process through :class:`InProcessGrid`, which
serializes every message to Flower's protobuf wire format and back, as a deployment would, and counts the bytes.

    python examples/flower/app.py --rounds 5 --clients 4          # compressed, then uncompressed, compared

The module-level ``server_app`` and ``client_app`` are the same apps for Flower's deployment engine
(``pyproject.toml`` names them): ``flwr run examples/flower <connection>`` against a running SuperLink and
SuperNodes (see the README). There the server drops a reply whose payload does not parse and aggregates the
others; a SuperNode started with ``--node-config "... damaged=true"`` damages its compressed replies, to show it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import random
from collections.abc import Callable, Iterable
from typing import Any

import flwr
import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import serde
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

import gpu_codec
from gpu_codec import flower as gflower
from gpu_codec.errors import GpuCodecError
from gpu_codec.flower import CompressedStrategy, compression_mod

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
torch.set_num_threads(1)  # a model this small gains nothing from threads, and they contend on a busy CPU

FEATURES, CLASSES, HIDDEN = 32, 10, 64
PIPELINE = [gpu_codec.Quantize("float16"), gpu_codec.RiceIndices(), gpu_codec.Zstd(level=3)]


# ---------------------------------------------------------------- task: data and model


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ten Gaussian classes in 32 dimensions, overlapping enough that the task is not trivial."""
    centers = np.random.default_rng(1234).standard_normal((CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + 1.2 * rng.standard_normal((n, FEATURES))
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y)


def partition(pid: int, num: int, per_client: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(per_client, seed=100 + pid + 1000 * num)


def test_set() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(2000, seed=7)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def train_local(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int = 1) -> float:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    total = 0.0
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(32):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
    return total / (epochs * len(x))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ---------------------------------------------------------------- the Flower apps


def make_client_app(compress: bool, fraction: float = 0.1) -> ClientApp:
    app = ClientApp(mods=[compression_mod(fraction, pipeline=PIPELINE)] if compress else None)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return train_reply(msg, context)

    return app


def train_reply(msg: Message, context: Context, with_partition: bool = False) -> Message:
    """Train the global model on this node's partition: the reply holds the trained weights and the metrics (the
    partition's id among them where asked)."""
    pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = partition(pid, num)
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    rnd = int(msg.content["config"]["server-round"])
    loss = train_local(model, x, y, seed=1000 * rnd + pid)
    metrics = {"num-examples": len(x), "train_loss": loss} | ({"partition-id": pid} if with_partition else {})
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}), reply_to=msg
    )


def make_server_app(compress: bool, rounds: int, out: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        x_test, y_test = test_set()

        def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = net()
            model.load_state_dict(arrays.to_torch_state_dict())
            return MetricRecord({"accuracy": accuracy(model, x_test, y_test)})

        strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
        if compress:
            strategy = CompressedStrategy(strategy)
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(net().state_dict()),
            num_rounds=rounds,
            evaluate_fn=central_eval,
        )
        out["result"] = result

    return app


# ---------------------------------------------------------------- the apps for the deployment engine

FRACTION = 0.1
log = logging.getLogger("gpu_codec.example")


def wire_bytes(msg: Message) -> int:
    """The size of ``msg`` in Flower's protobuf wire form, as the SuperLink relays it."""
    return len(serde.message_to_proto(msg).SerializeToString())


def damage_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A client mod for the demonstration: on a SuperNode whose node config says ``damaged=true``, flip one byte
    in the middle of each gpu_codec payload of the (compressed) train reply."""
    reply = call_next(msg, context)
    if str(context.node_config.get("damaged", "false")).lower() != "true" or not reply.has_content():
        return reply
    for rec in reply.content.array_records.values():
        for key in list(rec.keys()):
            a = rec[key]
            if gflower.holds_payload(a):
                data = bytearray(a.data)
                data[len(data) // 2] ^= 0xFF
                a.data = bytes(data)
    return reply


def unreadable(reply: Message) -> str | None:
    """Why the gpu_codec payloads of ``reply`` do not parse (None when they do, or when it holds none)."""
    try:
        for rec in reply.content.array_records.values():
            for a in rec.values():
                if gflower.holds_payload(a):
                    gflower.array_payload(a)
    except GpuCodecError as e:
        return f"{type(e).__name__}: {e}"
    return None


class DeployedStrategy(CompressedStrategy):
    """``CompressedStrategy`` that drops a reply whose payload does not parse (logged, the round goes on with the
    others) and records the wire size of every train message, both ways, in ``self.wire``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wire: list[dict] = []

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
        msgs = super().configure_train(server_round, arrays, config, grid)
        for m in msgs:
            node = m.metadata.dst_node_id
            self.wire.append({"round": server_round, "dir": "down", "node": node, "bytes": wire_bytes(m)})
        return msgs

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
        kept = []
        for m in replies:
            rec = {"round": server_round, "dir": "up", "node": m.metadata.src_node_id, "bytes": wire_bytes(m)}
            if m.has_error():
                rec["error"] = m.error.reason
            why = None if m.has_error() else unreadable(m)
            if why is not None:
                log.warning("round %d: dropped the reply of node %d: %s", server_round, rec["node"], why)
                rec["dropped"] = why
            else:
                kept.append(m)
            if not m.has_error():
                rec["partition"] = int(m.content["metrics"]["partition-id"])
            self.wire.append(rec)
        return super().aggregate_train(server_round, kept)


client_app = ClientApp(mods=[damage_mod, compression_mod(FRACTION, pipeline=PIPELINE)])


@client_app.train()
def deployed_train(msg: Message, context: Context) -> Message:
    return train_reply(msg, context, with_partition=True)


server_app = ServerApp()


@server_app.main()
def deployed_main(grid: Grid, context: Context) -> None:
    """FedAvg for ``num-server-rounds`` rounds over every connected SuperNode (at least ``min-nodes``); with a
    ``result-file`` in the run config, the accuracy per round and the wire sizes go there as JSON."""
    cfg = context.run_config
    rounds, min_nodes = int(cfg["num-server-rounds"]), int(cfg["min-nodes"])
    x_test, y_test = test_set()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = net()
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(model, x_test, y_test)})

    strategy = DeployedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=min_nodes, min_train_nodes=min_nodes))
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(net().state_dict()), num_rounds=rounds, evaluate_fn=central_eval
    )
    acc = result.evaluate_metrics_serverapp
    out = {"accuracy": [acc[r]["accuracy"] for r in sorted(acc)], "wire": strategy.wire}
    log.warning("gpu_codec example result: %s", json.dumps(out))
    if cfg.get("result-file"):
        with open(str(cfg["result-file"]), "x", encoding="utf-8") as f:
            json.dump(out, f)


# ---------------------------------------------------------------- one process, real messages


class InProcessGrid(Grid):
    """A ``Grid`` whose nodes are ``ClientApp`` objects in this process. Every message goes through Flower's
    protobuf serialization both ways; ``wire`` records (direction, message type, bytes) for each."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1):
        self._app = client_app
        self._contexts = {
            10 + i: Context(
                run_id=run_id,
                node_id=10 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._run = None
        self._replies: dict[str, Message] = {}
        self._ids = itertools.count()
        self.wire: list[tuple[str, str, int]] = []
        self.messages: list[tuple[str, bytes]] = []

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def _transmit(self, direction: str, msg: Message) -> Message:
        blob = serde.message_to_proto(msg).SerializeToString()
        self.wire.append((direction, msg.metadata.message_type, len(blob)))
        self.messages.append((direction, blob))
        proto = ProtoMessage()
        proto.ParseFromString(blob)
        return serde.message_from_proto(proto)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            received = self._transmit("down", msg)
            context = self._contexts[received.metadata.dst_node_id]
            try:
                reply = self._app(received, context)
            except Exception as e:  # as a SuperNode does: the error travels back in the reply
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=received)
            mid = str(next(self._ids))
            self._replies[mid] = self._transmit("up", reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in message_ids]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


def run(
    compress: bool = True,
    rounds: int = 5,
    clients: int = 4,
    fraction: float = 0.1,
    client_app: ClientApp | None = None,
) -> dict:
    """Run the apps for ``rounds`` rounds; returns the final accuracy, its history and the traffic."""
    random.seed(0)  # Flower samples nodes with `random`: the same order in every run
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # the server's identity
    try:
        out: dict = {}
        grid = InProcessGrid(client_app or make_client_app(compress, fraction), clients)
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        make_server_app(compress, rounds, out)(grid, context)
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    acc = out["result"].evaluate_metrics_serverapp
    return {
        "accuracy": acc[rounds]["accuracy"],
        "history": [acc[r]["accuracy"] for r in sorted(acc)],
        "arrays": out["result"].arrays,
        "up_bytes": sum(n for d, t, n in grid.wire if d == "up" and t == "train"),
        "down_bytes": sum(n for d, t, n in grid.wire if d == "down" and t == "train"),
        "grid": grid,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--out", metavar="FILE", help="also write the results as JSON (benchmarks/results/flower_app.json)")
    args = ap.parse_args()
    runs = {c: run(c, args.rounds, args.clients, args.fraction) for c in (True, False)}
    if args.out:
        import platform

        keep = ("accuracy", "history", "up_bytes", "down_bytes")
        res = {
            "example": "examples/flower/app.py: FedAvg, MLP 32-64-10 (2,826 parameters), synthetic data, InProcessGrid",
            "rounds": args.rounds,
            "clients": args.clients,
            "fraction": args.fraction,
            "versions": {"flwr": flwr.__version__, "torch": torch.__version__, "python": platform.python_version()},
            "backend": gpu_codec.backend_info(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "results": {
                name: {k: runs[c][k] for k in keep} for name, c in (("compressed", True), ("uncompressed", False))
            },
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    for c, r in runs.items():
        print(
            f"{'compressed  ' if c else 'uncompressed'}: accuracy {r['accuracy']:.3f} "
            f"(per round {', '.join(f'{a:.3f}' for a in r['history'])}), "
            f"train traffic up {r['up_bytes']} B, down {r['down_bytes']} B"
        )
    print(f"uplink bytes: {runs[True]['up_bytes'] / runs[False]['up_bytes']:.3f} of uncompressed")


if __name__ == "__main__":
    main()
