"""The backend contract: every op declared once (bitsandbytes style), implemented per backend.

Each op takes lists over tensors of backend arrays. For the codec ops: kept values (fp32, fp64 for fp64
tensors), kept indices (``None`` for a dense tensor) and error-feedback residuals (``None`` where there is
none). Every backend gives the same bytes: the NumPy backend runs the twins in :mod:`gpu_codec.cpu_fallback`,
the kernel backends (GPU, emulated) launch kernels/*.cu through :mod:`gpu_codec.backends.kernels`.

Layers point down only: adapters -> engine -> codecs -> backends -> kernels / twins.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..constants import Criterion, DType, Rounding, ScatterMode
from ..xp.finite import all_finite, some_nonfinite  # array code every backend runs (gpu_codec.xp)
from ..xp.limbs import abs_max, abs_max_bits, add_span, from_abs_bits, mean_span
from . import events

Array = Any  # an array of the backend's ``xp`` (NumPy or CuPy)


@dataclass(frozen=True)
class DeltaRequest:
    """What one pass over an update reads and writes, tensor by tensor (every list has one entry a tensor): the
    tensors (``new``, and ``base`` / ``res`` or None where absent), where the error-feedback residual goes
    (``res_out``, None where there is none), each tensor's :class:`~gpu_codec.constants.DType`, the caller's
    ``scores`` (None where the ``criterion`` computes them) and their dtypes.

    >>> import numpy as np
    >>> r = DeltaRequest([np.ones(3, np.float32)], [None], [None], [None], [DType.F32], [None], [DType.F32],
    ...                  Criterion.MAGNITUDE)
    >>> r.criterion.name, len(r)
    ('MAGNITUDE', 1)
    >>> DeltaRequest([np.ones(3, np.float32)], [], [None], [None], [DType.F32], [None], [DType.F32], 0)
    Traceback (most recent call last):
    ...
    ValueError: a DeltaRequest's lists must each have one entry a tensor (1): base has 0
    """

    new: list[Array]
    base: list[Array | None]
    res: list[Array | None]
    res_out: list[Array | None]
    dtypes: list[DType]
    scores: list[Array | None]
    score_dtypes: list[DType]
    criterion: Criterion

    def __post_init__(self) -> None:
        n = len(self.new)
        for name in ("base", "res", "res_out", "dtypes", "scores", "score_dtypes"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"a {type(self).__name__}'s lists must each have one entry a tensor ({n}): {name} has "
                    f"{len(getattr(self, name))}"
                )
        object.__setattr__(self, "criterion", Criterion(self.criterion))

    def __len__(self) -> int:
        return len(self.new)

    def delta_args(self) -> tuple:
        """The fields in the order of the kernels' (and their twins') arguments."""
        return (self.new, self.base, self.res, self.res_out, self.dtypes, self.scores, self.score_dtypes)


@dataclass(frozen=True)
class SelectRequest(DeltaRequest):
    """A :class:`DeltaRequest` whose kept entries are the exact top-k of each segment: ``segments`` (runs of tensor
    positions that share one threshold, covering every tensor in order), ``ks`` (k per segment) and ``rounding``
    (what the receiver decodes for a kept value, for the residuals of the kept entries)."""

    segments: list[list[int]] = ()  # type: ignore[assignment]
    ks: list[int] = ()  # type: ignore[assignment]
    rounding: Rounding = Rounding.EXACT

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.segments) != len(self.ks):
            raise ValueError(f"{len(self.segments)} segments but {len(self.ks)} values of k")
        object.__setattr__(self, "rounding", Rounding(self.rounding))

    def select_args(self) -> tuple:
        """The fields in the order of the selection's (and its twin's) arguments."""
        return (*self.delta_args(), self.criterion, self.segments, self.ks, self.rounding)


class DeviceViews(Sequence):
    """Flat device arrays given by address, each made into an array only when it is read: item ``i`` is
    ``numels[i]`` elements of ``storage[i]`` (a NumPy dtype) at ``ptrs[i]`` on CUDA device ``device_ids[i]``, in
    memory that ``owners[i]`` holds (a torch tensor or a CuPy array, which its array keeps alive). The kernel
    backends read the ``ptrs`` and ``numels`` columns and make no array; reading an item makes it once, a CuPy
    array over that memory (no copy, and none of DLPack's per-array stream handshake). ``cupy``: the CuPy module
    (a stand-in in tests). A slice, a pick and the sum of two such sequences stay columns.

    >>> v = DeviceViews(None, [4096, 0], [10, 0], [np.float32, np.uint16], [None, None], [0, 0])
    >>> len(v), v.numels, (v + v).ptrs, v[1:].numels
    (2, [10, 0], [4096, 0, 4096, 0], [0])
    """

    __slots__ = ("_made", "cupy", "device_ids", "numels", "owners", "ptrs", "storage")

    def __init__(
        self, cupy: Any, ptrs: list[int], numels: list[int], storage: list[Any], owners: list[Any], device_ids: list
    ):
        self.cupy, self.ptrs, self.numels, self.storage = cupy, ptrs, numels, storage
        self.owners, self.device_ids = owners, device_ids
        self._made: list | None = None  # (each item's array, once made)

    def __len__(self) -> int:
        return len(self.ptrs)

    def _columns(self) -> tuple[list, ...]:
        return self.ptrs, self.numels, self.storage, self.owners, self.device_ids

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return DeviceViews(self.cupy, *(c[i] for c in self._columns()))
        made = self._made
        a = None if made is None else made[i]  # (an index out of range raises, as a list's)
        return self._made_all((i,))[i] if a is None else a

    def pick(self, indices: Sequence[int]) -> DeviceViews:
        """The items at ``indices``, as columns (no array made)."""
        return DeviceViews(self.cupy, *([c[i] for i in indices] for c in self._columns()))

    def _made_all(self, which: Sequence[int]) -> list:
        """The items ``which`` made (those not made yet), in one loop; the cache of every item's array."""
        made = self._made
        if made is None:
            made = self._made = [None] * len(self.ptrs)
        ptrs, numels, storage, owners, devs = self._columns()
        cupy = self.cupy
        unowned, pointer, ndarray = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, cupy.ndarray
        itemsize = {dt: np.dtype(dt).itemsize for dt in set(map(storage.__getitem__, which))}
        for i in which:
            if made[i] is None:
                n, dt = numels[i], storage[i]
                if n:
                    made[i] = ndarray((n,), dt, pointer(unowned(ptrs[i], n * itemsize[dt], owners[i], devs[i]), 0))
                else:  # (an empty tensor: its own empty array, whatever its address)
                    made[i] = ndarray((0,), dt)
        return made

    def __iter__(self) -> Iterator[Any]:
        made = self._made
        # every item made in one loop where one is missing (found by identity: `None in` would compare arrays)
        if made is None or any(map(is_, made, repeat(None))):
            made = self._made_all(range(len(self.ptrs)))
        return iter(made)

    def __add__(self, other: Sequence) -> Sequence:
        if type(other) is DeviceViews and other.cupy is self.cupy:
            return DeviceViews(self.cupy, *(a + b for a, b in zip(self._columns(), other._columns())))
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)


