"""Decompression: a payload back to dense tensors, alone or onto a base (:func:`decompress`), and the pieces the
aggregator shares (the output cap, the decoded records, the device checks, the entries decoded per step).

>>> import numpy as np, gpu_codec
>>> blob = gpu_codec.compress({"w": np.array([0, 3, 0, -5], np.float32)}, fraction=0.5).to_bytes()
>>> gpu_codec.decompress(blob)["w"].tolist()
[0.0, 3.0, 0.0, -5.0]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from itertools import accumulate, pairwise, repeat
from operator import attrgetter, mul, sub
from typing import Any, NamedTuple

import numpy as np

from . import dtypes
from .arrays import Tensor, TensorTable, from_backend, is_device_array, tensor_table, to_tensor
from .backends import Backend, get_backend, require_cupy
from .codecs import decoder_for, inner_encoding
from .collector import holds_collector
from .constants import U64_MAX, ScatterMode
from .errors import InvalidInputError, PayloadError, PayloadIndexError, PayloadLimitError, PayloadValueError
from .format import (
    TensorRecord,
)
from .format.common import Ranges, RecordTable, SegmentBuffers, Segmented, record_column, record_columns
from .format.fingerprint import check_base
from .payload import Payload, as_mapping, in_order, payload_records
from .xp.finite import all_finite, some_nonfinite

# a record's fields, read for every record by one C call (a list comprehension reads each in Python)
_ENCODING, _BUFFERS = attrgetter("encoding"), attrgetter("buffers")

MANY_RECORDS = 16  # a payload of at least this many records has its runs found, and taken, a run at a time
DEFAULT_MAX_OUTPUT_BYTES = 4 << 30  # decompress's cap on the dense output a payload may declare
# Entries written per scatter: a 256th of the tensor, within these bounds, so the temporaries of a chunk (about
# 40 bytes per entry on the host) stay a small share of the output; on the GPU a launch has a fixed cost.
DECODE_CHUNK = (1 << 14, 1 << 20)
DECODE_CHUNK_DEVICE = (1 << 20, 1 << 24)


def _output_kind(like: str | None, base_tensors: TensorTable | None) -> tuple[str, Any]:
    if base_tensors:
        return base_tensors.kinds[0], base_tensors.devices[0]
    if like is None:
        return "numpy", None
    if like not in ("numpy", "cupy", "torch"):
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
    if like == "cupy":
        require_cupy("like='cupy'")
    return like, None


def _output_bytes(logical: list[str], numels: list[int]) -> int:
    """Bytes of the dense outputs of tensors of these logical dtypes and element counts."""
    size = {lg: dtypes.storage_dtype(lg).itemsize for lg in set(logical)}
    return sum(map(mul, numels, map(size.__getitem__, logical)))


def check_output_cap(
    records: list[TensorRecord],
    with_base: bool,
    max_output_bytes: Any,
    max_elements: Any = None,
    numels: list[int] | None = None,
    logical: list[str] | None = None,
) -> None:
    """Refuse (``PayloadLimitError``) a payload whose declared dense output is over the cap, before anything is
    decompressed or allocated: :func:`decompress`'s check, shared with :mod:`gpu_codec.aggregate` (``numels``: the
    records' element counts, and ``logical``: their outputs' dtypes, each record's dtype with a base and its value
    dtype without, where the caller has them)."""
    numels = [r.numel for r in records] if numels is None else numels
    if max_elements is not None:
        total = sum(numels)
        if total > max_elements:
            raise PayloadLimitError(f"payload asks for {total} dense elements, over max_elements={max_elements}")
    if max_output_bytes is None:
        return
    if logical is None:
        logical = [r.dtype if with_base else dtypes.value_dtype(r.dtype) for r in records]
    declared = _output_bytes(logical, numels)
    if declared > max_output_bytes:
        raise PayloadLimitError(
            f"payload declares {declared} bytes of dense output ({len(records)} tensors), over "
            f"max_output_bytes={max_output_bytes}; pass a larger cap (or None) to accept it"
        )


def chunk_entries(nnz: int, bounds: tuple[int, int]) -> int:
    return min(bounds[1], max(bounds[0], nnz // 256))


def _check_indices(d: Any, numel: int, xp: Any, chunk: int) -> None:
    """Every index of a sparse tensor in range and strictly ascending, before its output exists."""
    last = -1
    for a in range(0, d.nnz, chunk):
        b = min(a + chunk, d.nnz)
        i = d.indices(a, b)
        _check_count(d, a, b, i, "indices")
        first, end = int(i[0]), int(i[-1])
        ok = first > last and end < numel and (i.size < 2 or bool(xp.all(i[1:] > i[:-1])))
        if not ok:
            raise PayloadIndexError(
                f"tensor {d.name!r}: a sparse index in entries [{a}, {a + int(i.size)}) is out of range [0, {numel}), "
                "repeated or not increasing; nothing was decoded"
            )
        last = end


def _check_count(d: Any, a: int, b: int, x: Any, what: str) -> None:
    """Entries ``[a, b)`` of tensor ``d`` decoded to as many ``what`` (a record's buffer shorter or longer than its
    nnz, in a payload made by hand, decodes to another count)."""
    if x.size != b - a:
        raise PayloadIndexError(f"tensor {d.name!r}: entries [{a}, {b}) decode to {x.size} {what}")


def _decode_one(d: Any, base: Any, backend: Any, bounds: tuple[int, int], out_of: Any) -> Any:
    """One tensor's dense output into ``out_of()`` (its slice of the decode's one allocation, zeros without a base,
    asked for once the indices are checked; the base, its tensor's flat data or None, is copied, never written),
    filled a chunk at a time; onto a base, each chunk of entries copies the base up to its last index and adds them
    (``scatter_onto``)."""
    xp = backend.xp
    numel = d.numel
    chunk = chunk_entries(d.nnz, bounds)
    if d.indices is not None:
        _check_indices(d, numel, xp, chunk)
    logical = d.dtype if base is not None else dtypes.value_dtype(d.dtype)
    mode = ScatterMode.ADD if base is not None else ScatterMode.ZEROS
    code = dtypes.code(logical)
    dense = d.indices is None
    base_arr = backend.asarray(base) if base is not None else None
    onto = not dense and base_arr is not None
    out = out_of()
    copied = 0  # onto a base: elements [0, copied) of out are written
    step = max(d.step, chunk // d.step * d.step)
    for a in range(0, d.nnz, step):
        b = min(a + step, d.nnz)
        vals = d.values(a, b)
        _check_count(d, a, b, vals, "values")
        finite = True
        if dense:
            idx = None
            part = None if base_arr is None else base_arr[a:b]
            bad = backend.dense_apply([out[a:b]], [code], [part], [vals], mode)
            finite = bad is not None or mode != ScatterMode.ADD or all_finite(out[a:b], code, xp)
        elif onto:
            idx = d.indices(a, b)  # checked ascending and in range: the last chunk copies the base to its end
            stop = numel if b == d.nnz else int(idx[-1]) + 1
            bad, finite = backend.scatter_onto(out, base_arr, copied, stop, code, numel, idx, vals)
            copied = stop
        else:
            idx = d.indices(a, b)
            bad = backend.scatter([out], [code], [numel], [idx], [vals], mode)
        if bad is not None:
            if dense:  # (no indices: only a value can be bad)
                raise PayloadIndexError(
                    f"tensor {d.name!r}: dense value at entry {a + bad} is not finite; nothing was decoded"
                )
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


def _decode_one_deferred(d: Any, base: Any, backend: Any, bounds: tuple[int, int], out_of: Any, checks: Any):
    """:func:`_decode_one` with no host wait: the checks it reads are left in ``checks`` (a failed one: the caller
    decodes again with :func:`_decode_one`, which raises the error). Onto a base, the base is copied whole and the
    entries added: the same bytes as :meth:`~gpu_codec.backends.base.Backend.scatter_onto` on a kernel backend."""
    xp = backend.xp
    numel = d.numel
    logical = d.dtype if base is not None else dtypes.value_dtype(d.dtype)
    mode = ScatterMode.ADD if base is not None else ScatterMode.ZEROS
    code = dtypes.code(logical)
    base_arr = backend.asarray(base) if base is not None else None
    out = out_of()
    step = max(d.step, chunk_entries(d.nnz, bounds) // d.step * d.step)
    if d.indices is None:
        for a in range(0, d.nnz, step):
            b = min(a + step, d.nnz)
            part = None if base_arr is None else base_arr[a:b]
            vals = d.values(a, b)
            _check_count(d, a, b, vals, "values")  # (sizes: known on the host, no wait)
            checks.word(backend.dense_apply([out[a:b]], [code], [part], [vals], mode, defer=True))
            if mode == ScatterMode.ADD:
                checks.flag(some_nonfinite(out[a:b], code, xp))
        return
    if base_arr is not None:
        out[...] = base_arr
    last = None
    for a in range(0, d.nnz, step):
        b = min(a + step, d.nnz)
        idx, vals = d.indices(a, b), d.values(a, b)
        _check_count(d, a, b, idx, "indices")
        _check_count(d, a, b, vals, "values")
        checks.word(backend.scatter([out], [code], [numel], [idx], [vals], mode, defer=True))
        if last is not None:  # each chunk's entries after the last chunk's (the scatter checks within a chunk)
            checks.flag(idx[0] <= last)
        last = idx[-1]
        if mode == ScatterMode.ADD:  # (an index out of range is clamped here: the scatter's word reports it)
            checks.flag(some_nonfinite(out[xp.minimum(idx, max(numel - 1, 0))], code, xp))


SMALL_TENSOR = 1 << 18  # sparse tensors of at most this many elements are decoded in runs, a few calls a run
SMALL_RUN = 1 << 20  # elements of output a run covers at the most
SMALL_RUN_ENTRIES = 1 << 14  # ... and entries (its temporaries, about 20 bytes an entry, stay near 320 KiB)


def entries_ok(gi: Any, counts: np.ndarray, numels: np.ndarray, xp: Any, host: Any) -> Any:
    """Whether joined indices of adjacent tensors (``counts`` entries each, tensor j's counted in its own
    ``numels[j]`` elements) are each inside its tensor and above the one before it in the tensor: a 0-d flag where
    ``gi`` lies (``host`` takes the small host tables there). The one check of a run or batch of joined entries.

    >>> bool(entries_ok(np.array([1, 4, 0, 2]), np.array([2, 0, 2]), np.array([5, 3, 3]), np, np.asarray))
    True
    >>> bool(entries_ok(np.array([1, 4, 2, 0]), np.array([2, 0, 2]), np.array([5, 3, 3]), np, np.asarray))
    False
    """
    ends = np.cumsum(counts)
    some = np.flatnonzero(counts > 0)
    last = gi[host(ends[some] - 1)]  # ascending within each tensor: its last entry is its largest
    step = gi[1:] > gi[:-1]
    firsts = ends[:-1] - 1  # where a tensor's first entry follows the last one's
    step[host(firsts[(firsts >= 0) & (firsts < step.size)])] = True
    return xp.all(last < host(numels[some])) & xp.all(step)


def join_run(run: list, offsets: list[int], backend: Any) -> tuple[Any, Any, list[int], Any] | None:
    """The entries of a run of small sparse tensors (``offsets``: each one's start in a span, then the span's end)
    joined: (each entry's place in the span, counted from ``offsets[0]``; the values; each tensor's entry count; a
    0-d flag on the device, true where every index is in range and ascending within its tensor), or None where the
    run has no entry. Plain COO entries read from bytes are joined on the host and copied to the device at once;
    decoded ones (coded, or a payload's own device buffers) are joined where they are."""
    joined = all(d.host is not None for d in run)
    idx = [d.host[0][: d.nnz] if joined else d.indices(0, d.nnz) for d in run]
    vals = [d.host[1][: d.nnz] if joined else d.values(0, d.nnz) for d in run]
    return join_entries(idx, vals, [d.numel for d in run], offsets, backend, joined)


def join_entries(
    idx: list, vals: list, numels: list[int], offsets: list[int], backend: Any, on_host: bool
) -> tuple[Any, Any, list[int], Any] | None:
    """:func:`join_run` of the tensors' index and value arrays (host arrays where ``on_host``, joined there and
    copied to the device at once; else the backend's), ``numels`` elements each."""
    counts = [int(i.size) for i in idx]
    if not sum(counts):
        return None
    o0, o1 = offsets[0], offsets[-1]
    # (a payload may give a small tensor 64-bit indices; a span past 2^32 elements needs them)
    wide = any(i.dtype.itemsize > 4 for i in idx) or dtypes.index_dtype(o1 - o0).itemsize > 4
    join = np.concatenate if on_host else backend.xp.concatenate
    gi = join([i.astype(np.int64 if wide else np.uint32, copy=False) for i in idx])
    return _joined(gi, join(vals), counts, numels, offsets, backend, on_host, wide)


def _joined(
    gi: Any,
    vals: Any,
    counts: list[int],
    numels: list[int],
    offsets: list[int],
    backend: Any,
    host_side: bool,
    wide: bool,
) -> tuple[Any, Any, list[int], Any]:
    """:func:`join_entries`' result from the joined indices ``gi`` (each counted in its own tensor; int64 where
    ``wide``, a fresh array) and values: copied to the device where ``host_side``, checked, and shifted to their
    tensors' places in the span."""
    xp = backend.xp
    host = xp.asarray if backend.on_device else np.asarray  # small host tables, where the entries are
    o0, o1 = offsets[0], offsets[-1]
    if host_side:
        gi, vals = backend.asarray(gi), backend.asarray(vals)
    ok = entries_ok(gi, np.asarray(counts), np.asarray(numels, np.int64), xp, host)
    if wide:
        ok = ok & xp.all(gi >= 0)
    gi += host(np.repeat(np.asarray(offsets[:-1], np.int64) - o0, counts).astype(gi.dtype))
    return gi.astype(dtypes.index_dtype(o1 - o0), copy=False), vals, counts, ok


def apply_run(gi: Any, vals: Any, span: Any, bases: list, logical: str, backend: Any, checks: Any = None) -> bool:
    """A run's joined entries (:func:`join_run`) written (or added onto its bases, copied in first) into ``span``,
    the run's outputs end to end, in one scatter. False where a value is not finite or a sum with the base is not;
    with ``checks`` (:class:`DeviceChecks`) nothing is read back: the checks are left there, and the result is
    True."""
    xp = backend.xp
    n = int(span.size)
    code = dtypes.code(logical)
    if bases[0] is not None:  # (a run is all onto a base, or none of it)
        backend.gather_copy(span, backend.asarrays(bases))
    if gi is None:
        return True
    mode = ScatterMode.ADD if bases[0] is not None else ScatterMode.ZEROS
    if checks is not None:
        checks.word(backend.scatter([span], [code], [n], [gi], [vals], mode, defer=True))
        if mode == ScatterMode.ADD and n:  # (an index out of range is clamped: the checks above report it)
            checks.flag(some_nonfinite(span[xp.minimum(gi, n - 1)], code, xp))
        return True
    if backend.scatter([span], [code], [n], [gi], [vals], mode) is not None:
        return False  # a value is not finite
    return mode != ScatterMode.ADD or all_finite(span[gi], code, xp)


def _decode_run(
    run: list, flat_of: Any, offsets: list[int], bases: list, logical: str, backend: Any, checks: Any = None
) -> bool:
    """A run of small sparse tensors, adjacent in the buffer ``flat_of()`` gives (``offsets``: each one's start,
    then the run's end), which is asked for once the entries are checked:
    their bases copied in, then every entry checked and added (or written) in one scatter over the run's span.
    False where an index or value is bad or a sum not finite: the caller then decodes them one by one, which
    raises the error that names the tensor. With ``checks`` (:class:`DeviceChecks`) nothing is read back: the
    checks are left there, and the result is True."""
    joined = join_run(run, offsets, backend)
    return _apply_joined(joined, [d.nnz for d in run], flat_of, offsets, bases, logical, backend, checks)


def _apply_joined(
    joined: Any, nnz: list[int], flat_of: Any, offsets: list[int], bases: list, logical: str, backend: Any, checks: Any
) -> bool:
    """:func:`_decode_run` of a run's joined entries (:func:`join_entries`); False (nothing written) where the
    tensors' entries are not ``nnz`` indices and values each (a buffer of a payload made by hand)."""
    gi = vals = None
    if joined is None:
        if any(nnz):
            return False
    else:
        gi, vals, counts, ok = joined
        if counts != nnz or int(vals.size) != sum(counts):
            return False
        if checks is not None:
            checks.flag(~ok)
        elif not bool(ok):
            return False
    return apply_run(gi, vals, flat_of()[offsets[0] : offsets[-1]], bases, logical, backend, checks)


def joined_values(run: list, backend: Any) -> Any:
    """A run of dense records' values (each a :class:`~gpu_codec.codecs.Decoded` read from bytes, its values
    decoded on the host: ``host_values``) joined there, end to end, and copied to the backend once; None where a
    record has no host values or not one value of its value dtype an element."""
    if any(d.host_values is None for d in run):
        return None
    vals = [d.host_values() for d in run]
    if any(v.ndim != 1 or v.size != d.numel or v.dtype != dtypes.value_dtype(d.dtype) for v, d in zip(vals, run)):
        return None
    return backend.asarray(np.concatenate(vals))


def _dense_run(
    run: list, flat_of: Any, offsets: list[int], bases: list, logical: str, backend: Any, checks: Any = None
) -> bool:
    """A run of small dense tensors read from bytes (``offsets`` as in :func:`_decode_run`): their values decoded
    on the host (``host_values``), joined there and copied to the device once, then written (or added onto their
    bases) by one ``dense_apply`` over the run's outputs. False where a record has no host values or not one
    value of its value dtype an element, or (without ``checks``) a value or a sum is not finite: the caller then
    decodes them one by one, which raises the error that names the tensor."""
    joined = joined_values(run, backend)
    if joined is None:
        return False
    xp, o0 = backend.xp, offsets[0]
    span = flat_of()[o0 : offsets[-1]]
    cuts = list(pairwise(offsets))
    outs = [span[a - o0 : b - o0] for a, b in cuts]
    parts = [joined[a - o0 : b - o0] for a, b in cuts]
    codes = [dtypes.code(logical)] * len(run)
    mode = ScatterMode.ADD if bases[0] is not None else ScatterMode.ZEROS
    srcs = backend.asarrays(bases)
    if checks is not None:
        checks.word(backend.dense_apply(outs, codes, srcs, parts, mode, True))
        if mode == ScatterMode.ADD:
            checks.flag(some_nonfinite(span, codes[0], xp))
        return True
    if backend.dense_apply(outs, codes, srcs, parts, mode) is not None:
        return False  # a value is not finite
    return mode != ScatterMode.ADD or all_finite(span, codes[0], xp)


def decoded_records(payload: Payload, backend: Backend) -> list[TensorRecord]:
    """The payload's records decoded by its own pipeline to ``coo``/``dense`` buffers on ``backend`` (quantized
    values, coded indices, lossless stages), all at once, as :mod:`gpu_codec.aggregate` takes them. Indices and
    values are not checked here: the caller checks them before use (:func:`decompress` streams instead)."""
    return decoder_for(payload.pipeline).decode(payload.tensors, backend)


def _runs(
    records: list[TensorRecord], logical: list[str], numels: list[int], device: bool = False, dense: bool = False
) -> list[int | None]:
    """Each record's run (sparse tensors of one dtype decoded together, see :func:`_decode_run`), or None for a
    tensor decoded alone: small tensors (SMALL_TENSOR elements), at most SMALL_RUN elements and SMALL_RUN_ENTRIES
    entries a run; or on a ``device`` (whose runs are written straight into the outputs' one allocation) sparse
    tensors of any size, at most :func:`batch_entries` of the outputs' bytes in entries a run, so the launches of
    a decode do not grow with its tensor count (a run's temporaries are its entries', as a tensor decoded alone
    streams chunks of them). With ``dense``, small dense tensors too, in runs of their own of at most SMALL_RUN
    elements (see :func:`_dense_run`)."""
    most_numel, most_size = (None, None) if device else (SMALL_TENSOR, SMALL_RUN)
    most_entries = batch_entries(_output_bytes(logical, numels)) if device else SMALL_RUN_ENTRIES
    table = record_columns(records)  # (plain coo records as columns: read as such, no record made)
    nnzs = record_column(records, "nnz")
    all_coo = device and (table is not None or set(map(_ENCODING, records)) == {"coo"})  # (read on a device only)
    if all_coo and len(records) >= MANY_RECORDS and len(set(logical)) == 1:
        return _coo_runs(nnzs, most_entries)
    inners = repeat("coo") if table is not None else map(inner_encoding, records)
    out: list[int | None] = []
    run, size, entries, run_dense = -1, 0, 0, False
    for i, (inner, nnz, numel) in enumerate(zip(inners, nnzs, numels)):
        is_dense = dense and inner in ("dense", "dense_q") and numel <= SMALL_TENSOR
        if not is_dense and (inner not in ("coo", "sparse") or (most_numel is not None and numel > most_numel)):
            out.append(None)
            continue
        joins = i and out[-1] == run and logical[i] == logical[i - 1] and run_dense == is_dense
        if is_dense:
            fits = size + numel <= SMALL_RUN
        else:
            fits = entries + nnz <= most_entries and (most_size is None or size + numel <= most_size)
        if not (joins and fits):
            run, size, entries, run_dense = run + 1, 0, 0, is_dense
        out.append(run)
        size += numel
        entries += nnz
    return out


def _coo_runs(nnz: list[int], most_entries: int) -> list[int]:
    """:func:`_runs` on a device of ``coo`` records of one dtype (every one in a run; a run ends where the next
    record's entries would take it past ``most_entries``), found a run at a time, not a record at a time.

    >>> _coo_runs([3, 4, 0, 9, 1, 1], 8)
    [0, 0, 0, 1, 2, 2]
    """
    ends = np.cumsum(nnz)  # entries up to and including each record
    lengths, first = [], 0
    while first < len(nnz):
        before = int(ends[first - 1]) if first else 0
        end = max(first + 1, int(np.searchsorted(ends, before + most_entries, side="right")))
        lengths.append(end - first)
        first = end
    return np.repeat(np.arange(len(lengths)), lengths).tolist()


class _Outputs:
    """Every tensor's flat output: on a device and onto a base, views of one allocation (one region per storage
    dtype, in record order; on a device the allocator pools it; onto a base every element is written); for a delta
    on the host, one zeroed allocation per run of small tensors and one per other tensor (the C allocator recycles
    those, where one zeroed allocation of the whole output, written sparsely, paid fresh pages on every call: 5.1M
    parameters in 28 tensors, top-1%, took 27-46 ms to decompress instead of 7 ms).
    An allocation is made when its first output is asked for, after that tensor's entries are checked (a payload
    that fails its first check allocates nothing). Zeros where outputs are deltas (a sparse tensor's other
    elements stay 0); onto a base every element is written."""

    def __init__(
        self,
        records: list[TensorRecord],
        logical: list[str],
        runs: list,
        onto: bool,
        backend: Any,
        numels: list[int] | None = None,
    ):
        kinds = {lg: dtypes.storage_dtype(lg) for lg in dict.fromkeys(logical)}
        storage = list(map(kinds.__getitem__, logical))
        self._one = backend.on_device or onto
        self._key = storage if self._one else [("tensor", i) if g is None else ("run", g) for i, g in enumerate(runs)]
        self._dtype = dict(zip(self._key, storage))
        self.numels = [r.numel for r in records] if numels is None else numels
        if len(self._dtype) == 1:  # (one region: each output starts where the one before it ends)
            self.starts = list(accumulate(self.numels[:-1], initial=0)) if records else []
            self._sizes = {self._key[0]: sum(self.numels)} if records else {}
        else:
            self.starts, self._sizes = [], {}
            for n, key in zip(self.numels, self._key):
                self.starts.append(self._sizes.get(key, 0))
                self._sizes[key] = self.starts[-1] + n
        self._alloc = backend.xp.empty if onto else backend.xp.zeros
        self._flats: dict = {}

    @property
    def nbytes(self) -> int:
        """The outputs' bytes."""
        return sum(n * np.dtype(self._dtype[key]).itemsize for key, n in self._sizes.items())

    @property
    def keys(self) -> list:
        """What each tensor's allocation (or region of the one allocation) is known by."""
        return self._key

    def flat(self, i: int) -> Any:
        """The allocation (or region of the one allocation) that holds tensor i's output."""
        key = self._key[i]
        if key not in self._flats:
            if self._one:
                self._allocate()
            else:
                self._flats[key] = self._alloc(self._sizes[key], dtype=self._dtype[key])
        return self._flats[key]

    def _allocate(self) -> None:
        """The one allocation, cut into a region per storage dtype (each starting on a 64-byte boundary)."""
        at, regions = 0, {}
        for key, n in self._sizes.items():
            regions[key] = at
            at += -(-n * np.dtype(self._dtype[key]).itemsize // 64) * 64
        whole = self._alloc(at, dtype=np.uint8)
        for key, n in self._sizes.items():
            dt = np.dtype(self._dtype[key])
            self._flats[key] = whole[regions[key] : regions[key] + n * dt.itemsize].view(dt)

    def __getitem__(self, i: int) -> Any:
        return self.flat(i)[self.starts[i] : self.starts[i] + self.numels[i]]

    def torch_views(self, logical: list[str], devs: list[Any]) -> list[Any] | None:
        """Every tensor's output as a flat torch tensor, in record order, where the outputs are views of one
        allocation going to one device: each region becomes one torch tensor (one DLPack exchange, or one
        ``from_numpy``), cut by one ``torch.split``. None otherwise (the caller converts them one by one)."""
        if not self._one or not self.numels or any(d != devs[0] for d in devs):
            return None
        import torch

        kinds = dict(zip(self._key, logical))
        if len(kinds) != len(set(zip(self._key, logical))):  # (a region of two logical dtypes)
            return None
        members: dict[Any, list[int]] = {}
        for i, key in enumerate(self._key):
            members.setdefault(key, []).append(i)
        out: list[Any] = [None] * len(self.numels)
        for key, idx in members.items():
            flat = self.flat(idx[0])
            whole = from_backend(flat, kinds[key], (int(flat.size),), "torch", devs[0])
            for i, t in zip(idx, torch.split(whole, [self.numels[i] for i in idx])):
                out[i] = t
        return out

    def _single(self) -> bool:
        """Whether the outputs are one region (one storage dtype), each starting where the one before it ends."""
        return len(self._sizes) == 1 and bool(self.numels)

    def _cut(self, region: Any) -> list[Any]:
        """Every tensor's output as a view of ``region``, the one region (:meth:`_single`) or a copy of it."""
        return [region[a : a + n] for a, n in zip(self.starts, self.numels)]

    def host_views(self, backend: Any) -> list[Any]:
        """Every tensor's output as a host array, in record order: each region in device memory copied to the host
        once (one copy a storage dtype, where a copy a tensor would make the host wait for each), then cut."""
        if self._single():  # (one region, the common case: copied, then cut in one comprehension)
            flat = self.flat(0)
            return self._cut(backend.to_host(flat) if is_device_array(flat) else flat)
        hosts: dict[Any, Any] = {}
        out = []
        for i, (a, n) in enumerate(zip(self.starts, self.numels)):
            key = self._key[i]
            region = hosts.get(key)
            if region is None:
                flat = self.flat(i)
                region = hosts[key] = backend.to_host(flat) if is_device_array(flat) else flat
            out.append(region[a : a + n])
        return out

    def views(self) -> list[Any]:
        """Every tensor's output, in record order."""
        if self._single():
            return self._cut(self.flat(0))
        return [self.flat(i)[a : a + n] for i, (a, n) in enumerate(zip(self.starts, self.numels))]


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
    plain = plain_buffers(pipe, records)
    nnz_all = record_column(records, "nnz")

    def one(i: int, d: Any) -> None:
        if d is None:  # (a plain record: decoded only where it is decoded alone)
            d = next(pipe.decode_stream([records[i]], backend))
        if checks is not None:
            _decode_one_deferred(d, bases[i], backend, bounds, lambda: outs[i], checks)
        else:
            _decode_one(d, bases[i], backend, bounds, lambda: outs[i])

    def flush() -> None:
        first, last = run[0][0], run[-1][0]
        offsets = outs.starts[first : last + 1] + [outs.starts[last] + outs.numels[last]]
        flat_of, lg, bs = (lambda: outs.flat(first)), logical[first], bases[first : last + 1]
        if len(run) == 1:
            ok = False
        elif run[0][1] is not None and run[0][1].indices is None:  # (small dense tensors)
            ok = _dense_run([d for _, d in run], flat_of, offsets, bs, lg, backend, checks)
        elif plain is not None:  # (the entries as they lie in the buffers: no decoder)
            joined = join_plain(plain, records, first, last + 1, offsets, backend)
            ok = _apply_joined(joined, nnz_all[first : last + 1], flat_of, offsets, bs, lg, backend, checks)
        else:
            ok = _decode_run([d for _, d in run], flat_of, offsets, bs, lg, backend, checks)
        if not ok:
            for i, d in run:  # one by one (one alone; a bad run: the error names the tensor)
                one(i, d)
        run.clear()

    stream = records_stream(pipe, records, backend, plain)
    try:
        if plain is not None and len(records) >= MANY_RECORDS and None not in runs:  # (taken a run at a time)
            ids = np.asarray(runs, np.int64)
            cuts = (np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist()
            for first, end in pairwise([0, *cuts, len(records)]):
                run.extend([(i, None) for i in range(first, end)])
                flush()
            stream = iter(())
        for i, d in stream:
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


def records_stream(pipe: Any, records: list, backend: Any, plain: Any) -> Iterator[tuple[int, Any]]:
    """(position, decoded record) of each record, in order: where ``plain`` (:func:`plain_buffers`), None for each
    (its entries are read from its buffers as they lie: :func:`join_plain`; or decoded alone,
    ``pipe.decode_stream([record])``); else each one decoded (``pipe.decode_stream``)."""
    if plain is not None:
        return ((i, None) for i in range(len(records)))
    return enumerate(pipe.decode_stream(records, backend))


SHARED_JOIN_MIN = 16  # a run of at least this many records in shared ranges is joined by one gather a role ...
SHARED_JOIN_ENTRIES = 256  # ... where they hold at most this many entries a record on average (a gather writes
# an index array of the entries' size a role: with more entries a record, slicing each record and joining them costs
# less; 1,000 records' indices: 0.15 / 0.24 / 0.57 ms gathered against 0.59 / 0.61 / 0.68 ms sliced and joined at 21,
# 84 and 300 entries a record, on an AMD EPYC with AVX2)


def join_plain(plain: Any, records: list, first: int, end: int, offsets: list[int], backend: Any) -> Any:
    """:func:`join_entries` of the plain records ``[first, end)`` (adjacent in a span, ``offsets`` their starts then
    its end), from their buffers as read from bytes (``plain``: :func:`plain_buffers`), with no decoder. Records
    whose buffers are ranges of the payload's data (:class:`SharedEntries`) are joined by one gather a role, with
    no array made per record, where the run has many of them."""
    nnz = record_column(records, "nnz", first, end)
    numels = list(map(math.prod, record_column(records, "shape", first, end)))
    if type(plain) is SharedEntries:
        if end - first >= SHARED_JOIN_MIN:
            joined = _join_shared(plain, nnz, numels, first, end, offsets, backend)
            if joined is not False:
                return joined
        plain, first, end = (plain.indices[first:end], plain.values[first:end]), 0, end - first
    idx, vals = plain
    return join_entries(
        [idx[first + j][:n] for j, n in enumerate(nnz)],
        [vals[first + j][:n] for j, n in enumerate(nnz)],
        numels,
        offsets,
        backend,
        True,
    )


_ROLES, _T = attrgetter("_roles"), attrgetter("_t")  # (a SegmentBuffers' slots, read by one C call each)


class SharedEntries(NamedTuple):
    """The indices and values of a payload's plain ``coo`` records as the v2 reader found them: record ``t``'s are
    range ``t`` of each (:func:`plain_buffers`)."""

    indices: Ranges
    values: Ranges


def plain_buffers(pipe: Any, records: list) -> tuple[list, list] | SharedEntries | None:
    """Every record's indices and values where the pipeline has no stage after top-k and every record is ``coo``
    with host buffers (a payload read from bytes): its entries are read as they lie, with no decoder. None
    otherwise. Where the records' buffers are the reader's ranges of the payload's data (uint32 indices, float32
    values, record ``t`` range ``t``), or records held as columns whose buffers are those ranges or a selection's
    shared host outputs (:func:`_table_entries`), the two shared ranges, with no array made per record."""
    if not pipe.plain():
        return None
    table = record_columns(records)
    if table is not None:  # (plain coo records as columns: their shared arrays, or the records made after all)
        shared = _table_entries(table)
        if shared is not None:
            return shared
        records = table.records()
    if set(map(_ENCODING, records)) != {"coo"}:
        return None
    bufs = list(map(_BUFFERS, records))
    if set(map(type, bufs)) == {SegmentBuffers} and len(set(map(id, map(_ROLES, bufs)))) == 1:
        roles = bufs[0].roles
        ir, vr = roles.get("indices"), roles.get("values")
        if (
            type(ir) is Ranges
            and type(vr) is Ranges
            and len(roles) == 2
            and len(ir) == len(records)
            and list(map(_T, bufs)) == list(range(len(records)))
            and ir.source.dtype == np.uint32
            and vr.source.dtype == np.float32
        ):
            return SharedEntries(ir, vr)
    idx, vals = [b.get("indices") for b in bufs], [b.get("values") for b in bufs]
    if set(map(type, idx)) | set(map(type, vals)) != {np.ndarray}:
        return None
    return idx, vals


def _table_entries(table: RecordTable) -> SharedEntries | None:
    """:func:`plain_buffers` of a table of records (:class:`~gpu_codec.format.common.RecordTable`): the reader's
    ranges as they are, or a selection's shared host outputs (one uint32 index array and one float32 value array)
    as ranges; None otherwise."""
    ir, vr = table.roles.get("indices"), table.roles.get("values")
    if len(table.roles) != 2:
        return None
    if type(ir) is Segmented and type(vr) is Segmented:
        off = list(ir.offsets)
        if off != list(vr.offsets) or ir.which is not None or (vr.which is not None and any(vr.which)):
            return None
        ir, vr = Ranges(ir.sources[0], off[:-1], off[1:]), Ranges(vr.sources[0], off[:-1], off[1:])
    if type(ir) is not Ranges or type(vr) is not Ranges or len(ir) != len(table) or len(vr) != len(table):
        return None
    if type(ir.source) is not np.ndarray or type(vr.source) is not np.ndarray:
        return None  # (a payload's own device buffers: decoded where they are)
    if ir.source.dtype != np.uint32 or vr.source.dtype != np.float32:
        return None
    return SharedEntries(ir, vr)


def _gather_shared(plain: SharedEntries, first: int, end: int, nnz: list[int]) -> tuple | None:
    """Records ``[first, end)`` of shared ranges, their entries joined: (indices, each counted in its own tensor;
    values; entry counts), each role gathered from the payload's data by one index array (each entry's place
    there: its record's start plus its rank in the record). None where a range is not its record's ``nnz`` long, or
    the records hold more than SHARED_JOIN_ENTRIES entries each on average (the caller then slices them)."""
    ir, vr = plain
    counts = list(map(sub, ir.stops[first:end], ir.starts[first:end]))
    if counts != nnz or counts != list(map(sub, vr.stops[first:end], vr.starts[first:end])):
        return None
    if _end_to_end(ir, first, end) and _end_to_end(vr, first, end):
        # (each role's ranges end to end, as a selection writes them: one slice; the indices copied, as a gather
        # would give them, for the caller to shift in place)
        gi = ir.source[ir.starts[first] : ir.stops[end - 1]].copy()
        return gi, vr.source[vr.starts[first] : vr.stops[end - 1]], counts
    if sum(counts) > SHARED_JOIN_ENTRIES * len(counts):  # (few records of many entries: slices cost less)
        return None
    # (np.take: the data need not be aligned to its words, where indexing by an array is several times slower)
    gi = np.take(ir.source, _positions(ir.starts[first:end], counts))
    return gi, np.take(vr.source, _positions(vr.starts[first:end], counts)), counts


def _end_to_end(r: Ranges, first: int, end: int) -> bool:
    """Whether ranges ``[first, end)`` of ``r`` lie end to end (each starts where the one before it stops)."""
    return r.starts[first + 1 : end] == r.stops[first : end - 1]


def _positions(starts: list[int], counts: list[int]) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, as one array made in place (a step of
    1 from each entry to the next, the jump to its range's start at each range's first, summed): no temporary of
    the entries' size beside it.

    >>> _positions([10, 4, 0, 7], [2, 0, 3, 1]).tolist()
    [10, 11, 0, 1, 2, 7]
    """
    c = np.asarray(counts, np.intp)
    some = np.flatnonzero(c)
    s, c = np.asarray(starts, np.intp)[some], c[some]
    step = np.ones(int(c.sum()), np.intp)
    if s.size:
        heads = np.cumsum(c) - c  # each range's first entry
        step[heads] = s - np.concatenate(([0], s[:-1] + c[:-1] - 1))  # (from the last entry of the range before)
        np.cumsum(step, out=step)
    return step


def _join_shared(
    plain: SharedEntries, nnz: list[int], numels: list[int], first: int, end: int, offsets: list[int], backend: Any
) -> Any:
    """:func:`join_plain` of records ``[first, end)`` of shared ranges (``nnz``, ``numels``: their entry and element
    counts): each role's entries gathered from the payload's data by one index array (each entry's place there: its
    record's start plus its rank in the record); False where a range is not its record's nnz long (then the records
    are sliced one by one)."""
    got = _gather_shared(plain, first, end, nnz)
    if got is None:
        return False
    gi, vals, counts = got
    if not vals.size:
        return None
    wide = dtypes.index_dtype(offsets[-1] - offsets[0]).itemsize > 4
    gi = gi.astype(np.int64) if wide else gi
    return _joined(gi, vals, counts, numels, offsets, backend, True, wide)


BATCH_ENTRIES = (1 << 14, 1 << 22)  # the bounds of a batch's entries onto a base on the host (see batch_entries)


def batch_entries(output_bytes: int) -> int:
    """Entries a batch of sparse tensors decoded onto their bases on the host holds at most: a 64th of the output's
    bytes (an entry's temporaries take about 24 bytes, so peak memory stays near the output's size), within
    BATCH_ENTRIES."""
    return min(BATCH_ENTRIES[1], max(BATCH_ENTRIES[0], output_bytes // 64))


def _join_host(idx: list, vals: list, nnz: list, numels: np.ndarray, starts: np.ndarray) -> tuple | None:
    """A batch's entries joined on the host (its tensors adjacent, from ``starts``, counted from the first one's):
    (each entry's flat position in the batch's span, its value), or None where a buffer is not ``nnz`` long or not
    flat, the indices are not unsigned integers or the values not floats, or an index is past its tensor or not
    above the one before it in the tensor. Every check at once, over the joined indices."""
    counts = np.fromiter((a.size for a in idx), np.int64, len(idx))
    try:  # (a batch of one is read where it lies: no copy, no temporary of the entries' size to fault in)
        gi, v = (
            (np.asarray(idx[0]), np.asarray(vals[0])) if len(idx) == 1 else (np.concatenate(idx), np.concatenate(vals))
        )
    except (TypeError, ValueError):  # (arrays of different ranks, or not on the host: a device payload's)
        return None
    return _host_checked(gi, v, counts, nnz, numels, starts)


def _host_checked(gi: Any, v: Any, counts: Any, nnz: list, numels: np.ndarray, starts: np.ndarray) -> tuple | None:
    """:func:`_join_host` of a batch's joined indices ``gi`` (each counted in its own tensor; ``counts`` a tensor,
    a fresh array where there are several) and values."""
    if (
        gi.ndim != 1
        or gi.dtype.kind != "u"
        or v.dtype not in (np.float32, np.float64)
        or v.shape != gi.shape
        or not np.array_equal(counts, nnz)
    ):
        return None
    if gi.size and not entries_ok(gi, counts, numels, np, np.asarray):
        return None
    span = dtypes.index_dtype(int(starts[-1] + numels[-1]))
    gi = gi.astype(span, copy=False)
    if len(counts) > 1:
        gi += np.repeat(starts.astype(span), counts)  # (in range: every index checked against its tensor)
    return gi, v


def _decode_onto_host(
    pipe: Any, records: list, bases: list, logical: list, outs: _Outputs, backend: Any, bounds: Any
) -> None:
    """Every record decoded onto its base into ``outs``, on the host. Sparse tensors go in batches (tensors adjacent
    in their dtype's region, at most :func:`batch_entries` entries): each batch's entries are joined and checked at
    once (:func:`_join_host`), then written with the bases in one call (``scatter_onto_bases``: one pass over the
    memory, whatever the tensor count). A batch that fails a check is decoded again tensor by tensor, which raises
    the error that names the tensor. Dense tensors and larger sparse ones are decoded alone, streamed
    (:func:`_decode_one`), after the batches before them. A plain COO record (of a pipeline with no stage after
    top-k) is read from its buffers as they are, without a decoder."""
    numels = np.asarray(outs.numels, np.int64)
    starts = np.asarray(outs.starts, np.int64)
    cap = batch_entries(outs.nbytes)
    count = len(records)
    plain = pipe.plain()
    # each batched tensor's indices, values and entry count
    idx_of: list = [None] * count
    val_of: list = [None] * count
    nnz_of: list = [0] * count
    as_read = plain_buffers(pipe, records)
    every = as_read is not None
    if every:  # (the entries as they lie in the buffers, read in a few passes over the records)
        idx_of, val_of = as_read
        nnz_of = record_column(records, "nnz")
    pending: dict[Any, list] = {}  # storage dtype -> the positions of its batch (adjacent in its region)
    held: dict[Any, int] = {}  # ... and the batch's entries

    def alone(i: int, d: Any) -> None:
        _decode_one(d, bases[i], backend, bounds, lambda: outs[i])

    def decoded(i: int) -> Any:
        return next(pipe.decode_stream([records[i]], backend))

    # a coded payload's records, each decoded once, in order, by one stream (which may decode several at once)
    in_order = None if plain else pipe.decode_stream(records, backend)

    def flush(key: Any) -> None:
        pos = pending.pop(key)
        held.pop(key)
        a, b = pos[0], pos[-1] + 1
        shared = None
        if b - a == len(pos):  # (positions a, a + 1, ..., b - 1: slices of the tables)
            nnz, srcs, at, sizes = nnz_of[a:b], bases[a:b], starts[a:b], numels[a:b]
            if type(as_read) is SharedEntries and b - a >= SHARED_JOIN_MIN:  # (no array made a tensor)
                shared = _gather_shared(as_read, a, b, nnz)
            if shared is None:
                idx, vals = idx_of[a:b], val_of[a:b]
        else:
            idx, vals, nnz, srcs = [[t[i] for i in pos] for t in (idx_of, val_of, nnz_of, bases)]
            at, sizes = starts[pos], numels[pos]
        if not every:  # (entries decoded for the batch: held no longer than it, where each batch's stayed to the end)
            for i in pos:
                idx_of[i] = val_of[i] = None
        if shared is None:
            joined = _join_host(idx, vals, nnz, sizes, at - at[0])
            del idx, vals  # (joined: the tensors' own arrays are not needed beside the joined ones)
        else:
            gi, v, counts = shared
            joined = _host_checked(gi, v, np.asarray(counts, np.int64), nnz, sizes, at - at[0])
        if joined is not None:
            gi, v = joined
            span = outs.flat(a)[int(at[0]) : int(at[-1] + sizes[-1])]
            code = dtypes.code(logical[a])
            bad, finite = backend.scatter_onto_bases(span, backend.asarrays(srcs), code, gi, v)
            if bad is None and finite:
                return
            del gi, v
        for i in pos:  # one by one: the error names the tensor
            alone(i, decoded(i))

    def flush_all() -> None:
        for k in list(pending):
            flush(k)

    keys = outs.keys
    if every and count and len(set(keys)) == 1 and sum(nnz_of) <= cap:  # (the common case: one batch of them all)
        pending[keys[0]], held[keys[0]] = list(range(count)), 0
        flush_all()
        return
    try:
        for i in range(count):
            if not every:
                r = records[i]
                if plain and r.encoding == "coo":
                    idx_of[i], val_of[i], nnz_of[i] = r.buffers["indices"], r.buffers["values"], r.nnz
                else:
                    d = decoded(i) if in_order is None else next(in_order)
                    if d.indices is None or d.nnz > cap:
                        flush_all()
                        alone(i, d)
                        continue
                    idx_of[i], val_of[i], nnz_of[i] = d.indices(0, d.nnz), d.values(0, d.nnz), d.nnz
            n = nnz_of[i]
            if n > cap:
                flush_all()
                alone(i, decoded(i))
                continue
            key = keys[i]
            if key in pending:
                if held[key] + n > cap:
                    flush(key)
                else:
                    pending[key].append(i)
                    held[key] += n
                    continue
            pending[key] = [i]
            held[key] = n
    except PayloadError:
        flush_all()  # an error of an earlier tensor first
        raise
    flush_all()


def _shaped(names: list[str], flats: list[Any], shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """name -> each flat output (NumPy, CuPy or torch, contiguous) in its tensor's shape: itself where that is flat
    (a view a tensor costs a few µs on a device), else a view; in one comprehension, no call a flat tensor."""
    return {n: a if len(s) == 1 else a.reshape(s) for n, a, s in zip(names, flats, shapes)}


def _base_tensor(x: Any, r: TensorRecord) -> Tensor:
    """Tensor ``r``'s base, wrapped and checked against the record's shape and dtype."""
    b = to_tensor(x, r.name)
    if b.shape != tuple(r.shape) or b.dtype != r.dtype:
        raise InvalidInputError(
            f"tensor {r.name!r}: base is {b.dtype}{list(b.shape)}, the payload holds {r.dtype}{list(r.shape)}"
        )
    return b


@holds_collector
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
        ``base + delta`` per tensor, as the base's kind on its device: a float32 add (float64 for float64 tensors)
        rounded to the base's dtype (a fp16 or bf16 result is rounded twice: docs/FORMAT.md §10); the base itself
        is never written. Without it, the dense delta (fp32, fp64 for fp64 tensors). The base is not scanned for
        inf or NaN (a pass over it): such an entry comes through where no entry of the payload lands, and a sum
        that is not finite is refused (``PayloadValueError``); ``Aggregator(base=)`` checks its base whole.
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
        name -> dense tensor, in the payload's order. The tensors are views of one allocation (one a storage
        dtype): keeping one alive keeps it all, and ``torch.save`` of a single tensor writes all of it (a whole
        dict is saved once); ``.clone()`` / ``.copy()`` a tensor to keep it on its own.

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
    aside); onto a base on the host, sparse tensors go in batches of at most a 64th of the output's bytes in
    entries, each batch's indices checked at once and written with its bases in one pass. Every header count
    and offset is checked when the payload is parsed; a tensor's indices are checked before its output is
    allocated; values are checked as they are written. On a GPU the checks of the entries
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
    for cap, what in ((max_output_bytes, "max_output_bytes"), (max_elements, "max_elements")):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
            raise InvalidInputError(f"{what} must be a non-negative integer or None, got {cap!r}")
    if not isinstance(payload, Payload):
        payload = Payload.from_bytes(payload)
    records = payload_records(payload)  # (a list of records, or their columns)
    names, shapes, stored = (record_column(records, f) for f in ("name", "shape", "dtype"))
    base_tensors = None
    if base is not None:
        base = as_mapping(base, "base")
        arrays = in_order(base, names)  # (the payload's names in its order, the common case: no lookup a name)
        if arrays is None:
            known = set(names)
            if len(known) != len(base) or not base.keys() >= known:
                missing = [n for n in names if n not in base]
                extra = [n for n in base if n not in known]
                raise InvalidInputError(
                    f"payload and base name different tensors: missing from base {missing[:5]}, "
                    f"not in payload {extra[:5]}"
                )
            arrays = [base[n] for n in names]
        table = tensor_table(arrays)  # (a few calls in all)
        if table is not None and table.shapes == shapes and table.dtypes == stored:
            base_tensors = table
        else:
            base_tensors = TensorTable.of([_base_tensor(x, r) for x, r in zip(arrays, records)])
    kind, device = _output_kind(like, base_tensors)
    numels = list(map(math.prod, shapes))
    logical = stored if base_tensors is not None else list(map(dtypes.value_dtype, stored))
    check_output_cap(records, base_tensors is not None, max_output_bytes, max_elements, numels, logical)
    pipe = decoder_for(payload.pipeline)
    backend = get_backend()
    bounds = DECODE_CHUNK_DEVICE if backend.on_device else DECODE_CHUNK
    host_onto = base_tensors is not None and not backend.on_device
    if host_onto:
        runs: list = []  # (batched, see _decode_onto_host)
    elif backend.on_device:  # (runs of sparse tensors of any size, bounded by their entries)
        runs = _runs(records, logical, numels, device=True, dense=True)
    else:
        runs = _runs(records, logical, numels)
    outs = _Outputs(records, logical, runs, base_tensors is not None, backend, numels)
    bases = base_tensors.data if base_tensors is not None else [None] * len(records)  # (each tensor's flat data)
    with backend.stream(base_tensors or []):
        if base_tensors is not None and payload.base_fingerprint is not None:
            check_base(payload.base_fingerprint, list(zip(names, stored, bases)), backend)
        if host_onto:
            _decode_onto_host(pipe, records, bases, logical, outs, backend, bounds)
        # on a device, a first pass reads its checks back once, at the end; where one failed, the decode runs again
        # reading each check as it is made, which raises the error that names the tensor
        elif not (backend.on_device and _decode_all(pipe, records, bases, logical, runs, outs, backend, bounds, True)):
            if backend.on_device:
                outs = _Outputs(records, logical, runs, base_tensors is not None, backend, numels)
            _decode_all(pipe, records, bases, logical, runs, outs, backend, bounds, False)
    devs = base_tensors.devices if base_tensors is not None else [device] * len(records)
    if base_tensors is not None and len(set(base_tensors.kinds)) > 1:  # (a base of several kinds: each its own)
        return {
            r.name: from_backend(v, lg, tuple(r.shape), kd, dev)
            for r, v, lg, kd, dev in zip(records, outs.views(), logical, base_tensors.kinds, devs)
        }
    if kind == "torch":
        split = outs.torch_views(logical, devs)
        if split is not None:
            return _shaped(names, split, shapes)
    on_host = kind == "numpy" and backend.on_device  # (NumPy outputs of a device decode: one copy a region)
    views = outs.host_views(backend) if on_host else outs.views()
    if "bfloat16" not in logical and (kind == "numpy" or (kind == "cupy" and backend.on_device)):
        # (the common cases: every view already of the output's kind, where it goes; without from_backend's
        # per-call checks)
        return _shaped(names, views, shapes)
    return {
        r.name: from_backend(v, lg, tuple(r.shape), kind, dev) for r, v, lg, dev in zip(records, views, logical, devs)
    }


__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DeviceChecks",
    "apply_run",
    "check_output_cap",
    "chunk_entries",
    "decoded_records",
    "decompress",
    "join_plain",
    "join_run",
    "joined_values",
    "plain_buffers",
    "records_stream",
]
