"""The recording launcher: the GPU path's host side, measured on any machine.

:func:`measure` runs one library call (a compress, a decompress, an aggregator's ``add``) on
:class:`RecordingBackend`, which is the GPU backend's code (:class:`~gpu_codec.backends.kernels.KernelOps`, the
float ops, the array decoders, the stream scope with its final wait) over a runner and an array module that
record instead of reaching a device:

1. **record**: kernels run on the emulator (:mod:`gpu_codec.backends.emulated`), array-module work on NumPy; every
   value the host reads back from the "device" is kept on a tape, in order;
2. **replay** (``repeat`` times, timed): the same call with no kernel executed; each read-back is answered from
   the tape, after checking that it is the same kind of read of an array of the same shape and dtype, and the
   kernel launches must come in the same order with the same grids (:class:`RecordingError` otherwise), so the
   host code takes the path it took on real values.

Counted, per call (:class:`Counts`):

- ``launches``: kernels of kernels/*.cu launched through the runner, by name;
- ``array_ops``: kernels the array module (CuPy on a GPU) would run: each ufunc call or reduction on a device
  array, each array-module function (``concatenate``, ``cumsum``, ``where``, ...), each cast that copies, each
  gather or scatter by an index array, each copy or fill by assignment, each ``zeros``/``arange`` fill; one
  each (CuPy may split or fuse a few of them differently);
- ``syncs``: every point where the host waits for the device: a runner's ``to_host``, ``int``/``float``/
  ``bool``/``item``/``tolist``/``get`` of a device array, an operation whose result's size depends on the data
  (``flatnonzero``, ``nonzero``, indexing by a boolean mask: CuPy reads the count back), and a stream's
  ``synchronize`` (the end of a call's scope); by the line of the library that asked (record pass);
- ``h2d`` and ``h2d_bytes``: host-to-device copies (``asarray`` of host memory, host tables of the launches), and
  ``d2h_bytes``: bytes the read-backs bring back;
- ``allocs``: device allocations.

The recorded arrays stand for device arrays throughout, so a call's outputs stay where they are: a decode whose
base is resident gives its outputs as the device arrays a CuPy base would get; the one copy to the host a region
that NumPy outputs of a device decode take (``_Outputs.host_views``, after the call's scope) is neither run nor
counted here (the GPU suite runs it on a device).

Not counted: NumPy's own functions called directly on a device array (CuPy would refuse most; they are flagged in
``host_numpy``, which should stay empty), the driver's cost of a launch or a copy (the replay skips them: on a GPU
each launch costs a few µs of host time on top), and the time the device itself takes. Inputs named
``resident`` stand for tensors already on the device (a torch CUDA tensor, say): wrapping them (or a flat view of
all of one) copies nothing, they are known by identity, and their address is read once, before the call, as
CuPy's ``data.ptr`` is a field; the device view of a resident array is made once, by the record pass, and
returned again by every replay's ``asarray`` of it, as CuPy's ``asarray`` returns a device array itself; a
slice of a device array is a view, made on the host, with no kernel.

The replay's time is the host's Python between launches, plus the NumPy work that stands for the device's (the
array module's kernels and the copies; ``array_ms`` reports its share) and the recorder's bookkeeping.

>>> import numpy as np, gpu_codec
>>> new = {"a": np.arange(1000, dtype=np.float32), "b": np.ones(300, np.float32)}
>>> m = measure(lambda _: gpu_codec.compress(new, fraction=0.01), resident=[new], repeat=2)
>>> m.counts.launches, m.counts.syncs, len(m.replay_ms)
(7, 3, 2)
>>> sorted(m.counts.kernels)[:3]
['cand_count', 'cand_select', 'cand_write_u32']
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import numpy as np

from ..backends import events, using_backend
from ..backends.decode import ArrayDecoders
from ..backends.float_ops import KernelFloatOps
from ..backends.kernels import KernelBackendBase

__all__ = ["Counts", "DeviceArray", "Measurement", "RecordingBackend", "RecordingError", "measure"]

_local = threading.local()


class RecordingError(RuntimeError):
    """The replay left the recorded path (another read-back, launch or shape than recorded)."""


@dataclass
class Counts:
    """What one call asked of the device (see the module docstring)."""

    launches: int = 0
    array_ops: int = 0
    syncs: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    allocs: int = 0
    kernels: Counter = field(default_factory=Counter)  # launches by kernel name
    ops: Counter = field(default_factory=Counter)  # array-module kernels by operation
    sync_sites: Counter = field(default_factory=Counter)  # syncs by the library line that asked (record pass)
    host_numpy: Counter = field(default_factory=Counter)  # NumPy functions called on device arrays (should be 0)

    def totals(self) -> dict[str, int]:
        return {
            k: getattr(self, k) for k in ("launches", "array_ops", "syncs", "h2d", "h2d_bytes", "d2h_bytes", "allocs")
        }


class _Session:
    def __init__(
        self, mode: str, tape: list, log: list, resident: dict[int, tuple[int, int]], views: dict | None = None
    ):
        self.mode, self.tape, self.log = mode, tape, log
        # id(array) -> (its data address, its size): the resident arrays (see :func:`_resident`)
        self.resident = resident
        # id(resident array) -> its device view, made by the first asarray of it (of all passes: as CuPy's asarray
        # of a device array returns the array, a replay's asarray of a resident one is a lookup)
        self.views = {} if views is None else views
        self.addresses = {addr for addr, _ in resident.values()}
        self.pos = self.lpos = 0
        self.counting = False
        self.counts = Counts()
        self.array_s = 0.0

    # -- what the recorded objects report
    def op(self, name: str) -> None:
        if self.counting:
            self.counts.array_ops += 1
            self.counts.ops[name] += 1

    def alloc(self) -> None:
        if self.counting:
            self.counts.allocs += 1

    def h2d(self, nbytes: int) -> None:
        if self.counting:
            self.counts.h2d += 1
            self.counts.h2d_bytes += int(nbytes)

    def sync(self, what: str) -> None:
        if self.counting:
            self.counts.syncs += 1
            if self.mode == "record":
                self.counts.sync_sites[f"{_site()} ({what})"] += 1

    def shaped(self, kind: str, a: np.ndarray, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """An array-module operation whose result's size depends on the data (CuPy reads the size back: a sync);
        its result is kept on the tape too, as a replay's data would give another size."""
        self.op(kind)
        self.alloc()
        self.sync(kind)
        if self.counting:
            self.counts.d2h_bytes += 8
        sig = (kind, a.shape, a.dtype.str)
        if self.mode == "record":
            out = compute()
            self.tape.append((sig, out))
            return out
        return self._next(sig)

    def launch(self, name: str, grid: Any) -> None:
        key = (name, _dims(grid))
        if self.mode == "record":
            self.log.append(key)
        else:
            if self.lpos >= len(self.log) or self.log[self.lpos] != key:
                want = self.log[self.lpos] if self.lpos < len(self.log) else "nothing"
                raise RecordingError(f"replay launched {key}, the recording has {want} at launch {self.lpos}")
            self.lpos += 1
        if self.counting:
            self.counts.launches += 1
            self.counts.kernels[name] += 1

    def read(self, kind: str, a: np.ndarray, get: Callable[[np.ndarray], Any]) -> Any:
        """One read-back of device array ``a``: computed (record) or taken from the tape (replay)."""
        self.sync(kind)
        if self.counting:
            self.counts.d2h_bytes += int(a.nbytes)
        sig = (kind, a.shape, a.dtype.str)
        if self.mode == "record":
            value = get(a)
            self.tape.append((sig, value))
            return value
        return self._next(sig)

    def _next(self, sig: tuple) -> Any:
        if self.pos >= len(self.tape):
            raise RecordingError(f"replay read {sig} past the end of the recording ({len(self.tape)} reads)")
        got, value = self.tape[self.pos]
        if got != sig:
            raise RecordingError(f"replay read {sig} where the recording read {got} (read {self.pos})")
        self.pos += 1
        return value.copy() if isinstance(value, np.ndarray) else value