def joined(backend: Any, arrays: Sequence[Any], indices: Sequence[int]) -> Array:
    """The arrays ``indices`` of ``arrays`` (of one storage dtype) end to end in one new array of ``backend``'s:
    from a :class:`DeviceViews`, by one launch that reads their addresses (``gather_copy``: no array made an
    item); from a list, ``xp.concatenate``."""
    if type(arrays) is not DeviceViews:
        return backend.xp.concatenate([arrays[i] for i in indices])
    part = arrays.pick(indices)
    out = backend.xp.empty(sum(part.numels), part.storage[0])
    backend.gather_copy(out, part)
    return out


def sizes_of(arrays: Sequence[Any]) -> list[int]:
    """Each array's element count, as Python ints: a :class:`DeviceViews`' column, without making its arrays.

    >>> sizes_of([np.zeros(3), np.zeros(0)]), sizes_of(DeviceViews(None, [64], [5], [np.float32], [None], [0]))
    ([3, 0], [5])
    """
    if type(arrays) is DeviceViews:
        return list(arrays.numels)
    return list(map(_SIZE, arrays))  # (a NumPy or CuPy array's size is a Python int)


_SIZE = attrgetter("size")


@runtime_checkable
class Runner(Protocol):
    """What :class:`~gpu_codec.backends.kernels.KernelOps` launches kernels through (CuPy, or the emulator)."""

    xp: Any

    def launch(self, name: str, grid: Any, block: Any, args: tuple) -> None: ...

    def ptr(self, a: Array) -> int: ...

    def to_host(self, a: Array) -> np.ndarray: ...


