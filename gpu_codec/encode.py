"""Compression: the exact top-k of ``update - base`` (:func:`compress`) and a payload of given sparse entries
(:func:`encode_coo`).

>>> import numpy as np, gpu_codec
>>> payload = gpu_codec.compress({"w": np.array([0, 3, 0, -5], np.float32)}, fraction=0.5)
>>> payload.tensors[0].buffers["indices"].tolist()
[1, 3]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import dtypes
from .arrays import TensorTable, tensor_table, to_tensor
from .backends import Backend, get_backend
from .backends.base import DeltaRequest, SelectRequest
from .codecs import SCOPES, as_pipeline, check_fraction, get_codec
from .collector import holds_collector
from .constants import DT_BF16, DT_F16, DT_F32, DT_F64, DType
from .errors import CodecConfigError, InvalidInputError, UnknownCodecError
from .format import (
    MAX_TENSORS,
    TensorRecord,
)
from .format.common import RecordTable, SegmentBuffers, Segmented
from .format.fingerprint import fingerprint
from .payload import (
    Payload,
    as_mapping,
    check_header_size,
    check_limits,
    check_metadata,
    in_order,
    within_limits,
)
from .xp.finite import all_finite

if TYPE_CHECKING:
    from .pending import PendingPayload

ScoreFn = Callable[[Mapping[str, Any], Mapping[str, Any] | None], Mapping[str, Any]]


def kept_count(fraction: float, n: int) -> int:
    """k = ceil(fraction x n), computed on the decimal value the user wrote (0.01 x 100 is 1, not 2).

    >>> kept_count(0.01, 100), kept_count(0.01, 101), kept_count(1.0, 7), kept_count(0.5, 0)
    (1, 2, 7, 0)
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InvalidInputError(f"n must be a non-negative integer (the elements), got {n!r}")
    return kept_counts(check_fraction(fraction), [int(n)])[0]


