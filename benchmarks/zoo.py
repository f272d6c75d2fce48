"""The model zoo: the updates every performance figure of the project is measured on.

Each entry builds ``(base, new)`` as mappings name -> array, deterministic by seed, at a ``scale`` (about the share
of the full parameter count; the tensor count stays):

- **architectures**: the tensor shapes of ResNet-50 (with its BatchNorm running statistics and a float
  ``num_batches_tracked`` per norm), BERT-base, GPT-2 small, a Llama-style model of about 1e9 parameters in
  bfloat16 (torch tensors: NumPy has no bfloat16), a LoRA adapter set and ViT-B/16, written out from the
  architectures' definitions; the delta is :func:`gpu_codec.synthetic.synthetic_delta`'s heavy-tailed per-layer,
  per-channel model with the scales of training on top (norms and heads move more, an embedding's unseen rows and
  frozen layers not at all, batch counters by exactly the step count);
- **trained**: updates made by really training small models (a CNN on scikit-learn's digits with SGD, Adam and
  frozen convolutions; a 4-layer character transformer on the text of Python's ``argparse`` module) for a few
  federated rounds, the server applying each round's top-1% update with error feedback; every round is kept
  (:attr:`Update.rounds`), so a benchmark can replay them and carry real residuals;
- **distributions** that break selection: exact zeros (99%, 100%), three distinct values (ties), 1e-30 and 1e+30
  tensors side by side, fewer non-zeros than k, one i.i.d. tensor of 2^24, and 2^23 elements in 1, 100 and 1,000
  uneven tensors.

>>> sorted(ZOO)[:3]
['bert-base', 'char-transformer', 'digits-cnn-adam']
>>> u = ZOO["resnet-50"].build(scale=1e-3)
>>> len(u.new), sorted({str(a.dtype) for a in u.new.values()})
(320, ['float32'])
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import gpu_codec
from gpu_codec.synthetic import synthetic_delta

Arrays = dict[str, Any]
Shapes = dict[str, tuple[int, ...]]


@dataclass
class Update:
    """One update of the zoo: ``new`` against ``base``; ``rounds`` every (base, new) of a federated run, oldest
    first, ending with this one (one round where the entry is not a training run); ``info`` what the builder
    knows (losses, zero share, frozen tensors)."""

    base: Arrays
    new: Arrays
    rounds: list[tuple[Arrays, Arrays]]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    """A zoo entry: ``shapes(scale)`` is cheap (no data); ``build(scale, seed)`` makes the update."""

    name: str
    kind: str  # "architecture", "trained" or "distribution"
    dtype: str
    description: str
    shapes: Callable[[float], Shapes]
    build_fn: Callable[[float, int], Update]

    def build(self, scale: float = 1.0, seed: int = 0) -> Update:
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale}")
        return self.build_fn(scale, seed)

    def params(self, scale: float = 1.0) -> int:
        return sum(math.prod(s) for s in self.shapes(scale).values())

    def tensors(self) -> int:
        return len(self.shapes(1.0))


# --- architectures -------------------------------------------------------------------------------------------------

# Delta scale of each kind of tensor relative to a weight matrix's (as training moves them).
KIND_SCALE = {"weight": 1.0, "bias": 1.0, "norm": 3.0, "embed": 1.0, "head": 10.0, "lora_a": 1.0, "lora_b": 3.0}


def _width(scale: float) -> Callable[[int], int]:
    """Scale a width by sqrt(scale) (so a matrix scales by ``scale``), in multiples of 8, at least 8."""
    r = math.sqrt(scale)
    return lambda x: max(8, round(x * r / 8) * 8) if r < 1 else x


def resnet50(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """torchvision's ResNet-50: conv weights (no bias), BatchNorm weight, bias, running_mean, running_var and
    num_batches_tracked (a float scalar here: the codec takes float dtypes), fc; 320 tensors, 25.6M elements."""
    d = _width(scale)
    s: dict[str, tuple[tuple[int, ...], str]] = {}

    def conv(name: str, co: int, ci: int, k: int) -> None:
        s[name + ".weight"] = ((co, ci, k, k), "weight")

    def bn(name: str, c: int) -> None:
        s[name + ".weight"] = ((c,), "norm")
        s[name + ".bias"] = ((c,), "norm")
        s[name + ".running_mean"] = ((c,), "running_mean")
        s[name + ".running_var"] = ((c,), "running_var")
        s[name + ".num_batches_tracked"] = ((), "count")

    conv("conv1", d(64), 3, 7)
    bn("bn1", d(64))
    cin = d(64)
    for li, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), 1):
        w = d(width)
        for b in range(blocks):
            p = f"layer{li}.{b}"
            conv(p + ".conv1", w, cin, 1)
            bn(p + ".bn1", w)
            conv(p + ".conv2", w, w, 3)
            bn(p + ".bn2", w)
            conv(p + ".conv3", 4 * w, w, 1)
            bn(p + ".bn3", 4 * w)
            if b == 0:
                conv(p + ".downsample.0", 4 * w, cin, 1)
                bn(p + ".downsample.1", 4 * w)
            cin = 4 * w
    s["fc.weight"] = ((d(1000), cin), "head")
    s["fc.bias"] = ((d(1000),), "head")
    return s


def bert_base(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face's BertModel (bert-base-uncased): 199 tensors, 109.5M parameters."""
    d = _width(scale)
    h, inter = d(768), d(3072)
    s = {
        "embeddings.word_embeddings.weight": ((d(30522), h), "embed"),
        "embeddings.position_embeddings.weight": ((d(512), h), "weight"),
        "embeddings.token_type_embeddings.weight": ((2, h), "weight"),
        "embeddings.LayerNorm.weight": ((h,), "norm"),
        "embeddings.LayerNorm.bias": ((h,), "norm"),
    }
    for i in range(12):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            s[p + m + ".weight"] = ((h, h), "weight")
            s[p + m + ".bias"] = ((h,), "bias")
        s[p + "attention.output.LayerNorm.weight"] = ((h,), "norm")
        s[p + "attention.output.LayerNorm.bias"] = ((h,), "norm")
        s[p + "intermediate.dense.weight"] = ((inter, h), "weight")
        s[p + "intermediate.dense.bias"] = ((inter,), "bias")
        s[p + "output.dense.weight"] = ((h, inter), "weight")
        s[p + "output.dense.bias"] = ((h,), "bias")
        s[p + "output.LayerNorm.weight"] = ((h,), "norm")
        s[p + "output.LayerNorm.bias"] = ((h,), "norm")
    s["pooler.dense.weight"] = ((h, h), "head")
    s["pooler.dense.bias"] = ((h,), "head")
    return s


