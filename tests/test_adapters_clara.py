"""Clara adapter: processor chains with compression and AES-GCM encryption, tampering, abort, readers/writers."""

from __future__ import annotations

import base64

import numpy as np
import pytest

import gpu_codec
from gpu_codec import clara as C
from gpu_codec.errors import GpuCodecError, InvalidInputError
from tests.common import HAS_GPU, dense_from, reference_topk, use_backend

pytest.importorskip("cryptography")

ADAPTER_BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]
KEY = bytes(range(32))


def ref_topk_delta(new: dict, base: dict, fraction: float) -> dict:
    """``base`` + the top-k delta (fp32 arithmetic), in ``new``'s dtypes, from the shared reference."""
    nf = {n: np.asarray(v, np.float32) for n, v in new.items()}
    bf = {n: np.asarray(base[n], np.float32) for n in new}
    kept = dense_from(
        reference_topk(nf, bf, fraction), {n: v.shape for n, v in nf.items()}, dict.fromkeys(nf, "float32")
    )
    return {n: (bf[n] + kept[n]).astype(new[n].dtype) for n in new}


def models(seed=0):
    rng = np.random.default_rng(seed)
    glob = {
        "conv.w": rng.standard_normal((4, 3, 3)).astype(np.float32),
        "fc.b": rng.standard_normal(7).astype(np.float32),
    }
    local = {k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in glob.items()}
    return glob, local


@pytest.fixture
def key_file(tmp_path):
    p = tmp_path / "fl.key"
    p.write_bytes(KEY.hex().encode() + b"\n")
    p.chmod(0o600)
    return str(p)


def make_chain(key_file, fraction=0.1):
    return C.ProcessorChain.from_config(
        {
            "pre_processors": [
                {"name": "IteratorNumberGenerator", "args": {"field": "n_iter"}},
                {"name": "BestMetricGenerator", "args": {"field": "best_validation_metric"}},
                {"name": "DataCompressor", "args": {"fraction": fraction}},
                {"name": "ModelEncryptor", "args": {"key_file": key_file}},
            ],
            "post_processors": [
                {"name": "DataDeCompressor", "args": {}},
                {"name": "ModelDecryptor", "args": {"key_file": key_file}},
            ],
        }
    )


def test_chain_compresses_encrypts_and_back(key_file):
    glob, local = models()
    chain = make_chain(key_file)
    ctx = C.DataContext(model=dict(local))
    app = C.AppContext(round_number=3, global_model=glob, n_iter=250, best_metric=0.75)
    chain.process_outgoing(ctx, app)
    assert ctx.get_metadata("n_iter") == 250 and ctx.get_metadata("best_validation_metric") == 0.75
    blob = C.serialize(ctx)
    assert blob[:8] == b"GCAESGCM" and b"conv.w" not in blob  # names and header are inside the ciphertext

    server = C.deserialize(blob)
    chain.process_incoming(server, C.AppContext(round_number=3, global_model=glob))
    want = ref_topk_delta(local, glob, 0.1)
    got = server.get_model()
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])
    assert server.get_metadata("n_iter") == 250 and server.get_metadata("best_validation_metric") == 0.75


def test_key_from_environment_and_base64(monkeypatch):
    monkeypatch.setenv("GPU_CODEC_TEST_KEY", base64.b64encode(KEY).decode())
    enc = C.ModelEncryptor(key_env="GPU_CODEC_TEST_KEY")
    dec = C.ModelDecryptor(key=KEY)
    ctx = C.DataContext(model={"w": np.arange(5, dtype=np.float16)})
    enc.process(ctx, C.AppContext())
    dec.process(ctx, C.AppContext())
    C.DataDeCompressor().process(ctx, C.AppContext())
    out = ctx.get_model()["w"]
    assert out.dtype == np.float16 and out.tolist() == [0, 1, 2, 3, 4]  # a lone encryptor is lossless
    assert enc.get_config() == {"key_file": None, "key_env": "GPU_CODEC_TEST_KEY", "bind": ["round"]}