def _session() -> _Session | None:
    return getattr(_local, "session", None)


def _site() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if ("gpu_codec" in name or "cpu_fallback" in name) and not name.endswith(("recording.py", "events.py")):
            return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


def _dims(d: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in d) if isinstance(d, (tuple, list)) else (int(d),)


def _plain(x: Any) -> Any:
    if isinstance(x, DeviceArray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, np.ndarray):
        return x.view(DeviceArray)
    if isinstance(x, (np.generic, bool, int, float)):  # a reduction's result stays on the device, as CuPy's
        return np.asarray(x).view(DeviceArray)
    return x


def _is_index_array(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


@contextlib.contextmanager
def _timed(s: _Session | None) -> Iterator[None]:
    """The NumPy work standing for the array module's kernels: its time (``array_ms``); quiet in a replay, whose
    kernels wrote nothing."""
    if s is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        with np.errstate(all="ignore") if s.mode == "replay" else contextlib.nullcontext():
            yield
    finally:
        s.array_s += time.perf_counter() - t0


def _is_mask(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.dtype == np.bool_ for k in keys)


def _host_arrays(args: Iterable[Any]) -> bool:
    return any(type(a) is np.ndarray and a.ndim > 0 for a in args)


class DeviceArray(np.ndarray):
    """A NumPy array standing for a device (CuPy) array: its operations are counted as the array module's kernels,
    its reads by the host as syncs (answered from the tape in a replay)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        s = _session()
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        if s is not None:
            s.op(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}")
            if s.counting and _host_arrays(inputs):
                s.counts.host_numpy[f"{ufunc.__name__} on a host array, at {_site()}"] += 1
        with _timed(s):
            result = getattr(ufunc, method)(*(_plain(i) for i in inputs), **kwargs)
        if outs is not None:
            return outs[0] if len(outs) == 1 else outs
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        s = _session()
        if s is not None and s.counting:
            s.counts.host_numpy[f"numpy.{func.__name__} at {_site()}"] += 1
        return func(*_plain(args), **_plain(kwargs))

    def __getitem__(self, key):
        if type(key) is slice:  # a view, made on the host as CuPy makes it: no kernel
            return np.ndarray.__getitem__(self, key)
        s = _session()
        if s is not None and _is_mask(key):
            plain = self.view(np.ndarray)
            return _wrap(s.shaped("mask", plain, lambda: plain[_plain(key)]))
        if s is not None and _is_index_array(key):
            s.op("gather")
            if any(type(k) is np.ndarray for k in (key if isinstance(key, tuple) else (key,))):
                s.h2d(sum(k.nbytes for k in (key if isinstance(key, tuple) else (key,)) if type(k) is np.ndarray))
        with _timed(s):
            out = np.ndarray.__getitem__(self.view(np.ndarray), _plain(key))
        return _wrap(out)

    def __setitem__(self, key, value):
        s = _session()
        if s is not None:
            if _is_mask(key):
                s.sync("mask")  # CuPy counts the mask's entries first
            s.op("scatter" if _is_index_array(key) else "copy" if isinstance(value, np.ndarray) else "fill")
            if type(value) is np.ndarray:
                s.h2d(value.nbytes)
        with _timed(s):
            np.ndarray.__setitem__(self.view(np.ndarray), _plain(key), _plain(value))

    def nonzero(self):
        s = _session()
        plain = self.view(np.ndarray)
        return _wrap(plain.nonzero() if s is None else s.shaped("nonzero", plain, plain.nonzero))

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        dt = np.dtype(dtype)
        if not copy and dt == self.dtype:
            return self
        s = _session()
        if s is not None:
            s.alloc()
            s.op("astype")
        with _timed(s):
            return _wrap(self.view(np.ndarray).astype(dt, order=order, casting=casting, copy=copy))

    def copy(self, order="C"):
        s = _session()
        if s is not None:
            s.alloc()
            s.op("copy")
        with _timed(s):
            return _wrap(self.view(np.ndarray).copy(order=order))

    def fill(self, value):
        s = _session()
        if s is not None:
            s.op("fill")
        with _timed(s):
            self.view(np.ndarray).fill(value)

    # -- host reads: syncs
    def _read(self, kind: str, get: Callable[[np.ndarray], Any]) -> Any:
        s = _session()
        plain = self.view(np.ndarray)
        return get(plain) if s is None else s.read(kind, plain, get)

    def __int__(self) -> int:
        return self._read("int", int)

    def __index__(self) -> int:
        return self._read("int", int)

    def __float__(self) -> float:
        return self._read("float", float)

    def __bool__(self) -> bool:
        return self._read("bool", bool)

    def item(self, *args):
        return self._read("item", lambda a: a.item(*args))

    def tolist(self):
        return self._read("tolist", lambda a: a.tolist())

    def get(self) -> np.ndarray:
        """CuPy's copy to the host."""
        return self._read("get", lambda a: np.array(a, copy=True))


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        s = _session()
        if s is not None:
            s.sync("stream")

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    def __init__(self, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        _Stream().synchronize()


class _Cuda:
    Event = _Event
    _stream = _Stream()

    def get_current_stream(self) -> _Stream:
        return self._stream


_ALLOC = {"empty", "empty_like"}
_FILLED = {"zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange"}
_UPLOAD = {"asarray", "array", "ascontiguousarray"}
_SHAPED = {"flatnonzero", "nonzero", "argwhere", "unique", "extract", "compress"}  # sizes known from the data


class RecordingXP:
    """NumPy as the array module of the recording backend: functions hand out :class:`DeviceArray`, counted."""

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if isinstance(attr, (type, np.ufunc)) or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            s = _session()
            if s is None:
                return _wrap(attr(*_plain(args), **_plain(kwargs)))
            if name in _UPLOAD:
                a = args[0]
                if isinstance(a, DeviceArray):
                    if (name == "array" and kwargs.get("copy", True)) or not a.flags.c_contiguous:
                        return a.copy()
                    return a if kwargs.get("dtype") in (None, a.dtype) else a.astype(kwargs["dtype"])
                host = np.asarray(a, dtype=kwargs.get("dtype"))
                s.alloc()
                s.h2d(host.nbytes)
                with _timed(s):  # (the copy stands for the upload)
                    return _wrap(np.array(host, copy=True))
            if name in _ALLOC:
                s.alloc()
                # a replay's kernels write nothing: zeros keep the NumPy stand-ins quiet
                return _wrap((np.zeros if name == "empty" else np.zeros_like)(*_plain(args), **_plain(kwargs)))
            if name in _FILLED:
                s.alloc()
                s.op(name)
                return _wrap(attr(*_plain(args), **_plain(kwargs)))
            if name in _SHAPED and isinstance(args[0], DeviceArray):
                first = args[0].view(np.ndarray)
                return _wrap(s.shaped(name, first, lambda: attr(*_plain(args), **_plain(kwargs))))
            flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,))]
            if s.counting and _host_arrays(flat):
                s.counts.host_numpy[f"xp.{name} given a host array, at {_site()}"] += 1
            s.op(name)
            if name in ("concatenate", "repeat", "where", "cumsum", "diff", "flatnonzero"):
                s.alloc()
            with _timed(s):
                out = attr(*_plain(args), **_plain(kwargs))
            return _wrap(out)

        return call