@runtime_checkable
class Backend(Protocol):
    """A place to compute: its memory (``xp``), conversions, a stream scope, and every op."""

    name: str
    xp: Any
    on_device: bool

    def asarray(self, a: Any) -> Array:
        """``a`` in this backend's memory (no copy where it is there already)."""
        ...

    def asarrays(self, arrays: Sequence[Any]) -> Sequence[Any]:
        """:meth:`asarray` of each of ``arrays`` (None stays None), without a call a tensor where each is in this
        backend's memory already (a model's tensors; a :class:`DeviceViews` on the kernel backends, as it is)."""
        ...

    def to_host(self, a: Array) -> np.ndarray:
        """A host NumPy copy of ``a``."""
        ...

    @property
    def host(self) -> Backend:
        """The NumPy backend (this one, on the host), where a device backend decodes what lies in host memory (a
        payload read from bytes)."""
        ...

    def stream(self, tensors: Sequence[Any]) -> contextlib.AbstractContextManager:
        """The scope in which every kernel, copy and decode of one call runs (the caller's stream)."""
        ...

    def info(self) -> dict[str, Any]:
        """What this backend says about itself in ``backend_info()`` (allocator, stream, device)."""
        ...

    # --- selection and reconstruction -------------------------------------------------------------------

    def topk_select(self, req: SelectRequest) -> tuple[list[Array] | None, list[Array] | None, int | None]:
        """(indices, values, None) of the exact top-k per segment, or (None, None, first bad tensor)."""
        ...

    def dense_delta(self, req: DeltaRequest) -> tuple[list[Array] | None, int | None]:
        """Dense mode (every element kept, the residual's rounding exact): (values, None) with each tensor's delta
        (fp32, fp64 for fp64 tensors) and every ``res_out`` set to zero, or (None, first bad tensor) with the
        residuals untouched. The same checks as :meth:`topk_select`."""
        ...

    def scatter(
        self,
        outs: list[Array],
        out_dtypes: list[DType],
        numels: list[int],
        indices: list[Array],
        values: list[Array],
        mode: ScatterMode,
        defer: bool = False,
    ) -> int | Array | None:
        """Write kept entries into dense outputs; the lowest bad entry position, or None. ``defer``: the error
        word itself (a one-element uint64 array of the backend, ``U64_MAX`` where every entry is good; None where
        there is no entry), not read by the host."""
        ...

    def scatter_onto(
        self,
        out: Array,
        base: Array,
        start: int,
        stop: int,
        out_dtype: DType,
        numel: int,
        indices: Array,
        values: Array,
    ) -> tuple[int | None, bool]:
        """``out[start:stop] = base[start:stop]`` with one tensor's entries (ascending, within [start, stop)) added
        as :meth:`scatter` in mode ``ScatterMode.ADD`` adds them: (the lowest bad entry or None, whether every sum
        is finite in the dtype). The same bytes as a copy of the base and :meth:`scatter`, which the kernel backends
        run."""
        ...

    def scatter_onto_bases(
        self, out: Array, bases: list[Array], out_dtype: DType, indices: Array, values: Array
    ) -> tuple[int | None, bool]:
        """``out`` = the ``bases`` end to end (as :meth:`gather_copy`), with the entries (flat positions in ``out``,
        ascending) added as :meth:`scatter` adds them over ``out`` in mode ``ScatterMode.ADD``: (the lowest bad
        entry or None, whether every sum is finite in the dtype). A run of tensors onto their bases in one call."""
        ...

    def gather_copy(self, out: Array, sources: list[Array]) -> None:
        """``out`` = the ``sources`` end to end (flat, of ``out``'s element size; their sizes sum to ``out.size``),
        the bits copied as they are: a run of small tensors' bases into their outputs, in one pass."""
        ...

    def gather_entries(
        self, out: Array, sources: list[Array], starts: list[int], indices: Array, counts: list[int]
    ) -> None:
        """``out[j]`` = the element of its tensor's source at entry j: ``counts`` entries a source, at ``indices``
        (positions in a run's span, in which the sources start at ``starts``, then its end; checked in range), the
        bits as they are. A run's bases read at its entries in one pass (not a copy of every base)."""
        ...

    def dense_apply(
        self,
        outs: list[Array],
        out_dtypes: list[DType],
        bases: list[Array | None],
        values: list[Array],
        mode: ScatterMode,
        defer: bool = False,
    ) -> int | Array | None:
        """Dense records (every element sent) into fresh outputs: values (``ScatterMode.ZEROS``) or base + values
        (``ScatterMode.ADD``),
        read in place; the lowest entry with a non-finite value, or None (``defer``: the error word, as
        :meth:`scatter` gives it)."""
        ...

    # --- the aggregator's integer limbs (gpu_codec.aggregate) ---------------------------------------------------

    def limb_accumulate(
        self,
        limbs: Array,
        start: int,
        counts: Sequence[int],
        exps: np.ndarray,
        vals: Array,
        idx: Array | None,
        w: float,
    ) -> None:
        """``limbs[j][start + e] += q_j`` for every entry: ``q`` the int32 limbs of ``vals * w`` (fp64) on its
        tensor's grids ``2^exps[t][j]`` (a host row per tensor, coarsest first; the entries are ``counts`` of
        ``vals`` in turn), ``e`` its index (``idx``, distinct; ``None``: dense tensors end to end, entry e is
        element e)."""
        ...

    def limb_shift(self, limbs: Array, starts: np.ndarray, numels: np.ndarray, shifts: np.ndarray) -> None:
        """Each listed tensor's grid made coarser by ``shifts[t]`` whole limbs (row j takes row j - s, 0 past the
        top)."""
        ...

    def segment_abs_max(self, vals: Array, counts: Sequence[int]) -> Array:
        """The bits of each tensor's largest ``|v|`` (uint64, 0 for no entry; inf or NaN above every finite one),
        the entries being ``counts`` of ``vals`` in turn; left on the device."""
        ...

    def limb_mean(
        self, limbs: Array, starts: np.ndarray, numels: np.ndarray, scales: np.ndarray, total: float, out: Array
    ) -> None:
        """``out`` (the listed tensors end to end) = ``(sum over j of limbs[j] * scales[t][j]) / total`` over each
        tensor's elements (from ``starts[t]``): each step in fp64, in limb order, the last cast to ``out``'s
        dtype."""
        ...

    # --- value and index codecs (encode) -----------------------------------------------------------------

    def cast16(self, values: list[Array], dtype: str, indices: list[Any], res: list[Any]) -> list[Array]:
        """fp16 / bf16 bit patterns (uint16) of every tensor's values, clamped; residual fixed where given."""
        ...

    def int8(
        self, values: list[Array], block: int, indices: list[Any], res: list[Any]
    ) -> tuple[list[Array], list[Array]]:
        """Blockwise absmax int8 of every tensor's values: (q per tensor, scales per tensor)."""
        ...

    def ternary(self, values: list[Array], indices: list[Any], res: list[Any]) -> tuple[list[Array], Array]:
        """Ternary (STC) of every tensor's values: (packed sign bits per tensor, fp32 mu of each tensor, one array
        on the backend: the host reads it with the call's other reads, :func:`later`)."""
        ...

    def rice(self, indices: list[Array], ks: list[int], numels: list[int]) -> tuple[list[Array], Array]:
        """Rice streams (uint8) of every tensor's ascending indices (``numels`` elements each) and their bit
        counts (uint64, one array on the backend). A stream may run past its ``ceil(bits / 8)`` bytes (with zero
        bytes, up to its length's bound :func:`~gpu_codec.constants.max_bits`), where the bit counts are not read
        before the streams are placed."""
        ...

    # --- decode ----------------------------------------------------------------------------------------------

    def decode_f16(self, bits: Array) -> Array: ...

    def decode_bf16(self, bits: Array) -> Array: ...

    def int8_decode(self, q: Array, scales: Array, block: int) -> Array: ...

    def as_values(self, x: Array, dtype: Any) -> Array:
        """Decoded fp32 values as ``dtype`` (fp32, or fp64 for fp64 tensors), exactly."""
        ...

    def ternary_decode(self, signs: Array, mu: float, n: int) -> Array: ...

    def rice_decode(self, stream: Array, bits: int, k: int, nnz: int, numel: int) -> Array:
        """Ascending indices from a Rice stream, validated completely (PayloadError on any inconsistency)."""
        ...


