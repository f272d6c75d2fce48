"""The emulated runner: the CUDA kernels of kernels/*.cu compiled with g++ and run on the CPU.

Each ``.cu`` source is compiled unchanged, after the shim header ``kernels/host/cuda_shim.h`` (the CUDA built-ins
our kernels use) and before a launcher generated from its ``extern "C" __global__`` signatures, into one shared
library together with ``kernels/host/emu_runtime.cpp`` (the block scheduler: fibers with real ``__syncthreads``
barriers and warp-lockstep intrinsics). The library is built on first use and cached on disk, keyed by a hash of
every source, the shim, the runtime, the compiler and its flags; it is loaded with :mod:`ctypes`.

:class:`EmulatorRunner` implements the runner protocol of :mod:`gpu_codec.backends.base` (``xp``, ``launch``,
``ptr``, ``to_host``) on NumPy memory, so ``KernelOps(EmulatorRunner())`` (:mod:`gpu_codec.backends.kernels`)
runs exactly what the GPU backend launches; :class:`EmulatedBackend` is the backend built on it. It is for
tests, not speed: thousands of elements per second per thread-switch, not billions.
``EmulatorRunner(sources={"topk.cu": text})`` builds from modified source text (tests plant bugs that way).

What the emulator cannot see (races inside a barrier interval, out-of-bounds accesses, ...) is listed in
kernels/host/README.md and at the top of cuda_shim.h.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import defines
from ..errors import BackendUnavailableError
from .decode import ArrayDecoders
from .float_ops import KernelFloatOps
from .kernels import KernelBackendBase
from .sources import parse_signatures

__all__ = [
    "DEFINES",
    "SCHEDULES",
    "EmulatedBackend",
    "EmulatorError",
    "EmulatorRunner",
    "EmulatorUnavailableError",
    "build_library",
    "expand_source",
    "parse_signatures",
]

DEFINES = defines()  # gpu_codec/constants.py, as every device compile
CXX_FLAGS = (
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-pthread",
)
LINK_FLAGS = ("-shared", "-pthread", "-Wl,-z,noexecstack")
SCHEDULES = {"forward": 0, "reverse": 1, "shuffle": 2}
# The traffic-counting build: GCC's address instrumentation in call mode on the kernel units only, so every
# global load and store calls a hook in emu_runtime.cpp (no shadow memory, no redzones, no globals registry).
TRACE_FLAGS = (
    "-fsanitize=kernel-address",
    "-fasan-shadow-offset=0x7fff8000",
    "--param",
    "asan-instrumentation-with-call-threshold=0",
    "--param",
    "asan-stack=0",
    "--param",
    "asan-globals=0",
    "-DEMU_TRACE",
)
SECTOR = 32  # bytes: the unit of DRAM traffic counted per launch
_ABI = 1

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_./-]+)"\s*$')

# C type of a by-value argument -> NumPy scalar type the caller must pass.
_SCALAR_TYPES: dict[str, type] = {
    "int": np.int32,
    "signed": np.int32,
    "signed int": np.int32,
    "int32_t": np.int32,
    "unsigned": np.uint32,
    "unsigned int": np.uint32,
    "u32": np.uint32,
    "uint32_t": np.uint32,
    "long long": np.int64,
    "long long int": np.int64,
    "i64": np.int64,
    "int64_t": np.int64,
    "unsigned long long": np.uint64,
    "unsigned long long int": np.uint64,
    "u64": np.uint64,
    "uint64_t": np.uint64,
    "short": np.int16,
    "unsigned short": np.uint16,
    "u16": np.uint16,
    "float": np.float32,
    "double": np.float64,
}
# Element type of a pointer argument -> the NumPy dtype its array must have (void: any).
_POINTEE_DTYPES = {k: np.dtype(v) for k, v in _SCALAR_TYPES.items()}
_POINTEE_DTYPES.update(
    {
        "char": np.dtype(np.int8),
        "signed char": np.dtype(np.int8),
        "unsigned char": np.dtype(np.uint8),
        "bool": np.dtype(np.bool_),
    }
)
_CTYPES = {
    np.dtype(np.int8): ctypes.c_int8,
    np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16,
    np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


class EmulatorError(RuntimeError):
    """A kernel did something the emulator rejects (deadlock, divergent barrier, bad launch) or a bad argument."""


class EmulatorUnavailableError(BackendUnavailableError):
    """No C++ compiler to build the emulator with, or the build failed."""


class _Config(ctypes.Structure):
    """Mirror of ``emu::LaunchConfig`` in cuda_shim.h."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("schedule", ctypes.c_int),
        ("poison", ctypes.c_int),
        ("seed", ctypes.c_ulonglong),
        ("blocks_run", ctypes.c_ulonglong),
        ("barriers", ctypes.c_ulonglong),
        ("warp_collectives", ctypes.c_ulonglong),
        ("switches", ctypes.c_ulonglong),
        ("error", ctypes.c_char * 2048),
    ]


