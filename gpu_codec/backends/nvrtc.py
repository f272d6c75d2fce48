"""Device code for kernels/*.cu, compiled by NVRTC with exactly :func:`gpu_codec.constants.compile_options`.

CuPy's ``RawModule(code=...)`` appends ``-ftz=true`` after the caller's options, so the device would flush
subnormals where the NumPy twins keep them (the bytes would differ on subnormal inputs, and the sign of a tiny
negative delta could flip). We compile with NVRTC ourselves instead, and hand the CUBIN (or PTX, where this NVRTC
does not know the device's architecture) to CuPy's module loader. No GPU is needed to compile: CI compiles
every kernel through :func:`compile_source` with the runtime's options and checks the PTX for ``.ftz``.

Results are cached in memory and on disk (``$GPU_CODEC_CACHE_DIR/nvrtc``, else ``~/.cache/gpu_codec/nvrtc``),
keyed by the source, the options, the target and the NVRTC version.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

from ..constants import compile_options
from ..errors import BackendUnavailableError
from .files import replace_atomically

_lock = threading.Lock()
_memory: dict[str, bytes] = {}


class KernelCompileError(BackendUnavailableError):
    """NVRTC rejected a kernel source (the message holds the program log)."""


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); raises where NVRTC cannot be loaded."""
    from cupy.cuda import nvrtc

    major, minor = nvrtc.getVersion()
    return int(major), int(minor)


@functools.cache
def supported_archs() -> tuple[int, ...]:
    from cupy.cuda import nvrtc

    return tuple(int(a) for a in nvrtc.getSupportedArchs())


def driver_version() -> int:
    """The CUDA version the driver supports, as CUDA writes it (12080 for 12.8); 0 where there is no driver."""
    from cupy.cuda import runtime

    return int(runtime.driverGetVersion())


def _as_cuda_version(v: tuple[int, int]) -> int:
    return v[0] * 1000 + v[1] * 10


def _dotted(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def target_for(cc: int, driver: int | None = None) -> tuple[str, bool]:
    """(``--gpu-architecture`` value, whether it is a CUBIN) for a device of compute capability ``cc`` (e.g. 90)
    whose driver supports CUDA ``driver`` (as :func:`driver_version`; None: ask the driver).

    - a CUBIN for ``sm_cc`` where NVRTC knows the architecture;
    - else a CUBIN for the newest architecture NVRTC knows of the same major version at or below ``cc`` (SASS
      runs on later minor versions of its major: 8.0 code on an 8.9 device), which needs no driver JIT;
    - else PTX for the newest architecture NVRTC knows at or below ``cc``, which the driver JIT-compiles: only
      where the driver is at least as new as NVRTC (an older driver rejects a newer PTX ISA);
    - else :class:`~gpu_codec.errors.BackendUnavailableError`, saying why (the backend choice then falls back to
      NumPy with that reason in ``backend_info()``).
    """
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}", True
    same_major = [a for a in archs if a // 10 == cc // 10 and a <= cc]
    if same_major:
        return f"sm_{max(same_major)}", True
    older = [a for a in archs if a <= cc]
    nv = nvrtc_version()
    if not older:
        raise BackendUnavailableError(f"NVRTC {nv[0]}.{nv[1]} supports no architecture at or below sm_{cc}")
    drv = driver_version() if driver is None else int(driver)
    if drv < _as_cuda_version(nv):
        raise BackendUnavailableError(
            f"NVRTC {nv[0]}.{nv[1]} does not know sm_{cc}, and its PTX (for compute_{max(older)}) needs a driver "
            f"for CUDA {nv[0]}.{nv[1]} or newer to load; this driver supports CUDA {_dotted(drv)}"
        )
    return f"compute_{max(older)}", False


def describe_target(cc: int, driver: int | None = None) -> str:
    """What :func:`target_for` picks for ``cc`` and why, in words (``backend_info()["kernels"]``)."""
    arch, cubin = target_for(cc, driver)
    nv = nvrtc_version()
    if cubin and arch == f"sm_{cc}":
        return f"CUBIN for {arch} (NVRTC {nv[0]}.{nv[1]})"
    if cubin:
        return f"CUBIN for {arch}: NVRTC {nv[0]}.{nv[1]} does not know sm_{cc}, which runs {arch} code"
    drv = driver_version() if driver is None else int(driver)
    return (
        f"PTX for {arch}: NVRTC {nv[0]}.{nv[1]} does not know sm_{cc}; the driver (CUDA {_dotted(drv)}) "
        "compiles it on load"
    )


def options_for(arch: str) -> tuple[str, ...]:
    """The full NVRTC option list for ``arch``: the package's options, then the target."""
    return (*compile_options(), f"--gpu-architecture={arch}")


def compile_source(source: str, name: str, arch: str, extra: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile ``source`` for ``arch`` (``sm_XX``: CUBIN, ``compute_XX``: PTX); returns (image, program log).

    Raises :class:`KernelCompileError` with the log when NVRTC fails.
    """
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options_for(arch), *extra])
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog).replace("\x00", "")
            raise KernelCompileError(f"NVRTC failed on {name} for {arch}: {e}\n{log}") from None
        log = nvrtc.getProgramLog(prog).replace("\x00", "")
        if arch.startswith("sm_"):
            image = nvrtc.getCUBIN(prog)
        else:
            image = nvrtc.getPTX(prog)
        if isinstance(image, str):
            image = image.encode()
        return bytes(image), log
    finally:
        nvrtc.destroyProgram(prog)


def ptx_of(source: str, name: str, arch: str) -> str:
    """The PTX of ``source`` under the runtime's options (``arch`` as ``sm_XX`` or ``compute_XX``)."""
    image, _ = compile_source(source, name, arch.replace("sm_", "compute_"))
    return image.rstrip(b"\x00").decode()


def _cache_dir() -> Path:
    env = os.environ.get("GPU_CODEC_CACHE_DIR")
    root = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu_codec"
    return root / "nvrtc"


def cached_image(source: str, name: str, arch: str) -> bytes:
    """:func:`compile_source`'s image, from the memory or disk cache where it is there already."""
    key = hashlib.sha256(
        "\0".join((source, name, arch, *options_for(arch), repr(nvrtc_version()))).encode()
    ).hexdigest()[:40]
    with _lock:
        hit = _memory.get(key)
        if hit is not None:
            return hit
        path = _cache_dir() / f"{key}.{'cubin' if arch.startswith('sm_') else 'ptx'}"
        try:
            image = path.read_bytes()
        except OSError:
            image, _ = compile_source(source, name, arch)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                replace_atomically(path, lambda f: f.write(image))
            except OSError:
                pass  # an unwritable cache only costs a compile per process
        _memory[key] = image
        return image


__all__ = [
    "KernelCompileError",
    "cached_image",
    "compile_source",
    "describe_target",
    "driver_version",
    "nvrtc_version",
    "options_for",
    "ptx_of",
    "supported_archs",
    "target_for",
]