def gpt2_small(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face's GPT2Model (gpt2, Conv1D weights stored (in, out)); the head is tied to wte: 148 tensors,
    124.4M parameters."""
    d = _width(scale)
    h = d(768)
    s = {"wte.weight": ((d(50257), h), "embed"), "wpe.weight": ((d(1024), h), "weight")}
    for i in range(12):
        p = f"h.{i}."
        s[p + "ln_1.weight"] = ((h,), "norm")
        s[p + "ln_1.bias"] = ((h,), "norm")
        s[p + "attn.c_attn.weight"] = ((h, 3 * h), "weight")
        s[p + "attn.c_attn.bias"] = ((3 * h,), "bias")
        s[p + "attn.c_proj.weight"] = ((h, h), "weight")
        s[p + "attn.c_proj.bias"] = ((h,), "bias")
        s[p + "ln_2.weight"] = ((h,), "norm")
        s[p + "ln_2.bias"] = ((h,), "norm")
        s[p + "mlp.c_fc.weight"] = ((h, 4 * h), "weight")
        s[p + "mlp.c_fc.bias"] = ((4 * h,), "bias")
        s[p + "mlp.c_proj.weight"] = ((4 * h, h), "weight")
        s[p + "mlp.c_proj.bias"] = ((h,), "bias")
    s["ln_f.weight"] = ((h,), "norm")
    s["ln_f.bias"] = ((h,), "norm")
    return s


def llama_1b(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """A Llama-style decoder (LlamaForCausalLM's tensors): 32 layers, hidden 1536 (24 heads of 64), grouped-query
    attention with 8 key/value heads, SwiGLU MLP of 4608, RMSNorm, vocabulary 32,000, untied head: 291 tensors,
    0.98e9 parameters."""
    d = _width(scale)
    h, kv, inter, vocab = d(1536), d(512), d(4608), d(32000)
    s = {"model.embed_tokens.weight": ((vocab, h), "embed")}
    for i in range(32):
        p = f"model.layers.{i}."
        s[p + "self_attn.q_proj.weight"] = ((h, h), "weight")
        s[p + "self_attn.k_proj.weight"] = ((kv, h), "weight")
        s[p + "self_attn.v_proj.weight"] = ((kv, h), "weight")
        s[p + "self_attn.o_proj.weight"] = ((h, h), "weight")
        s[p + "mlp.gate_proj.weight"] = ((inter, h), "weight")
        s[p + "mlp.up_proj.weight"] = ((inter, h), "weight")
        s[p + "mlp.down_proj.weight"] = ((h, inter), "weight")
        s[p + "input_layernorm.weight"] = ((h,), "norm")
        s[p + "post_attention_layernorm.weight"] = ((h,), "norm")
    s["model.norm.weight"] = ((h,), "norm")
    s["lm_head.weight"] = ((vocab, h), "head")
    return s


def lora_adapters(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """PEFT LoRA adapters of rank 16 on q, k, v and o of a 32-layer model of hidden 4096 (a 7B Llama): 256 small
    matrices, 16.8M parameters."""
    h, r = max(8, round(4096 * scale / 8) * 8), 16  # only the model's width scales (the rank stays)
    s = {}
    for i in range(32):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}."
            s[p + "lora_A.weight"] = ((r, h), "lora_a")
            s[p + "lora_B.weight"] = ((h, r), "lora_b")
    return s


def vit_b16(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str]]:
    """timm's vit_base_patch16_224: 152 tensors, 86.6M parameters."""
    d = _width(scale)
    h = d(768)
    s = {
        "cls_token": ((1, 1, h), "weight"),
        "pos_embed": ((1, 197, h), "weight"),
        "patch_embed.proj.weight": ((h, 3, 16, 16), "weight"),
        "patch_embed.proj.bias": ((h,), "bias"),
    }
    for i in range(12):
        p = f"blocks.{i}."
        s[p + "norm1.weight"] = ((h,), "norm")
        s[p + "norm1.bias"] = ((h,), "norm")
        s[p + "attn.qkv.weight"] = ((3 * h, h), "weight")
        s[p + "attn.qkv.bias"] = ((3 * h,), "bias")
        s[p + "attn.proj.weight"] = ((h, h), "weight")
        s[p + "attn.proj.bias"] = ((h,), "bias")
        s[p + "norm2.weight"] = ((h,), "norm")
        s[p + "norm2.bias"] = ((h,), "norm")
        s[p + "mlp.fc1.weight"] = ((4 * h, h), "weight")
        s[p + "mlp.fc1.bias"] = ((4 * h,), "bias")
        s[p + "mlp.fc2.weight"] = ((h, 4 * h), "weight")
        s[p + "mlp.fc2.bias"] = ((h,), "bias")
    s["norm.weight"] = ((h,), "norm")
    s["norm.bias"] = ((h,), "norm")
    s["head.weight"] = ((d(1000), h), "head")
    s["head.bias"] = ((d(1000),), "head")
    return s


def _base_values(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """A trained model's values of a tensor of ``kind``, as initializers leave them (fp32)."""
    if kind == "norm":
        a = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    elif kind in ("bias", "running_mean"):
        a = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    elif kind == "running_var":
        a = 1.0 + 0.2 * np.abs(rng.standard_normal(shape, dtype=np.float32))
    elif kind == "count":
        a = np.full(shape, 12_000.0, np.float32)  # steps seen so far
    else:
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        a = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(fan_in))
    return a.astype(np.float32, copy=False)


def architecture_update(
    spec: dict[str, tuple[tuple[int, ...], str]],
    seed: int,
    *,
    frozen: tuple[str, ...] = (),
    steps: int = 100,
    bf16: bool = False,
) -> Update:
    """Base values per kind, and one round's delta: :func:`~gpu_codec.synthetic.synthetic_delta` (heavy-tailed, a
    log-normal scale per layer and per output channel; the ``embed`` tensor's unseen rows stay still) times the
    kind's :data:`KIND_SCALE`; running statistics drift, ``count`` tensors gain exactly ``steps``, tensors whose
    name starts with one of ``frozen`` do not move. ``bf16``: torch bfloat16 tensors."""
    rng = np.random.default_rng(seed)
    embed = [n for n, (_, k) in spec.items() if k == "embed"]
    alias = dict.fromkeys(embed[:1], "embed.weight")  # the name synthetic_delta gives unseen rows to
    shapes = {alias.get(n, n): s for n, (s, _) in spec.items()}
    delta = synthetic_delta(seed=seed + 1, shapes=shapes)
    base, new = {}, {}
    zero = 0
    for name, (shape, kind) in spec.items():
        b = _base_values(rng, shape, kind)
        d = delta.pop(alias.get(name, name))
        if kind == "running_mean":
            d = 0.05 * rng.standard_normal(shape, dtype=np.float32)
        elif kind == "running_var":
            d = 0.05 * b * rng.standard_normal(shape, dtype=np.float32)
        elif kind == "count":
            d = np.full(shape, float(steps), np.float32)
        else:
            d = d * np.float32(KIND_SCALE[kind])
        if name.startswith(frozen):
            d = np.zeros(shape, np.float32)
        n = np.asarray(b + d, np.float32)  # (a 0-d tensor stays an array, as a state dict's: not a NumPy scalar)
        if bf16:
            import torch

            b, n = torch.from_numpy(b).to(torch.bfloat16), torch.from_numpy(n).to(torch.bfloat16)
            zero += int((b == n).sum())
        else:
            zero += int(np.count_nonzero(b == n))
        base[name], new[name] = b, n
    total = sum(math.prod(s) for s, _ in spec.values())
    info = {"frozen": [n for n in spec if n.startswith(frozen)], "zero_share": zero / total}
    return Update(base, new, [(base, new)], info)


def _arch(name: str, fn, description: str, *, frozen: tuple[str, ...] = (), bf16: bool = False) -> Entry:
    return Entry(
        name,
        "architecture",
        "bfloat16" if bf16 else "float32",
        description,
        lambda scale: {k: s for k, (s, _) in fn(scale).items()},
        lambda scale, seed: architecture_update(fn(scale), seed, frozen=frozen, bf16=bf16),
    )


# --- trained -------------------------------------------------------------------------------------------------------


def _torch_threads(n: int):
    """Run torch on ``n`` threads inside the block (training is deterministic on one), restoring the count."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return ctx()


def _state(model) -> dict[str, np.ndarray]:
    """The model's float tensors (parameters and buffers) as fp32 NumPy copies."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if v.is_floating_point()}


def federated_rounds(
    model,
    batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable,
    make_opt: Callable,
    rounds: int,
    steps: int,
    fraction: float = 0.01,
) -> Update:
    """Train ``model`` for ``rounds`` rounds of ``steps`` steps (a fresh optimizer over the parameters that need
    gradients each round, as a client starts it); the server adds each round's top-``fraction`` update, compressed
    with error feedback, to the global model, from which the next round starts. One thread, seeded by the caller."""
    import torch

    ef = gpu_codec.ErrorFeedback()
    glob = _state(model)
    pairs, losses = [], []
    step = 0
    for _ in range(rounds):
        model.load_state_dict({k: torch.from_numpy(v) for k, v in glob.items()}, strict=False)
        opt = make_opt([p for p in model.parameters() if p.requires_grad])
        for _ in range(steps):
            x, y = batch(step)
            step += 1
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        new = _state(model)
        pairs.append((glob, new))
        payload = gpu_codec.compress(new, glob, fraction=fraction, residual=ef)
        glob = {k: np.asarray(v) for k, v in gpu_codec.decompress(payload, base=glob).items()}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    base, new = pairs[-1]
    return Update(base, new, pairs, {"losses": losses, "frozen": frozen, "rounds": rounds, "steps": steps})


def _digits_cnn():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
            self.fc1 = nn.Linear(64 * 8 * 8, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    return Net()


def digits_update(optimizer: str, frozen: bool, seed: int, rounds: int = 4, steps: int = 10) -> Update:
    """A small CNN (8 tensors, 281,674 parameters) trained on scikit-learn's digits (shipped with it)."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.from_numpy((x / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(y.astype(np.int64))
    with _torch_threads(1):
        torch.manual_seed(seed)
        model = _digits_cnn()
        if frozen:
            for p in (*model.conv1.parameters(), *model.conv2.parameters()):
                p.requires_grad_(False)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))

        def batch(step: int):
            i = order[(step * 64) % (len(y) - 64) :][:64]
            return x[i], y[i]

        if optimizer == "sgd":
            make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
        else:
            make = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
        return federated_rounds(model, batch, torch.nn.functional.cross_entropy, make, rounds, steps)


def text_corpus() -> str:
    """Text every Python installation ships: the source of the standard library's ``argparse`` module."""
    import argparse

    return pathlib.Path(argparse.__file__).read_text(encoding="utf-8")


def _char_model(vocab: int, d: int, layers: int, context: int):
    import torch
    from torch import nn

    class CharTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(context, d)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers)
            )
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), False)

        def forward(self, x):
            t = x.shape[1]
            h = self.tok(x) + self.pos.weight[:t]
            for b in self.blocks:
                h = b(h, src_mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.ln(h))

    return CharTransformer()


