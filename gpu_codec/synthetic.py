"""A deterministic synthetic model and client updates, for the demo, the benchmarks and the tests.

The model has the tensor kinds of a real network: an embedding (only the rows of tokens seen this round move),
convolutions with norms, an MLP with a layer norm, attention projections, a head, and biases. A client's delta
is heavy-tailed (Student t, 3 dof) with a log-normal scale per layer and per output channel, so top-k positions
cluster the way trained deltas do. Everything is generated with NumPy from a seed.

>>> base = synthetic_model(200_000, seed=0)
>>> sorted(base)[:3], sum(v.size for v in base.values()) >= 200_000
(['attn.out.bias', 'attn.out.weight', 'attn.qkv.bias'], True)
>>> new = synthetic_update(base, seed=1)
>>> all(new[k].shape == base[k].shape and new[k].dtype == base[k].dtype for k in base)
True
>>> sum(v.size for v in synthetic_delta(1.0).values())
5275816
"""

from __future__ import annotations

import math

import numpy as np

from .errors import InvalidInputError


def model_shapes(scale: float = 1.0) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape; ``scale`` 1.0 gives about 5.3 million parameters in 28 tensors."""
    w = max(8, round(64 * math.sqrt(scale)))
    s: dict[str, tuple[int, ...]] = {"embed.weight": (int(16000 * math.sqrt(scale)), 2 * w)}
    s["stem.conv.weight"] = (w, 3, 7, 7)
    s["stem.norm.weight"] = (w,)
    s["stem.norm.bias"] = (w,)
    c = w
    for b, mult in enumerate((1, 2, 4, 8)):
        co = w * mult
        s[f"layer{b}.conv.weight"] = (co, c, 3, 3)
        s[f"layer{b}.norm.weight"] = (co,)
        s[f"layer{b}.norm.bias"] = (co,)
        c = co
    s["mlp.fc1.weight"] = (2 * c, c)
    s["mlp.fc1.bias"] = (2 * c,)
    s["mlp.ln.weight"] = (2 * c,)
    s["mlp.ln.bias"] = (2 * c,)
    s["mlp.fc2.weight"] = (c, 2 * c)
    s["mlp.fc2.bias"] = (c,)
    s["head.weight"] = (1000, c)
    s["head.bias"] = (1000,)
    s["attn.qkv.weight"] = (3 * 2 * w, 2 * w)
    s["attn.qkv.bias"] = (3 * 2 * w,)
    s["attn.out.weight"] = (2 * w, 2 * w)
    s["attn.out.bias"] = (2 * w,)
    return s


SMALLEST_SCALE = 1e-3


def smallest_model_params() -> int:
    """Parameters of the smallest :func:`synthetic_model` (every layer keeps its least shape): 117,200.

    >>> smallest_model_params()
    117200
    """
    return sum(math.prod(s) for s in model_shapes(SMALLEST_SCALE).values())


def synthetic_model(n_params: int = 5_000_000, *, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The :func:`model_shapes` model scaled to at least ``n_params`` parameters, as name -> NumPy array (at least
    :func:`smallest_model_params`, which ``n_params`` may not be below)."""
    least = smallest_model_params()
    if n_params < least:
        raise InvalidInputError(f"n_params must be at least {least} (the smallest model), got {n_params}")
    scale = SMALLEST_SCALE
    while sum(math.prod(s) for s in model_shapes(scale).values()) < n_params:
        scale *= 1.05
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in model_shapes(scale).items():
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        if name.endswith("norm.weight") or name.endswith("ln.weight"):
            a = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            a = 0.01 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        out[name] = a.astype(dtype)
    return out


def synthetic_delta(
    scale: float = 1.0, seed: int = 0, *, shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """One client's update delta (fp32) for :func:`model_shapes` ``(scale)``, or for the given ``shapes``.

    Heavy-tailed (Student t, 3 dof) with a log-normal scale per layer and per output channel (norm gains move
    more), and an embedding whose unseen rows stay still: top-k positions cluster as trained deltas do.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in (shapes if shapes is not None else model_shapes(scale)).items():
        layer = 1e-3 * math.exp(0.7 * rng.standard_normal())
        if name.endswith(("norm.weight", "ln.weight")):
            layer *= 3.0  # norm gains move more than weights do
        rows = shape[0] if shape else 1
        chan = np.exp(0.5 * rng.standard_normal(rows))  # per output channel / row
        d = rng.standard_t(3, size=shape) * layer
        d *= chan.reshape((rows,) + (1,) * (len(shape) - 1)) if shape else chan[0]
        if name == "embed.weight":  # Zipf-ish token frequencies: most rows see no token this round
            seen = rng.random(rows) < np.minimum(1.0, 30.0 / (1.0 + np.arange(rows)) ** 0.6)
            d[~seen] = 0.0
        out[name] = d.astype(np.float32)
    return out


def synthetic_update(base: dict[str, np.ndarray], *, seed: int = 1, scale: float = 1e-3) -> dict[str, np.ndarray]:
    """``base`` after one simulated round of local training: ``base`` + :func:`synthetic_delta` of its shapes,
    with layer scales around ``scale``."""
    delta = synthetic_delta(seed=seed, shapes={k: v.shape for k, v in base.items()})
    return {k: np.asarray(b.astype(np.float64) + delta[k] * (scale / 1e-3)).astype(b.dtype) for k, b in base.items()}