def test_a_compressor_with_no_arguments_sends_whole_weights_dense():
    """Clara's configs list ``DataCompressor`` with ``{}``: with no global model (the server's way down) the model
    itself goes dense (top-1% of raw weights zeroed 99% of it); with one, the delta's top-1%; with ``delta=False``
    the model, a delta already, its top-k."""
    glob, local = models(2)
    comp = C.ProcessorChain.from_config({"pre_processors": [{"name": "DataCompressor", "args": {}}]})
    ctx = C.DataContext(model=dict(local))
    comp.process_outgoing(ctx, C.AppContext())
    assert ctx.get_model().nnz == sum(v.size for v in local.values())
    C.DataDeCompressor().process(ctx, C.AppContext())
    assert all(np.array_equal(ctx.get_model()[n], local[n]) for n in local)
    ctx = C.DataContext(model=dict(local))
    comp.process_outgoing(ctx, C.AppContext(global_model=glob))
    assert ctx.get_model().nnz == gpu_codec.kept_count(0.01, sum(v.size for v in local.values()))
    ctx = C.DataContext(model=dict(local))
    C.DataCompressor(fraction=0.25, delta=False).process(ctx, C.AppContext(global_model=glob))
    assert ctx.get_model().nnz == gpu_codec.kept_count(0.25, sum(v.size for v in local.values()))


@pytest.mark.parametrize("where", ["ciphertext", "tag", "nonce", "key_id", "magic", "truncated"])
def test_tampered_payload_is_rejected_and_not_decoded(key_file, where):
    glob, local = models(1)
    chain = make_chain(key_file)
    ctx = C.DataContext(model=local)
    app = C.AppContext(global_model=glob)
    blob = bytearray(C.serialize(chain.process_outgoing(ctx, app)))
    pos = {"ciphertext": 60, "tag": len(blob) - 1, "nonce": 20, "key_id": 10, "magic": 0}.get(where)
    if where == "truncated":
        blob = blob[:-5]
    else:
        blob[pos] ^= 0x01
    server = C.DataContext(model=bytes(blob))
    with pytest.raises(C.DecryptionError):
        chain.process_incoming(server, app)
    assert server.get_model() == bytes(blob)  # untouched: nothing decoded


def test_wrong_key_is_rejected(key_file):
    glob, local = models(2)
    ctx = C.DataContext(model=local)
    blob = C.serialize(make_chain(key_file).process_outgoing(ctx, C.AppContext(global_model=glob)))
    other = C.ModelDecryptor(key=bytes(32))
    with pytest.raises(C.DecryptionError, match="different key"):
        other.process(C.DataContext(model=blob), C.AppContext())
    assert issubclass(C.DecryptionError, GpuCodecError) and issubclass(C.DecryptionError, ValueError)


@pytest.mark.parametrize(
    "args, match",
    [
        ({}, "GPU_CODEC_MODEL_KEY"),  # (no key given: the default variable, not set here)
        ({"key": b"short"}, "16, 24 or 32 bytes"),
        ({"key": bytes(33)}, "16, 24 or 32 bytes"),
        ({"key": 32}, "must be bytes"),
        ({"key": KEY.hex()}, "must be bytes"),
        ({"key": KEY, "bind": "round"}, "list of app-context keys"),
        ({"key_env": "GPU_CODEC_NO_SUCH_VAR"}, "not set"),
        ({"key_file": "/nonexistent/key"}, "cannot read"),
        ({"key": KEY, "key_env": "X"}, "exactly one"),
    ],
)
def test_key_errors(args, match, monkeypatch):
    monkeypatch.delenv("GPU_CODEC_MODEL_KEY", raising=False)
    with pytest.raises(InvalidInputError, match=match) as e:
        C.ModelEncryptor(**args)
    assert isinstance(e.value, (C.EncryptionKeyError, InvalidInputError))


