"""Where the GPU path would do float arithmetic through CuPy's own kernels, found on the CPU.

CuPy compiles its elementwise and reduction kernels with ``-ftz=true``: every single-precision operation it runs
(a multiply, a cast to or from fp32, an ``abs``, a ``max``, a comparison) flushes subnormal inputs and results
to zero, where the NumPy twins keep them (an fp32 -> fp64 cast compiles to ``cvt.ftz.f64.f32``). ``-ftz``
leaves double precision alone: an operation on fp64 alone keeps IEEE subnormals, and one ufunc is one CuPy
kernel, so nothing is contracted into an FMA across ufuncs. An fp16 -> wider cast is exact too: CuPy's half type
converts with ``__half2float``, inline PTX ``cvt.f32.f16`` that the flag does not touch, and every fp16 value
is a normal fp32. Our kernels compile without ``-ftz`` (:mod:`gpu_codec.backends.nvrtc`). So on the GPU path,
every single-precision operation whose result reaches the bytes runs in our kernels, or as integer operations on
the floats' bits.

:func:`audit_backend` is the emulated backend (the GPU path's launches, on the CPU) whose array module hands out
:class:`Recorded` arrays: NumPy arrays that log each float operation done on them outside a kernel (a ufunc or
reduction with a float operand or result, a cast between float dtypes, a store that casts). A test runs the
library on it and checks the log is empty.

>>> a = np.arange(3, dtype=np.float32).view(Recorded)
>>> with recording() as log:
...     _ = a * 2
...     _ = a.view(np.uint32) >> 1          # integer work on the bits: not logged
...     _ = a.astype(np.float64) * 2.0      # the cast flushes; the fp64 multiply does not
>>> [(e.op, e.dtypes) for e in log]
[('multiply', ('float32', 'int64', 'float32')), ('astype', ('float32', 'float64'))]
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# classifications a flush cannot change (a subnormal is finite, not NaN, not inf, whatever the mode)
EXACT_UFUNCS = frozenset({"isfinite", "isnan", "isinf"})

_local = threading.local()


@dataclass(frozen=True)
class FloatOp:
    """One float operation outside our kernels: what (ufunc name, "astype" or "setitem"), the dtypes involved,
    and the innermost gpu_codec frame that asked for it."""

    op: str
    dtypes: tuple[str, ...]
    where: str


def _log() -> list[FloatOp] | None:
    return getattr(_local, "log", None)


def _caller() -> str:
    for f in reversed(traceback.extract_stack(limit=30)[:-3]):
        if ("gpu_codec" in f.filename and "ftz_audit" not in f.filename) or "cpu_fallback" in f.filename:
            return f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
    return "?"


def _note(op: str, dts: tuple[str, ...]) -> None:
    log = _log()
    if log is not None:
        log.append(FloatOp(op, dts, _caller()))


@contextlib.contextmanager
def recording() -> Iterator[list[FloatOp]]:
    """Log the float operations done on :class:`Recorded` arrays in this thread inside the block."""
    prev = _log()
    _local.log = []
    try:
        yield _local.log
    finally:
        _local.log = prev


def _flushes(dts) -> bool:
    """Whether an operation on these dtypes runs single-precision (or narrower) float code under -ftz."""
    return any(d is not None and d.kind == "f" and d.itemsize <= 4 for d in dts)


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if isinstance(x, Recorded) else x


def _wrap(x: Any) -> Any:
    return x.view(Recorded) if type(x) is np.ndarray else x


def _dtype_of(x: Any) -> np.dtype | None:
    if isinstance(x, (np.ndarray, np.generic)):
        return x.dtype
    if isinstance(x, float):
        return np.dtype(np.float64)
    if isinstance(x, (bool, int)):
        return np.dtype(np.int64)
    return None


class Recorded(np.ndarray):
    """A NumPy array standing for a CuPy array on the GPU path (see the module docstring)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        result = getattr(ufunc, method)(*(_plain(i) for i in inputs), **kwargs)
        results = result if isinstance(result, tuple) else (result,)
        dts = [_dtype_of(i) for i in inputs] + [_dtype_of(r) for r in results] + [_dtype_of(o) for o in outs or ()]
        if ufunc.__name__ not in EXACT_UFUNCS and _flushes(dts):
            _note(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}", tuple(map(str, dts)))
        if outs is not None:
            return outs[0] if len(outs) == 1 else outs
        return tuple(_wrap(r) for r in results) if isinstance(result, tuple) else _wrap(result)

    def astype(self, dtype, *args, **kwargs):
        dt = np.dtype(dtype)
        widen16 = self.dtype == np.float16 and dt.itemsize > 2  # exact (see the module docstring)
        if (
            self.dtype.kind == "f"
            and dt.kind == "f"
            and dt != self.dtype
            and not widen16
            and _flushes((self.dtype, dt))
        ):
            _note("astype", (str(self.dtype), str(dt)))
        return _wrap(self.view(np.ndarray).astype(dt, *args, **kwargs))

    def __setitem__(self, key, value):
        dv = _dtype_of(value)
        if (
            self.dtype.kind == "f"
            and dv is not None
            and dv.kind == "f"
            and dv != self.dtype
            and _flushes((dv, self.dtype))
        ):
            _note("setitem", (str(dv), str(self.dtype)))
        self.view(np.ndarray)[key] = _plain(value)

    def fill(self, value):
        dv = _dtype_of(value)
        if dv is not None and dv.kind == "f" == self.dtype.kind and value != 0 and _flushes((dv, self.dtype)):
            _note("fill", (str(dv), str(self.dtype)))
        self.view(np.ndarray).fill(value)


class RecordingXP:
    """NumPy as an array module whose functions hand out :class:`Recorded` arrays (types and ufuncs as they
    are: a ufunc called on a Recorded array logs through it)."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if isinstance(attr, (type, np.ufunc)) or not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            return tuple(_wrap(o) for o in out) if isinstance(out, tuple) else _wrap(out)

        return call


def audit_backend() -> Any:
    """The emulated backend on :class:`RecordingXP` (built on first use: the emulator needs a C++ compiler)."""
    from ..backends.emulated import EmulatedBackend, EmulatorRunner

    class AuditRunner(EmulatorRunner):
        xp = RecordingXP()

        def to_host(self, a: Any) -> np.ndarray:
            return np.array(_plain(a), copy=True)

    class AuditBackend(EmulatedBackend):
        def asarray(self, a: Any) -> Any:
            return _wrap(np.ascontiguousarray(_plain(super().asarray(a))))

        def to_host(self, a: Any) -> np.ndarray:
            return np.array(_plain(a), copy=True)

    return AuditBackend(AuditRunner())


__all__ = ["EXACT_UFUNCS", "FloatOp", "Recorded", "RecordingXP", "audit_backend", "recording"]


def audit_pipelines() -> dict[str, list | None]:
    """The pipelines the float audit runs (and ``benchmarks/gpu_suite.py`` on a GPU), by name: raw (None), every
    value codec, and Rice-coded indices."""
    from ..codecs import Int8Blockwise, Quantize, RiceIndices, Ternary

    return {
        "raw": None,
        "int8": [Int8Blockwise(block_size=64)],
        "f16": [Quantize("float16")],
        "bf16": [Quantize("bfloat16")],
        "ternary": [Ternary()],
        "rice": [RiceIndices()],
    }