CHAR_WIDTH = 256  # d_model at scale 1: 54 tensors, 3.2M parameters


def char_width(scale: float) -> int:
    return max(16, round(CHAR_WIDTH * math.sqrt(scale) / 16) * 16)


def char_update(scale: float, seed: int, rounds: int = 3, steps: int = 8, context: int = 32) -> Update:
    """A 4-layer pre-norm character transformer trained with Adam on :func:`text_corpus` (next character)."""
    import torch

    text = text_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
    with _torch_threads(1):
        torch.manual_seed(seed)
        model = _char_model(len(chars), char_width(scale), 4, context)
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - context - 1, (rounds * steps, 16), generator=gen)

        def batch(step: int):
            s = starts[step][:, None] + torch.arange(context + 1)
            w = data[s]
            return w[:, :-1], w[:, 1:]

        def loss(logits, y):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return federated_rounds(model, batch, loss, lambda ps: torch.optim.Adam(ps, lr=3e-3), rounds, steps)


def _char_shapes(scale: float) -> Shapes:

    with _torch_threads(1):
        m = _char_model(len(set(text_corpus())), char_width(scale), 4, 32)
    return {k: tuple(v.shape) for k, v in m.state_dict().items() if v.is_floating_point()}


_DIGITS_SHAPES = {
    "conv1.weight": (32, 1, 3, 3),
    "conv1.bias": (32,),
    "conv2.weight": (64, 32, 3, 3),
    "conv2.bias": (64,),
    "fc1.weight": (64, 4096),
    "fc1.bias": (64,),
    "fc2.weight": (10, 64),
    "fc2.bias": (10,),
}