# ------------------------------------------------------------------------------------------------ sources


def _kernel_dir():
    return resources.files("gpu_codec.kernels")


def _host_file(name: str) -> str:
    return _kernel_dir().joinpath("host").joinpath(name).read_text()


def _package_text(name: str) -> str:
    return _kernel_dir().joinpath(name).read_text()


def package_sources() -> dict[str, str]:
    """The shipped kernel sources and headers (``.cu`` and ``.cuh``), by file name."""
    return {p.name: p.read_text() for p in _kernel_dir().iterdir() if p.name.endswith((".cu", ".cuh"))}


def expand_source(name: str, sources: Mapping[str, str] | None = None) -> str:
    """``name`` with local ``#include "x"`` lines expanded (each file once), as ``sources.kernel_source`` does,
    plus ``#line`` markers so that compiler messages and the emulator's reports name the original file and line.
    Files are looked up in ``sources`` first, then in the package."""
    sources = dict(sources or {})
    seen: set[str] = set()

    def text_of(f: str) -> str:
        return sources[f] if f in sources else _package_text(f)

    def expand(f: str, text: str) -> str:
        out = []
        for i, line in enumerate(text.split("\n"), 1):
            m = _INCLUDE.match(line)
            if not m:
                out.append(line)
                continue
            inc = m.group(1)
            if inc in seen:
                out.append("")
                continue
            seen.add(inc)
            out.append(f'#line 1 "{inc}"')
            out.append(expand(inc, text_of(inc)))
            out.append(f'#line {i + 1} "{f}"')
        return "\n".join(out)

    return f'#line 1 "{name}"\n' + expand(name, text_of(name))


def _glue(fname: str, expanded: str, sigs: Mapping[str, tuple[tuple[str, str], ...]]) -> str:
    """One translation unit: the shim, the kernel source, and one ``emu_launch_<name>`` per kernel."""
    parts = [
        '#include "cuda_shim.h"',
        expanded,
        "",
        f"// ---- launchers generated by gpu_codec/backends/emulated.py for {fname}",
    ]
    for name, args in sigs.items():
        fields = "".join(f"    {ct} a{i};\n" for i, (ct, _) in enumerate(args))
        call = ", ".join(f"a->a{i}" for i in range(len(args)))
        init = ", ".join(f"*({ct}*)argv[{i}]" for i, (ct, _) in enumerate(args))
        parts.append(
            f"namespace {{\nstruct emu_args_{name} {{\n{fields}    char unused_;\n}};\n"
            f"void emu_thunk_{name}(void* p) {{\n    emu_args_{name}* a = (emu_args_{name}*)p;\n"
            f"    (void)a;\n    {name}({call});\n}}\n}}  // namespace\n"
            f"EMU_EXPORT int emu_launch_{name}(::emu::LaunchConfig* cfg, void** argv) {{\n"
            f"    (void)argv;\n    emu_args_{name} a = {{{init}{', ' if args else ''}0}};\n"
            f"    return ::emu::launch(cfg, emu_thunk_{name}, &a);\n}}\n"
        )
    return "\n".join(parts) + "\n"


# -------------------------------------------------------------------------------------------------- build


def _cache_root() -> Path:
    env = os.environ.get("GPU_CODEC_CACHE_DIR")
    if env:
        root = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "gpu_codec"
    return root / "emulator"


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    raise EmulatorUnavailableError("the emulated backend needs a C++20 compiler (g++ or clang++; set CXX), none found")


_version_cache: dict[str, str] = {}


def _compiler_id(cxx: str) -> str:
    if cxx not in _version_cache:
        try:
            r = subprocess.run(cxx.split() + ["--version"], check=False, capture_output=True, text=True, timeout=60)
            _version_cache[cxx] = r.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            raise EmulatorUnavailableError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return _version_cache[cxx]