def test_clara_s_configs_name_the_cipher_with_no_arguments(monkeypatch):
    """Clara's own config files list ``{"name": "ModelEncryptor", "args": {}}``: the key comes from the environment
    (GPU_CODEC_MODEL_KEY); here compress-then-encrypt, with Clara's post list as written."""
    monkeypatch.setenv("GPU_CODEC_MODEL_KEY", KEY.hex())
    config = {
        "pre_processors": [{"name": "DataCompressor", "args": {}}, {"name": "ModelEncryptor", "args": {}}],
        "post_processors": [{"name": "DataDeCompressor", "args": {}}, {"name": "ModelDecryptor", "args": {}}],
    }
    glob, local = models(3)
    app = C.AppContext(global_model=glob)
    sent = C.serialize(C.ProcessorChain.from_config(config).process_outgoing(C.DataContext(model=local), app))
    server = C.deserialize(sent)
    C.ProcessorChain.from_config(config).process_incoming(server, app)
    for n, v in ref_topk_delta(local, glob, 0.01).items():
        np.testing.assert_array_equal(server.get_model()[n], v)
    monkeypatch.setenv("GPU_CODEC_MODEL_KEY", bytes(range(1, 33)).hex())  # (another key: refused)
    with pytest.raises(C.DecryptionError):
        C.ProcessorChain.from_config(config).process_incoming(C.deserialize(sent), app)


@pytest.mark.parametrize("size", [16, 24, 32])
@pytest.mark.parametrize("form", ["raw", "hex", "base64"])
def test_key_sizes_and_forms(tmp_path, size, form):
    key = bytes(range(100, 100 + size))
    text = {"raw": key, "hex": key.hex().encode(), "base64": base64.b64encode(key)}[form]
    path = tmp_path / "k"
    path.write_bytes(text)
    path.chmod(0o600)
    enc = C.ModelEncryptor(key_file=str(path))
    dec = C.ModelDecryptor(key=key)  # the same key, given as bytes
    ctx = C.DataContext(model={"w": np.arange(4, dtype=np.float32)})
    enc.process(ctx, C.AppContext())
    dec.process(ctx, C.AppContext())
    assert isinstance(ctx.get_model(), gpu_codec.Payload)


def test_key_file_readable_by_others_warns(tmp_path):
    path = tmp_path / "k"
    path.write_bytes(KEY.hex().encode())
    path.chmod(0o644)
    with pytest.warns(C.KeyFilePermissionWarning, match="chmod 600"):
        C.ModelEncryptor(key_file=str(path))


def test_envelope_is_bound_to_the_round_and_context(key_file):
    _, local = models(8)
    enc = C.ModelEncryptor(key_file=key_file, bind=("round", "task"))
    dec = enc.inverse()
    ctx = C.DataContext(model=dict(local))
    enc.process(ctx, C.AppContext(round_number=5, task="train"))
    blob = ctx.get_model()
    for app in (C.AppContext(round_number=6, task="train"), C.AppContext(round_number=5, task="validate")):
        replayed = C.DataContext(model=blob)
        with pytest.raises(C.DecryptionError, match="another round/task"):
            dec.process(replayed, app)
        assert replayed.get_model() == blob  # nothing decoded
    ok = C.DataContext(model=blob)
    dec.process(ok, C.AppContext(round_number=5, task="train"))
    C.DataDeCompressor().process(ok, C.AppContext())
    np.testing.assert_array_equal(ok.get_model()["fc.b"], local["fc.b"])
    unbound = C.ModelEncryptor(key_file=key_file, bind=())  # bind=(): any round decrypts
    ctx2 = C.DataContext(model=dict(local))
    unbound.process(ctx2, C.AppContext(round_number=1))
    unbound.inverse().process(ctx2, C.AppContext(round_number=9))