_ADDR = attrgetter("_addr")


class RecordingRunner:
    """The runner of :class:`RecordingBackend`: records each launch; runs it on ``emulator`` where one is given."""

    xp = RecordingXP()

    def __init__(self, emulator: Any = None):
        self.emulator = emulator

    def launch(self, name: str, grid: Any, block: Any, args: tuple) -> None:
        s = _session()
        if s is not None:
            s.launch(name, grid)
        if self.emulator is not None:
            self.emulator.launch(name, grid, block, tuple(_plain(a) for a in args))

    def ptr(self, a: Any) -> int:
        addr = getattr(a, "_addr", None)  # (a resident tensor's, known from the start, as CuPy's ``data.ptr``)
        return int(_plain(a).ctypes.data) if addr is None else addr

    def ptrs(self, arrays: list) -> list[int]:
        """:meth:`ptr` of each array: resident tensors' addresses read in one C loop, as the CuPy runner's
        ``data.ptr`` of each."""
        try:
            return list(map(_ADDR, arrays))
        except AttributeError:  # (an array made during the call)
            return list(map(self.ptr, arrays))

    def to_host(self, a: Any) -> np.ndarray:
        if not isinstance(a, DeviceArray):
            raise TypeError(f"to_host takes a device array, got {type(a).__name__}")
        s = _session()
        plain = a.view(np.ndarray)
        return np.array(plain, copy=True) if s is None else s.read("to_host", plain, lambda x: np.array(x, copy=True))