def kept_counts(fraction: float, numels: list[int]) -> list[int]:
    """:func:`kept_count` of each size, the fraction's decimal value read once.

    >>> kept_counts(0.01, [100, 101, 0])
    [1, 2, 0]
    """
    f = Fraction(repr(float(fraction)))
    p, q = f.numerator, f.denominator
    return [min(n, -(-n * p // q)) for n in numels]


def _check_tensors(
    update: Mapping[str, Any], base: Mapping[str, Any] | None
) -> tuple[list[str], TensorTable, TensorTable | None]:
    names = list(update.keys())
    if not names:
        raise InvalidInputError("the update is empty: nothing to compress")
    if len(names) > MAX_TENSORS:
        raise InvalidInputError(f"the update has {len(names)} tensors, the wire format allows {MAX_TENSORS}")
    checked = _host_tables(update, base, names)
    if checked is not None:
        return names, *checked
    for n in names:
        check_limits(n, ())
    if base is not None:
        missing = [n for n in names if n not in base]
        extra = [n for n in base if n not in update]
        if missing or extra:
            raise InvalidInputError(
                f"update and base name different tensors: missing from base {missing[:5]}, "
                f"missing from update {extra[:5]}"
            )
    news, bases = [], []
    for n in names:
        t = to_tensor(update[n], n)
        check_limits(n, t.shape)
        if t.dtype not in dtypes.FLOAT_DTYPES:
            raise InvalidInputError(
                f"tensor {n!r}: dtype {t.dtype} is not a float dtype (float32, float16, "
                "bfloat16, float64); a delta makes no sense for it"
            )
        if base is not None:
            b = to_tensor(base[n], n)
            if b.shape != t.shape:
                raise InvalidInputError(f"tensor {n!r}: update shape {t.shape} differs from base shape {b.shape}")
            if b.dtype != t.dtype:
                raise InvalidInputError(f"tensor {n!r}: update dtype {t.dtype} differs from base dtype {b.dtype}")
            bases.append(b)
        news.append(t)
    return names, TensorTable.of(news), TensorTable.of(bases) if base is not None else None


def _host_tables(
    update: Mapping[str, Any], base: Mapping[str, Any] | None, names: list[str]
) -> tuple[TensorTable, TensorTable | None] | None:
    """:func:`_check_tensors`' tables where the update and the base are each a table the fast wrappers take whole
    (:func:`~gpu_codec.arrays.tensor_table`) and pass every check, found with a few calls over the whole table;
    None where any check may fail (the tensor-by-tensor checks then give the error)."""
    arrays = in_order(update, names)  # (names are the update's keys: its values, where it reads them as a dict)
    news = tensor_table([update[n] for n in names] if arrays is None else arrays)
    if news is None:
        return None
    if not within_limits(names, news.shapes, news.sizes()):
        return None
    if base is None:
        return news, None
    if len(base) != len(names):
        return None
    arrays = in_order(base, names)  # (the update's names in its order, the common case: no lookup a name)
    if arrays is None:
        if not base.keys() >= set(names):
            return None
        arrays = [base[n] for n in names]
    bases = tensor_table(arrays)
    if bases is None or bases.shapes != news.shapes or bases.dtypes != news.dtypes:
        return None
    return news, bases


def _segments(numels: list[int], fraction: float, scope: str) -> tuple[list[list[int]], list[int]]:
    if scope == "global":
        return [list(range(len(numels)))], [kept_count(fraction, sum(numels))]
    return [[t] for t in range(len(numels))], kept_counts(fraction, numels)


def _external_scores(score: ScoreFn, update, base, names, news, backend: Backend) -> tuple[list, list[int]]:
    try:
        out = score(update, base)
    except Exception as e:
        raise InvalidInputError(f"the score function raised {type(e).__name__}: {e}") from e
    if not isinstance(out, Mapping):
        raise InvalidInputError(f"the score function must return a mapping name -> scores, got {type(out).__name__}")
    arrays, codes = [], []
    for n, t in zip(names, news):
        if n not in out:
            raise InvalidInputError(f"tensor {n!r}: the score function returned no scores for it")
        s = to_tensor(out[n], n)
        if s.shape != t.shape:
            raise InvalidInputError(f"tensor {n!r}: scores have shape {s.shape}, the tensor has {t.shape}")
        if s.dtype not in dtypes.FLOAT_DTYPES:
            raise InvalidInputError(f"tensor {n!r}: scores must be floats, got {s.dtype}")
        arrays.append(backend.asarray(s.data))
        codes.append(dtypes.code(s.dtype))
    return arrays, codes


@holds_collector
def compress(
    update: Mapping[str, Any],
    base: Mapping[str, Any] | None = None,
    *,
    fraction: float | None = 0.01,
    scope: str = "global",
    score: str | ScoreFn = "magnitude",
    residual: Any = None,
    metadata: Mapping[str, Any] | None = None,
    pipeline: Any = None,
    fingerprint_base: bool = False,
    blocking: bool = True,
) -> Payload | PendingPayload:
    """Compress ``update - base`` to its exact top-k entries as sparse COO.

    Parameters
    ----------
    update, base
        Mappings of name -> array (NumPy, CuPy or torch, CPU or CUDA; fp32, fp16, bf16 or fp64). ``base``
        defaults to zeros (``update`` is then the delta itself). Names, shapes and dtypes must agree.
    fraction
        Share of entries kept, in (0, 1]: k = ceil(fraction x N), as fl4health's ``sparsity_level``. ``None``:
        dense, no sparsification (every tensor is encoded ``dense``; value codecs still apply).
    scope
        ``"global"`` (one threshold across all tensors, ties broken by tensor order then index) or
        ``"per_tensor"`` (k per tensor).
    score
        ``"magnitude"`` (|delta|, the default), one of fl4health's six criteria (``largest_final_magnitude``,
        ``smallest_final_magnitude``, ``largest_magnitude_change``, ``smallest_magnitude_change``,
        ``largest_increase_in_magnitude``, ``smallest_increase_in_magnitude``), or a callable
        ``score(update, base) -> {name: scores}`` returning arrays on the same backend.
    residual
        An error-feedback state (:class:`gpu_codec.ErrorFeedback`) or None.
    metadata
        JSON-serializable values stored in the header.
    pipeline
        The stages after top-k (:mod:`gpu_codec.codecs`): None, a :class:`~gpu_codec.Pipeline`, or a list of
        codecs or codec configs, e.g. ``[Quantize("float16"), RiceIndices(), Zstd()]``. A ``topk`` stage in it
        replaces ``fraction``, ``scope`` and ``score``.
    fingerprint_base
        Store an 8-byte sampled fingerprint of ``base`` (:mod:`gpu_codec.format.fingerprint`: at most 256
        elements per tensor, gathered where the base lives), which :func:`decompress` checks against the base
        it is given. Off by default; needs a ``base``.
    blocking
        ``False``: return a :class:`~gpu_codec.pending.PendingPayload` as soon as the work is queued, without the
        final wait described below (its ``wait()`` / ``to_bytes()`` wait; ``ready()`` asks).

    Returns
    -------
    Payload
        Kept entries per tensor: ``indices`` (flat, ascending, uint32 where the tensor allows) and ``values``
        (the delta in fp32, fp64 for fp64 tensors). A kept value of exactly 0.0 is kept.

    Notes
    -----
    Host waits on the GPU. The call runs on the caller's current torch stream (CuPy's current stream for
    CuPy inputs), and the host waits for that stream at these points: each small read-back of the selection
    (an error word after scoring, the sampled keys, the per-tensor kept counts), each of which waits for
    everything queued on the stream before it, so the first one also waits for the work the caller queued
    before the call (an optimizer step, say); and the end of the call, which waits for the whole stream so that
    the payload's device buffers are complete: where the stages need values on the host (the ternary means, the
    Rice bit counts, the bytes zstd compresses), that wait is one copy of all of them, else a sync.
    ``blocking=False`` skips the end's sync, not that copy. :meth:`Payload.to_bytes` then copies the buffers to
    the host, and a stored error-feedback residual carries an event that the next call's stream waits on.

    >>> import numpy as np
    >>> p = compress({"a": np.array([1., -4., 2.], np.float32), "b": np.array([4., 0.5], np.float32)},
    ...              fraction=0.4)                        # k = ceil(0.4 x 5) = 2, tie at 4.0: "a" comes first
    >>> [(r.name, r.buffers["indices"].tolist()) for r in p.tensors]
    [('a', [1]), ('b', [0])]
    """
    if not blocking:  # the same call, with its end-of-call wait turned into an event (gpu_codec.pending)
        from .pending import PendingPayload

        kw = dict(fraction=fraction, scope=scope, score=score, residual=residual, metadata=metadata)
        kw["fingerprint_base"] = fingerprint_base
        return PendingPayload.run(lambda: compress(update, base, pipeline=pipeline, **kw))
    update = as_mapping(update, "update")
    if base is not None:
        base = as_mapping(base, "base")
    # the stages after top-k; a topk stage in the pipeline sets the selection
    pipe = as_pipeline(pipeline)
    if pipe.topk is not None:
        fraction, scope = pipe.topk.fraction, pipe.topk.scope
        if pipe.topk.score != "custom":  # "custom" names a callable, which only the caller can pass
            score = pipe.topk.score
    dense = fraction is None
    fraction = None if dense else check_fraction(fraction)
    if scope not in SCOPES:
        raise InvalidInputError(f"scope must be one of {SCOPES}, got {scope!r}")
    if callable(score):
        crit, score_name = dtypes.CRIT_EXTERNAL, "custom"
    elif isinstance(score, str) and score in dtypes.CRITERIA:
        crit, score_name = dtypes.CRITERIA[score], score
    else:
        raise InvalidInputError(f"score must be a callable or one of {sorted(dtypes.CRITERIA)}, got {score!r}")
    metadata = check_metadata(metadata)
    if dense and pipe.indices is not None:
        raise InvalidInputError(
            f"the {pipe.indices.codec_id!r} index stage needs a sparse (top-k) update; "
            "fraction=None encodes every tensor densely, with no indices"
        )
    from .error_feedback import ErrorFeedback

    if residual is not None and not isinstance(residual, ErrorFeedback):
        raise InvalidInputError(f"residual must be a gpu_codec.ErrorFeedback or None, got {type(residual).__name__}")
    names, news, bases = _check_tensors(update, base)
    if fingerprint_base and base is None:
        raise InvalidInputError("fingerprint_base=True needs the base the update is made against")
    backend = get_backend()
    nt = len(news)
    logical, shapes = news.dtypes, news.shapes  # (the table's columns: no call a tensor)
    dtype_codes = dtypes.codes(logical)
    session = residual.session(names, news, backend) if residual is not None else contextlib.nullcontext()
    # the residual is held from reading to storing, and stored only once the payload is complete
    with backend.stream(news if bases is None else news + bases), session as binding:
        new_arrays = backend.asarrays(news.data)
        base_arrays = [None] * nt if bases is None else backend.asarrays(bases.data)
        if crit == dtypes.CRIT_EXTERNAL:
            ext, ext_dt = _external_scores(score, update, base, names, news, backend)
        else:
            ext, ext_dt = [None] * nt, [DType.F32] * nt  # (no scores to read)
        res_in, res_out = [None] * nt, [None] * nt
        if binding is not None:  # (the value codecs round kept values and fix their residuals themselves)
            res_in, res_out = binding.res_in, binding.res_out
        if dense:  # every entry of every tensor, in one pass (no keys, no selection)
            req = DeltaRequest(new_arrays, base_arrays, res_in, res_out, dtype_codes, ext, ext_dt, crit)
            values, bad = backend.dense_delta(req)
            indices = [None] * nt
        else:
            segments, ks = _segments(news.sizes(), fraction, scope)  # (the backend's arrays: the same sizes)
            req = SelectRequest(new_arrays, base_arrays, res_in, res_out, dtype_codes, ext, ext_dt, crit, segments, ks)
            indices, values, bad = backend.topk_select(req)
        if bad is not None:
            t = bad
            why = _bad_input(names[t], new_arrays[t], base_arrays[t], res_in[t], crit, score_name, dtype_codes[t])
            raise InvalidInputError(why)
        if dense:
            records = [
                TensorRecord(n, dt, shape, "dense", val.size, {"values": val})
                for n, dt, shape, val in zip(names, logical, shapes, values)
            ]
        elif type(indices) is Segmented and type(values) is Segmented:  # shared outputs: no array per tensor
            roles = {"indices": indices, "values": values}
            nnz = np.diff(np.asarray(indices.offsets, np.int64)).tolist()  # (Python ints)
            if pipe.plain():  # (no stage to run on them: the records stay columns, no object a tensor)
                records = RecordTable(names, logical, shapes, nnz, roles)
            else:
                bufs = map(SegmentBuffers, repeat(roles), range(nt))
                records = list(map(TensorRecord, names, logical, shapes, repeat("coo"), nnz, bufs))
        else:
            records = [
                TensorRecord(n, dt, shape, "coo", idx.size, {"indices": idx, "values": val})
                for n, dt, shape, idx, val in zip(names, logical, shapes, indices, values)
            ]
        pipeline_cfg = [] if dense else [{"id": "topk", "fraction": fraction, "scope": scope, "score": score_name}]
        # value, index and lossless stages, on the backend; they fix the kept residuals
        if not pipe.plain():
            records = pipe.encode(records, backend, res_out if binding is not None else None)
        pipeline_cfg += pipe.after_topk()
        payload = Payload(records, pipeline_cfg, metadata, backend=backend.name)
        if fingerprint_base:
            payload.base_fingerprint = fingerprint(zip(names, logical, base_arrays), backend)
        check_header_size(payload)
        if binding is not None:
            residual.commit(binding, backend)
    return payload


# criteria whose score is |delta| or its negation (the others read the weights)
_DELTA_CRITERIA = (dtypes.Criterion.MAGNITUDE, dtypes.Criterion.LARGEST_CHANGE, dtypes.Criterion.SMALLEST_CHANGE)


def _bad_input(name: str, new: Any, base: Any, res: Any, crit: int, score: str, dt: int) -> str:
    """Why the selection refused tensor ``name`` (of dtype code ``dt``, scored by ``crit``, named ``score``): a
    non-finite value; (fp64) a finite delta, or under a criterion that reads the weights a finite weight, whose fp32
    score overflows (top-k compares scores in fp32); or a finite update and base whose delta plus the
    error-feedback residual is not finite (the residual grew past the range: every later round would fail the same
    way until it is reset)."""
    backend = get_backend()
    xp = backend.xp
    # the delta in the dtype it is taken in: fp64 as it is, the others as fp32 (the backend's widening of the
    # stored fp16 and bf16 bits)
    wide = {DT_F16: backend.decode_f16, DT_BF16: backend.decode_bf16}.get(dt, lambda x: x)
    with np.errstate(over="ignore", invalid="ignore"):
        d0 = wide(new) - wide(base) if base is not None else wide(new)
        d = d0 + res if res is not None else d0
    if dt == DT_F64 and crit != dtypes.CRIT_EXTERNAL and all_finite(d, DT_F64, xp):
        top = np.finfo(np.float32).max
        if crit not in _DELTA_CRITERIA and bool(xp.all(xp.abs(d) <= top)):  # (the score reads the weights)
            return (
                f"tensor {name!r}: a float64 weight past the float32 range (|w| > 3.4e38) has no float32 score "
                f"{score!r} for top-k to compare; compress with score='magnitude', or fraction=None (dense)"
            )
        if res is not None and bool(xp.all(xp.abs(d0) <= top)):
            return (
                f"tensor {name!r}: the float64 delta plus the error-feedback residual is past the float32 range "
                "(|x| > 3.4e38), where top-k compares scores: the residual has grown; ErrorFeedback.reset() "
                "discards it"
            )
        return (
            f"tensor {name!r}: a finite float64 delta past the float32 range (|delta| > 3.4e38) has no float32 "
            "score for top-k to compare; compress with fraction=None (dense), which sends float64 values exactly"
        )
    inputs_finite = all_finite(new, dt, xp) and (base is None or all_finite(base, dt, xp))
    if res is not None and inputs_finite and all_finite(d0, DT_F32, xp) and not all_finite(d, DT_F32, xp):
        return (
            f"tensor {name!r}: the update and its delta against base are finite, but the delta plus the "
            "error-feedback residual is not (inf or NaN): the residual has grown past the range; "
            "ErrorFeedback.reset() discards it"
        )
    return f"tensor {name!r}: the update, its delta against base or its score holds a non-finite value (inf or NaN)"


class SparseEntries(NamedTuple):
    """One tensor's kept entries for :func:`encode_coo`: flat ``indices`` (strictly ascending), their
    ``values``, and the dense tensor's ``shape`` and ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``,
    ``"float64"``)."""

    indices: Any
    values: Any
    shape: tuple[int, ...]
    dtype: str


def encode_coo(
    entries: Mapping[str, SparseEntries],
    *,
    pipeline: Any = None,
    metadata: Mapping[str, Any] | None = None,
    selection: Mapping[str, Any] | None = None,
) -> Payload:
    """A payload from entries the caller chose (no top-k here), encoded by ``pipeline``'s later stages.

    For adapters whose selection is not the engine's (fl4health's packings, a value other than the delta). Every
    entry is checked: indices integral, strictly ascending and inside the tensor; values finite. ``selection``
    (a registered codec config, e.g. ``{"id": "topk", ...}``) is recorded first in the header's pipeline.

    >>> import numpy as np
    >>> p = encode_coo({"w": SparseEntries(np.array([1, 3]), np.array([0.5, -2.0]), (2, 2), "float32")})
    >>> from gpu_codec import decompress
    >>> decompress(p.to_bytes())["w"].tolist()
    [[0.0, 0.5], [0.0, -2.0]]
    """
    if not isinstance(entries, Mapping) or not entries:
        raise InvalidInputError("encode_coo takes a non-empty mapping of name -> SparseEntries")
    if len(entries) > MAX_TENSORS:
        raise InvalidInputError(f"{len(entries)} tensors, the wire format allows {MAX_TENSORS}")
    metadata = check_metadata(metadata)
    pipe = as_pipeline(pipeline)
    if pipe.topk is not None:
        raise InvalidInputError("encode_coo encodes given entries: leave the topk stage out of its pipeline")
    backend = get_backend()
    xp = backend.xp
    wrapped = []
    for name, e in entries.items():
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(e, SparseEntries):
            raise InvalidInputError(f"tensor {name!r}: expected SparseEntries, got {type(e).__name__}")
        if e.dtype not in dtypes.FLOAT_DTYPES:
            raise InvalidInputError(f"tensor {name!r}: dtype {e.dtype!r} is not one of {list(dtypes.FLOAT_DTYPES)}")
        if (
            isinstance(e.shape, (str, bytes))
            or not isinstance(e.shape, Iterable)
            or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in e.shape)
        ):
            raise InvalidInputError(f"tensor {name!r}: shape {e.shape!r} is not a tuple of integers")
        shape = tuple(int(s) for s in e.shape)
        if any(s < 0 for s in shape):
            raise InvalidInputError(f"tensor {name!r}: shape {shape} has a negative dimension")
        check_limits(name, shape)
        wrapped.append((name, e.dtype, shape, to_tensor(e.indices, name), to_tensor(e.values, name)))
    records = []
    # every check, cast and stage runs on the inputs' device and the caller's stream
    with backend.stream([t for w in wrapped for t in w[3:]]):
        for name, dtype, shape, ti, tv in wrapped:
            numel = math.prod(shape)
            idx = backend.asarray(ti.data).reshape(-1)
            val = backend.asarray(tv.data).reshape(-1)
            if idx.dtype.kind not in "iu":
                raise InvalidInputError(f"tensor {name!r}: indices must be integers, got {ti.dtype}")
            if tv.dtype not in dtypes.FLOAT_DTYPES or idx.size != val.size:
                raise InvalidInputError(
                    f"tensor {name!r}: values must be {idx.size} floats (one per index), got {tv.dtype}[{val.size}]"
                )
            if tv.dtype == "bfloat16":  # (its bits: widened to float32, exactly)
                val = backend.decode_bf16(val)
            if idx.size:
                lo, hi = int(idx.min()), int(idx.max())
                if lo < 0 or hi >= numel or bool(xp.any(idx[1:] <= idx[:-1])):
                    raise InvalidInputError(
                        f"tensor {name!r}: indices must be strictly ascending and inside [0, {numel}), "
                        f"got a range [{lo}, {hi}]"
                    )
            idx = idx.astype(dtypes.index_dtype(numel), copy=False)
            vdt = dtypes.value_dtype(dtype)
            with np.errstate(over="ignore"):  # (a value past the value dtype's range becomes inf: refused below)
                val = val.astype(vdt, copy=False)
            if idx.size and not bool(xp.all(xp.isfinite(val))):
                raise InvalidInputError(
                    f"tensor {name!r}: a value is not finite in {np.dtype(vdt).name} (inf or NaN, or past its range)"
                )
            records.append(TensorRecord(name, dtype, shape, "coo", int(idx.size), {"indices": idx, "values": val}))
        records = pipe.encode(records, backend, None)
    head = [] if selection is None else [_checked_selection(selection)]
    payload = Payload(records, head + pipe.after_topk(), metadata, backend=backend.name)
    check_header_size(payload)
    return payload


def _checked_selection(selection: Any) -> dict[str, Any]:
    """:func:`encode_coo`'s ``selection``, as given (NumPy numbers as the Python numbers they hold), once it is a
    registered selection stage's valid config (what a reader rebuilds the header's pipeline from)."""
    try:
        codec = get_codec(selection)
    except (UnknownCodecError, CodecConfigError) as e:
        raise InvalidInputError(f"selection: {e}") from None
    if codec.stage != "sparsify":
        raise InvalidInputError(f"selection must be a selection stage's config (e.g. topk), got {selection['id']!r}")
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in selection.items()}


__all__ = ["SparseEntries", "compress", "encode_coo", "kept_count"]