def test_abort_stops_the_chain_and_restores_the_context(key_file):
    glob, local = models(3)
    chain = make_chain(key_file)
    ctx = C.DataContext(model=local, metadata={"site": "a"})
    app = C.AppContext(global_model=glob, n_iter=9)

    chain.abort(app)  # before the run: the next run stops
    with pytest.raises(C.ProcessingAbortedError):
        chain.process_outgoing(ctx, app)
    assert ctx.get_model() is local and ctx.get_all_metadata() == {"site": "a"}

    class Aborter(C.DataProcessor):  # aborts the chain from inside, after the generators ran
        def process(self, data_ctx, app_ctx):
            chain.abort(app_ctx)

    chain.pre_processors.insert(2, Aborter())
    with pytest.raises(C.ProcessingAbortedError):
        chain.process_outgoing(ctx, app)
    assert ctx.get_model() is local and ctx.get_all_metadata() == {"site": "a"}

    del chain.pre_processors[2]  # and the chain runs again afterwards
    chain.process_outgoing(ctx, app)
    assert ctx.get_model()[:8] == b"GCAESGCM" and ctx.get_metadata("n_iter") == 9


def test_processor_order_errors(key_file):
    glob, local = models(4)
    wrong = C.ProcessorChain([C.ModelEncryptor(key_file=key_file), C.DataCompressor(fraction=0.5)])
    ctx = C.DataContext(model=local)
    with pytest.raises(C.ProcessorOrderError, match="before ModelEncryptor"):
        wrong.process_outgoing(ctx, C.AppContext())
    assert ctx.get_model() is local
    enc_ctx = C.DataContext(model=local)
    C.ProcessorChain([C.DataCompressor(fraction=0.5), C.ModelEncryptor(key_file=key_file)]).process_outgoing(
        enc_ctx, C.AppContext(global_model=glob)
    )
    with pytest.raises(C.ProcessorOrderError, match="ModelDecryptor must run"):
        C.DataDeCompressor().process(enc_ctx, C.AppContext(global_model=glob))
    with pytest.raises(C.ProcessorOrderError, match=r"not compressed or encrypted|neither"):
        C.serialize(C.DataContext(model=local))
    delta_payload = gpu_codec.compress(local, glob, fraction=0.5, metadata={C.CLARA_KEY: {"delta": True}})
    with pytest.raises(InvalidInputError, match="no global model"):
        C.DataDeCompressor().process(C.DataContext(model=delta_payload), C.AppContext())


def test_default_post_processors_are_the_inverses(key_file):
    glob, local = models(5)
    chain = C.ProcessorChain([C.DataCompressor(fraction=0.2), C.ModelEncryptor(key_file=key_file)])
    assert [type(p).__name__ for p in chain.post_processors] == ["DataDeCompressor", "ModelDecryptor"]
    ctx = C.DataContext(model=local)
    app = C.AppContext(global_model=glob)
    server = C.deserialize(C.serialize(chain.process_outgoing(ctx, app)))
    chain.process_incoming(server, app)
    for n, v in ref_topk_delta(local, glob, 0.2).items():
        np.testing.assert_array_equal(server.get_model()[n], v)


def test_codec_stages_in_the_compressor_config(key_file):
    glob, local = models(7)
    chain = C.ProcessorChain.from_config(
        {
            "pre_processors": [
                {
                    "name": "DataCompressor",
                    "args": {
                        "fraction": 0.2,
                        "pipeline": [
                            {"id": "quantize", "dtype": "float16"},
                            {"id": "rice"},
                            {"id": "zstd", "level": 3},
                        ],
                    },
                },
                {"name": "ModelEncryptor", "args": {"key_file": key_file}},
            ]
        }
    )
    app = C.AppContext(global_model=glob)
    server = C.deserialize(C.serialize(chain.process_outgoing(C.DataContext(model=local), app)))
    chain.process_incoming(server, app)
    d = {n: local[n] - glob[n] for n in local}
    kept = ref_topk_delta(d, {n: np.zeros_like(v) for n, v in d.items()}, 0.2)
    for n in local:
        np.testing.assert_array_equal(server.get_model()[n], glob[n] + kept[n].astype(np.float16).astype(np.float32))


