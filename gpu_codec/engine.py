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

import math
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from . import dtypes
from .arrays import Tensor, array_kind, from_backend, to_tensor
from .backends import Backend, get_backend
from .codecs import SCOPES, as_pipeline, check_fraction, decode_records, wire_layouts
from .constants import SCATTER_ADD, SCATTER_ZEROS
from .errors import InvalidInputError, PayloadIndexError, PayloadLimitError
from .format import TensorRecord, header_size, pack, packed_size, unpack

DEFAULT_MAX_ELEMENTS = 1 << 31

ScoreFn = Callable[[Mapping[str, Any], Mapping[str, Any] | None], Mapping[str, Any]]


def kept_count(fraction: float, n: int) -> int:
    """k = ceil(fraction x n), computed on the decimal value the user wrote (0.01 x 100 is 1, not 2).

    >>> kept_count(0.01, 100), kept_count(0.01, 101), kept_count(1.0, 7), kept_count(0.5, 0)
    (1, 2, 7, 0)
    """
    return min(n, math.ceil(Fraction(repr(float(fraction))) * n))


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
    for n in names:
        if not isinstance(n, str) or not n:
            raise InvalidInputError(f"tensor names must be non-empty strings, got {n!r}")
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

    def to_bytes(self, version: int | None = None) -> bytes:
        """Serialize: wire format v2 (``version=None`` or 2; v1 for records v2 cannot describe, which no
        built-in codec makes), or v1 on request (``version=1``, for readers that predate v2). On the GPU path
        this is the one device-to-host copy.

        >>> import numpy as np, gpu_codec
        >>> p = gpu_codec.compress({"w": np.arange(100, dtype=np.float32)}, fraction=0.05)
        >>> blob = p.to_bytes()
        >>> blob[:8], blob[8], len(blob) == p.nbytes, len(p.to_bytes(version=1)) > len(blob)
        (b'GPUCODEC', 2, True, True)
        """
        return pack(
            self.tensors,
            pipeline=self.pipeline,
            metadata=self.metadata,
            layouts=wire_layouts(),
            version=version,
            cache=self._wire_cache,
        )

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> Payload:
        """Parse and validate a payload of either format version (hostile input is rejected with a
        PayloadError)."""
        header, records = unpack(blob, wire_layouts())
        p = cls(records, header.get("pipeline", []), header.get("metadata", {}), backend="cpu")
        p.version = int(header["version"])
        return p

    @property
    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes`, computed without copying anything off the device."""
        return packed_size(self.tensors, self.pipeline, self.metadata, wire_layouts(), cache=self._wire_cache)

    @property
    def header_nbytes(self) -> int:
        """Bytes of :meth:`to_bytes` that are neither buffer data nor checksum: the prefix, the tensor table
        and the metadata (no device copy).

        >>> import numpy as np, gpu_codec
        >>> u = {f"layer{i}.weight": np.ones(1000, np.float32) * i for i in range(1, 11)}
        >>> gpu_codec.compress(u, fraction=0.01).header_nbytes / len(u) < 16
        True
        """
        return header_size(self.tensors, self.pipeline, self.metadata, wire_layouts(), cache=self._wire_cache)

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
) -> Payload:
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

    Returns
    -------
    Payload
        Kept entries per tensor: ``indices`` (flat, ascending, uint32 where the tensor allows) and ``values``
        (the delta in fp32, fp64 for fp64 tensors). A kept value of exactly 0.0 is kept.

    >>> import numpy as np
    >>> p = compress({"a": np.array([1., -4., 2.], np.float32), "b": np.array([4., 0.5], np.float32)},
    ...              fraction=0.4)                        # k = ceil(0.4 x 5) = 2, tie at 4.0: "a" comes first
    >>> [(r.name, r.buffers["indices"].tolist()) for r in p.tensors]
    [('a', [1]), ('b', [0])]
    """
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
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    names, news, bases = _check_tensors(update, base)
    backend = get_backend()
    nt = len(news)
    dtype_codes = [dtypes.code(t.dtype) for t in news]
    with backend.stream(news + bases):
        new_arrays = [backend.asarray(t.data) for t in news]
        base_arrays = [backend.asarray(b.data) if b is not None else None for b in bases]
        if crit == dtypes.CRIT_EXTERNAL:
            ext, ext_dt = _external_scores(score, update, base, names, news, backend)
        else:
            ext, ext_dt = [None] * nt, [0] * nt
        res_in, res_out, qmode = [None] * nt, [None] * nt, 0
        if residual is not None:
            res_in, res_out, qmode = residual._bind(names, news, backend)
        if dense:  # every entry of every tensor, in one pass (no keys, no selection)
            if qmode != 0:
                raise AssertionError("dense mode sends every value exactly; the codecs round and fix the residual")
            values, bad = backend.dense_delta(new_arrays, base_arrays, res_in, res_out, dtype_codes, ext, ext_dt, crit)
            indices = [None] * nt
        else:
            segments, ks = _segments([t.numel for t in news], fraction, scope)
            indices, values, bad = backend.topk_select(
                new_arrays, base_arrays, res_in, res_out, dtype_codes, ext, ext_dt, crit, segments, ks, qmode
            )
        if bad is not None:
            raise InvalidInputError(
                f"tensor {names[bad]!r}: the update, its delta against base or its score holds "
                "a non-finite value (inf or NaN)"
            )
        if residual is not None:
            residual._commit(res_out)
    records = []
    for n, t, idx, val in zip(names, news, indices, values):
        if dense:
            records.append(TensorRecord(n, t.dtype, t.shape, "dense", t.numel, {"values": val}))
            continue
        records.append(TensorRecord(n, t.dtype, t.shape, "coo", int(idx.size), {"indices": idx, "values": val}))
    pipeline_cfg = [] if dense else [{"id": "topk", "fraction": fraction, "scope": scope, "score": score_name}]
    # value, index and lossless stages, on the backend; they fix the kept residuals
    with backend.stream(news + bases):
        records = pipe.encode(records, backend, res_out if residual is not None else None)
    pipeline_cfg += pipe.after_topk()
    return Payload(records, pipeline_cfg, dict(metadata or {}), backend=backend.name)


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
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping, got {type(metadata).__name__}")
    pipe = as_pipeline(pipeline)
    if pipe.topk is not None:
        raise InvalidInputError("encode_coo encodes given entries: leave the topk stage out of its pipeline")
    backend = get_backend()
    xp = backend.xp
    records = []
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
        numel = math.prod(shape)
        idx = backend.asarray(to_tensor(e.indices, name).data).reshape(-1)
        val = backend.asarray(to_tensor(e.values, name).data).reshape(-1)
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
        val = val.astype(dtypes.value_dtype(e.dtype), copy=False)
        records.append(TensorRecord(name, e.dtype, shape, "coo", int(idx.size), {"indices": idx, "values": val}))
    with backend.stream([]):
        records = pipe.encode(records, backend, None)
    head = [dict(selection)] if selection is not None else []
    return Payload(records, head + pipe.after_topk(), dict(metadata or {}), backend=backend.name)


def _output_kind(like: str | None, base_tensors: list[Tensor] | None) -> tuple[str, Any]:
    if base_tensors:
        return base_tensors[0].kind, base_tensors[0].device
    if like is None:
        return "numpy", None
    if like not in ("numpy", "cupy", "torch"):
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
    return like, None


def decoded_records(payload: Payload, backend: Backend) -> list[TensorRecord]:
    """The payload's records decoded by its own pipeline to ``coo``/``dense`` buffers on ``backend`` (quantized
    values, coded indices, lossless stages), as :func:`decompress` and :mod:`gpu_codec.aggregate` take them.
    Indices and values are not checked here: the caller checks them before use."""
    return decode_records(payload.pipeline, payload.tensors, backend)


def decompress(
    payload: Payload | bytes | bytearray | memoryview,
    base: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> dict[str, Any]:
    """Rebuild dense tensors from a payload (bytes or :class:`Payload`).

    With ``base``: ``base + delta`` per tensor, rounded to the base's dtype, returned as the base's kind on its
    device. Without: the dense delta (fp32, fp64 for fp64 tensors) as NumPy, or as ``like`` ('numpy', 'cupy',
    'torch'). ``max_elements`` caps the dense elements a payload may ask for when there is no base to check it
    against. Indices are checked on the device (or by the NumPy twin) before use; a bad payload raises a
    :class:`~gpu_codec.errors.PayloadError` and returns nothing.
    """
    if not isinstance(payload, Payload):
        payload = Payload.from_bytes(payload)
    records = payload.tensors
    names = [r.name for r in records]
    backend = get_backend()
    base_tensors = None
    if base is not None:
        base = _as_mapping(base, "base")
        missing = [n for n in names if n not in base]
        extra = [n for n in base if n not in set(names)]
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
    else:
        total = sum(r.numel for r in records)
        if total > max_elements:
            raise PayloadLimitError(f"payload asks for {total} dense elements, over max_elements={max_elements}")
    kind, device = _output_kind(like, base_tensors)
    outs, out_dtypes, idx_list, val_list = [], [], [], []
    # one device, one stream and one allocator for the decode and the scatter (the GPU backend syncs on exit)
    with backend.stream(base_tensors or []):
        records = decoded_records(payload, backend)
        mode = SCATTER_ADD if base_tensors is not None else SCATTER_ZEROS
        bases = [backend.asarray(b.data) for b in base_tensors] if base_tensors is not None else [None] * len(records)
        for r in records:
            out_dtypes.append(dtypes.code(r.dtype if base_tensors is not None else dtypes.value_dtype(r.dtype)))
            val_list.append(backend.asarray(r.buffers["values"]))
        if records and all(r.encoding == "dense" for r in records):
            # every element is sent: one pass reads base and values where they lie and writes the output
            for r in records:
                logical = r.dtype if base_tensors is not None else dtypes.value_dtype(r.dtype)
                outs.append(backend.xp.empty(r.numel, dtype=dtypes.storage_dtype(logical)))
            counts = [r.numel for r in records]
            bad = backend.dense_apply(outs, out_dtypes, bases, val_list, mode)
        else:
            for i, r in enumerate(records):
                if base_tensors is not None:
                    outs.append(bases[i].copy())
                else:
                    outs.append(backend.xp.zeros(r.numel, dtype=np.dtype(dtypes.value_dtype(r.dtype))))
                if r.encoding == "dense":
                    idx_list.append(backend.xp.arange(r.numel, dtype=dtypes.index_dtype(r.numel)))
                else:
                    idx_list.append(backend.asarray(r.buffers["indices"]))
            counts = [int(idx.size) for idx in idx_list]
            bad = backend.scatter(outs, out_dtypes, [r.numel for r in records], idx_list, val_list, mode)
    if bad is not None:
        a = 0
        for r, c in zip(records, counts):
            if bad < a + c:
                raise PayloadIndexError(
                    f"tensor {r.name!r}: sparse index at entry {bad - a} is out of range, "
                    "repeated or not increasing, or its value is not finite; nothing was decoded"
                )
            a += c
        raise PayloadIndexError("a sparse index is out of range, repeated or not increasing, or a value is not finite")
    result = {}
    for i, (r, out) in enumerate(zip(records, outs)):
        logical = r.dtype if base_tensors is not None else dtypes.value_dtype(r.dtype)
        dev = base_tensors[i].device if base_tensors is not None else device
        result[r.name] = from_backend(out, logical, tuple(r.shape), kind, dev)
    return result


__all__ = ["Payload", "array_kind", "compress", "decompress", "kept_count"]