def _trained(name: str, description: str, shapes, build) -> Entry:
    return Entry(name, "trained", "float32", description, shapes, build)


# --- distributions -------------------------------------------------------------------------------------------------

LARGE = 1 << 24
SPLIT = 1 << 23


def _n(full: int, scale: float) -> int:
    return max(1024, int(full * scale))


def iid_update(n: int, seed: int) -> Update:
    """One fp32 tensor: base and delta standard normal (as benchmarks/bench_topk.py times it)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n, dtype=np.float32)
    new = base + rng.standard_normal(n, dtype=np.float32)
    return Update({"w": base}, {"w": new}, [({"w": base}, {"w": new})])


def zeros_update(n: int, nonzero: int, seed: int) -> Update:
    """One fp32 tensor whose delta is exactly zero but at ``nonzero`` positions (|delta| >= 0.5 there)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n, dtype=np.float32)
    new = base.copy()
    pos = rng.choice(n, size=nonzero, replace=False)
    d = (0.5 + np.abs(rng.standard_normal(nonzero, dtype=np.float32))) * rng.choice(
        np.array([-1, 1], np.float32), nonzero
    )
    new[pos] += d
    u = {"w": base}, {"w": new}
    return Update(*u, [u], {"nonzero": nonzero, "zero_share": 1 - nonzero / n})


