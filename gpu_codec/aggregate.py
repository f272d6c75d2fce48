"""Server-side aggregation straight from the sparse form: the weighted mean of many clients' compressed updates.

One accumulator per tensor on the backend's device; each payload is decoded by its own pipeline to
(index, value) pairs and scatter-added into it. No client is ever made dense.

Determinism: each weighted value ``w * v`` is formed in fp64 and rounded once to a grid fixed per tensor, no
coarser than 2^-35 of the largest ``|w * v|`` that tensor has received (the grid only depends on that maximum, so
on the set of inputs, not on their order). Grid values are summed exactly, as integers (three 18-bit limbs per
element held in int32: 12 bytes per element; up to 16383 payloads). The result is therefore the same, to the
byte, in any arrival order, on the GPU and the CPU.

>>> import numpy as np, gpu_codec
>>> p1 = gpu_codec.compress({"w": np.array([4., 0., 0., 1.], np.float32)}, fraction=0.25)   # sends w[0] = 4
>>> p2 = gpu_codec.compress({"w": np.array([0., 0., 2., 0.], np.float32)}, fraction=0.25)   # sends w[2] = 2
>>> aggregate([p1, p2], weights=[3, 1])["w"].tolist()                                     # (3 p1 + p2) / 4
[3.0, 0.0, 0.5, 0.0]
>>> agg = Aggregator()
>>> agg.add(p2.to_bytes(), weight=1); agg.add(p1, weight=3)          # one at a time, any order
>>> agg.result()["w"].tolist()
[3.0, 0.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from . import dtypes
from . import engine as _engine
from .arrays import from_backend, to_tensor
from .backends import events, get_backend
from .backends.base import abs_max
from .errors import InvalidInputError, PayloadIndexError
from .format import TensorRecord

LIMB_BITS = 18
LIMBS = 3
MAX_PAYLOADS = (1 << (32 - LIMB_BITS)) - 1  # every limb sum stays within int32
_BETA_MIN = -56 * LIMB_BITS  # grid floor (2^-1008): keeps every scale factor a normal fp64
_C_MAX = 2.0**960  # weighted values at or above this would overflow the top limb's scale

__all__ = ["MAX_PAYLOADS", "Aggregator", "aggregate"]


def _grid_exponent(m: float) -> int | None:
    """Smallest multiple of LIMB_BITS, beta, with m < 2^(beta + 3 LIMB_BITS - 1) (None for m == 0)."""
    if m == 0.0:
        return None
    e = math.frexp(m)[1]  # m < 2^e
    beta = -((-(e - LIMBS * LIMB_BITS + 1)) // LIMB_BITS) * LIMB_BITS
    return max(beta, _BETA_MIN)


def _check_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
        raise InvalidInputError(f"a weight must be a non-negative number, got {type(weight).__name__}")
    try:
        w = float(weight)
    except OverflowError:
        w = math.inf
    if not (math.isfinite(w) and w >= 0.0):
        raise InvalidInputError(f"a weight must be finite and non-negative, got {weight!r}")
    return w


class _Template:
    """Names, shapes and dtypes every payload must match (from the base, else the first payload)."""

    def __init__(self, entries: list[tuple[str, tuple[int, ...], str]]):
        self.entries = entries
        self.by_name = {n: (s, d) for n, s, d in entries}

    def check(self, records: list[TensorRecord], what: str) -> None:
        got = {r.name: (tuple(r.shape), r.dtype) for r in records}
        if len(got) != len(records):
            raise InvalidInputError(f"{what} names a tensor twice")
        missing = [n for n in self.by_name if n not in got]
        extra = [n for n in got if n not in self.by_name]
        if missing or extra:
            raise InvalidInputError(
                f"{what} holds a different tensor set: missing {missing[:5]}, unexpected {extra[:5]}; "
                "every payload of one aggregation must carry the same tensors"
            )
        for n, (shape, dt) in got.items():
            want_shape, want_dt = self.by_name[n]
            if shape != want_shape or dt != want_dt:
                raise InvalidInputError(
                    f"{what}: tensor {n!r} is {dt}{list(shape)}, the aggregation holds {want_dt}{list(want_shape)}"
                )


class Aggregator:
    """The streaming form of :func:`aggregate`: add payloads one at a time, read the weighted mean at any point.

    Parameters
    ----------
    base
        Optional mapping name -> array (the global model the deltas were taken against). With it,
        :meth:`result` returns ``base + mean delta`` in the base's dtypes, kind and device (as
        :func:`gpu_codec.decompress` does), and every payload must match its names, shapes and dtypes. Without it,
        the first payload fixes them and the result is the mean delta (fp32, fp64 for fp64 tensors).
    like
        Output kind without a base: ``"numpy"`` (default), ``"cupy"`` or ``"torch"``.
    max_output_bytes
        Cap on the dense output a payload declares (elements x output itemsize), checked before it is decoded,
        as in :func:`gpu_codec.decompress` (default 4 GiB; ``None``: no cap).

    A payload that does not match, fails to decode, holds a bad index or a non-finite value, or comes with a bad
    weight raises a :class:`~gpu_codec.errors.GpuCodecError` and leaves the accumulator as it was.

    >>> import numpy as np, gpu_codec
    >>> base = {"w": np.ones(3, np.float32)}
    >>> agg = Aggregator(base=base)
    >>> agg.add(gpu_codec.compress({"w": np.array([3., 1., 1.], np.float32)}, base, fraction=0.3), weight=1)
    >>> agg.add(gpu_codec.compress({"w": np.array([1., 1., 5.], np.float32)}, base, fraction=0.3), weight=1)
    >>> agg.count, agg.total_weight, agg.result()["w"].tolist()
    (2, 2.0, [2.0, 1.0, 3.0])
    >>> agg.add(gpu_codec.compress({"v": np.ones(3, np.float32)}, fraction=0.3))
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: payload 2 holds a different tensor set: missing ['w'], unexpected ['v']; ...
    """

    def __init__(
        self,
        base: Mapping[str, Any] | None = None,
        *,
        like: str | None = None,
        max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        if like is not None and like not in ("numpy", "cupy", "torch"):
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        self._backend = get_backend()
        self._like = like
        self._max_output_bytes = max_output_bytes
        self._base = None
        self._template: _Template | None = None
        if base is not None:
            if not isinstance(base, Mapping) or not base:
                raise InvalidInputError("base must be a non-empty mapping of name -> array")
            entries = []
            for n, a in base.items():
                t = to_tensor(a, n)
                if t.dtype not in dtypes.FLOAT_DTYPES:
                    raise InvalidInputError(f"tensor {n!r}: base dtype {t.dtype} is not a float dtype")
                entries.append((n, tuple(t.shape), t.dtype))
            self._base = base
            self._template = _Template(entries)
        self._limbs: dict[str, Any] = {}
        self._beta: dict[str, int | None] = {}
        self._weights: list[float] = []
        self._ready: Any = None  # device backends: an event after the last limb update (see backends.events)

    @property
    def count(self) -> int:
        """Payloads added so far."""
        return len(self._weights)

    @property
    def total_weight(self) -> float:
        """Sum of the weights added so far (exactly rounded, so independent of their order)."""
        return math.fsum(self._weights)

    def add(self, payload: Any, weight: float = 1.0) -> None:
        """Scatter-add one client's payload (a :class:`~gpu_codec.Payload` or its bytes) with ``weight``."""
        what = f"payload {self.count}"
        w = _check_weight(weight)
        if self.count >= MAX_PAYLOADS:
            raise InvalidInputError(f"an aggregation takes at most {MAX_PAYLOADS} payloads")
        if not isinstance(payload, _engine.Payload):
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise InvalidInputError(f"{what}: expected a gpu_codec Payload or its bytes, got {type(payload)}")
            payload = _engine.Payload.from_bytes(payload)
        template = self._template
        _engine.check_output_cap(payload.tensors, self._base is not None, self._max_output_bytes)
        if template is None:
            template = _Template([(r.name, tuple(r.shape), r.dtype) for r in payload.tensors])
        template.check(payload.tensors, what)
        backend = self._backend
        records = _engine.decoded_records(payload, backend)
        # every check before the accumulator changes
        plan = []
        for r in records:
            vals, idx = self._checked_entries(r, backend, what)
            m = abs_max(vals, backend.to_host)  # from the bits: no float kernel of the array module
            cmax = w * m
            if not cmax < _C_MAX:
                raise InvalidInputError(f"{what}: tensor {r.name!r}: weight x value reaches {cmax!r}, beyond range")
            plan.append((r, idx, vals, _grid_exponent(cmax)))
        if self._template is None:
            self._template = template
        events.wait(backend, self._ready)  # the previous add may have run on another stream
        for r, idx, vals, beta in plan:
            self._accumulate(r, idx, vals, w, beta)
        self._ready = events.record(backend)
        self._weights.append(w)

    @staticmethod
    def _checked_entries(r: TensorRecord, backend: Any, what: str) -> tuple[Any, Any]:
        xp = backend.xp
        vals = backend.asarray(r.buffers["values"])
        if r.encoding == "dense":
            if vals.size != r.numel:
                raise PayloadIndexError(f"{what}: tensor {r.name!r}: {vals.size} dense values for {r.numel} entries")
            idx = None
        else:
            idx = backend.asarray(r.buffers["indices"])
            if idx.dtype.kind != "u" or idx.size != vals.size or idx.size > r.numel:
                raise PayloadIndexError(f"{what}: tensor {r.name!r}: indices and values do not pair up")
        bad = ~xp.isfinite(vals).all()
        if idx is not None and idx.size:
            bad |= (idx[-1] >= r.numel) | (idx[1:] <= idx[:-1]).any()
        if bool(backend.to_host(bad)):
            raise PayloadIndexError(
                f"{what}: tensor {r.name!r}: a sparse index is out of range, repeated or not increasing, "
                "or a value is not finite; nothing was added"
            )
        return vals, idx

    def _accumulate(self, r: TensorRecord, idx: Any, vals: Any, w: float, beta: int | None) -> None:
        xp = self._backend.xp
        limbs = self._limbs.get(r.name)
        if limbs is None:
            limbs = xp.zeros((LIMBS, r.numel), dtype=np.int32)
            self._limbs[r.name] = limbs
            self._beta[r.name] = None
        cur = self._beta[r.name]
        if beta is not None and (cur is None or beta > cur):
            if cur is not None:  # a coarser grid: whole limbs move down, the lowest falls off (exactly)
                s = (beta - cur) // LIMB_BITS
                for j in range(LIMBS - 1, -1, -1):
                    if j >= s:
                        limbs[j] = limbs[j - s]
                    else:
                        limbs[j] = 0
            self._beta[r.name] = cur = beta
        if cur is None or vals.size == 0:
            return  # nothing but zeros so far
        qs = self._backend.limb_split(vals, w, [cur + (LIMBS - 1 - j) * LIMB_BITS for j in range(LIMBS)])
        self._backend.limb_add(limbs, idx, qs)

    def mean_delta(self) -> dict[str, Any]:
        """The weighted mean delta per tensor as flat backend arrays (fp32; fp64 for fp64 tensors)."""
        if self.count == 0 or self._template is None:
            raise InvalidInputError("nothing to aggregate: no payload was added")
        total = self.total_weight
        if total <= 0.0:
            raise InvalidInputError("the weights sum to zero: the weighted mean is undefined")
        xp = self._backend.xp
        events.wait(self._backend, self._ready)  # the adds' limb updates, on whatever stream they ran
        out = {}
        for n, shape, dt in self._template.entries:
            numel = math.prod(shape)
            vd = np.dtype(dtypes.value_dtype(dt))
            beta, limbs = self._beta.get(n), self._limbs.get(n)
            if beta is None:
                out[n] = xp.zeros(numel, dtype=vd)
                continue
            mean = xp.empty(numel, dtype=vd)
            scales = [math.ldexp(1.0, beta + (LIMBS - 1 - j) * LIMB_BITS) for j in range(LIMBS)]
            self._backend.limb_mean(limbs, scales, total, mean)  # in limb order, in fp64, then rounded once
            out[n] = mean
        self._ready = events.record(self._backend)
        return out

    def result(self) -> dict[str, Any]:
        """``base + mean delta`` (with a base) or the mean delta, as :func:`gpu_codec.decompress` returns them.

        On a GPU the mean is computed on the stream :func:`gpu_codec.decompress` applies it on (the caller's
        current torch stream for a torch CUDA base), after the adds' limb updates (an event), and the call
        returns once that stream has finished it, as decompress does."""
        bases = [to_tensor(a, n) for n, a in self._base.items()] if self._base is not None else []
        with self._backend.stream(bases):
            means = self.mean_delta()
            if self._base is not None:
                recs = [
                    TensorRecord(n, dt, shape, "dense", math.prod(shape), {"values": means[n]})
                    for n, shape, dt in self._template.entries
                ]
                return _engine.decompress(_engine.Payload(recs, []), base=self._base)
            kind = self._like or "numpy"
            return {
                n: from_backend(means[n], dtypes.value_dtype(dt), shape, kind)
                for n, shape, dt in self._template.entries
            }