class RecordingBackend(KernelFloatOps, ArrayDecoders, KernelBackendBase):
    """The GPU backend's code on :class:`RecordingRunner` (a device backend: ``on_device``, a stream scope that
    ends with the host's wait)."""

    name = "gpu"
    on_device = True

    def __init__(self, emulator: Any = None):
        super().__init__(RecordingRunner(emulator))

    def asarray(self, a: Any) -> Any:
        if isinstance(a, DeviceArray):
            return a
        s = _session()
        if s is not None:
            v = s.views.get(id(a))  # (a resident array itself, whose view was made before: kept alive, so its id
            if v is not None:  # is no other live object's)
                return v
        if not isinstance(a, np.ndarray) and type(a).__module__.split(".")[0] in ("cupy", "torch"):
            raise TypeError(f"the recording backend takes NumPy arrays, got {type(a).__module__}")
        if s is not None and type(a) is np.ndarray and a.size:
            # a resident array, or a view of all of one (a flattened tensor): known by identity, no address read
            known = s.resident.get(id(a))
            if known is not None:
                if known[1] == a.size and a.flags.c_contiguous:
                    v = s.views[id(a)] = a.view(DeviceArray)
                    v._addr = known[0]
                    return v
            elif a.base is not None:
                key = ("flat", id(a.base))  # (a flat view of all of a resident array: its view, made once)
                v = s.views.get(key)
                if v is not None and v.shape == a.shape and v.dtype == a.dtype and a.flags.c_contiguous:
                    return v
                known = s.resident.get(id(a.base))
                if known is not None and known[1] == a.size and a.flags.c_contiguous:
                    v = a.view(DeviceArray)
                    v._addr = known[0]
                    if a.ndim == 1:
                        s.views[key] = v
                    return v
        host = a if type(a) is np.ndarray and a.flags.aligned else np.require(np.asarray(a), requirements="A")
        if s is not None and host.size:
            addr = int(host.ctypes.data)
            if addr in s.addresses:  # stands for a tensor already on the device
                v = host.view(DeviceArray)
                v._addr = addr
                return v
        if s is not None:
            s.alloc()
            s.h2d(host.nbytes)
        with _timed(s):  # (the copy stands for the upload)
            return _wrap(np.array(host, copy=True))

    def asarrays(self, arrays: Any) -> list[Any]:
        s = _session()
        views: dict = s.views if s is not None else {}
        got = list(map(views.get, map(id, arrays)))  # (resident arrays: a lookup in C, as CuPy's a type check)
        if all(map(is_not, got, repeat(None))):
            return got
        return [a if a is None else self.asarray(a) if v is None else v for a, v in zip(arrays, got)]

    def info(self) -> dict[str, Any]:
        return {"allocator": "recording", "runner": "emulator" if self.runner.emulator is not None else "replay"}

    @contextlib.contextmanager
    def stream(self, tensors: Any) -> Iterator[None]:
        with events.scope(self):
            yield


