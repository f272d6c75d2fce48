"""Server-side aggregation straight from the sparse form: the weighted mean of many clients' compressed updates.

One accumulator for the whole model on the backend's device (every tensor at its offset, with its own grid); each
payload is decoded by its own pipeline to (index, value) pairs and scatter-added into it. No client is ever made
dense. On a device, runs of small sparse tensors are joined as :func:`gpu_codec.decompress` joins them, checked
with one read-back and added by one launch a run, so an add makes the same few launches at any tensor count.

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
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from . import decode as _decode
from . import dtypes
from .arrays import TensorTable, from_backend, is_device_array, tensor_table, to_tensor
from .backends import events, get_backend, require_cupy
from .backends.base import joined
from .codecs import decoder_for, host_resident, inner_encoding
from .collector import holds_collector
from .constants import ScatterMode
from .errors import (
    BaseMismatchError,
    InvalidInputError,
    PayloadError,
    PayloadIndexError,
    PayloadLayoutError,
    PayloadLimitError,
    PayloadValueError,
)
from .format import MAX_TENSORS, TensorRecord
from .format.fingerprint import fingerprint
from .payload import Payload, check_limits, within_limits
from .xp.finite import all_finite, first_nonfinite, saturate_inf, some_nonfinite
from .xp.limbs import abs_max, abs_max_bits

LIMB_BITS = 18
LIMBS = 3
MAX_PAYLOADS = (1 << (32 - LIMB_BITS)) - 1  # every limb sum stays within int32
_BETA_MIN = -56 * LIMB_BITS  # grid floor (2^-1008): keeps every scale factor a normal fp64
_C_MAX = 2.0**960  # weighted values at or above this would overflow the top limb's scale
# the least weight above 0: the grid floor, divided by the weights' sum, stays below 2^-208 (a weight of 1e-300
# put it at 1e-4 of the mean's values, and 5e-324 took every weighted value below the floor, to a mean of 0)
W_MIN = 2.0**-800
ACCUMULATOR_BYTES = LIMBS * 4  # per element: three int32 limbs
SPARSE_ENTRY_BYTES = 32  # decoding a sparse tensor, per kept entry: at most 28 measured (fp64, Rice + zstd)

__all__ = ["MAX_PAYLOADS", "SPARSE_ENTRY_BYTES", "Aggregator", "aggregate", "held_bytes"]


NO_GRID = np.iinfo(np.int64).min  # a tensor's grid exponent where it has received nothing but zeros


def _grid_exponents(m: np.ndarray) -> np.ndarray:
    """Per value of ``m``: the smallest multiple of LIMB_BITS, beta, with m < 2^(beta + 3 LIMB_BITS - 1), not below
    the floor (NO_GRID for m == 0)."""
    e = np.frexp(np.asarray(m, np.float64))[1].astype(np.int64)  # m < 2^e
    beta = np.maximum(-((-(e - LIMBS * LIMB_BITS + 1)) // LIMB_BITS) * LIMB_BITS, _BETA_MIN)
    return np.where(np.asarray(m) == 0.0, NO_GRID, beta)


def _grid_exponent(m: float) -> int | None:
    """:func:`_grid_exponents` of one value (None for m == 0)."""
    beta = int(_grid_exponents(np.asarray([m]))[0])
    return None if beta == NO_GRID else beta


def shown_weight(weight: Any) -> str:
    """A weight as an error message writes it: its repr, but an int of more than 1,000 bits by its size (its
    digits may be more than ``str`` writes, and a line should stay a line).

    >>> shown_weight(3), shown_weight(2.5), shown_weight(-(10**400))
    ('3', '2.5', 'an integer of 1329 bits')
    """
    if isinstance(weight, int) and weight.bit_length() > 1000:
        return f"an integer of {weight.bit_length()} bits"
    return repr(weight)


def _check_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
        raise InvalidInputError(f"a weight must be a non-negative number, got {type(weight).__name__}")
    try:
        w = float(weight)
    except OverflowError:
        w = math.inf
    if not (math.isfinite(w) and w >= 0.0):
        raise InvalidInputError(f"a weight must be finite and non-negative, got {shown_weight(weight)}")
    if 0.0 < w < W_MIN:
        raise InvalidInputError(
            f"a weight must be 0 or at least 2^-800 (about 1.5e-241), got {weight!r}: scale the weights up (the mean "
            "does not change)"
        )
    return w


class _Template:
    """Names, shapes and dtypes every payload must match (from the base, else the first payload)."""

    def __init__(self, entries: list[tuple[str, tuple[int, ...], str]]):
        self.entries = entries
        self.by_name = {n: (s, d) for n, s, d in entries}
        self.pos = {n: i for i, (n, _, _) in enumerate(entries)}  # each tensor's place in the accumulator
        self.numels = np.asarray([math.prod(s) for _, s, _ in entries], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.numels)])[:-1].astype(np.int64)

    def held_bytes(self) -> int:
        """:func:`held_bytes` of the tensors as dense records over a base, counted as one record a dtype (the
        count is a sum over records, linear in each one's elements: the same number, with no record a tensor)."""
        totals: dict[str, int] = {}
        for (_, _, dt), n in zip(self.entries, self.numels.tolist()):
            totals[dt] = totals.get(dt, 0) + n
        return held_bytes([TensorRecord(dt, dt, (n,), "dense", n, {}) for dt, n in totals.items()], True)

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


def _sends_dense(r: TensorRecord) -> bool:
    return inner_encoding(r) in ("dense", "dense_q")


def held_bytes(records: Iterable[Any], with_base: bool) -> int:
    """Bytes an aggregation of payloads holding ``records`` (a payload's ``tensors``) needs at its peak, as the
    :class:`Aggregator`'s ``max_output_bytes`` counts them: the larger of

    * the accumulator (12 bytes per element), the mean delta (fp32; fp64 for fp64 tensors) and the result (in the
      base's dtype with a base; fp32 or fp64 without): 20 bytes per fp32 element, 5x the dense output
      :func:`gpu_codec.decompress` counts;
    * the accumulator and one payload being added: its decoded values for a dense tensor, and up to
      ``SPARSE_ENTRY_BYTES`` per kept entry of a sparse one (values, indices and the decoder's buffers).

    Temporaries of a few MiB come on top (fp64 buffers of the weighted mean, a chunk of the limb passes).

    >>> import gpu_codec, numpy as np
    >>> held_bytes(gpu_codec.compress({"w": np.ones(1000, np.float32)}, fraction=0.01).tensors, with_base=False)
    20000
    """
    result = adding = 0
    sizes: dict[str, tuple[int, int]] = {}  # (value, output) itemsize by dtype
    for r in records:
        vo = sizes.get(r.dtype)
        if vo is None:
            vd = dtypes.value_dtype(r.dtype)
            vo = sizes[r.dtype] = (
                np.dtype(vd).itemsize,
                dtypes.storage_dtype(r.dtype if with_base else vd).itemsize,
            )
        vsize, osize = vo
        n = r.numel
        result += n * (ACCUMULATOR_BYTES + vsize + osize)
        adding += n * ACCUMULATOR_BYTES + (n * vsize if _sends_dense(r) else r.nnz * SPARSE_ENTRY_BYTES)
    return max(result, adding)


def _entries_of(d: Any, backend: Any, bounds: tuple[int, int]) -> TensorRecord:
    """A tensor's entries decoded by the payload's own pipeline (``values``, and ``indices`` for a sparse tensor);
    a dense tensor a slice at a time, so that the decoder's temporaries are a slice's."""
    xp = backend.xp
    if d.indices is not None:  # the decoder makes a sparse tensor's entries at once: taken as they are
        vals, idx = d.values(0, d.nnz), d.indices(0, d.nnz) if d.nnz else xp.empty(0, dtype=np.uint32)
        if vals.size != d.nnz or idx.size != d.nnz:
            raise PayloadIndexError(f"tensor {d.name!r}: {vals.size} values and {idx.size} indices for {d.nnz}")
    else:  # a dense one a slice at a time, into one compact array
        vals, idx = xp.empty(d.nnz, dtype=dtypes.value_dtype(d.dtype)), None
        step = max(d.step, _decode.chunk_entries(d.nnz, bounds) // d.step * d.step)
        for a in range(0, d.nnz, step):
            b = min(a + step, d.nnz)
            v = d.values(a, b)
            if v.size != b - a:
                raise PayloadIndexError(f"tensor {d.name!r}: entries [{a}, {b}) decode to {v.size} values")
            vals[a:b] = v
            del v
    return TensorRecord(
        d.name, d.dtype, d.shape, "dense" if idx is None else "coo", d.nnz, {"values": vals, "indices": idx}
    )


def _decoded_entries(payload: Any, backend: Any, bounds: tuple[int, int]) -> list[TensorRecord]:
    """Each tensor's entries (:func:`_entries_of`), in the payload's order."""
    return [
        _entries_of(d, backend, bounds) for d in decoder_for(payload.pipeline).decode_stream(payload.tensors, backend)
    ]


class _Segment:
    """Entries of tensors adjacent in the accumulator, added in one pass: ``pos`` (their places in the template),
    ``counts`` (entries of each, in turn), ``vals``, ``idx`` (each entry's element, counted from the first tensor's
    start; None: one dense tensor, entry e is element e) and, where read from a payload one tensor at a time, the
    record (for the checks that name it)."""

    __slots__ = ("counts", "idx", "pos", "record", "vals")

    def __init__(self, pos: list[int], counts: list[int], vals: Any, idx: Any, record: Any = None):
        self.pos, self.counts, self.vals, self.idx, self.record = pos, counts, vals, idx, record


class Aggregator:
    """The streaming form of :func:`aggregate`: add payloads one at a time, read the weighted mean at any point.

    Parameters
    ----------
    base
        Optional mapping name -> array (the global model the deltas were taken against). With it,
        :meth:`result` returns ``base + mean delta`` in the base's dtypes, kind and device (as
        :func:`gpu_codec.decompress` does), and every payload must match its names, shapes and dtypes. Without it,
        the first payload fixes them and the result is the mean delta (fp32, fp64 for fp64 tensors). A base
        holding inf or NaN is refused. The aggregator holds the base's arrays (not copies) from when it is made,
        where it checks them: change or replace none of them until its result is taken.
    like
        Output kind without a base: ``"numpy"`` (default), ``"cupy"`` or ``"torch"``.
    max_output_bytes
        Cap on the memory the aggregation needs, counted as :func:`held_bytes` counts it: the 12-byte accumulator
        with the mean and the result (20 bytes per fp32 element, 5x the dense output :func:`gpu_codec.decompress`
        counts under the same name), or with one payload's decoded entries while it is added. A payload that
        needs more is refused before it is decoded or anything is allocated, and a base that needs more is
        refused here. Peak memory stays within 1.5x the cap. Default 4 GiB (about 200M fp32 parameters);
        ``None``: no cap.

    A payload that does not match (with a base: a payload that records the fingerprint of another base,
    ``BaseMismatchError``), fails to decode, holds a bad index or a non-finite value, comes with a bad
    weight (negative, not finite, or above 0 but below 2^-800, where the accumulator's grid would be too coarse for
    the mean), or cannot be represented in the aggregation (a weight x value beyond the accumulator's range, a weight
    that takes the weights' sum past fp64's range, a delta that takes the base past its dtype's range) raises a
    :class:`~gpu_codec.errors.GpuCodecError` and leaves the accumulator exactly as it was: a server drops that
    client and carries on with the others.

    Threads may share one Aggregator: :meth:`add` and :meth:`result` take turns (a payload is parsed and its
    checksum verified outside the lock; it is decoded and added inside, so one payload's working space at a time).

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
    >>> Aggregator(max_output_bytes=1000).add(gpu_codec.compress({"w": np.ones(100, np.float32)}, fraction=0.01))
    Traceback (most recent call last):
    ...
    gpu_codec.errors.PayloadLimitError: payload 0: an aggregation of its tensors needs 2000 bytes ...
    """

    @holds_collector
    def __init__(
        self,
        base: Mapping[str, Any] | None = None,
        *,
        like: str | None = None,
        max_output_bytes: int | None = _decode.DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        if like is not None and like not in ("numpy", "cupy", "torch"):
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        if like == "cupy":
            require_cupy("like='cupy'")
        cap = max_output_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
            raise InvalidInputError(f"max_output_bytes must be a non-negative integer or None, got {cap!r}")
        self._backend = get_backend()
        self._like = like
        self._max_output_bytes = cap
        self._lock = threading.RLock()
        self._base = None
        self._base_tensors = TensorTable.of([])  # the base's tensors, wrapped once as columns (template order)
        self._fingerprints: dict[tuple[str, ...], str] = {}  # the base's, by the payload order of the names
        self._template: _Template | None = None
        if base is not None:
            if not isinstance(base, Mapping) or not base:
                raise InvalidInputError("base must be a non-empty mapping of name -> array")
            be = self._backend
            names, arrays = list(base), list(base.values())
            if len(names) > MAX_TENSORS:
                raise InvalidInputError(f"the base has {len(names)} tensors, the wire format allows {MAX_TENSORS}")
            tensors = tensor_table(arrays) or TensorTable.of([to_tensor(a, n) for n, a in zip(names, arrays)])
            if not within_limits(names, tensors.shapes, tensors.sizes()):  # (a tensor no payload can hold)
                for n, shape in zip(names, tensors.shapes):
                    check_limits(n, tuple(shape))
            logical = tensors.dtypes
            if not dtypes.FLOAT_DTYPES.keys() >= set(logical):
                n, dt = next((n, dt) for n, dt in zip(names, logical) if dt not in dtypes.FLOAT_DTYPES)
                raise InvalidInputError(f"tensor {n!r}: base dtype {dt} is not a float dtype")
            entries = list(zip(names, map(tuple, tensors.shapes), logical))
            self._base_tensors = tensors
            with be.stream(tensors):  # (on the caller's stream, behind its writes of the base)
                storages = be.asarrays(tensors.data)
                codes, join = list(map(dtypes.code, logical)), partial(joined, be, storages)
                bad = first_nonfinite(storages, codes, be.xp, be.to_host, tensors.sizes(), join)
                events.waited()  # (its last step, a read-back, waited for the stream)
            if bad is not None:
                raise InvalidInputError(f"tensor {names[bad]!r}: the base holds inf or NaN, so no mean on it is finite")
            self._base = base
            self._template = _Template(entries)
            need = self._template.held_bytes()
            if cap is not None and need > cap:
                raise InvalidInputError(
                    f"an aggregation over this base needs {need} bytes (accumulator, mean and result), over "
                    f"max_output_bytes={cap}; pass a larger cap (or None)"
                )
        self._limbs: Any = None  # int32 (LIMBS, elements): every tensor at its start (template order)
        self._beta = np.zeros(0, np.int64)  # each tensor's grid exponent (NO_GRID: nothing but zeros so far)
        self._weights: list[float] = []
        self._wsum = 0.0  # plain running sum: an exact one is taken only near fp64's range
        self._ready: Any = None  # device backends: an event after the last limb update (see backends.events)

    @property
    def count(self) -> int:
        """Payloads added so far."""
        return len(self._weights)

    @property
    def total_weight(self) -> float:
        """Sum of the weights added so far (exactly rounded, so independent of their order)."""
        return math.fsum(self._weights)

    @holds_collector
    def add(self, payload: Any, weight: float = 1.0) -> None:
        """Scatter-add one client's payload (a :class:`~gpu_codec.Payload` or its bytes) with ``weight``; a payload
        that is refused leaves the aggregation exactly as it was."""
        w = _check_weight(weight)
        if not isinstance(payload, Payload):  # (its bytes: any contiguous buffer, as decompress takes)
            payload = Payload.from_bytes(payload)
        with self._lock:
            self._add(payload, w, weight)

    def _add(self, payload: Any, w: float, weight: Any) -> None:
        what = f"payload {self.count}"
        if self.count >= MAX_PAYLOADS:
            raise InvalidInputError(f"an aggregation takes at most {MAX_PAYLOADS} payloads")
        self._check_weight_sum(w, weight, what)
        if not payload.tensors:  # (no update: as the first payload it would fix an empty template for the round)
            raise PayloadLayoutError(f"{what} holds no tensor")
        template = self._template
        need = held_bytes(payload.tensors, self._base is not None)
        if self._max_output_bytes is not None and need > self._max_output_bytes:
            raise PayloadLimitError(
                f"{what}: an aggregation of its tensors needs {need} bytes (accumulator with mean and result, or "
                f"with its decoded entries), over "
                f"max_output_bytes={self._max_output_bytes}; nothing was decoded"
            )
        if template is None:
            template = _Template([(r.name, tuple(r.shape), r.dtype) for r in payload.tensors])
        template.check(payload.tensors, what)
        if payload.base_fingerprint is not None and self._base is not None:
            self._check_fingerprint(payload, template, what)
        backend = self._backend
        bounds = _decode.DECODE_CHUNK_DEVICE if backend.on_device else _decode.DECODE_CHUNK
        pos = np.asarray([template.pos[r.name] for r in payload.tensors], np.int64)
        # every check before the accumulator changes, read back at once (where one fails, they run again one by one,
        # reading each, which raises the error of the first tensor that fails)
        planned = self._plan_deferred(payload, pos, template, w, what, bounds)
        if planned is None:
            records = _decoded_entries(payload, backend, bounds)
            plan = self._plan(records, w, weight, what)
            del records
            segs = [_Segment([int(p)], [int(vals.size)], vals, idx) for p, (_, idx, vals, _) in zip(pos, plan)]
            betas = np.asarray([NO_GRID if beta is None else beta for _, _, _, beta in plan], np.int64)
            del plan
        else:
            segs, betas = planned
        if self._template is None:
            self._template = template
        events.wait(backend, self._ready)  # the previous add may have run on another stream
        self._commit(segs, pos, betas, w, bounds)
        self._ready = events.record(backend)
        self._weights.append(w)
        self._wsum += w

    def _check_fingerprint(self, payload: Payload, template: _Template, what: str) -> None:
        """Refuse (:class:`~gpu_codec.errors.BaseMismatchError`) a payload whose base fingerprint is not the base's,
        as :func:`gpu_codec.decompress` does. The base's is computed once for each order of the names (the base does
        not change while the aggregator holds it)."""
        names = tuple(r.name for r in payload.tensors)
        got = self._fingerprints.get(names)
        if got is None:
            at, tb = template.pos, self._base_tensors
            got = fingerprint([(n, tb.dtypes[at[n]], tb.data[at[n]]) for n in names], self._backend)
            self._fingerprints[names] = got
        if got != payload.base_fingerprint:
            raise BaseMismatchError(
                f"{what} was made against another base than the aggregation's (base fingerprint {got}, the payload "
                f"records {payload.base_fingerprint}); nothing was added"
            )

    def _plan(self, records: list[TensorRecord], w: float, weight: Any, what: str) -> list:
        """(record, indices, values, grid exponent) of each tensor, checked one by one: the error of the first
        that fails is raised."""
        backend = self._backend
        plan = []
        for r in records:
            vals, idx = self._checked_entries(r, backend, what)
            m = abs_max(vals, backend.to_host)  # from the bits: no float kernel of the array module
            cmax = w * m
            if not cmax < _C_MAX:
                raise InvalidInputError(
                    f"{what}: tensor {r.name!r}: weight {weight!r} x value {m!r} reaches {cmax!r}, beyond the "
                    "accumulator's range; nothing was added"
                )
            if self._base is not None:
                self._check_onto_base(r, idx, vals, what)
            plan.append((r, idx, vals, _grid_exponent(cmax)))
        return plan

    def _plan_deferred(
        self, payload: Payload, pos: np.ndarray, template: _Template, w: float, what: str, bounds: tuple[int, int]
    ) -> tuple[list[_Segment], np.ndarray] | None:
        """:meth:`_plan` with every check left on the backend and read back at once (twice with a base: the sums
        with the base are formed once the ranges are known good): (segments, each tensor's grid exponent), or None
        where a check fails. Runs of small tensors adjacent in the accumulator (sparse ones as
        :func:`gpu_codec.decode.decompress` forms them, and plain dense ones) are joined, checked and added a run at
        a time: on a device a few launches a run, on the host a few NumPy calls (not a few per tensor)."""
        backend, xp = self._backend, self._backend.xp
        records = payload.tensors
        with_base = self._base is not None
        logical = [r.dtype if with_base else dtypes.value_dtype(r.dtype) for r in records]
        # (on a device, runs of sparse tensors of any size, bounded by their entries, as decompress forms them)
        runs, dense = self._runs(records, logical, pos, backend.on_device)
        segs: list[_Segment] = []
        flags, parts = [], []
        where = np.full(len(records), -1, np.int64)  # each tensor's largest |v| in the read-back (-1: none)
        wide = np.zeros(len(records), bool)
        group: list = []
        filled = 1  # (word 0: the flags)
        pipe = decoder_for(payload.pipeline)
        plain = _decode.plain_buffers(pipe, records)  # (read from bytes, no stage: entries read as they lie)
        try:
            for i, d in _decode.records_stream(pipe, records, backend, plain):
                if runs[i] is not None:
                    group.append(d)
                    if i + 1 < len(records) and runs[i + 1] == runs[i]:
                        continue
                    first = i + 1 - len(group)
                    ps = [int(p) for p in pos[first : i + 1]]
                    starts = [int(template.starts[p]) for p in ps]
                    offsets = [*starts, starts[-1] + records[i].numel]
                    if runs[i] in dense:
                        joined = self._join_dense(records[first : i + 1], group, backend)
                    elif plain is not None:
                        joined = _decode.join_plain(plain, records, first, i + 1, offsets, backend)
                    else:
                        joined = _decode.join_run(group, offsets, backend)
                    if joined is None and runs[i] in dense:
                        return None  # (values that are not one per element: added one by one, or refused)
                    if joined is not None:
                        gi, vals, counts, ok = joined
                        if counts != [r.nnz for r in records[first : i + 1]] or int(vals.size) != sum(counts):
                            return None
                        if ok is not None:
                            flags.append(~ok)
                        parts.append(backend.segment_abs_max(vals, counts))
                        where[first : i + 1] = np.arange(filled, filled + len(ps))
                        wide[first : i + 1] = vals.dtype.itemsize == 8
                        filled += len(ps)
                        segs.append(_Segment(ps, counts, vals, gi))
                    group = []
                    continue
                if d is None:  # (a plain record added alone)
                    d = next(pipe.decode_stream([records[i]], backend))
                r = _entries_of(d, backend, bounds)
                vals, idx, bad = self._entries(r, backend, what)
                flags.append(bad)
                if vals.size:
                    parts.append(abs_max_bits(vals).astype(np.uint64).reshape(1))
                    where[i], wide[i] = filled, vals.dtype.itemsize == 8
                    filled += 1
                segs.append(_Segment([int(pos[i])], [int(vals.size)], vals, idx, r))
        except PayloadError:
            return None
        if not parts:  # no entry at all (runs of empty tensors, or no tensor): nothing to check, nothing to add
            return segs, np.full(len(records), NO_GRID, np.int64)
        bad = xp.stack(flags).any().astype(np.uint64).reshape(1) if flags else xp.zeros(1, dtype=np.uint64)
        host = backend.to_host(xp.concatenate([bad, *parts]))
        if host[0]:
            return None
        bits = np.where(where >= 0, host[np.maximum(where, 0)], 0).astype(np.uint64)
        with np.errstate(over="ignore", invalid="ignore"):  # (a signalling NaN's widening raises the flag)
            m = np.where(wide, bits.view(np.float64), bits.astype(np.uint32).view(np.float32).astype(np.float64))
            cmax = w * m
            if not (np.isfinite(m).all() and (cmax < _C_MAX).all()):
                return None
        if with_base:
            checks = _decode.DeviceChecks(xp)
            for seg in segs:
                if seg.record is not None:
                    self._check_onto_base(seg.record, seg.idx, seg.vals, what, checks)
                    continue
                lg = template.entries[seg.pos[0]][2]
                bases = [self._base_tensors.data[p] for p in seg.pos]  # (their storages)
                if seg.idx is not None:
                    self._check_run_onto_bases(seg, bases, lg, template, checks)
                    continue
                # a dense run (of small tensors): every element's sum with its base, as decompress forms it, in one pass
                span = xp.empty(int(template.numels[seg.pos].sum()), dtype=dtypes.storage_dtype(lg))
                ends = np.cumsum(seg.counts).tolist()
                cut = [(b - c, b) for c, b in zip(seg.counts, ends)]
                code = dtypes.code(lg)
                checks.word(
                    backend.dense_apply(
                        [span[a:b] for a, b in cut],
                        [code] * len(cut),
                        backend.asarrays(bases),
                        [seg.vals[a:b] for a, b in cut],
                        ScatterMode.ADD,
                        True,
                    )
                )
                checks.flag(some_nonfinite(span, code, xp))
            if not checks.passed():
                return None
        return segs, _grid_exponents(cmax)

    def _check_run_onto_bases(self, seg: _Segment, bases: list, lg: str, template: _Template, checks: Any) -> None:
        """The sums with the bases (storages) of a sparse run's entries (their indices checked), formed as
        :func:`gpu_codec.decompress` forms them, from the bases read at the entries (``gather_entries``: one
        launch on a device; not a copy of the run's bases: the entries' worth of memory and work, not the
        elements'), their checks left in ``checks``."""
        backend, xp = self._backend, self._backend.xp
        n = int(seg.vals.size)
        if not n:
            return
        at = template.starts[seg.pos] - template.starts[seg.pos[0]]
        spans = [*at.tolist(), int(at[-1] + template.numels[seg.pos[-1]])]  # each tensor's start in the run's span
        code, storage = dtypes.code(lg), dtypes.storage_dtype(lg)
        part = xp.empty(n, dtype=storage)
        backend.gather_entries(part, backend.asarrays(bases), spans, seg.idx, seg.counts)
        out = xp.empty(n, dtype=storage)
        checks.word(backend.dense_apply([out], [code], [part], [seg.vals], ScatterMode.ADD, True))
        checks.flag(some_nonfinite(out, code, xp))

    @staticmethod
    def _join_dense(records: list[TensorRecord], group: list, backend: Any) -> tuple[None, Any, list[int], None] | None:
        """A run of dense records' values end to end (joined on the host where they were read from bytes, decoded
        there where coded, and copied once): (None, values, each one's count, None); None where a record does not
        hold one value of its value dtype per element."""
        if all(d.host_values is not None for d in group):  # (read from bytes for a device: decoded on the host)
            joined = _decode.joined_values(group, backend)
            return None if joined is None else (None, joined, [r.numel for r in records], None)
        vals = [r.buffers.get("values") for r in records]
        if any(
            not hasattr(v, "reshape")  # (an array, not a buffer streamed from a frame)
            or r.nnz != r.numel
            or v.size != r.numel
            or v.dtype != dtypes.value_dtype(r.dtype)
            for r, v in zip(records, vals)
        ):
            return None
        if all(isinstance(v, np.ndarray) for v in vals):
            joined = backend.asarray(np.concatenate([v.reshape(-1) for v in vals]))
        else:
            joined = backend.xp.concatenate([backend.asarray(v).reshape(-1) for v in vals])
        return None, joined, [r.numel for r in records], None

    @staticmethod
    def _runs(
        records: list[TensorRecord], logical: list[str], pos: np.ndarray, device: bool = False
    ) -> tuple[list[int | None], set[int]]:
        """Each record's run, or None for a tensor added alone: :func:`gpu_codec.decode.decompress`'s runs of sparse
        tensors (small ones; on a ``device``, of any size, bounded by their entries), and runs of small plain dense
        ones (as many elements; on a device, coded ones read from bytes too), each cut where the tensors are not
        adjacent in the accumulator; and the runs that are dense."""
        numels = [r.numel for r in records]
        given = _decode._runs(records, logical, numels, device)
        if given and None not in given and (len(pos) < 2 or bool((np.diff(pos) == 1).all())):
            # (every record in a sparse run, adjacent in the accumulator: the runs as given, found at once; what
            # the loop below gives them)
            sizes = Counter(given)
            return [None if sizes[g] < 2 else g for g in given], set()
        return Aggregator._cut_runs(records, logical, pos, device, given, numels)

    @staticmethod
    def _cut_runs(
        records: list[TensorRecord], logical: list[str], pos: np.ndarray, device: bool, given: list, numels: list
    ) -> tuple[list[int | None], set[int]]:
        """:meth:`_runs` from decode's runs ``given``, record by record."""
        out: list[int | None] = []
        dense: set[int] = set()
        rid, size = -1, 0
        for i, (g, r, numel) in enumerate(zip(given, records, numels)):
            inner = inner_encoding(r)
            # (plain dense records; on a device, coded ones too, decoded on the host where read from bytes)
            joinable = r.encoding == "dense" or (device and inner in ("dense", "dense_q") and host_resident(r))
            plain = g is None and joinable and numel <= _decode.SMALL_TENSOR
            if g is None and not plain:
                out.append(None)
                continue
            after = i and pos[i] == pos[i - 1] + 1 and out[-1] is not None
            if g is not None:
                joins = after and given[i - 1] == g and out[-1] not in dense
            else:
                joins = (
                    after and out[-1] in dense and logical[i] == logical[i - 1] and size + numel <= _decode.SMALL_RUN
                )
            if not joins:
                rid, size = rid + 1, 0
                if plain:
                    dense.add(rid)
            out.append(rid)
            size += numel
        sizes = Counter(out)
        return [None if g is None or sizes[g] < 2 else g for g in out], dense

    def _check_weight_sum(self, w: float, weight: Any, what: str) -> None:
        if self._wsum + w < 2.0**1000:
            return
        try:
            total = math.fsum([*self._weights, w])
        except OverflowError:
            total = math.inf
        if not math.isfinite(total):
            raise InvalidInputError(
                f"{what}: weight {weight!r} takes the sum of the weights past the fp64 range; nothing was added"
            )

    def _check_onto_base(self, r: TensorRecord, idx: Any, vals: Any, what: str, checks: Any = None) -> None:
        """Refuse a delta that takes the base past its dtype's range, computed as :func:`gpu_codec.decompress`
        adds it (a chunk of entries at a time, into a small buffer); with ``checks``
        (:class:`gpu_codec.engine.DeviceChecks`), leave the check there unread."""
        backend, xp = self._backend, self._backend.xp
        base = backend.asarray(self._base_tensors.data[self._template.pos[r.name]])
        code = dtypes.code(r.dtype)
        step = _decode.chunk_entries(
            vals.size, _decode.DECODE_CHUNK_DEVICE if backend.on_device else _decode.DECODE_CHUNK
        )
        buf = xp.empty(min(step, vals.size), dtype=dtypes.storage_dtype(r.dtype))
        for a in range(0, vals.size, step):
            b = min(a + step, vals.size)
            part = base[a:b] if idx is None else base[idx[a:b]]
            out = buf[: b - a]
            if checks is not None:  # (the values are finite: its error word says nothing more)
                backend.dense_apply([out], [code], [part], [vals[a:b]], ScatterMode.ADD, defer=True)
                checks.flag(some_nonfinite(out, code, xp))
                continue
            backend.dense_apply([out], [code], [part], [vals[a:b]], ScatterMode.ADD)
            if not all_finite(out, code, xp):
                raise PayloadValueError(
                    f"{what}: tensor {r.name!r}: the update takes the base past the range of {r.dtype} (inf or NaN); "
                    "nothing was added"
                )

    @staticmethod
    def _checked_entries(r: TensorRecord, backend: Any, what: str) -> tuple[Any, Any]:
        vals, idx, bad = Aggregator._entries(r, backend, what)
        if bool(backend.to_host(bad)):
            raise PayloadIndexError(
                f"{what}: tensor {r.name!r}: a sparse index is out of range, repeated or not increasing, "
                "or a value is not finite; nothing was added"
            )
        return vals, idx

    @staticmethod
    def _entries(r: TensorRecord, backend: Any, what: str) -> tuple[Any, Any, Any]:
        """(values, indices, a flag on the device: true where an index or value is bad) of a decoded record."""
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
        return vals, idx, bad

    def _commit(self, segs: list[_Segment], pos: np.ndarray, betas: np.ndarray, w: float, bounds: Any) -> None:
        """Add the checked segments with weight ``w`` (``betas``: the grid exponent each tensor of ``pos`` needs);
        a tensor whose grid coarsens has its limbs moved down first, for all such tensors at once."""
        backend, tpl = self._backend, self._template
        if self._limbs is None:
            self._limbs = backend.xp.zeros((LIMBS, int(tpl.numels.sum())), dtype=np.int32)
            self._beta = np.full(len(tpl.entries), NO_GRID, np.int64)
        limbs = self._limbs
        cur = self._beta[pos]
        up = (betas != NO_GRID) & ((cur == NO_GRID) | (betas > cur))
        move = up & (cur != NO_GRID)
        if move.any():  # a coarser grid: whole limbs move down, the lowest falls off (exactly)
            at = pos[move]
            backend.limb_shift(limbs, tpl.starts[at], tpl.numels[at], (betas[move] - cur[move]) // LIMB_BITS)
        self._beta[pos[up]] = betas[up]
        rows = (LIMBS - 1 - np.arange(LIMBS)) * LIMB_BITS
        for seg in segs:
            grid = self._beta[seg.pos]
            if not seg.vals.size or (grid == NO_GRID).all():
                continue  # nothing but zeros so far (a tensor of a run with no grid yet sends zeros: adds 0)
            exps = np.where(grid == NO_GRID, 0, grid)[:, None] + rows
            start = int(tpl.starts[seg.pos[0]])
            if len(seg.pos) > 1:
                backend.limb_accumulate(limbs, start, seg.counts, exps, seg.vals, seg.idx, w)
                continue
            n = int(seg.vals.size)
            step = _decode.chunk_entries(n, bounds)  # the fp64 and limb temporaries of one chunk at a time
            for a in range(0, n, step):
                b = min(a + step, n)
                if seg.idx is None:
                    backend.limb_accumulate(limbs, start + a, [b - a], exps, seg.vals[a:b], None, w)
                else:
                    backend.limb_accumulate(limbs, start, [b - a], exps, seg.vals[a:b], seg.idx[a:b], w)

    def mean_delta(self) -> dict[str, Any]:
        """The weighted mean delta per tensor as flat backend arrays (fp32; fp64 for fp64 tensors)."""
        with self._lock:
            return self._mean_delta()

    def _mean_delta(self, regions: list | None = None) -> dict[str, Any]:
        """The mean delta per tensor: views of one allocation per value dtype, which are appended to ``regions``
        (where given) with the positions and ends of their tensors."""
        if self.count == 0 or self._template is None:
            raise InvalidInputError("nothing to aggregate: no payload was added")
        total = self.total_weight
        if total <= 0.0:
            raise InvalidInputError("the weights sum to zero: the weighted mean is undefined")
        xp, tpl = self._backend.xp, self._template
        events.wait(self._backend, self._ready)  # the adds' limb updates, on whatever stream they ran
        none = self._beta == NO_GRID
        exps = np.where(none, 0, self._beta)[:, None] + (LIMBS - 1 - np.arange(LIMBS)) * LIMB_BITS
        scales = np.where(none[:, None], 0.0, np.ldexp(1.0, exps))  # (limbs of a tensor with no grid are 0)
        f64 = np.asarray([dtypes.value_dtype(dt) == "float64" for _, _, dt in tpl.entries], bool)
        flat: list[Any] = [None] * len(tpl.entries)
        for wide in (False, True):  # one pass per value dtype, into one allocation
            at = np.flatnonzero(f64 == wide)
            if not at.size:
                continue
            numels = tpl.numels[at]
            mean = xp.empty(int(numels.sum()), dtype=np.float64 if wide else np.float32)
            # in limb order, in fp64, then rounded once (on the host the twin bounds its fp64 buffers by blocks)
            self._backend.limb_mean(self._limbs, tpl.starts[at], numels, scales[at], total, mean)
            ends = np.cumsum(numels).tolist()
            for p, b, n in zip(at.tolist(), ends, numels.tolist()):
                flat[p] = mean[b - n : b]
            if regions is not None:
                regions.append((mean, at.tolist(), ends, numels.tolist()))
        self._ready = events.record(self._backend)
        return {n: flat[i] for i, (n, _, _) in enumerate(tpl.entries)}

    @holds_collector
    def result(self) -> dict[str, Any]:
        """``base + mean delta`` (with a base) or the mean delta, as :func:`gpu_codec.decompress` returns them.

        On a GPU the mean is computed on the stream :func:`gpu_codec.decompress` applies it on (the caller's
        current torch stream for a torch CUDA base), after the adds' limb updates (an event), and the call
        returns once that stream has finished it, as decompress does."""
        bases = self._base_tensors
        regions: list = []
        with self._backend.stream(bases):
            with self._lock:
                means = self._mean_delta(regions)
                entries = self._template.entries
            if self._base is not None:
                # the cap was applied to every payload; every client's base + delta is finite, so the mean's is
                # (_onto_base saturates a sum the mean's rounding takes past the dtype's range)
                out = self._onto_base(means, bases, entries)
                if out is not None:
                    return out
                recs = [
                    TensorRecord(n, dt, shape, "dense", math.prod(shape), {"values": means[n]})
                    for n, shape, dt in entries
                ]
                del means
                return _decode.decompress(Payload(recs, []), base=self._base, max_output_bytes=None)
            kind = self._like or "numpy"
            if kind == "numpy" and self._backend.on_device:  # (one copy to the host a dtype, not one a tensor)
                for mean, at, ends, numels in regions:
                    if is_device_array(mean):
                        host = self._backend.to_host(mean)
                        for p, b, n in zip(at, ends, numels):
                            means[entries[p][0]] = host[b - n : b]
            return {n: from_backend(means[n], dtypes.value_dtype(dt), shape, kind) for n, shape, dt in entries}

    def _onto_base(self, means: dict[str, Any], bases: TensorTable, entries: list) -> dict[str, Any] | None:
        """``base + mean`` of every tensor as :func:`gpu_codec.decompress` adds a dense delta onto its base (the
        same bytes), in one launch over all of them into one allocation per dtype, checked with one read-back; a
        sum the mean's rounding takes past the dtype's range is its largest finite value of that sign. None where a
        sum is still not finite (decompress then raises its error)."""
        backend, xp = self._backend, self._backend.xp
        logical = [dt for _, _, dt in entries]
        recs = [TensorRecord(n, dt, shape, "dense", math.prod(shape), {}) for n, shape, dt in entries]
        outs = _decode._Outputs(recs, logical, [None] * len(recs), True, backend)
        views = [outs[i] for i in range(len(recs))]
        checks = _decode.DeviceChecks(xp)
        codes = [dtypes.code(dt) for dt in logical]
        vals = [means[n] for n, _, _ in entries]
        word = backend.dense_apply(views, codes, backend.asarrays(bases.data), vals, ScatterMode.ADD, True)
        checks.word(word)
        del vals, means
        regions = [(outs.flat(logical.index(dt)), dtypes.code(dt)) for dt in dict.fromkeys(logical)]
        for flat, code in regions:  # one allocation (and one check) per dtype
            checks.flag(some_nonfinite(flat, code, xp))
        if not checks.passed():
            # every client's base + delta was finite (add() refused any other), so the mean's exact sum rounds to
            # a finite value; where the mean's rounding to its grid took a sum at the very edge of the dtype's range
            # past it, the sum is that edge: the largest finite value of its sign (a mean value the apply refused,
            # which leaves its element unwritten, still fails)
            checks = _decode.DeviceChecks(xp)
            checks.word(word)
            for flat, code in regions:
                saturate_inf(flat, code, xp)
                checks.flag(some_nonfinite(flat, code, xp))
            if not checks.passed():
                return None
        kinds, devices = bases.kinds, bases.devices
        if set(kinds) == {"numpy"}:  # (one copy to the host a dtype, not one a tensor)
            views = outs.host_views(backend)
        return {n: from_backend(views[i], dt, shape, kinds[i], devices[i]) for i, (n, shape, dt) in enumerate(entries)}


def aggregate(
    payloads: Iterable[Any],
    weights: Sequence[float] | None = None,
    base: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    max_output_bytes: int | None = _decode.DEFAULT_MAX_OUTPUT_BYTES,
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
    if isinstance(payloads, (bytes, bytearray, memoryview, Payload)) or not isinstance(payloads, Iterable):
        raise InvalidInputError(f"payloads must be an iterable of payloads, got {type(payloads).__name__}")
    payloads = list(payloads)
    if weights is None:
        weights = [1.0] * len(payloads)
    elif isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Iterable):
        raise InvalidInputError(f"weights must be a sequence of numbers, one a payload, got {type(weights).__name__}")
    weights = list(weights)
    if len(weights) != len(payloads):
        raise InvalidInputError(f"{len(weights)} weights for {len(payloads)} payloads")
    agg = Aggregator(base, like=like, max_output_bytes=max_output_bytes)
    for p, w in zip(payloads, weights):
        agg.add(p, w)
    return agg.result()
