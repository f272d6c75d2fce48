"""A deterministic synthetic model and client updates, for the demo, the benchmarks and tests.

The model has the tensor kinds of a real network (convolutions, linear layers, an embedding, norms and biases)
and a client update whose deltas are heavy-tailed, as trained deltas are.

>>> base = synthetic_model(100_000, seed=0)
>>> sorted(base)[:3], sum(v.size for v in base.values()) >= 100_000
(['block0.conv.bias', 'block0.conv.weight', 'block0.norm.bias'], True)
>>> new = synthetic_update(base, seed=1)
>>> all(new[k].shape == base[k].shape and new[k].dtype == base[k].dtype for k in base)
True
"""

from __future__ import annotations

import numpy as np


def synthetic_model(n_params: int = 5_000_000, *, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """A conv/linear/embedding/norm model of at least ``n_params`` parameters, as name -> NumPy array."""
    if n_params < 1000:
        raise ValueError(f"n_params must be at least 1000, got {n_params}")
    rng = np.random.default_rng(seed)
    # one "unit" = embedding + conv blocks + linear head; scale width until the count is reached
    width = 8
    while True:
        shapes = _shapes(width)
        if sum(int(np.prod(s)) for s in shapes.values()) >= n_params:
            break
        width = int(width * 1.05) + 1
    out = {}
    for name, shape in shapes.items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if name.endswith("norm.weight"):
            a = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            a = 0.01 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        out[name] = a.astype(dtype)
    return out


def _shapes(w: int) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {"embed.weight": (1000, w)}
    c = 3
    for b in range(4):
        co = w * (b + 1)
        s[f"block{b}.conv.weight"] = (co, c, 3, 3)
        s[f"block{b}.conv.bias"] = (co,)
        s[f"block{b}.norm.weight"] = (co,)
        s[f"block{b}.norm.bias"] = (co,)
        c = co
    s["head.fc1.weight"] = (4 * w, c)
    s["head.fc1.bias"] = (4 * w,)
    s["head.norm.weight"] = (4 * w,)
    s["head.norm.bias"] = (4 * w,)
    s["head.fc2.weight"] = (10, 4 * w)
    s["head.fc2.bias"] = (10,)
    return s


def synthetic_update(base: dict[str, np.ndarray], *, seed: int = 1, scale: float = 1e-3) -> dict[str, np.ndarray]:
    """``base`` after one simulated round of local training: heavy-tailed (Student t, 3 dof) deltas."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, b in base.items():
        d = scale * rng.standard_t(3, size=b.shape)
        out[name] = (b.astype(np.float64) + d).astype(b.dtype)
    return out