def flat_tables(numels: list[int], dtypes: list[int], f64_code: int) -> tuple[np.ndarray, int, int]:
    """(element offsets, fp32 buffer size, fp64 buffer size) of a tensor list's values laid out at their element
    offsets (as dense_delta writes them); a buffer no tensor uses has one slot."""
    off = np.concatenate([[0], np.cumsum(numels, dtype=np.int64)])[:-1].astype(np.int64)
    total = max(sum(numels), 1)
    has64 = any(d == f64_code for d in dtypes)
    has32 = any(d != f64_code for d in dtypes)
    return off, total if has32 else 1, total if has64 else 1


def split_values(
    vals32: Any, vals64: Any, numels: list[int], dtypes: list[int], off: np.ndarray, f64_code: int
) -> list:
    return [(vals64 if d == f64_code else vals32)[int(o) : int(o) + n] for n, d, o in zip(numels, dtypes, off)]


def dense_values(values: list, out_dtypes: list[int], f64_code: int) -> list:
    """Each tensor's values in the dtype dense_apply reads: fp64 for fp64 outputs, else fp32 (no copy if so)."""
    return [v.astype(np.float64 if dt == f64_code else np.float32, copy=False) for v, dt in zip(values, out_dtypes)]


def scatter_args(xp: Any, indices: list, values: list):
    """Concatenate per-tensor entries as the scatter kernels (and their twins) take them: (total, ent_start
    (host u64), indices (u32, or u64 if any tensor needs it), vals32, vals64); ``None`` when there is no entry."""
    counts = [int(i.size) for i in indices]
    total = sum(counts)
    if total == 0:
        return None
    ent_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
    wide = any(i.dtype == np.uint64 for i in indices)
    idx = xp.concatenate([i.astype(np.uint64 if wide else np.uint32, copy=False) for i in indices])
    if all(v.dtype != np.float64 for v in values):
        vals32, vals64 = xp.concatenate([v.astype(np.float32, copy=False) for v in values]), xp.zeros(1, np.float64)
    elif all(v.dtype == np.float64 for v in values):
        vals32, vals64 = xp.zeros(1, np.float32), xp.concatenate(values)
    else:
        vals32 = xp.concatenate([v if v.dtype == np.float32 else xp.zeros(v.size, np.float32) for v in values])
        vals64 = xp.concatenate([v if v.dtype == np.float64 else xp.zeros(v.size, np.float64) for v in values])
    return total, ent_start, idx, vals32, vals64