def three_level_update(n: int, seed: int) -> Update:
    """One fp32 tensor whose delta is exactly -1/16, 0 or +1/16 (a quarter, a half, a quarter): k falls inside a
    tie of millions."""
    rng = np.random.default_rng(seed)
    base = (rng.integers(-1024, 1024, n) / 1024).astype(np.float32)  # exact: base +- 1/16 - base == +-1/16
    d = rng.choice(np.array([-1 / 16, 0.0, 0.0, 1 / 16], np.float32), n)
    u = {"w": base}, {"w": base + d}
    return Update(*u, [u], {"levels": 3})


def mixed_scales_update(n: int, seed: int) -> Update:
    """Tensors of scale 1e-30, 1 and 1e+30 side by side (a quarter, a half, a quarter of ``n``)."""
    rng = np.random.default_rng(seed)
    base, new = {}, {}
    for name, size, s in (("tiny", n // 4, 1e-30), ("unit", n - n // 2, 1.0), ("huge", n // 4, 1e30)):
        b = rng.standard_normal(size, dtype=np.float32) * np.float32(s)
        base[name], new[name] = b, b + rng.standard_normal(size, dtype=np.float32) * np.float32(s)
    return Update(base, new, [(base, new)])


def split_update(n: int, tensors: int, seed: int) -> Update:
    """``n`` fp32 elements in ``tensors`` uneven tensors (benchmarks/traffic.py's update, device-aligned)."""
    from benchmarks.traffic import update

    new, base = update(n, tensors, seed)
    return Update(base, new, [(base, new)])


def _dist(name: str, description: str, full: int, build, tensors: int = 1) -> Entry:
    def shapes(scale: float) -> Shapes:
        n = _n(full, scale)
        if tensors == 3:
            return {"tiny": (n // 4,), "unit": (n - n // 2,), "huge": (n // 4,)}
        # the sizes vary (see the builder); the count and the total are these
        return {f"t{i}": (n // tensors + (n % tensors if i == tensors - 1 else 0),) for i in range(tensors)}

    return Entry(name, "distribution", "float32", description, shapes, lambda scale, seed: build(_n(full, scale), seed))


def fewer_nonzeros(n: int) -> int:
    """Non-zeros of the ``fewer-than-k`` entry: half of k at fraction 0.001 (so fewer than k at 1% and 0.1%)."""
    return max(1, gpu_codec.kept_count(0.001, n) // 2)


ENTRIES = [
    _arch(
        "resnet-50",
        resnet50,
        "ResNet-50 with BatchNorm buffers; stem and layer1 frozen",
        frozen=("conv1", "bn1", "layer1."),
    ),
    _arch(
        "bert-base", bert_base, "BERT-base; layers 0-3 frozen", frozen=tuple(f"encoder.layer.{i}." for i in range(4))
    ),
    _arch("gpt2-small", gpt2_small, "GPT-2 small, full fine-tuning"),
    _arch(
        "llama-1b",
        llama_1b,
        "Llama-style 1B in bfloat16; layers 0-3 frozen",
        frozen=tuple(f"model.layers.{i}." for i in range(4)),
        bf16=True,
    ),
    _arch("lora", lora_adapters, "LoRA rank 16 on q,k,v,o of a 32-layer 4096-wide model"),
    _arch("vit-b16", vit_b16, "ViT-B/16; patch embedding frozen", frozen=("patch_embed.",)),
    _trained(
        "digits-cnn-sgd",
        "CNN on digits, SGD+momentum, 4 rounds of 10 steps",
        lambda s: dict(_DIGITS_SHAPES),
        lambda s, seed: digits_update("sgd", False, seed),
    ),
    _trained(
        "digits-cnn-adam",
        "CNN on digits, Adam, 4 rounds of 10 steps",
        lambda s: dict(_DIGITS_SHAPES),
        lambda s, seed: digits_update("adam", False, seed),
    ),
    _trained(
        "digits-cnn-frozen",
        "CNN on digits, SGD, convolutions frozen",
        lambda s: dict(_DIGITS_SHAPES),
        lambda s, seed: digits_update("sgd", True, seed),
    ),
    _trained(
        "char-transformer",
        "4-layer char transformer on argparse.py, Adam, 3 rounds of 8 steps",
        _char_shapes,
        char_update,
    ),
    _dist("iid-2^24", "one i.i.d. normal tensor of 2^24", LARGE, iid_update),
    _dist("zeros-99", "2^24, 99% of the delta exactly zero", LARGE, lambda n, seed: zeros_update(n, n // 100, seed)),
    _dist("zeros-100", "2^24, the delta exactly zero", LARGE, lambda n, seed: zeros_update(n, 0, seed)),
    _dist("three-level", "2^24, delta in {-1/16, 0, 1/16}", LARGE, three_level_update),
    _dist("mixed-scales", "2^24 in tensors of scale 1e-30, 1, 1e+30", LARGE, mixed_scales_update, tensors=3),
    _dist(
        "fewer-than-k",
        "2^24, fewer non-zeros than k at 0.1%",
        LARGE,
        lambda n, seed: zeros_update(n, fewer_nonzeros(n), seed),
    ),
    *(
        _dist(f"split-2^23-{t}", f"2^23 in {t} uneven tensors", SPLIT, lambda n, seed, t=t: split_update(n, t, seed), t)
        for t in (1, 100, 1000)
    ),
]
ZOO: dict[str, Entry] = {e.name: e for e in ENTRIES}