_build_lock = threading.Lock()
# ctypes array types made once: ctypes holds an array type only while something uses it, so one made a launch
# would be a new type (a reference cycle) each time
_TRACE_COUNTS = ctypes.c_ulonglong * 3


@functools.cache
def _argv_type(n: int) -> Any:
    """The ctypes array type of ``n`` pointers (made once a length)."""
    return ctypes.c_void_p * n


_launch_lock = threading.Lock()


def build_library(
    sources: Mapping[str, str] | None = None,
    *,
    package: bool = True,
    cxx: str | None = None,
    trace: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Path, dict[str, tuple[tuple[str, str], ...]]]:
    """Build (or find in the cache) the emulator library; returns its path and the kernel signatures in it.

    ``sources`` maps file names to source text; it replaces packaged files of the same name and adds new ones
    (``.cuh`` headers too). With ``package=False`` only the ``.cu`` files of ``sources`` are compiled.
    """
    sources = dict(sources or {})
    cu = sorted(
        {n for n in sources if n.endswith(".cu")}
        | ({n for n in package_sources() if n.endswith(".cu")} if package else set())
    )
    if not cu:
        raise EmulatorError("no .cu source to build")
    cxx = cxx or _compiler()
    defines = tuple(f"-D{k}={v}" for k, v in DEFINES.items())
    units: dict[str, str] = {}
    sigs: dict[str, tuple[tuple[str, str], ...]] = {}
    owner: dict[str, str] = {}
    for f in cu:
        expanded = expand_source(f, sources)
        fs = parse_signatures(expanded)
        for k in fs:
            if k in owner:
                raise EmulatorError(f"kernel {k} is defined in both {owner[k]} and {f}")
            owner[k] = f
        sigs.update(fs)
        units["gen_" + re.sub(r"[^A-Za-z0-9_]", "_", f) + ".cpp"] = _glue(f, expanded, fs)
    shim, runtime = _host_file("cuda_shim.h"), _host_file("emu_runtime.cpp")
    key = hashlib.sha256(
        json.dumps(
            {
                "abi": _ABI,
                "cxx": cxx,
                "cxx_id": _compiler_id(cxx),
                "machine": platform.machine(),
                "flags": CXX_FLAGS + LINK_FLAGS + defines,
                "trace": TRACE_FLAGS if trace else (),
                "shim": shim,
                "runtime": runtime,
                "units": units,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:32]
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    final = root / f"emu-{key}"
    lib = final / "libgpu_codec_emu.so"
    if lib.exists():
        return lib, sigs
    with _build_lock:
        if lib.exists():
            return lib, sigs
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        except OSError:
            root = Path(tempfile.gettempdir()) / f"gpu_codec-{os.getuid() if hasattr(os, 'getuid') else 0}" / "emulator"
            root.mkdir(parents=True, exist_ok=True)
            final, tmp = root / f"emu-{key}", Path(tempfile.mkdtemp(prefix=".build-", dir=root))
            lib = final / "libgpu_codec_emu.so"
            if lib.exists():
                return lib, sigs
        try:
            (tmp / "cuda_shim.h").write_text(shim)
            (tmp / "emu_runtime.cpp").write_text(runtime)
            for n, text in units.items():
                (tmp / n).write_text(text)
            srcs = ["emu_runtime.cpp", *units]

            def compile_one(src: str) -> tuple[str, subprocess.CompletedProcess]:
                extra = () if not trace else ("-DEMU_TRACE",) if src == "emu_runtime.cpp" else TRACE_FLAGS
                cmd = [*cxx.split(), *CXX_FLAGS, *defines, *extra, "-I.", "-c", src, "-o", src[:-4] + ".o"]
                return src, subprocess.run(cmd, check=False, cwd=tmp, capture_output=True, text=True)

            with ThreadPoolExecutor(max_workers=max(1, min(len(srcs), os.cpu_count() or 1))) as ex:
                results = list(ex.map(compile_one, srcs))
            for src, r in results:
                if r.returncode:
                    raise EmulatorUnavailableError(
                        f"emulator build failed compiling {src} in {tmp}:\n{r.stderr[-8000:]}"
                    )
            r = subprocess.run(
                [*cxx.split(), *LINK_FLAGS, "-o", "libgpu_codec_emu.so", *(s[:-4] + ".o" for s in srcs)],
                check=False,
                cwd=tmp,
                capture_output=True,
                text=True,
            )
            if r.returncode:
                raise EmulatorUnavailableError(f"emulator link failed in {tmp}:\n{r.stderr[-8000:]}")
            (tmp / "manifest.json").write_text(
                json.dumps({"kernels": {k: owner[k] for k in sigs}, "cxx": cxx, "flags": CXX_FLAGS + defines}, indent=1)
            )
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished the same build first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return lib, sigs


_loaded: dict[Path, ctypes.CDLL] = {}


def _load(lib: Path) -> ctypes.CDLL:
    with _build_lock:
        dll = _loaded.get(lib)
        if dll is None:
            dll = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            if dll.emu_abi_version() != _ABI:
                raise EmulatorError(f"{lib} has ABI {dll.emu_abi_version()}, expected {_ABI}")
            _loaded[lib] = dll
        return dll


# ------------------------------------------------------------------------------------------------- runner


def _base_type(ctype: str) -> str:
    words = [
        w
        for w in ctype.replace("*", " ").split()
        if w not in ("const", "volatile", "__restrict__", "__restrict", "struct")
    ]
    return " ".join(words)


class _Arg:
    __slots__ = ("ctype", "dtype", "name", "pointer", "writable")

    def __init__(self, ctype: str, name: str):
        self.name, self.ctype = name, ctype
        self.pointer = ctype.count("*") > 0
        base = _base_type(ctype)
        if self.pointer:
            if ctype.count("*") > 1:
                self.dtype = np.dtype(np.uint64)  # a pointer to pointers: a table of addresses
            else:
                self.dtype = None if base == "void" else _POINTEE_DTYPES.get(base)
                if base != "void" and self.dtype is None:
                    raise EmulatorError(f"argument {name}: unsupported pointer type {ctype!r}")
            self.writable = not ctype.lstrip().startswith("const")
        else:
            if base not in _SCALAR_TYPES:
                raise EmulatorError(f"argument {name}: unsupported by-value type {ctype!r}")
            self.dtype = np.dtype(_SCALAR_TYPES[base])
            self.writable = False


def _dims(d: Any) -> tuple[int, int, int]:
    if isinstance(d, (tuple, list)):
        v = [int(x) for x in d] + [1] * (3 - len(d))
        if len(v) != 3:
            raise EmulatorError(f"launch dimensions {d!r}: at most 3")
        return v[0], v[1], v[2]
    return int(d), 1, 1


class EmulatorRunner:
    """Runner of the emulated backend (see the module docstring).

    ``schedule`` is the order in which blocks, and the threads of a block after every barrier, run:
    ``"forward"``, ``"reverse"`` or ``"shuffle"`` (seeded by ``seed``). A kernel whose result depends on it has a
    race. ``poison`` is the byte written over shared memory before each block (``None``: leave it).
    """

    xp = np

    def __init__(
        self,
        sources: Mapping[str, str] | None = None,
        *,
        package: bool = True,
        schedule: str = "forward",
        seed: int = 0,
        poison: int | None = 0xA5,
        cxx: str | None = None,
        trace: bool = False,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.schedule, self.seed, self.poison = schedule, int(seed), poison
        self.library, sigs = build_library(sources, package=package, cxx=cxx, trace=trace)
        self.trace = trace
        self.traffic: list[dict[str, Any]] = []  # per launch, with trace=True: sectors read / written
        # address -> (bytes, owner) of every live array handed to a kernel (trace=True)
        self._buffers: dict[tuple[int, int], Any] = {}
        self._dll = _load(self.library)
        self.signatures = sigs
        self._args = {k: tuple(_Arg(ct, n) for ct, n in v) for k, v in sigs.items()}
        self._fns: dict[str, Any] = {}
        self.launch_counts: Counter[str] = Counter()
        self.last_stats: dict[str, int] = {}

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            if name not in self._args:
                raise EmulatorError(f"no kernel named {name!r} (have {', '.join(sorted(self._args))})")
            fn = getattr(self._dll, f"emu_launch_{name}")
            fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        return fn

    def _marshal(self, name: str, args: tuple) -> tuple[list, Any]:
        spec = self._args[name]
        if len(args) != len(spec):
            raise TypeError(f"{name} takes {len(spec)} arguments ({', '.join(a.name for a in spec)}), got {len(args)}")
        values = []
        for a, v in zip(spec, args):
            if a.pointer:
                if v is None:
                    values.append(ctypes.c_void_p(0))
                    continue
                if not isinstance(v, np.ndarray):
                    raise TypeError(
                        f"{name}: argument {a.name} ({a.ctype}) must be a NumPy array, got {type(v).__name__}"
                    )
                if a.dtype is not None and v.dtype != a.dtype:
                    raise TypeError(f"{name}: argument {a.name} ({a.ctype}) needs dtype {a.dtype}, got {v.dtype}")
                if not v.flags.c_contiguous:
                    raise TypeError(f"{name}: argument {a.name} must be C-contiguous")
                if a.writable and not v.flags.writeable:
                    raise TypeError(f"{name}: argument {a.name} ({a.ctype}) is written but the array is read-only")
                values.append(ctypes.c_void_p(v.ctypes.data))
                if self.trace:
                    self._note(v)
            else:
                if not isinstance(v, np.generic) or v.dtype != a.dtype:
                    raise TypeError(
                        f"{name}: argument {a.name} ({a.ctype}) must be a NumPy {a.dtype} scalar "
                        f"(as CuPy needs it), got {type(v).__name__}"
                    )
                values.append(_CTYPES[a.dtype](v.item()))
        argv = _argv_type(max(1, len(values)))(*[ctypes.addressof(x) for x in values])
        return values, argv

    def launch(self, name: str, grid: Any, block: Any, args: tuple) -> None:
        fn = self._fn(name)
        values, argv = self._marshal(name, tuple(args))
        cfg = _Config()
        cfg.grid[:] = _dims(grid)
        cfg.block[:] = _dims(block)
        cfg.schedule = SCHEDULES[self.schedule]
        cfg.poison = -1 if self.poison is None else int(self.poison) & 0xFF
        # the native runtime's scheduler state is process-wide: one launch at a time, whatever the thread
        with _launch_lock:
            cfg.seed = self.seed + sum(self.launch_counts.values())
            if self.trace:
                ranges = self._live_ranges()
                self._dll.emu_trace_begin(ranges.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(len(ranges)))
            rc = fn(ctypes.byref(cfg), argv)
            if self.trace:
                out = _TRACE_COUNTS()
                self._dll.emu_trace_end(out)
                self.traffic.append(
                    {"kernel": name, "read_bytes": SECTOR * out[0], "write_bytes": SECTOR * out[1], "grid": _dims(grid)}
                )
            self.launch_counts[name] += 1
        del values
        self.last_stats = {
            "blocks": int(cfg.blocks_run),
            "barriers": int(cfg.barriers),
            "warp_collectives": int(cfg.warp_collectives),
            "switches": int(cfg.switches),
        }
        if rc != 0:
            raise EmulatorError(f"{name}<<<{_dims(grid)}, {_dims(block)}>>>: {cfg.error.decode(errors='replace')}")

    def _note(self, a: np.ndarray) -> None:
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        self._buffers[(int(a.ctypes.data), int(a.nbytes))] = weakref.ref(owner)

    def _live_ranges(self) -> np.ndarray:
        live = {k: r for k, r in self._buffers.items() if r() is not None}
        self._buffers = live
        return np.asarray([(a, a + n) for a, n in live] or [(0, 0)], dtype=np.uint64)

    def ptr(self, a: Any) -> int:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"the emulated runner works on NumPy arrays, got {type(a).__name__}")
        if self.trace:
            self._note(a)
        return int(a.ctypes.data)

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)


class EmulatedBackend(KernelFloatOps, ArrayDecoders, KernelBackendBase):
    """The kernels of kernels/*.cu run on the CPU by :class:`EmulatorRunner`, on NumPy memory (tests)."""

    name = "emulated"
    on_device = False

    def __init__(self, runner: EmulatorRunner | None = None):
        super().__init__(runner or EmulatorRunner())

    def asarray(self, a: Any) -> np.ndarray:
        if type(a).__module__.startswith("cupy"):
            return a.get()
        return np.require(np.asarray(a), requirements="A")  # kernels load whole words: aligned memory only

    def info(self) -> dict[str, Any]:
        return {"allocator": "numpy"}

    def stream(self, tensors) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
