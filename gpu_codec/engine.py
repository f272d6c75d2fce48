"""The engine: exact top-k sparse compression of a model update, and its inverse.

>>> import numpy as np, gpu_codec
>>> base = {"w": np.zeros(8, np.float32)}
>>> new = {"w": np.array([0, 3, 0, -5, 0, 1, 0, 0], np.float32)}
>>> payload = gpu_codec.compress(new, base=base, fraction=0.25)     # keep ceil(0.25 * 8) = 2 entries
>>> payload.tensors[0].buffers["indices"].tolist(), payload.tensors[0].buffers["values"].tolist()
([1, 3], [3.0, -5.0])
>>> gpu_codec.decompress(payload.to_bytes(), base=base)["w"].tolist()
[0.0, 3.0, 0.0, -5.0, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import dtypes
from .arrays import Tensor, array_kind, from_backend, to_tensor
from .backends import Backend, get_backend
from .backends.base import DeltaRequest, SelectRequest, all_finite, some_nonfinite
from .codecs import SCOPES, as_pipeline, check_fraction, decoder_for, wire_layouts
from .constants import SCATTER_ADD, SCATTER_ZEROS, U64_MAX, DType
from .errors import InvalidInputError, PayloadError, PayloadIndexError, PayloadLimitError, PayloadValueError
from .format import (
    MAX_HEADER_BYTES,
    MAX_NAME,
    MAX_NDIM,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSORS,
    TensorRecord,
    header_size,
    pack,
    packed_size,
    unpack,
)
from .format.fingerprint import check_base, fingerprint

if TYPE_CHECKING:
    from .pending import PendingPayload

DEFAULT_MAX_OUTPUT_BYTES = 4 << 30  # decompress's cap on the dense output a payload may declare
# Entries written per scatter: a 256th of the tensor, within these bounds, so the temporaries of a chunk (about
# 40 bytes per entry on the host) stay a small share of the output; on the GPU a launch has a fixed cost.
DECODE_CHUNK = (1 << 14, 1 << 20)
DECODE_CHUNK_DEVICE = (1 << 20, 1 << 24)
MAX_METADATA_DEPTH = 64  # nesting levels of metadata containers
MAX_METADATA_INT = 10**40  # the header parser rejects longer integers

ScoreFn = Callable[[Mapping[str, Any], Mapping[str, Any] | None], Mapping[str, Any]]


def kept_count(fraction: float, n: int) -> int:
    """k = ceil(fraction x n), computed on the decimal value the user wrote (0.01 x 100 is 1, not 2).

    >>> kept_count(0.01, 100), kept_count(0.01, 101), kept_count(1.0, 7), kept_count(0.5, 0)
    (1, 2, 7, 0)
    """
    return min(n, math.ceil(Fraction(repr(float(fraction))) * n))


def check_json(value: Any, path: str = "", depth: int = 0, *, numpy_scalars: bool = False) -> Any:
    """``value`` as the header stores it, checked: None, bools, strings, finite numbers (integers of at most 40
    digits), lists and str-keyed dicts of those, nested at most MAX_METADATA_DEPTH deep; tuples become lists and
    NumPy scalars (with ``numpy_scalars``, as frameworks' metadata holds them) Python numbers. The one check of
    metadata, for the engine and for every adapter.

    >>> check_json({"a": (1, 2.5)}), check_json(np.float32(0.5), numpy_scalars=True)
    ({'a': [1, 2.5]}, 0.5)
    >>> check_json({"x": np.int64(3)})
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: metadata['x']: a numpy.int64 is not a JSON value (use None, bool, ...)
    """
    if numpy_scalars and isinstance(value, np.generic) and isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if depth > MAX_METADATA_DEPTH:
        raise InvalidInputError(f"metadata{path}: nested deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -MAX_METADATA_INT < value < MAX_METADATA_INT:
            raise InvalidInputError(f"metadata{path}: integer with more than 40 digits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInputError(f"metadata{path}: {value!r} is not a finite number (JSON cannot hold it)")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [check_json(v, f"{path}[{i}]", depth + 1, numpy_scalars=numpy_scalars) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidInputError(f"metadata{path}: key {k!r} is a {type(k).__name__}; JSON keys are strings")
            out[k] = check_json(v, f"{path}[{k!r}]", depth + 1, numpy_scalars=numpy_scalars)
        return out
    raise InvalidInputError(
        f"metadata{path}: a {type(value).__module__}.{type(value).__name__} is not a JSON value "
        "(use None, bool, int, float, str, list or dict; convert NumPy scalars with .item())"
    )


def check_metadata(metadata: Any) -> dict[str, Any]:
    """Metadata as the header will store it: a dict of JSON values (str keys, finite floats, integers of at most
    40 digits, at most 64 levels deep, small enough for the header). Raises InvalidInputError otherwise.

    >>> check_metadata({"round": 3, "lr": 0.1, "tags": ("a", "b")})
    {'round': 3, 'lr': 0.1, 'tags': ['a', 'b']}
    >>> check_metadata({"loss": float("nan")})
    Traceback (most recent call last):
    ...
    gpu_codec.errors.InvalidInputError: metadata['loss']: nan is not a finite number (JSON cannot hold it)
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    out = check_json(metadata)
    size = len(json.dumps(out, separators=(",", ":"), ensure_ascii=True))
    if size > MAX_HEADER_BYTES // 2:
        raise InvalidInputError(
            f"metadata is {size} bytes as JSON, over {MAX_HEADER_BYTES // 2} (half the header limit of "
            f"{MAX_HEADER_BYTES} bytes); send large data as tensors"
        )
    return out


def _check_limits(name: Any, shape: tuple[int, ...]) -> None:
    """A tensor the reader will accept: the wire format's name, rank and element limits."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"tensor names must be non-empty strings, got {name!r}")
    if len(name) > MAX_NAME:
        raise InvalidInputError(f"tensor {name[:40]!r}...: name of {len(name)} characters, the limit is {MAX_NAME}")
    if len(shape) > MAX_NDIM:
        raise InvalidInputError(f"tensor {name!r}: {len(shape)} dimensions, the wire format allows {MAX_NDIM}")
    if math.prod(s for s in shape if s) > MAX_TENSOR_ELEMENTS:
        raise InvalidInputError(f"tensor {name!r}: shape {shape} exceeds {MAX_TENSOR_ELEMENTS} elements")


# Bytes a tensor's entry in the v2 table can take beside its name: kind, form, 8 dimensions, nnz and the codec
# fields are each a byte or a varint of at most 10 bytes (about 140 in all at the most), and the name's own varints.
TABLE_ENTRY_BOUND = 512


def _header_bound(payload: Payload) -> int:
    """An upper bound on the header's bytes from the names, the stage and metadata JSON and the tensor count alone
    (no layout of the table): where it is within the reader's limit, the exact size need not be computed."""
    names = sum(len(r.name) for r in payload.tensors)  # UTF-8 takes at most 4 bytes a character
    cfg = json.dumps([payload.pipeline, payload.metadata], separators=(",", ":"), ensure_ascii=True)
    return 4 * names + TABLE_ENTRY_BOUND * (len(payload.tensors) + len(payload.pipeline)) + 4 * len(cfg) + 4096


def _check_header_size(payload: Payload) -> None:
    if _header_bound(payload) <= MAX_HEADER_BYTES:
        return
    header = payload.header_nbytes
    if header > MAX_HEADER_BYTES:
        raise InvalidInputError(
            f"the payload header would be {header} bytes, over the reader's limit of {MAX_HEADER_BYTES}: "
            f"{len(payload.tensors)} tensors, their names and the metadata do not fit"
        )


def _as_mapping(x: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(x, Mapping):
        raise InvalidInputError(f"{what} must be a mapping of name -> array, got {type(x).__name__}")
    return x


def _check_tensors(
    update: Mapping[str, Any], base: Mapping[str, Any] | None
) -> tuple[list[str], list[Tensor], list[Tensor | None]]:
    names = list(update.keys())
    if not names:
        raise InvalidInputError("the update is empty: nothing to compress")
    if len(names) > MAX_TENSORS:
        raise InvalidInputError(f"the update has {len(names)} tensors, the wire format allows {MAX_TENSORS}")
    for n in names:
        _check_limits(n, ())
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
        _check_limits(n, t.shape)
        if t.dtype not in dtypes.FLOAT_DTYPES:
            raise InvalidInputError(
                f"tensor {n!r}: dtype {t.dtype} is not a float dtype (float32, float16, "
                "bfloat16, float64); a delta makes no sense for it"
            )
        b = None
        if base is not None:
            b = to_tensor(base[n], n)
            if b.shape != t.shape:
                raise InvalidInputError(f"tensor {n!r}: update shape {t.shape} differs from base shape {b.shape}")
            if b.dtype != t.dtype:
                raise InvalidInputError(f"tensor {n!r}: update dtype {t.dtype} differs from base dtype {b.dtype}")
        news.append(t)
        bases.append(b)
    return names, news, bases


class Payload:
    """A compressed update: tensor records whose buffers stay where they were computed (the GPU on the GPU path)
    until :meth:`to_bytes`.

    Attributes: ``tensors`` (list of :class:`~gpu_codec.format.TensorRecord`), ``pipeline`` (codec configs, as
    stored in the header), ``metadata`` (str -> JSON value), ``backend`` (the backend that made it, not stored).
    """

    def __init__(
        self, tensors: list[TensorRecord], pipeline: list[dict], metadata: dict | None = None, backend: str = "cpu"
    ):
        self.tensors = tensors
        self.pipeline = pipeline
        self.metadata = dict(metadata or {})
        self.backend = backend
        self._wire_cache: dict = {}  # the bytes stage's layout, shared by nbytes, header_nbytes and to_bytes
        self.version: int | None = None  # the wire version it was read from (None: made here)
        self.base_fingerprint: str | None = None  # of the base it was made against (compress(fingerprint_base=True))

    def to_bytes(self, version: int | None = None) -> bytes:
        """Serialize: wire format v2 (``version=None`` or 2; v1 for records v2 cannot describe, which no
        built-in codec makes; v3 where an ``nvcomp`` tensor is more than one zstd frame, more than 16 MiB of
        encoded bytes), or v1 or v2 on request (``version=1`` or ``2``, for readers that predate the later
        versions: a tensor of several frames is then compressed again, on the CPU, as one). On the GPU path this
        is the one device-to-host copy.

        >>> import numpy as np, gpu_codec
        >>> p = gpu_codec.compress({"w": np.arange(100, dtype=np.float32)}, fraction=0.05)
        >>> blob = p.to_bytes()
        >>> blob[:8], blob[8], len(blob) == p.nbytes, len(p.to_bytes(version=1)) > len(blob)
        (b'GPUCODEC', 2, True, True)
        """
        blob = pack(
            self.tensors,
            pipeline=self.pipeline,
            metadata=self.metadata,
            layouts=wire_layouts(),
            version=version,
            cache=self._wire_cache,
            fingerprint=self.base_fingerprint,
        )
        if blob[8] == 1 and int.from_bytes(blob[12:16], "little") > MAX_HEADER_BYTES:
            raise InvalidInputError(
                f"a version-1 header for {len(self.tensors)} tensors would be over the reader's limit of "
                f"{MAX_HEADER_BYTES} bytes; write version 2 (the default), whose tensor table is compact"
            )
        return blob

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> Payload:
        """Parse and validate a payload of either format version (hostile input is rejected with a
        PayloadError)."""
        header, records = unpack(blob, wire_layouts())
        p = cls(records, header.get("pipeline", []), header.get("metadata", {}), backend="cpu")
        p.version = int(header["version"])
        p.base_fingerprint = header.get("base_fingerprint")
        return p

    def _laid_out(self, measure: Callable[..., int]) -> int:
        """A size of the wire layout (sharing the layout with :meth:`to_bytes` through the cache)."""
        return measure(
            self.tensors,
            self.pipeline,
            self.metadata,
            wire_layouts(),
            cache=self._wire_cache,
            fingerprint=self.base_fingerprint,
        )

    @property
    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes`, computed without copying anything off the device."""
        return self._laid_out(packed_size)

    @property
    def header_nbytes(self) -> int:
        """Bytes of :meth:`to_bytes` that are neither buffer data nor checksum: the prefix, the tensor table
        and the metadata (no device copy).

        >>> import numpy as np, gpu_codec
        >>> u = {f"layer{i}.weight": np.ones(1000, np.float32) * i for i in range(1, 11)}
        >>> gpu_codec.compress(u, fraction=0.01).header_nbytes / len(u) < 16
        True
        """
        return self._laid_out(header_size)

    @property
    def dense_nbytes(self) -> int:
        """Size of the dense update in its original dtypes."""
        return sum(r.numel * dtypes.storage_dtype(r.dtype).itemsize for r in self.tensors)

    @property
    def ratio(self) -> float:
        """Dense size over compressed size."""
        return self.dense_nbytes / max(1, self.nbytes)

    @property
    def nnz(self) -> int:
        return sum(r.nnz for r in self.tensors)

    def __repr__(self) -> str:
        return (
            f"Payload({len(self.tensors)} tensors, {self.nnz} kept entries, {self.nbytes} bytes, "
            f"ratio {self.ratio:.1f}x, backend={self.backend!r})"
        )


def _segments(numels: list[int], fraction: float, scope: str) -> tuple[list[list[int]], list[int]]:
    if scope == "global":
        return [list(range(len(numels)))], [kept_count(fraction, sum(numels))]
    return [[t] for t in range(len(numels))], [kept_count(fraction, n) for n in numels]


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
    (an error word after scoring, the sampled keys, the per-tensor kept counts; with codecs, the ternary means
    and Rice bit counts), each of which waits for everything queued on the stream before it, so the first one
    also waits for the work the caller queued before the call (an optimizer step, say); and the end of the
    call, which waits for the whole stream so that the payload's device buffers are complete
    (``blocking=False`` skips only this last wait). :meth:`Payload.to_bytes` then copies the buffers to the
    host, and a stored error-feedback residual carries an event that the next call's stream waits on.

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
    update = _as_mapping(update, "update")
    if base is not None:
        base = _as_mapping(base, "base")
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
    dtype_codes = [dtypes.code(t.dtype) for t in news]
    session = residual.session(names, news, backend) if residual is not None else contextlib.nullcontext()
    # the residual is held from reading to storing, and stored only once the payload is complete
    with backend.stream(news + bases), session as binding:
        new_arrays = [backend.asarray(t.data) for t in news]
        base_arrays = [backend.asarray(b.data) if b is not None else None for b in bases]
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
            segments, ks = _segments([t.numel for t in news], fraction, scope)
            req = SelectRequest(new_arrays, base_arrays, res_in, res_out, dtype_codes, ext, ext_dt, crit, segments, ks)
            indices, values, bad = backend.topk_select(req)
        if bad is not None:
            raise InvalidInputError(_bad_input(names[bad], new_arrays[bad], base_arrays[bad], res_in[bad], crit))
        records = []
        for n, t, idx, val in zip(names, news, indices, values):
            if dense:
                records.append(TensorRecord(n, t.dtype, t.shape, "dense", t.numel, {"values": val}))
                continue
            records.append(TensorRecord(n, t.dtype, t.shape, "coo", int(idx.size), {"indices": idx, "values": val}))
        pipeline_cfg = [] if dense else [{"id": "topk", "fraction": fraction, "scope": scope, "score": score_name}]
        # value, index and lossless stages, on the backend; they fix the kept residuals
        records = pipe.encode(records, backend, res_out if binding is not None else None)
        pipeline_cfg += pipe.after_topk()
        payload = Payload(records, pipeline_cfg, metadata, backend=backend.name)
        if fingerprint_base:
            payload.base_fingerprint = fingerprint(zip(names, [t.dtype for t in news], base_arrays), backend)
        _check_header_size(payload)
        if binding is not None:
            residual.commit(binding, backend)
    return payload


def _bad_input(name: str, new: Any, base: Any, res: Any, crit: int) -> str:
    """Why the selection refused tensor ``name``: a non-finite value, or (fp64) a finite delta whose fp32 score
    overflows, which only dense mode can send (top-k compares scores in fp32)."""
    if new.dtype == np.float64 and crit != dtypes.CRIT_EXTERNAL:
        with np.errstate(over="ignore", invalid="ignore"):
            d = new - base if base is not None else new
            d = d + res if res is not None else d
        if all_finite(d, dtypes.code("float64"), get_backend().xp):
            return (
                f"tensor {name!r}: a finite float64 delta past the float32 range (|delta| > 3.4e38) has no float32 "
                "score for top-k to compare; compress with fraction=None (dense), which sends float64 values exactly"
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
        try:
            shape = tuple(int(s) for s in e.shape)
        except (TypeError, ValueError):
            raise InvalidInputError(f"tensor {name!r}: shape {e.shape!r} is not a tuple of integers") from None
        if any(s < 0 for s in shape):
            raise InvalidInputError(f"tensor {name!r}: shape {shape} has a negative dimension")
        _check_limits(name, shape)
        wrapped.append((name, e.dtype, shape, to_tensor(e.indices, name), to_tensor(e.values, name)))
    records = []
    # every check, cast and stage runs on the inputs' device and the caller's stream
    with backend.stream([t for w in wrapped for t in w[3:]]):
        for name, dtype, shape, ti, tv in wrapped:
            numel = math.prod(shape)
            idx = backend.asarray(ti.data).reshape(-1)
            val = backend.asarray(tv.data).reshape(-1)
            if idx.dtype.kind not in "iu":
                raise InvalidInputError(f"tensor {name!r}: indices must be integers, got {idx.dtype}")
            if val.dtype.kind != "f" or idx.size != val.size:
                raise InvalidInputError(
                    f"tensor {name!r}: values must be {idx.size} floats (one per index), got {val.dtype}[{val.size}]"
                )
            if idx.size:
                lo, hi = int(idx.min()), int(idx.max())
                if lo < 0 or hi >= numel or bool(xp.any(idx[1:] <= idx[:-1])):
                    raise InvalidInputError(
                        f"tensor {name!r}: indices must be strictly ascending and inside [0, {numel}), "
                        f"got a range [{lo}, {hi}]"
                    )
                if not bool(xp.all(xp.isfinite(val))):
                    raise InvalidInputError(f"tensor {name!r}: a value is not finite (inf or NaN)")
            idx = idx.astype(dtypes.index_dtype(numel), copy=False)
            val = val.astype(dtypes.value_dtype(dtype), copy=False)
            records.append(TensorRecord(name, dtype, shape, "coo", int(idx.size), {"indices": idx, "values": val}))
        records = pipe.encode(records, backend, None)
    head = [dict(selection)] if selection is not None else []
    payload = Payload(records, head + pipe.after_topk(), metadata, backend=backend.name)
    _check_header_size(payload)
    return payload


def _output_kind(like: str | None, base_tensors: list[Tensor] | None) -> tuple[str, Any]:
    if base_tensors:
        return base_tensors[0].kind, base_tensors[0].device
    if like is None:
        return "numpy", None
    if like not in ("numpy", "cupy", "torch"):
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
    return like, None


def _output_itemsize(r: TensorRecord, with_base: bool) -> int:
    logical = r.dtype if with_base else dtypes.value_dtype(r.dtype)
    return dtypes.storage_dtype(logical).itemsize


def check_output_cap(
    records: list[TensorRecord], with_base: bool, max_output_bytes: Any, max_elements: Any = None
) -> None:
    """Refuse (``PayloadLimitError``) a payload whose declared dense output is over the cap, before anything is
    decompressed or allocated: :func:`decompress`'s check, shared with :mod:`gpu_codec.aggregate`."""
    if max_elements is not None:
        total = sum(r.numel for r in records)
        if total > max_elements:
            raise PayloadLimitError(f"payload asks for {total} dense elements, over max_elements={max_elements}")
    if max_output_bytes is None:
        return
    declared = sum(r.numel * _output_itemsize(r, with_base) for r in records)
    if declared > max_output_bytes:
        raise PayloadLimitError(
            f"payload declares {declared} bytes of dense output ({len(records)} tensors), over "
            f"max_output_bytes={max_output_bytes}; pass a larger cap (or None) to accept it"
        )


def _chunk(nnz: int, bounds: tuple[int, int]) -> int:
    return min(bounds[1], max(bounds[0], nnz // 256))


def _check_indices(d: Any, numel: int, xp: Any, chunk: int) -> None:
    """Every index of a sparse tensor in range and strictly ascending, before its output exists."""
    last = -1
    for a in range(0, d.nnz, chunk):
        i = d.indices(a, min(a + chunk, d.nnz))
        first, end = int(i[0]), int(i[-1])
        ok = first > last and end < numel and (i.size < 2 or bool(xp.all(i[1:] > i[:-1])))
        if not ok:
            raise PayloadIndexError(
                f"tensor {d.name!r}: a sparse index in entries [{a}, {a + int(i.size)}) is out of range [0, {numel}), "
                "repeated or not increasing; nothing was decoded"
            )
        last = end


def _decode_one(d: Any, base: Tensor | None, backend: Any, bounds: tuple[int, int], out_of: Any) -> Any:
    """One tensor's dense output into ``out_of()`` (its slice of the decode's one allocation, zeros without a base,
    asked for once the indices are checked; the base is copied, never written), filled a chunk at a time; onto a
    base, each chunk of entries copies the base up to its last index and adds them (``scatter_onto``)."""
    xp = backend.xp
    numel = d.numel
    chunk = _chunk(d.nnz, bounds)
    if d.indices is not None:
        _check_indices(d, numel, xp, chunk)
    logical = d.dtype if base is not None else dtypes.value_dtype(d.dtype)
    mode = SCATTER_ADD if base is not None else SCATTER_ZEROS
    code = dtypes.code(logical)
    dense = d.indices is None
    base_arr = backend.asarray(base.data) if base is not None else None
    onto = not dense and base_arr is not None
    out = out_of()
    copied = 0  # onto a base: elements [0, copied) of out are written
    step = max(d.step, chunk // d.step * d.step)
    for a in range(0, d.nnz, step):
        b = min(a + step, d.nnz)
        vals = d.values(a, b)
        finite = True
        if dense:
            idx = None
            part = None if base_arr is None else base_arr[a:b]
            bad = backend.dense_apply([out[a:b]], [code], [part], [vals], mode)
            finite = bad is not None or mode != SCATTER_ADD or all_finite(out[a:b], code, xp)
        elif onto:
            idx = d.indices(a, b)  # checked ascending and in range: the last chunk copies the base to its end
            stop = numel if b == d.nnz else int(idx[-1]) + 1
            bad, finite = backend.scatter_onto(out, base_arr, copied, stop, code, numel, idx, vals)
            copied = stop
        else:
            idx = d.indices(a, b)
            bad = backend.scatter([out], [code], [numel], [idx], [vals], mode)
        if bad is not None:
            raise PayloadIndexError(
                f"tensor {d.name!r}: sparse index at entry {a + bad} is out of range, repeated or not "
                "increasing, or its value is not finite; nothing was decoded"
            )
        # a finite delta can still take the base past its dtype's range (fp16: 60000 + 60000 = inf)
        if not finite:
            raise PayloadValueError(
                f"tensor {d.name!r}: adding the update to the base gives inf or NaN in {logical} (a delta past the "
                "dtype's range, or a non-finite base entry); nothing was decoded and the base is unchanged"
            )
        del vals, idx
    if onto and copied < numel:  # no entry at all: the base itself
        out[copied:] = base_arr[copied:]
    return out


class DeviceChecks:
    """The checks of a decode left on the device, read by the host once (a device backend's first pass):
    error words of the scatter and dense passes, and flags (0-d bool arrays, true where a check failed)."""

    def __init__(self, xp: Any):
        self.xp = xp
        self.words: list[Any] = []
        self.flags: list[Any] = []

    def word(self, err: Any) -> None:
        if err is not None:
            self.words.append(err)

    def flag(self, bad: Any) -> None:
        self.flags.append(bad)

    def passed(self) -> bool:
        """Whether every check passed: one read by the host."""
        xp = self.xp
        parts = [xp.stack(self.flags).any()] if self.flags else []
        if self.words:
            parts.append(xp.concatenate(self.words).min() != U64_MAX)
        return not parts or not bool(xp.stack(parts).any() if len(parts) > 1 else parts[0])


def _decode_one_deferred(d: Any, base: Tensor | None, backend: Any, bounds: tuple[int, int], out_of: Any, checks: Any):
    """:func:`_decode_one` with no host wait: the checks it reads are left in ``checks`` (a failed one: the caller
    decodes again with :func:`_decode_one`, which raises the error). Onto a base, the base is copied whole and the
    entries added: the same bytes as :meth:`~gpu_codec.backends.base.Backend.scatter_onto` on a kernel backend."""
    xp = backend.xp
    numel = d.numel
    logical = d.dtype if base is not None else dtypes.value_dtype(d.dtype)
    mode = SCATTER_ADD if base is not None else SCATTER_ZEROS
    code = dtypes.code(logical)
    base_arr = backend.asarray(base.data) if base is not None else None
    out = out_of()
    step = max(d.step, _chunk(d.nnz, bounds) // d.step * d.step)
    if d.indices is None:
        for a in range(0, d.nnz, step):
            b = min(a + step, d.nnz)
            part = None if base_arr is None else base_arr[a:b]
            checks.word(backend.dense_apply([out[a:b]], [code], [part], [d.values(a, b)], mode, defer=True))
            if mode == SCATTER_ADD:
                checks.flag(some_nonfinite(out[a:b], code, xp))
        return
    if base_arr is not None:
        out[...] = base_arr
    last = None
    for a in range(0, d.nnz, step):
        b = min(a + step, d.nnz)
        idx = d.indices(a, b)
        checks.word(backend.scatter([out], [code], [numel], [idx], [d.values(a, b)], mode, defer=True))
        if last is not None:  # each chunk's entries after the last chunk's (the scatter checks within a chunk)
            checks.flag(idx[0] <= last)
        last = idx[-1]
        if mode == SCATTER_ADD:  # (an index out of range is clamped here: the scatter's word reports it)
            checks.flag(some_nonfinite(out[xp.minimum(idx, max(numel - 1, 0))], code, xp))


SMALL_TENSOR = 1 << 18  # sparse tensors of at most this many elements are decoded in runs, a few calls a run
SMALL_RUN = 1 << 20  # elements of output a run covers at the most
SMALL_RUN_ENTRIES = 1 << 14  # ... and entries (its temporaries, about 20 bytes an entry, stay near 320 KiB)


def _decode_run(
    run: list, flat_of: Any, offsets: list[int], bases: list, logical: str, backend: Any, checks: Any = None
) -> bool:
    """A run of small sparse tensors, adjacent in the buffer ``flat_of()`` gives (``offsets``: each one's start,
    then the run's end), which is asked for once the entries are checked:
    their bases copied in, then every entry checked and added (or written) in one scatter over the run's span.
    False where an index or value is bad or a sum not finite: the caller then decodes them one by one, which
    raises the error that names the tensor. With ``checks`` (:class:`DeviceChecks`) nothing is read back: the
    checks are left there, and the result is True."""
    xp = backend.xp
    host = xp.asarray if backend.on_device else np.asarray  # small host tables, where the entries are
    idx = [d.indices(0, d.nnz) for d in run]
    counts = [int(i.size) for i in idx]
    o0, o1 = offsets[0], offsets[-1]
    code = dtypes.code(logical)
    if sum(counts):
        wide = any(i.dtype.itemsize > 4 for i in idx)  # (a payload may give a small tensor 64-bit indices)
        gi = xp.concatenate([i.astype(np.int64 if wide else np.uint32, copy=False) for i in idx])
        vals = xp.concatenate([d.values(0, d.nnz) for d in run])
        ends = np.cumsum(counts)
        some = np.flatnonzero(np.asarray(counts) > 0)
        last = gi[host(ends[some] - 1)]  # ascending within each tensor: its last entry is its largest
        numels = host(np.asarray([run[j].numel for j in some], np.int64))
        step = gi[1:] > gi[:-1]
        firsts = ends[:-1] - 1  # where a tensor's first entry follows the last one's
        step[host(firsts[(firsts >= 0) & (firsts < step.size)])] = True
        ok = xp.all(last < numels) & xp.all(step)
        if wide:
            ok = ok & xp.all(gi >= 0)
        if checks is not None:
            checks.flag(~ok)
        elif not bool(ok):
            return False
        gi += host(np.repeat(np.asarray(offsets[:-1], np.int64) - o0, counts).astype(gi.dtype))
        gi = gi.astype(dtypes.index_dtype(o1 - o0), copy=False)
    flat = flat_of()
    span = flat[o0:o1]
    for b, o, n in zip(bases, offsets, np.diff(offsets).tolist()):
        if b is not None:
            flat[o : o + n] = backend.asarray(b.data)
    if not sum(counts):
        return True
    mode = SCATTER_ADD if bases[0] is not None else SCATTER_ZEROS
    if checks is not None:
        checks.word(backend.scatter([span], [code], [o1 - o0], [gi], [vals], mode, defer=True))
        if mode == SCATTER_ADD and o1 > o0:  # (an index out of range is clamped: the checks above report it)
            checks.flag(some_nonfinite(span[xp.minimum(gi, o1 - o0 - 1)], code, xp))
        return True
    if backend.scatter([span], [code], [o1 - o0], [gi], [vals], mode) is not None:
        return False  # a value is not finite
    return mode != SCATTER_ADD or all_finite(span[gi], code, xp)


def decoded_records(payload: Payload, backend: Backend) -> list[TensorRecord]:
    """The payload's records decoded by its own pipeline to ``coo``/``dense`` buffers on ``backend`` (quantized
    values, coded indices, lossless stages), all at once, as :mod:`gpu_codec.aggregate` takes them. Indices and
    values are not checked here: the caller checks them before use (:func:`decompress` streams instead)."""
    return decoder_for(payload.pipeline).decode(payload.tensors, backend)


def _runs(records: list[TensorRecord], logical: list[str]) -> list[int | None]:
    """Each record's run (small sparse tensors of one dtype decoded together, see :func:`_decode_run`), or None for a
    tensor decoded alone: at most SMALL_RUN elements and SMALL_RUN_ENTRIES entries a run."""
    out: list[int | None] = []
    run, size, entries = -1, 0, 0
    for i, r in enumerate(records):
        inner = r.codec.get("inner", r.encoding) if r.encoding in ("zstd", "nvcomp") else r.encoding
        if inner not in ("coo", "sparse") or r.numel > SMALL_TENSOR:
            out.append(None)
            continue
        joins = i and out[-1] == run and logical[i] == logical[i - 1]
        if not (joins and size + r.numel <= SMALL_RUN and entries + r.nnz <= SMALL_RUN_ENTRIES):
            run, size, entries = run + 1, 0, 0
        out.append(run)
        size += r.numel
        entries += r.nnz
    return out


class _Outputs:
    """Every tensor's flat output: views of one allocation per storage dtype in record order, on a device (the
    allocator pools them) and onto a base (every element written); for a delta on the host, one zeroed allocation
    per run of small tensors and one per other tensor (the C allocator recycles those, where one zeroed allocation
    of the whole output, written sparsely, paid fresh pages on every call: 5.1M parameters in 28 tensors, top-1%,
    took 27-46 ms to decompress instead of 7 ms).
    An allocation is made when its first output is asked for, after that tensor's entries are checked (a payload
    that fails its first check allocates nothing). Zeros where outputs are deltas (a sparse tensor's other
    elements stay 0); onto a base every element is written."""

    def __init__(self, records: list[TensorRecord], logical: list[str], runs: list, onto: bool, backend: Any):
        storage = [dtypes.storage_dtype(lg) for lg in logical]
        if backend.on_device or onto:
            self._key = storage
        else:
            self._key = [("tensor", i) if g is None else ("run", g) for i, g in enumerate(runs)]
        self._dtype = dict(zip(self._key, storage))
        self.numels = [r.numel for r in records]
        self.starts: list[int] = []
        self._sizes: dict = {}
        for n, key in zip(self.numels, self._key):
            self.starts.append(self._sizes.get(key, 0))
            self._sizes[key] = self.starts[-1] + n
        self._alloc = backend.xp.empty if onto else backend.xp.zeros
        self._flats: dict = {}

    def flat(self, i: int) -> Any:
        """The allocation that holds tensor i's output."""
        key = self._key[i]
        if key not in self._flats:
            self._flats[key] = self._alloc(self._sizes[key], dtype=self._dtype[key])
        return self._flats[key]

    def __getitem__(self, i: int) -> Any:
        return self.flat(i)[self.starts[i] : self.starts[i] + self.numels[i]]


def _decode_all(
    pipe: Any,
    records: list,
    bases: list,
    logical: list,
    runs: list,
    outs: _Outputs,
    backend: Any,
    bounds: Any,
    defer: bool,
) -> bool:
    """Every record decoded into ``outs``, streamed (see :func:`decompress`). ``defer``: no check is read until the
    end (:class:`DeviceChecks`); False where one failed or the decoders refused the payload. Without it, the first
    failed check raises its error."""
    checks = DeviceChecks(backend.xp) if defer else None
    run: list = []  # (position, decoded) of the tensors of one run, adjacent in their buffer

    def one(i: int, d: Any) -> None:
        if checks is not None:
            _decode_one_deferred(d, bases[i], backend, bounds, lambda: outs[i], checks)
        else:
            _decode_one(d, bases[i], backend, bounds, lambda: outs[i])

    def flush() -> None:
        first, last = run[0][0], run[-1][0]
        offsets = outs.starts[first : last + 1] + [outs.starts[last] + outs.numels[last]]
        ds = [d for _, d in run]
        if len(run) == 1 or not _decode_run(
            ds, lambda: outs.flat(first), offsets, bases[first : last + 1], logical[first], backend, checks
        ):
            for i, d in run:  # one by one (one alone; a bad run: the error names the tensor)
                one(i, d)
        run.clear()

    try:
        for i, d in enumerate(pipe.decode_stream(records, backend)):
            if run and runs[i] != runs[run[-1][0]]:
                flush()
            if runs[i] is not None:
                run.append((i, d))
            else:
                one(i, d)
        if run:
            flush()
    except PayloadError:
        if checks is None:
            raise
        return False  # (the second pass raises it, or an error of an earlier tensor)
    return checks is None or checks.passed()


def decompress(
    payload: Payload | bytes | bytearray | memoryview,
    base: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
    max_elements: int | None = None,
) -> dict[str, Any]:
    """Rebuild dense tensors from a payload (bytes or :class:`Payload`).

    Parameters
    ----------
    payload
        The bytes :meth:`Payload.to_bytes` wrote (treated as hostile), or a :class:`Payload`.
    base
        Mapping name -> array with exactly the payload's names, shapes and dtypes. With it the result is
        ``base + delta`` per tensor, rounded to the base's dtype, as the base's kind on its device; the base itself
        is never written. Without it, the dense delta (fp32, fp64 for fp64 tensors).
    like
        Kind of the result without a base: ``'numpy'`` (default), ``'cupy'`` or ``'torch'``.
    max_output_bytes
        Cap on the bytes of dense output the payload declares (the sum over its tensors of elements x output
        itemsize: the base's dtype with a base, fp32/fp64 without), checked before anything is decompressed or
        allocated. Default 4 GiB; ``None`` removes the cap.
    max_elements
        Deprecated (a cap on elements, which ignored the dtype): use ``max_output_bytes``.

    Returns
    -------
    dict
        name -> dense tensor, in the payload's order.

    Raises
    ------
    PayloadError
        A subclass naming the tensor and the problem: a malformed payload, an output over the cap
        (``PayloadLimitError``), an index out of range or not increasing or a non-finite value
        (``PayloadIndexError``), a sum with the base that is not finite in its dtype (``PayloadValueError``), a
        base other than the one whose fingerprint the payload records (``BaseMismatchError``).
        Nothing is returned and the base is unchanged.

    Notes
    -----
    Decoding streams: one tensor is decoded, checked and written into its output before the next is decoded,
    and a dense tensor a slice at a time, so peak memory stays near the output's size (the payload itself
    aside). Every header count and offset is checked when the payload is parsed; a tensor's indices are checked
    before its output is allocated; values are checked as they are written. On a GPU the checks of the entries
    stay on the device and are read back once, at the end (the scatter refuses an entry out of range as it
    writes); where one failed, the decode runs again reading each check as it is made, and raises its error.

    >>> import numpy as np, gpu_codec
    >>> blob = gpu_codec.compress({"w": np.ones((1000, 1000), np.float32)}, fraction=0.001).to_bytes()
    >>> decompress(blob, max_output_bytes=1 << 20)
    Traceback (most recent call last):
    ...
    gpu_codec.errors.PayloadLimitError: payload declares 4000000 bytes of dense output (1 tensors), over ...
    >>> int(np.count_nonzero(decompress(blob)["w"]))
    1000
    """
    if max_elements is not None:
        warnings.warn(
            "decompress(max_elements=...) is deprecated: use max_output_bytes, which counts bytes and applies "
            "with or without a base",
            DeprecationWarning,
            stacklevel=2,
        )
    cap = max_output_bytes
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
        raise InvalidInputError(f"max_output_bytes must be a non-negative integer or None, got {max_output_bytes!r}")
    if not isinstance(payload, Payload):
        payload = Payload.from_bytes(payload)
    records = payload.tensors
    names = [r.name for r in records]
    base_tensors = None
    if base is not None:
        base = _as_mapping(base, "base")
        missing = [n for n in names if n not in base]
        known = set(names)
        extra = [n for n in base if n not in known]
        if missing or extra:
            raise InvalidInputError(
                f"payload and base name different tensors: missing from base {missing[:5]}, not in payload {extra[:5]}"
            )
        base_tensors = []
        for r in records:
            b = to_tensor(base[r.name], r.name)
            if b.shape != tuple(r.shape) or b.dtype != r.dtype:
                raise InvalidInputError(
                    f"tensor {r.name!r}: base is {b.dtype}{list(b.shape)}, the payload holds {r.dtype}{list(r.shape)}"
                )
            base_tensors.append(b)
    kind, device = _output_kind(like, base_tensors)
    check_output_cap(records, base_tensors is not None, max_output_bytes, max_elements)
    pipe = decoder_for(payload.pipeline)
    backend = get_backend()
    bounds = DECODE_CHUNK_DEVICE if backend.on_device else DECODE_CHUNK
    logical = [r.dtype if base_tensors is not None else dtypes.value_dtype(r.dtype) for r in records]
    runs = _runs(records, logical)
    outs = _Outputs(records, logical, runs, base_tensors is not None, backend)
    bases = base_tensors if base_tensors is not None else [None] * len(records)
    with backend.stream(base_tensors or []):
        if base_tensors is not None and payload.base_fingerprint is not None:
            check_base(
                payload.base_fingerprint, [(r.name, r.dtype, b.data) for r, b in zip(records, base_tensors)], backend
            )
        # on a device, a first pass reads its checks back once, at the end; where one failed, the decode runs again
        # reading each check as it is made, which raises the error that names the tensor
        if not (backend.on_device and _decode_all(pipe, records, bases, logical, runs, outs, backend, bounds, True)):
            if backend.on_device:
                outs = _Outputs(records, logical, runs, base_tensors is not None, backend)
            _decode_all(pipe, records, bases, logical, runs, outs, backend, bounds, False)
    result = {}
    for i, r in enumerate(records):
        out = outs[i]
        logical = r.dtype if base_tensors is not None else dtypes.value_dtype(r.dtype)
        dev = base_tensors[i].device if base_tensors is not None else device
        result[r.name] = from_backend(out, logical, tuple(r.shape), kind, dev)
    return result


__all__ = ["Payload", "array_kind", "compress", "decompress", "kept_count"]
