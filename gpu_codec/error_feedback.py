"""Error feedback: what compression dropped is added to the next update before selection.

One :class:`ErrorFeedback` per client holds a residual per tensor (fp32; fp64 for fp64 tensors) on the device
the backend computes on. ``compress(..., residual=ef)`` selects top-k of ``delta + residual`` and, in the same
pass that extracts the kept values, rewrites the residual: the full delta where an entry was not kept, and
``delta - decoded`` where it was (so quantization error is carried too: the value codecs fix the kept entries
after quantizing, on the GPU and the CPU alike). It saves and loads in gpu_codec's own format (no pickle).

>>> import numpy as np, gpu_codec
>>> ef = gpu_codec.ErrorFeedback()
>>> u = {"w": np.array([1.0, 0.5, -0.25, 0.0], np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.25, residual=ef)     # sends 1.0, keeps the rest
>>> ef.residual("w").tolist()
[0.0, 0.5, -0.25, 0.0]
>>> p = gpu_codec.compress(u, fraction=0.25, residual=ef)     # 0.5 + 0.5 = 1.0 ties with 1.0: index 0 wins
>>> ef2 = gpu_codec.ErrorFeedback.from_bytes(ef.to_bytes())
>>> ef2.residual("w").tolist()
[0.0, 1.0, -0.5, 0.0]
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import dtypes
from .backends import Backend, get_backend
from .errors import InvalidInputError, PayloadLayoutError
from .format import TensorRecord, pack, unpack

_KIND = "gpu_codec.ErrorFeedback"


class ErrorFeedback:
    """Per-client residual state for :func:`gpu_codec.compress` (``residual=``)."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[Any, str, tuple[int, ...]]] = {}  # name -> (flat array, dtype, shape)

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, name: object) -> bool:
        return name in self._state

    def names(self) -> list[str]:
        return list(self._state)

    def reset(self) -> None:
        """Forget every residual."""
        self._state.clear()

    def residual(self, name: str) -> np.ndarray:
        """A host copy of one tensor's residual, in the tensor's shape."""
        if name not in self._state:
            raise KeyError(name)
        a, _, shape = self._state[name]
        host = a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)
        return np.array(host).reshape(shape)

    # --- engine hooks ---------------------------------------------------------------------------------------------

    def _bind(self, names: list[str], news: list[Any], backend: Backend) -> tuple[list[Any], list[Any], int]:
        """(residual in, residual out, rounding mode) per tensor: arrays on the backend, out aliasing in.

        The value codecs fix kept entries themselves, so the engine's own rounding mode stays exact (0).
        """
        res_in, res_out = [], []
        for n, t in zip(names, news):
            vd = np.dtype(dtypes.value_dtype(t.dtype))
            cur = self._state.get(n)
            if cur is not None:
                a, dt, shape = cur
                if shape != tuple(t.shape) or dt != t.dtype:
                    raise InvalidInputError(
                        f"tensor {n!r}: error-feedback residual is {dt}{list(shape)}, the update "
                        f"is {t.dtype}{list(t.shape)}; reset() the state to start over"
                    )
                a = backend.asarray(a)
                res_in.append(a)
                res_out.append(a)
            else:
                res_in.append(None)
                res_out.append(backend.xp.empty(t.numel, dtype=vd))
        self._pending = [(n, t.dtype, tuple(t.shape)) for n, t in zip(names, news)]
        return res_in, res_out, 0

    def _commit(self, res_out: list[Any]) -> None:
        for (n, dt, shape), a in zip(self._pending, res_out):
            self._state[n] = (a, dt, shape)
        self._pending = []

    # --- persistence ----------------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The state as a gpu_codec payload of ``dense`` records (checksummed; no pickle)."""
        recs = [
            TensorRecord(n, dt, shape, "dense", int(np.prod(shape, dtype=np.int64)), {"values": a})
            for n, (a, dt, shape) in self._state.items()
        ]
        return pack(recs, pipeline=[], metadata={"kind": _KIND})

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> ErrorFeedback:
        """Rebuild a state saved by :meth:`to_bytes` (validated as any payload; arrays land on the backend)."""
        header, records = unpack(blob)
        if header.get("metadata", {}).get("kind") != _KIND:
            raise PayloadLayoutError("this payload is not a saved ErrorFeedback state")
        ef = cls()
        backend = get_backend()
        for r in records:
            if r.encoding != "dense":
                raise PayloadLayoutError(f"tensor {r.name!r}: a saved residual must be 'dense', got {r.encoding!r}")
            ef._state[r.name] = (backend.asarray(np.array(r.buffers["values"])), r.dtype, tuple(r.shape))
        return ef

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ErrorFeedback:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self)} tensors)"
