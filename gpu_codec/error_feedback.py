"""Error feedback: what compression dropped is added to the next update before selection.

One :class:`ErrorFeedback` per client holds a residual per tensor (fp32; fp64 for fp64 tensors) on the device
the backend computes on. ``compress(..., residual=ef)`` selects top-k of ``delta + residual`` and, in the same
pass that extracts the kept values, rewrites the residual: the full delta where an entry was not kept, and
``delta - decoded`` where it was (so quantization error is carried too: the value codecs fix the kept entries
after quantizing, on the GPU and the CPU alike). It saves and loads in gpu_codec's own format (no pickle).

>>> import numpy as np, gpu_codec
>>> from gpu_codec.error_feedback import ErrorFeedback
>>> ef = ErrorFeedback()
>>> u = {"w": np.array([1.0, 0.5, -0.25, 0.0], np.float32)}
>>> p = gpu_codec.compress(u, fraction=0.25, residual=ef)     # sends 1.0, keeps the rest
>>> ef.residual("w").tolist()
[0.0, 0.5, -0.25, 0.0]
>>> p = gpu_codec.compress(u, fraction=0.25, residual=ef)     # 0.5 + 0.5 = 1.0 ties with 1.0: index 0 wins
>>> ef2 = ErrorFeedback.from_bytes(ef.to_bytes())
>>> ef2.residual("w").tolist()
[0.0, 1.0, -0.5, 0.0]
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import dtypes
from .arrays import TensorTable
from .backends import Backend, events, get_backend
from .backends.files import replace_atomically
from .codecs import wire_layouts
from .errors import InvalidInputError, PayloadLayoutError, PayloadValueError
from .format import TensorRecord, pack, unpack
from .xp.finite import some_nonfinite

_KIND = "gpu_codec.ErrorFeedback"


class _Binding:
    """One compress call's view of the state: residuals in (the stored arrays, read only), residuals out (fresh
    arrays the selection writes), and what to store once the call has succeeded."""

    def __init__(self, entries: list[tuple[str, str, tuple[int, ...]]], res_in: list[Any], res_out: list[Any]):
        self.entries = entries
        self.res_in = res_in
        self.res_out = res_out  # (kept entries' residuals: the value codecs, which round them, fix them)
        self.committed = False


class ErrorFeedback:
    """Per-client residual state for :func:`gpu_codec.compress` (``residual=``).

    A tensor's residual is kept until :meth:`reset` or :meth:`discard`, also through calls that do not name it (a
    client may compress parts of its model in separate calls): residuals of layers removed or renamed stay held
    until discarded.

    Thread safe: a compress call holds the state's lock from reading the residual to storing the new one, so
    threads sharing one state take turns (each sees the residual the previous call left). A call that fails
    (bad input, a pipeline that cannot encode the update, metadata too large) leaves the residual as it was:
    the new residual is written to fresh arrays and stored only when the call succeeds. On the GPU, the next
    call's stream waits for the kernels that wrote the stored residual.

    >>> import numpy as np, gpu_codec
    >>> ef = ErrorFeedback()
    >>> u = {"w": np.array([4.0, 1.0], np.float32)}
    >>> _ = gpu_codec.compress(u, fraction=None, pipeline=[gpu_codec.RiceIndices()], residual=ef)
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: the 'rice' index stage needs a sparse (top-k) update; ...
    >>> len(ef)                                  # the failed call stored nothing
    0
    """

    def __init__(self) -> None:
        self._state: dict[str, tuple[Any, str, tuple[int, ...]]] = {}  # name -> (flat array, dtype, shape)
        self._lock = threading.RLock()
        self._ready: Any = None  # GPU: an event recorded on the stream that wrote the stored residual

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, name: object) -> bool:
        return name in self._state

    def names(self) -> list[str]:
        with self._lock:
            return list(self._state)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) of each tensor's residual: what the next call's update must match.

        >>> import numpy as np, gpu_codec
        >>> ef = ErrorFeedback()
        >>> _ = gpu_codec.compress({"w": np.ones((2, 3), np.float32)}, fraction=0.5, residual=ef)
        >>> ef.layout()
        {'w': ('float32', (2, 3))}
        """
        with self._lock:
            return {n: (dt, shape) for n, (_, dt, shape) in self._state.items()}

    def reset(self) -> None:
        """Forget every residual."""
        with self._lock:
            self._state.clear()
            self._ready = None

    def discard(self, names: list[str]) -> None:
        """Forget the residuals of the tensors ``names`` (layers removed or renamed; a list or another iterable of
        names, not one name alone); a name not held is ignored.

        >>> import numpy as np, gpu_codec
        >>> ef = ErrorFeedback()
        >>> two = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
        >>> _ = gpu_codec.compress(two, fraction=0.5, residual=ef)
        >>> ef.discard(["a", "z"]); ef.names()
        ['b']
        >>> ef.discard("b")
        Traceback (most recent call last):
        ...
        gpu_codec.errors.InvalidInputError: discard takes a list of tensor names, got str: discard(['b']) for one
        """
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            one = f": discard([{names!r}]) for one" if isinstance(names, str) else ""
            raise InvalidInputError(f"discard takes a list of tensor names, got {type(names).__name__}{one}")
        names = list(names)
        with self._lock:
            for n in names:
                if isinstance(n, str):
                    self._state.pop(n, None)

    def residual(self, name: str) -> np.ndarray:
        """A host copy of one tensor's residual, in the tensor's shape; :class:`~gpu_codec.errors.InvalidInputError`
        where none is held for ``name``."""
        with self._lock:
            if name not in self._state:
                held = list(self._state)
                raise InvalidInputError(f"no residual is held for tensor {name!r} ({len(held)} held: {held[:5]})")
            a, _, shape = self._state[name]
            backend = get_backend()
            events.wait(backend, self._ready)  # the copy runs on the current stream, after the writes
            host = a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)
            return np.array(host).reshape(shape)

    # --- the engine's side: a compress call binds the state, then commits what it wrote -------------------------

    @contextlib.contextmanager
    def session(self, names: list[str], news: TensorTable, backend: Backend) -> Iterator[_Binding]:
        """Hold the state for one compress call (what :func:`gpu_codec.compress` does with ``residual=``): yields
        the residuals to read and to write; they are stored only if :meth:`commit` is called on the binding
        before the block ends (an exception stores nothing)."""
        with self._lock:
            events.wait(backend, self._ready)
            yield self._bind(names, news, backend)

    def _bind(self, names: list[str], news: TensorTable, backend: Backend) -> _Binding:
        res_in, res_out, entries = [], [], []
        # every residual written is a slice of one allocation a value dtype (not an allocation a tensor)
        logical, shapes, numels = news.dtypes, news.shapes, news.sizes()
        vds = [np.dtype(dtypes.value_dtype(dt)) for dt in logical]
        spans = {vd: backend.xp.empty(sum(m for m, v in zip(numels, vds) if v == vd), dtype=vd) for vd in set(vds)}
        at = dict.fromkeys(spans, 0)
        for n, dt, shape, m, vd in zip(names, logical, shapes, numels, vds):
            cur = self._state.get(n)
            if cur is not None:
                a, was, was_shape = cur
                if was_shape != tuple(shape) or was != dt:
                    raise InvalidInputError(
                        f"tensor {n!r}: error-feedback residual is {was}{list(was_shape)}, the update "
                        f"is {dt}{list(shape)}; reset() the state to start over"
                    )
                res_in.append(backend.asarray(a))
            else:
                res_in.append(None)
            res_out.append(spans[vd][at[vd] : at[vd] + m])  # every element is rewritten by the selection
            at[vd] += m
            entries.append((n, dt, tuple(shape)))
        return _Binding(entries, res_in, res_out)

    def commit(self, binding: _Binding, backend: Backend) -> None:
        """Store a successful call's residuals (the caller holds the lock through :meth:`session`)."""
        if binding.committed:
            raise RuntimeError("an error-feedback binding was committed twice")
        for (n, dt, shape), a in zip(binding.entries, binding.res_out):
            self._state[n] = (a, dt, shape)
        if len(self._state) > len(binding.entries):  # (residuals of tensors this call did not name)
            self._compact({n for n, _, _ in binding.entries})
        binding.committed = True
        self._ready = events.record(backend)

    def _compact(self, named: set[str]) -> None:
        """Copy the residuals a call did not name (``named``: those it did) out of an earlier call's allocation
        where they no longer fill it (a call writes its residuals as slices of one allocation a dtype): a name
        kept from an earlier call holds its own memory, not all of that call's."""
        groups: dict[int, list[str]] = {}
        for n, (a, _, _) in self._state.items():
            base = getattr(a, "base", None)
            if n not in named and base is not None:
                groups.setdefault(id(base), []).append(n)
        for ns in groups.values():
            base = self._state[ns[0]][0].base
            if sum(int(self._state[n][0].nbytes) for n in ns) < int(base.nbytes):
                for n in ns:
                    a, dt, shape = self._state[n]
                    self._state[n] = (a.copy(), dt, shape)

    # --- persistence ----------------------------------------------------------------------------------------------

    def to_bytes(self, version: int | None = None) -> bytes:
        """The state as a gpu_codec payload of ``dense`` records (checksummed; no pickle); ``version=1`` writes
        the version-1 container, which readers before version 2 understand."""
        with self._lock:
            recs = [
                TensorRecord(n, dt, shape, "dense", int(np.prod(shape, dtype=np.int64)), {"values": a})
                for n, (a, dt, shape) in self._state.items()
            ]
            return pack(recs, pipeline=[], metadata={"kind": _KIND}, version=version)

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> ErrorFeedback:
        """Rebuild a state saved by :meth:`to_bytes` (validated as any payload; arrays land on the backend).

        A residual holding NaN or inf is rejected (:class:`~gpu_codec.errors.PayloadValueError`): it would
        poison every later update of that client. On the host, the residuals of ``bytes`` (which cannot change)
        are read where they lie, as views of it (:meth:`load` holds one copy of the state, not two); those of a
        buffer that can change are copied.
        """
        header, records = unpack(blob, wire_layouts())  # (any payload reads, so that one of another kind is named)
        if header.get("metadata", {}).get("kind") != _KIND:
            raise PayloadLayoutError("this payload is not a saved ErrorFeedback state")
        ef = cls()
        backend = get_backend()
        fixed = type(blob) is bytes
        for r in records:
            if r.encoding != "dense":
                raise PayloadLayoutError(f"tensor {r.name!r}: a saved residual must be 'dense', got {r.encoding!r}")
            values = np.asarray(r.buffers["values"]) if fixed else np.array(r.buffers["values"])
            if some_nonfinite(values, dtypes.code(values.dtype.name)):  # (a block at a time)
                raise PayloadValueError(f"tensor {r.name!r}: the saved residual holds a non-finite value (inf or NaN)")
            ef._state[r.name] = (backend.asarray(values), r.dtype, tuple(r.shape))
        # the uploads are queued on the current stream: the first compress, on whatever stream, waits for them
        ef._ready = events.record(backend)
        return ef

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_bytes` to ``path``, replacing it at once: the bytes are made first, then written to a
        temporary file beside it and moved into place, so a state that cannot be written, an interruption or a
        full disk leaves the file there as it was."""
        blob = self.to_bytes()
        replace_atomically(path, lambda f: f.write(blob), prefix=".gcef-")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ErrorFeedback:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self)} tensors)"