def test_config_errors_and_byoc_path():
    with pytest.raises(InvalidInputError, match="unknown processor"):
        C.build_processor({"name": "NoSuchProcessor"})
    with pytest.raises(InvalidInputError, match="bad args"):
        C.build_processor({"name": "DataCompressor", "args": {"nope": 1}})
    p = C.build_processor({"path": "gpu_codec.clara.IteratorNumberGenerator", "args": {"field": "iters"}})
    assert isinstance(p, C.IteratorNumberGenerator) and p.field == "iters"
    assert C.build_processor({"name": "DataCompressor", "args": {"fraction": 0.05}}).get_config()["fraction"] == 0.05


def test_metadata_generators():
    ctx = C.DataContext(model={})
    app = C.AppContext(n_iter=12, best_metric=0.8, initial_metric=0.6)
    for g in (C.IteratorNumberGenerator(), C.BestMetricGenerator(), C.InitialValidationMetricGenerator()):
        g.process(ctx, app)
    assert ctx.get_all_metadata() == {"n_iter": 12, "best_validation_metric": 0.8, "initial_validation_metric": 0.6}
    ctx2 = C.DataContext(model={})
    C.BestMetricGenerator().process(ctx2, C.AppContext())  # nothing to attach
    assert ctx2.get_all_metadata() == {}


def test_metric_manager():
    torch = pytest.importorskip("torch")
    mm = C.MetricManager({"validation": {"val_dice": np.float32(0.5), "val_acc": 0.25}})
    mm.add_group("train", {"loss": 1})
    mm.add_group("train", {"lr": torch.tensor(0.01)})  # merged into the group
    assert mm.get_group("train") == {"loss": 1.0, "lr": pytest.approx(0.01)} and mm.get_group("nope") is None
    enc = mm.encode_metrics()
    assert list(enc) == ["train/loss", "train/lr", "validation/val_acc", "validation/val_dice"]
    assert enc["validation/val_dice"] == 0.5 and isinstance(enc["train/loss"], float)
    receiver = C.MetricManager()
    assert receiver.decode_metrics(enc) == mm.to_dict() and receiver.to_dict() == mm.to_dict()
    assert C.MetricManager().decode_metrics({"g/a/b": 1}) == {"g": {"a/b": 1.0}}  # split at the first "/"
    mm.to_dict()["train"]["loss"] = 9  # a copy
    assert mm.get_group("train")["loss"] == 1.0
    for bad in (
        {"v": {"acc": float("nan")}},
        {"v": {"loss": "high"}},
        {"v": {"loss": np.ones(3)}},
        {"v": {"ok": True}},
        {"a/b": {"x": 1}},
        {"": {"x": 1}},
        {"v": [1.0]},
        {"v": {"": 1.0}},
        [("v", {})],
    ):
        with pytest.raises(C.MetricsError):
            C.MetricManager.validate_metrics(bad)
    for bad in ({"noslash": 1.0}, {"/x": 1.0}, {"g/": 1.0}, ["g/x"]):
        with pytest.raises(C.MetricsError):
            C.MetricManager().decode_metrics(bad)
    with pytest.raises(C.MetricsError, match="not finite"):
        mm.add_group("train", {"loss": float("inf")})
    assert mm.get_group("train")["loss"] == 1.0  # a rejected add changes nothing


def test_dict_model_reader_writer_with_payloads():
    glob, local = models(6)
    rw = C.DictModelReaderWriter(exclude_vars=r"^fc\.")
    rw.initialize(glob)
    assert list(rw.get_local_models()) == ["conv.w"]
    payload = gpu_codec.compress(
        {"conv.w": local["conv.w"]}, {"conv.w": glob["conv.w"]}, fraction=0.3, metadata={C.CLARA_KEY: {"delta": True}}
    )
    assert rw.apply_model(payload.to_bytes()) is True
    want = ref_topk_delta({"conv.w": local["conv.w"]}, {"conv.w": glob["conv.w"]}, 0.3)["conv.w"]
    np.testing.assert_array_equal(rw.extract_model(["conv.w", "missing"])["conv.w"], want)
    assert rw.apply_model({"fc.b": np.zeros(7, np.float32)}) is False  # excluded


