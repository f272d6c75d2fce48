"""NVFlare filters on real NVFlare objects (DXO, Shareable, FLContext), and the digits job in NVFlare's simulator."""

from __future__ import annotations

import logging
import os
import pathlib
import pickle

import numpy as np
import pytest

pytest.importorskip("nvflare")
torch = pytest.importorskip("torch")

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable  # noqa: E402
from nvflare.apis.fl_constant import ReservedKey, ReturnCode  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.app_common.app_constant import AppConstants  # noqa: E402

import gpu_codec  # noqa: E402
from gpu_codec import clara as C  # noqa: E402
from gpu_codec import nvflare as gcf  # noqa: E402

UP_PIPELINE = [{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd", "level": 3}]


def ctx(site: str = "site-1", rnd: int = 0) -> FLContext:
    c = FLContext()
    c.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    c.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
    return c


def shareable(params: dict, kind=DataKind.WEIGHT_DIFF, rnd: int = 0, **meta):
    s = DXO(data_kind=kind, data=params, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 7, **meta}).to_shareable()
    s.set_header(AppConstants.CURRENT_ROUND, rnd)
    return s


def diff(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"fc.w": rng.standard_normal((16, 8)).astype(np.float32), "fc.b": rng.standard_normal(16).astype(np.float32)}


def topk_ref(d: dict, fraction: float) -> dict:
    flat = np.concatenate([v.reshape(-1) for v in d.values()])
    k = gpu_codec.kept_count(fraction, flat.size)
    keep = np.lexsort((np.arange(flat.size), -np.abs(flat)))[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    res, a = {}, 0
    for n, v in d.items():
        res[n] = out[a : a + v.size].reshape(v.shape)
        a += v.size
    return res


def test_update_round_trip_keeps_meta_and_error_feedback():
    up, down = gcf.UpdateCompressor(fraction=0.25), gcf.UpdateDecompressor()
    d = diff()
    sent = up.process(shareable(dict(d)), ctx())
    dxo = from_shareable(sent)
    assert set(dxo.data) == {gcf.PAYLOAD_KEY} and isinstance(dxo.data[gcf.PAYLOAD_KEY], bytes)
    assert dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 7
    assert dxo.get_meta_prop(MetaKey.PROCESSED_ALGORITHM) == gcf.ALGORITHM
    info = dxo.get_meta_prop(gcf.META_KEY)
    assert info["compressed"] and info["nnz"] == gpu_codec.kept_count(0.25, 144)
    assert info["nbytes"] == len(dxo.data[gcf.PAYLOAD_KEY]) and info["dense_nbytes"] == 144 * 4
    assert dxo.get_filter_history() == ["UpdateCompressor"]

    got = from_shareable(down.process(sent, ctx("server")))
    assert got.data_kind == DataKind.WEIGHT_DIFF and got.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 7
    assert got.get_meta_prop(MetaKey.PROCESSED_ALGORITHM) is None and got.get_meta_prop(gcf.META_KEY) is None
    want = topk_ref(d, 0.25)
    for n in d:
        np.testing.assert_array_equal(got.data[n], want[n])

    # round 2: what round 1 left out is added to the new update before top-k (per site)
    d2 = diff(1)
    got2 = from_shareable(down.process(up.process(shareable(dict(d2), rnd=1), ctx(rnd=1)), ctx("server")))
    with_residual = {n: d2[n] + (d[n] - want[n]) for n in d}
    for n, v in topk_ref(with_residual, 0.25).items():
        np.testing.assert_allclose(got2.data[n], v, rtol=0, atol=1e-6)
    other_site = from_shareable(down.process(up.process(shareable(dict(d2)), ctx("site-2")), ctx("server")))
    for n, v in topk_ref(d2, 0.25).items():  # site-2 has no residual of its own yet
        np.testing.assert_array_equal(other_site.data[n], v)


def test_weights_go_dense_and_other_entries_pass_through(tmp_path):
    up = gcf.UpdateCompressor(fraction=0.01, pipeline=UP_PIPELINE, state_dir=str(tmp_path))
    w = {"w": torch.linspace(-1, 1, 64).reshape(8, 8), "steps": np.array([3], np.int64)}
    sent = up.process(shareable(dict(w), kind=DataKind.WEIGHTS), ctx())
    info = from_shareable(sent).get_meta_prop(gcf.META_KEY)
    assert info["fraction"] is None and info["nnz"] == 64 and info["kind"] == "torch"
    assert info["passed_through"] == ["steps"]
    got = from_shareable(gcf.UpdateDecompressor().process(sent, ctx("server"))).data
    assert isinstance(got["w"], torch.Tensor) and got["w"].dtype == torch.float32
    torch.testing.assert_close(got["w"], w["w"].half().float(), rtol=0, atol=0)  # fp16 stage, dense
    assert got["steps"].tolist() == [3]
    assert not os.listdir(tmp_path)  # no error feedback for dense weights
    up.process(shareable(diff()), ctx())
    assert os.listdir(tmp_path) == ["site-1.gcef"]  # a restarted client resumes the residual
    assert sorted(gpu_codec.ErrorFeedback.load(tmp_path / "site-1.gcef").names()) == ["fc.b", "fc.w"]


def test_error_feedback_starts_over_where_the_model_changes(caplog):
    up = gcf.UpdateCompressor(fraction=0.25)
    up.process(shareable(diff(0)), ctx())
    assert up.residual_state("site-1").layout()["fc.w"] == ("float32", (16, 8))
    wider = {k: v.astype(np.float64) for k, v in diff(1).items()}  # (a model now sent in float64)
    with caplog.at_level(logging.WARNING):
        sent = up.process(shareable(wider), ctx())
    assert sent.get_return_code() == ReturnCode.OK and "the residual starts over" in caplog.text
    assert up.residual_state("site-1").layout()["fc.w"] == ("float64", (16, 8))
    got = from_shareable(gcf.UpdateDecompressor().process(sent, ctx("server"))).data
    np.testing.assert_array_equal(got["fc.w"], topk_ref(wider, 0.25)["fc.w"])  # (no residual added: it started over)


@pytest.mark.parametrize("damage", ["flip", "pickle", "truncate", "not_bytes", "no_meta", "no_data", "data_none"])
def test_corrupt_or_foreign_payload_is_rejected(damage, caplog):
    sent = gcf.UpdateCompressor(fraction=0.5).process(shareable(diff()), ctx())
    dxo = from_shareable(sent)
    blob = dxo.data[gcf.PAYLOAD_KEY]
    if damage == "flip":
        dxo.data[gcf.PAYLOAD_KEY] = blob[:40] + bytes([blob[40] ^ 1]) + blob[41:]
    elif damage == "pickle":
        dxo.data[gcf.PAYLOAD_KEY] = pickle.dumps({"fc.w": [0.0]})
    elif damage == "truncate":
        dxo.data[gcf.PAYLOAD_KEY] = blob[:-9]
    elif damage == "not_bytes":
        dxo.data[gcf.PAYLOAD_KEY] = np.zeros(4, np.float32)
    elif damage == "no_data":  # (NVFlare's own filter passes an empty DXO on unread: its meta says compressed)
        dxo.data = {}
    elif damage == "data_none":
        dxo.data = None
    else:
        dxo.remove_meta_props([gcf.META_KEY])
    bad = dxo.update_shareable(sent)
    bad.set_peer_props({ReservedKey.IDENTITY_NAME: "site-3"})
    bad.set_header(ReservedKey.TASK_NAME, "train")
    with caplog.at_level(logging.ERROR):
        out = gcf.UpdateDecompressor().process(bad, ctx("server"))
    assert out.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    line = [r.getMessage() for r in caplog.records if "gpu_codec: rejected" in r.getMessage()]
    assert len(line) == 1 and "site-3" in line[0] and "round 0" in line[0] and "dropped" in line[0]


@pytest.mark.gpu
def test_cuda_tensors_stay_on_the_device():
    from tests.common import HAS_GPU, use_backend

    if not HAS_GPU or not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    d = {k: torch.from_numpy(v).cuda() for k, v in diff(5).items()}
    with use_backend("gpu"):
        sent = gcf.UpdateCompressor(fraction=0.25, pipeline=UP_PIPELINE).process(shareable(dict(d)), ctx())
        assert from_shareable(sent).get_meta_prop(gcf.META_KEY)["kind"] == "torch"
        got = from_shareable(gcf.UpdateDecompressor(device="cuda").process(sent, ctx("server"))).data
        model = from_shareable(
            gcf.ModelDecompressor(device="cuda").process(
                gcf.ModelCompressor().process(DXO(DataKind.WEIGHTS, data=d).to_shareable(), ctx("server")), ctx()
            )
        ).data
    assert all(v.is_cuda for v in got.values()) and all(v.is_cuda for v in model.values())
    want = topk_ref({k: v.cpu().numpy() for k, v in d.items()}, 0.25)
    for n in d:  # fp16 values: the kept entries rounded to half precision
        np.testing.assert_array_equal(got[n].cpu().numpy(), want[n].astype(np.float16).astype(np.float32))


def test_uncompressed_dxo_passes_the_server_filter():
    d = diff()
    out = from_shareable(gcf.UpdateDecompressor().process(shareable(dict(d)), ctx("server")))
    assert out.data["fc.w"] is d["fc.w"]


def test_global_model_compressed_once_for_all_clients():
    down, dec = gcf.ModelCompressor(), gcf.ModelDecompressor(like="torch")
    model = {k: v * 10 for k, v in diff(3).items()}
    dxos = []
    for _ in range(3):  # the server hands every client the same data dict
        s = DXO(data_kind=DataKind.WEIGHTS, data=model, meta={}).to_shareable()
        dxos.append(from_shareable(down.process(s, ctx("server"))))
    assert dxos[0].data[gcf.PAYLOAD_KEY] is dxos[2].data[gcf.PAYLOAD_KEY]  # compressed once
    assert [d.get_filter_history() for d in dxos] == [["ModelCompressor"]] * 3
    assert dxos[0].get_meta_prop(gcf.META_KEY)["pipeline"] == gcf.DEFAULT_DOWN_PIPELINE
    got = from_shareable(dec.process(dxos[1].to_shareable(), ctx())).data
    for n, v in model.items():
        assert isinstance(got[n], torch.Tensor)
        np.testing.assert_array_equal(got[n].numpy(), v.astype(np.float16).astype(np.float32))
    model["fc.b"] += 1  # the same dict, updated in place for the next round: compressed anew
    s = DXO(data_kind=DataKind.WEIGHTS, data=model, meta={}).to_shareable()
    s.set_header(AppConstants.CURRENT_ROUND, 1)
    assert from_shareable(down.process(s, ctx("server"))).data[gcf.PAYLOAD_KEY] != dxos[0].data[gcf.PAYLOAD_KEY]


def test_a_relay_that_changes_the_global_model_in_place_within_a_round_sends_each_client_the_new_one():
    # NVFlare's cyclic relay adds each client's WEIGHT_DIFF into the same weights dict (FullModelShareableGenerator)
    # and sends it on in the same round: cached by the dict and the round, the next client got the model from
    # before the previous one trained.
    from nvflare.apis.shareable import make_copy
    from nvflare.app_common.abstract.model import make_model_learnable
    from nvflare.app_common.shareablegenerators.full_model_shareable_generator import FullModelShareableGenerator

    gen, dec = FullModelShareableGenerator(), gcf.ModelDecompressor()
    down = gcf.ModelCompressor(pipeline=[{"id": "zstd"}])
    learnable = make_model_learnable({"w": np.zeros(8, np.float32)}, {})
    server = ctx("server")
    server.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
    received = []
    for client in ("site-1", "site-2", "site-3"):
        task = gen.learnable_to_shareable(learnable, server)
        task.set_header(AppConstants.CURRENT_ROUND, 0)
        out = down.process(make_copy(task), ctx("server"))
        received.append(from_shareable(dec.process(out, ctx(client))).data["w"].tolist())
        result = DXO(data_kind=DataKind.WEIGHT_DIFF, data={"w": np.ones(8, np.float32)}).to_shareable()
        learnable = gen.shareable_to_learnable(result, server)  # (into the same dict)
    assert received == [[0.0] * 8, [1.0] * 8, [2.0] * 8]
    task = gen.learnable_to_shareable(learnable, server)
    task.set_header(AppConstants.CURRENT_ROUND, 0)
    a, b = (from_shareable(down.process(make_copy(task), ctx("server"))) for _ in range(2))
    assert a.data[gcf.PAYLOAD_KEY] is b.data[gcf.PAYLOAD_KEY]  # (unchanged: still compressed once)


def test_two_tasks_of_one_site_at_once_take_turns_with_its_residual(monkeypatch):
    # The residual was checked against the model (restarted where it changed), then used, then saved, each step on
    # its own: a second task of the same site changing it in between failed the first task's result.
    import threading

    from gpu_codec import adapt

    up = gcf.UpdateCompressor(fraction=0.1)
    models = [{"w": np.random.default_rng(t).standard_normal((20, 10 + 5 * t)).astype(np.float32)} for t in (0, 1)]
    a_checked, b_done = threading.Event(), threading.Event()
    real = adapt.restart_if_changed

    def restart(residual, update):
        out = real(residual, update)
        if update is models[0]:  # (task A, checked: task B now runs its whole call, if nothing keeps it out)
            a_checked.set()
            b_done.wait(2)
        return out

    monkeypatch.setattr(adapt, "restart_if_changed", restart)
    results = {}

    def task(i):
        if i == 1:
            a_checked.wait(10)
        try:
            results[i] = from_shareable(up.process(shareable(models[i]), ctx("site-1")))
        except Exception as e:  # (re-raised below)
            results[i] = e
        finally:
            if i == 1:
                b_done.set()

    threads = [threading.Thread(target=task, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(results[i], DXO) for i in (0, 1)), results
    for i in (0, 1):
        assert results[i].get_meta_prop(gcf.META_KEY) is not None


def test_a_relay_that_passes_a_result_s_meta_on_compresses_every_hop():
    # NVFlare's Cyclic workflow: ``model.params, model.meta = result.params, result.meta``, and the next task's DXO
    # gets that meta. A decoded result still marked compressed went down dense and the next client refused it.
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    srv_down, srv_up = gcf.ModelCompressor(), gcf.UpdateDecompressor()
    cli_down, cli_up = gcf.ModelDecompressor(), gcf.UpdateCompressor(fraction=0.1)
    model = FLModel(params_type=ParamsType.FULL, params={"w": np.ones((4, 4), np.float32)}, meta={})
    for hop, site in enumerate(["site-1", "site-2", "site-3"]):
        task = FLModelUtils.to_shareable(model)
        task.set_header(AppConstants.CURRENT_ROUND, 1)
        task = srv_down.process(task, ctx("server", 1))
        assert set(from_shareable(task).data) == {gcf.PAYLOAD_KEY}, hop  # compressed on every hop
        got = from_shareable(cli_down.process(task, ctx(site, 1)))
        assert got.get_meta_prop(gcf.META_KEY) is None and got.get_meta_prop(MetaKey.PROCESSED_ALGORITHM) is None
        np.testing.assert_array_equal(np.asarray(got.data["w"]), np.ones((4, 4)) + hop)
        trained = FLModel(params_type=ParamsType.FULL, params={"w": np.asarray(got.data["w"]) + 1}, meta={})
        res = srv_up.process(cli_up.process(FLModelUtils.to_shareable(trained), ctx(site, 1)), ctx("server", 1))
        result = FLModelUtils.from_shareable(res)
        assert gcf.META_KEY not in result.meta
        model.params, model.meta = result.params, result.meta  # (nvflare/app_common/workflows/cyclic.py)


def test_clara_processors_as_filters(tmp_path):
    key = tmp_path / "fl.key"
    key.write_bytes(bytes(range(32)).hex().encode())
    key.chmod(0o600)
    client = gcf.ClaraFilter(
        [
            {"name": "IteratorNumberGenerator", "args": {"field": "n_iter"}},
            {"name": "DataCompressor", "args": {"fraction": 0.25, "delta": False}},
            {"name": "ModelEncryptor", "args": {"key_file": str(key)}},
        ]
    )
    server = gcf.ClaraFilter(
        [{"name": "ModelDecryptor", "args": {"key_file": str(key)}}, {"name": "DataDeCompressor", "args": {}}]
    )
    d = diff(4)
    sent = client.process(shareable(dict(d), rnd=2), ctx(rnd=2))
    dxo = from_shareable(sent)
    assert dxo.data[gcf.PAYLOAD_KEY].startswith(C.ENVELOPE_MAGIC)
    assert dxo.get_meta_prop("clara") == {"n_iter": 7}  # NUM_STEPS_CURRENT_ROUND, as Clara's n_iter
    got = from_shareable(server.process(sent, ctx("server", rnd=2)))
    for n, v in topk_ref(d, 0.25).items():
        np.testing.assert_array_equal(got.data[n], v)
    assert got.get_filter_history() == ["ClaraFilter", "ClaraFilter"]
    with pytest.raises(C.DecryptionError):  # replayed into another round: the associated data differs
        server.process(client.process(shareable(dict(d), rnd=2), ctx(rnd=2)), ctx("server", rnd=3))
    # what a hostile peer puts under the payload key or in the meta: our error, nothing allocated for it
    for lie in (1 << 33, "abc", None, -1):
        with pytest.raises(gpu_codec.PayloadError, match="not bytes"):
            server.process(shareable({gcf.PAYLOAD_KEY: lie}), ctx("server"))
    with pytest.raises(gpu_codec.PayloadError, match="'clara' entry is a list"):
        server.process(shareable({gcf.PAYLOAD_KEY: C.ENVELOPE_MAGIC}, clara=[1, 2]), ctx("server"))


# ---------------------------------------------------------------- the job in NVFlare's simulator

FRACTION = 0.1
ACCURACY_TOLERANCE = 0.05  # top-10 % updates with error feedback vs dense, after 3 rounds


@pytest.fixture(scope="module")
def job():
    """``examples/nvflare/job.py`` (not a package), imported by path."""
    import importlib.util
    import pathlib
    import sys

    pytest.importorskip("sklearn")
    name = "gpu_codec_example_nvflare_job"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nvflare" / "job.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_digits_job_in_the_simulator(job, tmp_path):
    from faults import CorruptPayload

    plain = job.run("none", str(tmp_path / "none"), n_sites=3, rounds=3)
    comp = job.run(
        "gpu_codec",
        str(tmp_path / "gpu_codec"),
        n_sites=3,
        rounds=3,
        fraction=FRACTION,
        extra_sites={"site-4": [CorruptPayload()]},
    )
    honest = ["site-1", "site-2", "site-3"]

    def records(res, label):
        return [s for s in res["sizes"] if s["label"] == label]

    # the filters ran on every client and round
    up = {(s["site"], s["round"]): s for s in records(comp, "up")}
    assert set(up) == {(site, r) for site in [*honest, "site-4"] for r in range(3)}
    assert all(s["filters"][0] == "UpdateCompressor" for s in up.values())
    server_in = {(s["peer"], s["round"]): s for s in records(comp, "server_in")}
    for site in honest:
        for r in range(3):
            assert server_in[(site, r)]["filters"][-1] == "UpdateDecompressor"
            assert server_in[(site, r)]["rc"] == "OK"
    # site-4's damaged payloads were rejected, every round, and the others aggregated
    assert [server_in[("site-4", r)]["rc"] for r in range(3)] == ["TASK_RESULT_FILTER_ERROR"] * 3
    client_in = {(s["site"], s["round"]) for s in records(comp, "client_in")}
    assert client_in == {(site, r) for site in [*honest, "site-4"] for r in range(3)}
    assert all(s["filters"] == ["ModelCompressor"] for s in records(comp, "down"))
    with open(os.path.join(tmp_path / "gpu_codec", "server", "log.txt"), encoding="utf-8") as f:
        log = f.read()
    assert log.count("gpu_codec: rejected the train result of site-4") == 3
    assert log.count("Aggregated 3/4 results") == 3

    # the bytes sent shrank by the configured ratio (serialized shareables, client to server)
    plain_up = np.mean([s["bytes"] for s in records(plain, "up")])
    comp_up = np.mean([up[(site, r)]["bytes"] for site in honest for r in range(3)])
    assert plain_up / comp_up >= 1 / FRACTION, (plain_up, comp_up)
    down_plain = np.mean([s["bytes"] for s in records(plain, "down")])
    down_comp = np.mean([s["bytes"] for s in records(comp, "down")])
    assert down_plain / down_comp >= 1.8  # fp16 + zstd on the way down

    # and the model learned as well as without compression
    assert plain["accuracy"] > 0.85
    assert abs(comp["accuracy"] - plain["accuracy"]) <= ACCURACY_TOLERANCE, (comp["accuracy"], plain["accuracy"])


def test_exported_job_is_portable(job, tmp_path):
    """The exported job names no path of this machine, and no filter argument is called ``path`` (NVFlare would
    read it as a class path)."""
    import json

    job.export(job.build_job("gpu_codec", rounds=2, damaged_site=True), str(tmp_path / "jobs"))
    root = tmp_path / "jobs" / "digits_gpu_codec"
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["meta.json", "app_server", "app_site-1", "app_site-2", "app_site-3", "app_site-4"]
    )
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    for conf in root.glob("app_*/config/*.json"):
        text = conf.read_text(encoding="utf-8")
        assert repo not in text and str(tmp_path) not in text, conf

        def walk(node):
            if isinstance(node, dict):
                if node.get("path", "").startswith("gpu_codec."):
                    assert "path" not in node.get("args", {}), node
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(json.loads(text))
    client = json.loads((root / "app_site-1" / "config" / "config_fed_client.json").read_text(encoding="utf-8"))
    assert client["executors"][0]["executor"]["args"]["task_script_path"] == "digits_client.py"
    assert (root / "app_site-1" / "custom" / "digits_client.py").exists()
    assert (root / "app_site-4" / "custom" / "faults.py").exists()
    meters = [f for f in client["task_result_filters"][0]["filters"] if f["path"].endswith("SizeMeter")]
    assert meters and meters[0]["args"]["output_file"] == "sizes.jsonl"
    with pytest.raises(ValueError, match="damaged_site"):
        job.build_job("none", damaged_site=True)


def test_a_payload_that_needs_more_memory_than_there_is_drops_that_contribution(monkeypatch, caplog):
    up, down = gcf.UpdateCompressor(fraction=0.25), gcf.UpdateDecompressor()
    sent = up.process(shareable(diff()), ctx())

    def hungry(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(gcf, "decompress_params", hungry)
    with caplog.at_level(logging.ERROR):
        reply = down.process(sent, ctx("server"))
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    assert "MemoryError" in caplog.text and "this contribution is dropped" in caplog.text
