"""Clara components beyond the processor chain: model processors, savers, evaluators, validators, visualizers,
round-robin processors and metadata generators."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from gpu_codec import clara as C
from gpu_codec.errors import InvalidInputError

torch = pytest.importorskip("torch")


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


class Trainer:  # a Clara-style fitter: the trainer holding the model
    def __init__(self, model):
        self.model = model


def test_model_processor_contract():
    with pytest.raises(TypeError):
        C.ModelProcessor()
    assert issubclass(C.DictModelReaderWriter, C.ModelProcessor)
    assert issubclass(C.PTModelReaderWriter, C.ModelProcessor)
    rw = C.PTModelReaderWriter(exclude_vars="running_")
    rw.initialize(Trainer(net()))  # a trainer with a model, as Clara's fitter
    assert "1.running_mean" not in rw.get_local_models() and "0.weight" in rw.get_local_models()
    with pytest.raises(InvalidInputError, match=r"torch\.nn\.Module"):
        rw.initialize({"w": 1})
    d = C.DictModelReaderWriter()
    d.initialize()  # fitter=None: empty, adopts the first model it receives
    assert d.apply_model({"w": np.ones(2)}) is True and list(d.get_local_models()) == ["w"]
    d.initialize(Trainer({"v": np.zeros(1)}))
    assert list(d.extract_model()) == ["v"]
    with pytest.raises(InvalidInputError, match=r"DictModelReaderWriter\.initialize"):
        d.initialize(3)


def test_a_refused_model_leaves_the_module_as_it_was():
    torch = pytest.importorskip("torch")
    model = net()
    rw = C.PTModelReaderWriter()
    rw.initialize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = list(before)
    good = {names[0]: np.full(tuple(before[names[0]].shape), 7.0, np.float32)}  # (a good value read first)
    for bad in (np.ones(123, np.float32), np.array(["x"], dtype=object)):
        with pytest.raises(InvalidInputError, match=repr(names[1])):
            rw.apply_model({**good, names[1]: bad})
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert rw.apply_model(good) is True and bool((model.state_dict()[names[0]] == 7).all())


def test_pt_model_saver_round_trip(tmp_path):
    model = net(1)
    saver = C.PTModelSaver(exclude_vars=r"num_batches_tracked", model_log_dir=str(tmp_path))
    saver.initialize(Trainer(model))
    path = saver.save_model(None, False, round_number=2)  # None: the bound model
    best = saver.save_model(model, True)  # Clara's call: the model and whether it is the best so far
    assert os.path.basename(path) == "FL_global_model.pt" and os.path.basename(best) == "best_FL_global_model.pt"
    assert sorted(os.listdir(tmp_path)) == ["FL_global_model.pt", "best_FL_global_model.pt"]  # no temp files
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["round"] == 2 and "1.num_batches_tracked" not in ckpt["model"]
    for k, v in ckpt["model"].items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=0, atol=0)

    other = net(2)  # a fresh model preloaded from the checkpoint
    pre = C.PTModelSaver(exclude_vars=r"num_batches_tracked", ckpt_preload_path=path)
    pre.initialize(other)
    for k, v in ckpt["model"].items():
        torch.testing.assert_close(other.state_dict()[k], v, rtol=0, atol=0)

    # a mapping given: saved instead of the model's own (NumPy arrays too), the model untouched
    p2 = C.PTModelSaver(model_log_dir=str(tmp_path / "sub")).save_model({"w": np.arange(3, dtype=np.float32)}, False)
    assert torch.load(p2, weights_only=True)["model"]["w"].tolist() == [0.0, 1.0, 2.0]
    saver.close()
    assert saver.model is None
    unbound = C.PTModelSaver(model_log_dir=str(tmp_path / "u"))
    unbound.initialize()  # no builder: saves what it is given
    assert sorted(unbound.load_model(unbound.save_model(model, False))) == sorted(model.state_dict())


def test_pt_model_saver_errors(tmp_path):
    with pytest.raises(InvalidInputError, match="model_log_dir"):
        s = C.PTModelSaver()
        s.initialize(net())
        s.save_model(None, False)
    with pytest.raises(InvalidInputError, match="not initialized"):
        C.PTModelSaver(model_log_dir=str(tmp_path)).save_model(None, False)
    with pytest.raises(InvalidInputError, match="needs a model"):
        C.PTModelSaver(ckpt_preload_path=str(tmp_path / "x.pt")).initialize()
    wrong = tmp_path / "wrong.pt"
    torch.save({"model": {"0.weight": torch.zeros(5, 5)}}, wrong)
    with pytest.raises(InvalidInputError, match="shape"):
        C.PTModelSaver(ckpt_preload_path=str(wrong)).initialize(net())
    evil = tmp_path / "evil.pt"

    class Payload:  # an arbitrary object: a weights-only load refuses it, nothing runs
        def __reduce__(self):
            return (os.getcwd, ())

    with open(evil, "wb") as f:
        pickle.dump({"model": Payload()}, f)
    with pytest.raises(InvalidInputError, match="weights-only"):
        C.PTModelSaver().load_model(str(evil))
    with pytest.raises(InvalidInputError, match="cannot read"):
        C.PTModelSaver().load_model(str(tmp_path / "missing.pt"))
    with pytest.raises(InvalidInputError, match="no checkpoint"):
        C.PTModelSaver().load_model()


def test_tensorboard_model_visualizer_writes_readable_histograms(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    vis = C.TensorboardModelVisualizer(str(tmp_path), exclude_vars="bias")
    rng = np.random.default_rng(0)
    models = [{"w": rng.standard_normal((4, 5)).astype(np.float32), "bias": np.zeros(5, np.float32)}]
    for _ in range(2):
        models.append({k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in models[-1].items()})
    chain = C.ProcessorChain([vis])  # as a processor: the data context's model, the app context's round
    for r, m in enumerate(models):
        chain.process_outgoing(C.DataContext(model={"w": torch.from_numpy(m["w"]), "bias": m["bias"]}), C.AppContext(r))
    vis.close()

    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert acc.Tags()["histograms"] == ["model_diff/w"]
    events = acc.Histograms("model_diff/w")
    assert [e.step for e in events] == [1, 2]  # nothing for round 0: no previous model
    for e, r in zip(events, (1, 2)):
        d = (models[r]["w"] - models[r - 1]["w"]).astype(np.float64)
        assert e.histogram_value.num == d.size
        assert e.histogram_value.sum == pytest.approx(d.sum(), rel=1e-5)
        assert e.histogram_value.min == pytest.approx(d.min()) and e.histogram_value.max == pytest.approx(d.max())
    norms = [s.value for s in acc.Scalars("model_diff_norm/w")]
    assert norms == pytest.approx([float(np.linalg.norm(models[r]["w"] - models[r - 1]["w"])) for r in (1, 2)])
    # Clara's call, visualize(model_data): the steps count the calls
    seq = C.TensorboardModelVisualizer(str(tmp_path / "calls"))
    for m in models:
        seq.visualize({"w": m["w"]})
    seq.close()
    acc = EventAccumulator(str(tmp_path / "calls"), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Histograms("model_diff/w")] == [1, 2]
    assert C.build_processor({"name": "TensorboardModelVisualizer", "args": {"log_dir": str(tmp_path)}})
    with pytest.raises(TypeError):
        C.ModelVisualizer()


def test_model_evaluator_and_validator():
    with pytest.raises(TypeError):
        C.ModelEvaluator()
    with pytest.raises(TypeError):
        C.ModelValidator()

    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()

    class Acc(C.ModelValidator):
        def validate(self, model_params, app_ctx=None):
            m = torch.nn.Linear(4, 2)
            m.load_state_dict({k: torch.as_tensor(v) for k, v in model_params.items()})
            with torch.no_grad():
                return {"accuracy": float((m(x).argmax(1) == y).float().mean())}

    class Evaluator(C.ModelEvaluator):
        def __init__(self, model):
            self.model, self.metric = model, None

        def evaluate(self):
            self.metric = Acc().validate(self.model.state_dict())["accuracy"]

        def get_metric(self):
            return self.metric

    good = torch.nn.Linear(4, 2)
    with torch.no_grad():
        good.weight.zero_()
        good.bias.zero_()
        good.weight[1, 0] = 10.0
    ev = Evaluator(good)
    ev.evaluate()
    assert ev.get_metric() == 1.0
    ctx, app = C.DataContext(model=good.state_dict()), C.AppContext(key_metric="accuracy")
    C.ProcessorChain([Acc(), C.InitialValidationMetricGenerator()]).process_outgoing(ctx, app)
    assert ctx.get_metadata("validation_metrics") == {"validation/accuracy": 1.0}
    assert ctx.get_metadata("initial_validation_metric") == 1.0
    assert C.MetricManager().decode_metrics(ctx.get_metadata("validation_metrics")) == {"validation": {"accuracy": 1.0}}
    ev.initialize("the trainer")
    assert ev.builder == "the trainer"


def test_model_validator_validate_model_reads_a_checkpoint(tmp_path):
    seen = []

    class Norm(C.ModelValidator):
        def validate(self, model_params, app_ctx=None):
            seen.append(app_ctx)
            return {"norm": float(sum(torch.as_tensor(v).abs().sum() for v in model_params.values()))}

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(3.0)
    path = C.PTModelSaver(model_log_dir=str(tmp_path)).save_model(model, False)
    v = Norm()
    assert v.validate_model({"mmar": "config_validation.json"}, path) == {"norm": 6.0}  # Clara's call
    assert seen[-1]["configer"] == {"mmar": "config_validation.json"}
    assert v.validate_model(C.AppContext(round_number=4), model.state_dict()) == {"norm": 6.0}
    assert seen[-1].round_number == 4
    torch.save(model.state_dict(), tmp_path / "plain.pt")  # a plain state_dict file
    assert v.validate_model(None, str(tmp_path / "plain.pt")) == {"norm": 6.0}
    with pytest.raises(InvalidInputError, match="checkpoint must be"):
        v.validate_model(None, 3)
    with pytest.raises(InvalidInputError, match="cannot read"):
        v.validate_model(None, str(tmp_path / "missing.pt"))
    v.close()


def test_round_robin_processors():
    field = C.RoundRobinClientFieldProcessor(["a", "b", "c"], start_round=1)
    picks = []
    for r in range(1, 8):
        ctx = C.DataContext(model={})
        field.process(ctx, C.AppContext(round_number=r))
        picks.append(ctx.get_metadata("round_robin_client"))
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]

    st = C.build_processor({"name": "RoundRobinClientStateProcessor", "args": {"clients": ["a", "b", "c"]}})
    seen = []
    for unavailable in ([], ["b"], [], []):
        ctx = C.DataContext(model={})
        st.process(ctx, C.AppContext(unavailable_clients=unavailable))
        seen.append(ctx.get_metadata("round_robin_state"))
    assert [s["client"] for s in seen] == ["a", "c", "a", "b"]
    assert seen[0] == {"client": "a", "next": "b", "turn": 1} and seen[1]["next"] == "a"
    saved = st.get_state()
    again = C.RoundRobinClientStateProcessor(["a", "b", "c"])
    again.set_state(saved)
    ctx = C.DataContext(model={})
    again.process(ctx, C.AppContext())
    assert ctx.get_metadata("round_robin_state") == {"client": "c", "next": "a", "turn": 2}
    for bad in ([], ["a", "a"], "abc", [""]):
        with pytest.raises(InvalidInputError):
            C.RoundRobinClientFieldProcessor(bad)
    with pytest.raises(InvalidInputError, match="not a round-robin state"):
        again.set_state({"cursor": 0, "turns": {"x": 1}})
    with pytest.raises(InvalidInputError, match="every client is unavailable"):
        again.process(C.DataContext(model={}), C.AppContext(unavailable_clients=["a", "b", "c"]))


def test_metadata_generator_base():
    g = C.MetadataGenerator("site")
    assert g.get_field() == "site" and C.IteratorNumberGenerator("iters").get_field() == "iters"
    ctx = C.DataContext(model={})
    g.process(ctx, C.AppContext(site="s1"))
    C.IteratorNumberGenerator("iters").process(ctx, C.AppContext(n_iter=5))
    assert ctx.get_all_metadata() == {"site": "s1", "iters": 5}
    for bad in ("", None, 3):
        with pytest.raises(InvalidInputError):
            C.MetadataGenerator(bad)