@pytest.mark.parametrize("backend", ADAPTER_BACKENDS)
def test_pt_model_reader_writer_through_the_chain(backend, key_file):
    torch = pytest.importorskip("torch")
    device = "cuda" if backend == "gpu" else "cpu"
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to(device)
    rw = C.PTModelReaderWriter()
    rw.initialize(net)
    glob = {k: v.clone() for k, v in rw.get_local_models().items()}
    weight = net[0].weight
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    local = rw.get_local_models()
    assert local["0.weight"].data_ptr() == weight.data_ptr()  # no copies
    with use_backend(backend):
        chain = C.ProcessorChain([C.DataCompressor(fraction=0.25), C.ModelEncryptor(key_file=key_file)])
        ctx = C.DataContext(model=local)
        app = C.AppContext(global_model=glob)
        chain.pre_processors[0].process(ctx, app)
        if backend == "gpu":
            assert type(ctx.get_model().tensors[0].buffers["values"]).__module__.startswith("cupy")
        chain.pre_processors[1].process(ctx, app)
        server = C.deserialize(C.serialize(ctx))
        chain.process_incoming(server, app)
        got = server.get_model()
        assert all(v.device.type == device for v in got.values())
        np_local = {k: v.cpu().numpy() for k, v in local.items()}
        want = ref_topk_delta(np_local, {k: v.cpu().numpy() for k, v in glob.items()}, 0.25)
        for n in want:
            np.testing.assert_array_equal(got[n].cpu().numpy(), want[n])
        receiver = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to(device)
        rrw = C.PTModelReaderWriter()
        rrw.initialize(receiver)
        w_ptr = receiver[0].weight.data_ptr()
        assert rrw.apply_model(got) is True
    assert receiver[0].weight.data_ptr() == w_ptr  # written in place
    np.testing.assert_array_equal(receiver[0].weight.detach().cpu().numpy(), want["0.weight"])


@pytest.fixture
def parses(monkeypatch):
    """Every call of ``Payload.from_bytes`` from here on, counted."""
    calls = []
    parse = gpu_codec.Payload.from_bytes.__func__

    def counted(cls, blob):
        calls.append(len(blob))
        return parse(cls, blob)

    monkeypatch.setattr(gpu_codec.Payload, "from_bytes", classmethod(counted))
    return calls


def test_each_decode_path_parses_a_payload_once(key_file, parses):
    glob, local = models(8)
    app = C.AppContext(round_number=2, global_model=glob, n_iter=40)
    want = ref_topk_delta(local, glob, 0.2)
    plain = C.ProcessorChain.from_config(
        {"pre_processors": [{"name": "IteratorNumberGenerator"}, {"name": "DataCompressor", "args": {"fraction": 0.2}}]}
    )
    blob = C.serialize(plain.process_outgoing(C.DataContext(model=dict(local)), app))
    sealed = C.serialize(make_chain(key_file, 0.2).process_outgoing(C.DataContext(model=dict(local)), app))

    def decompressed(ctx):
        C.DataDeCompressor().process(ctx, app)
        return ctx

    runs = {
        "bytes into DataDeCompressor": lambda: decompressed(C.DataContext(model=blob)),
        "deserialize, then the chain": lambda: plain.process_incoming(C.deserialize(blob), app),
        "decrypt, then decompress": lambda: make_chain(key_file, 0.2).process_incoming(C.deserialize(sealed), app),
    }
    for what, run in runs.items():
        parses.clear()
        out = run()
        assert len(parses) == 1, what  # metadata and tensors come from the one parsed Payload
        assert out.get_metadata("n_iter") == 40, what
        for n in want:
            np.testing.assert_array_equal(out.get_model()[n], want[n])
    rw = C.DictModelReaderWriter()
    rw.initialize(glob)
    parses.clear()
    assert rw.apply_model(blob) is True and len(parses) == 1
    np.testing.assert_array_equal(rw.extract_model()["conv.w"], want["conv.w"])