@dataclass
class Measurement:
    """:func:`measure`'s result: the counts of one call, and the replays' times (ms)."""

    counts: Counts
    replay_ms: list[float]
    array_ms: list[float]  # of which in the NumPy work standing for the device's (array-module kernels, copies)

    @property
    def ms(self) -> float:
        """Median replay time."""
        return float(np.median(self.replay_ms))


def _resident(arrays: Iterable[Any]) -> tuple[dict[int, tuple[int, int]], list[Any]]:
    """The NumPy arrays and torch CPU tensors among ``arrays`` (anything else is copied by every call, so it is not
    resident): id -> (data address, elements), and the arrays, which the caller keeps alive so that no other array
    takes an id or an address."""
    known, kept = {}, []
    for group in arrays:
        for a in group.values() if isinstance(group, Mapping) else group:
            if isinstance(a, np.ndarray) and a.size:
                known[id(a)] = (int(a.ctypes.data), int(a.size))
            elif type(a).__module__.startswith("torch") and a.device.type == "cpu" and a.numel():
                known[id(a)] = (int(a.data_ptr()), int(a.numel()))  # (a bfloat16 one: read as its uint16 bits)
            else:
                continue
            kept.append(a)
    return known, kept


@contextlib.contextmanager
def _running(s: _Session) -> Iterator[None]:
    prev = _session()
    _local.session = s
    try:
        yield
    finally:
        _local.session = prev