def aggregate(
    payloads: Iterable[Any],
    weights: Sequence[float] | None = None,
    base: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
) -> dict[str, Any]:
    """Weighted mean of compressed updates, computed from their sparse form.

    Parameters
    ----------
    payloads
        :class:`~gpu_codec.Payload` objects or their bytes, each decoded by its own pipeline; all must carry the
        same tensor names, shapes and dtypes.
    weights
        One non-negative weight per payload (e.g. FedAvg's example counts); ``None``: equal weights.
    base
        Optional global model: the result is then ``base + mean delta``, in the base's dtypes, kind and device.
    like, max_output_bytes
        As for :class:`Aggregator`.

    Returns
    -------
    dict
        name -> array: ``sum(w_i * delta_i) / sum(w_i)`` (plus ``base``), identical to the byte for any order of
        the payloads (see the module notes for the rounding).

    >>> import numpy as np, gpu_codec
    >>> ps = [gpu_codec.compress({"w": np.array([x, 0.], np.float32)}, fraction=0.5) for x in (1., 2., 6.)]
    >>> aggregate(ps)["w"].tolist(), aggregate(ps, weights=[0, 0, 1])["w"].tolist()
    ([3.0, 0.0], [6.0, 0.0])
    """
    payloads = list(payloads)
    if weights is None:
        weights = [1.0] * len(payloads)
    elif len(weights) != len(payloads):
        raise InvalidInputError(f"{len(weights)} weights for {len(payloads)} payloads")
    agg = Aggregator(base, like=like, max_output_bytes=max_output_bytes)
    for p, w in zip(payloads, weights):
        agg.add(p, w)
    return agg.result()