# ------------------------------------------------------------------------------------------ host reads
# Some encode stages need values that only the device knows before their records are complete: ternary's mu per
# tensor, a Rice stream's bit count, the coded bytes a host-side zstd compresses. Each read is a wait for the
# device. A stage asks for what it needs with later(); inside gathered(), the asks are queued and answered together
# where the block ends, in one copy (one wait), marked as the call's wait (events.waited): the call's scope then
# ends without a second one.

_reads = threading.local()


def read_joined(backend: Any, arrays: list[Any]) -> list[np.ndarray]:
    """Host copies of ``arrays`` (the backend's, each contiguous), in one device-to-host copy on a device
    backend: their bytes joined there, copied, and cut back into arrays of their dtypes and sizes.

    >>> from gpu_codec.backends.cpu import CpuBackend
    >>> [a.tolist() for a in read_joined(CpuBackend(), [np.array([1, 2], np.uint64), np.array([0.5], np.float32)])]
    [[1, 2], [0.5]]
    """
    if not getattr(backend, "on_device", False):
        return [np.asarray(a) for a in arrays]
    xp = backend.xp
    parts = [backend.asarray(a).reshape(-1).view(np.uint8) for a in arrays]
    host = backend.to_host(xp.concatenate(parts) if parts else xp.zeros(0, np.uint8))
    out, at = [], 0
    for a, p in zip(arrays, parts):
        n = int(p.size)
        out.append(host[at : at + n].view(a.dtype))
        at += n
    return out