def _pass(s: _Session, backend: RecordingBackend, call: Callable[[Any], Any], setup: Callable[[], Any] | None):
    with _running(s), using_backend(backend):
        state = setup() if setup is not None else None
        s.counting, s.array_s = True, 0.0
        gc_was = gc.isenabled()
        gc.disable()
        try:
            t0 = time.perf_counter()
            call(state)
            elapsed = time.perf_counter() - t0
        finally:
            if gc_was:
                gc.enable()
            s.counting = False
    return elapsed


def measure(
    call: Callable[[Any], Any],
    *,
    setup: Callable[[], Any] | None = None,
    resident: Iterable[Any] = (),
    repeat: int = 5,
    emulator: Any = None,
) -> Measurement:
    """Record ``call(setup())`` once on the emulator, then replay it ``repeat`` times (see the module docstring).

    ``setup`` (optional) runs first on the same backend, neither counted nor timed (an Aggregator made before its
    ``add``); ``resident``: mappings or lists of the NumPy arrays or torch CPU tensors that stand for device tensors
    (any other input, such as a NumPy scalar, is copied to the device by every call, and counted so).
    ``emulator``: an :class:`~gpu_codec.backends.emulated.EmulatorRunner` to record on (one is built by default).
    """
    if emulator is None:
        from ..backends.emulated import EmulatorRunner

        emulator = EmulatorRunner()
    res, kept = _resident(resident)
    tape: list = []
    log: list = []
    views: dict = {}
    rec = _Session("record", tape, log, res, views)
    _pass(rec, RecordingBackend(emulator), call, setup)
    times, array = [], []
    for _ in range(repeat):
        s = _Session("replay", tape, log, res, views)
        times.append(1e3 * _pass(s, RecordingBackend(None), call, setup))
        array.append(1e3 * s.array_s)
        if s.pos != len(tape) or s.lpos != len(log):
            raise RecordingError(f"the replay made {s.pos} of {len(tape)} reads and {s.lpos} of {len(log)} launches")
        got, want = s.counts.totals(), rec.counts.totals()
        if got != want:
            raise RecordingError(f"the replay counted {got}, the recording {want}")
    del kept  # (alive until here)
    return Measurement(rec.counts, times, array)