def later(backend: Any, arrays: list[Any], finish: Callable[[list[np.ndarray]], None]) -> None:
    """``finish(host copies of arrays)``: queued to the end of the enclosing :func:`gathered` block on a device
    backend, at once otherwise."""
    queue = getattr(_reads, "queue", None)
    if queue is None or not getattr(backend, "on_device", False):
        finish(read_joined(backend, arrays))
    else:
        queue.append((arrays, finish))


@contextlib.contextmanager
def gathered(backend: Any) -> Iterator[None]:
    """Queue the :func:`later` asks made in the block and answer them where it ends (nothing is read where it
    raises): on a device backend, the arrays are joined there and copied to the host in one transfer, then each
    ask's ``finish`` runs on its host copies, in the order asked. On a host backend each ``finish`` ran at once.

    >>> from gpu_codec.backends.cpu import CpuBackend
    >>> got = []
    >>> with gathered(CpuBackend()):
    ...     later(CpuBackend(), [np.arange(3, dtype=np.float32)], lambda h: got.append(h[0].tolist()))
    >>> got
    [[0.0, 1.0, 2.0]]
    """
    prev = getattr(_reads, "queue", None)
    queue: list = []
    _reads.queue = queue
    try:
        yield
    finally:
        _reads.queue = prev
    if queue:
        host = read_joined(backend, [a for arrays, _ in queue for a in arrays])
        events.waited()
        at = 0
        for arrays, finish in queue:
            finish(host[at : at + len(arrays)])
            at += len(arrays)


__all__ = [
    "Array",
    "Backend",
    "DeviceViews",
    "Runner",
    "abs_max",
    "abs_max_bits",
    "add_span",
    "all_finite",
    "dense_values",
    "flat_tables",
    "from_abs_bits",
    "gathered",
    "joined",
    "later",
    "mean_span",
    "read_joined",
    "scatter_args",
    "sizes_of",
    "some_nonfinite",
    "split_values",
]
