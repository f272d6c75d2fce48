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
import tempfile
import threading
from pathlib import Path

from ..constants import compile_options
from ..errors import BackendUnavailableError

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


def target_for(cc: int) -> tuple[str, bool]:
    """(``--gpu-architecture`` value, whether it is a CUBIN) for a device of compute capability ``cc`` (e.g. 90):
    a CUBIN where NVRTC knows the architecture, else PTX for the newest one it knows (the driver compiles it)."""
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}", True
    older = [a for a in archs if a <= cc]
    if not older:
        raise BackendUnavailableError(f"NVRTC {nvrtc_version()} supports no architecture at or below sm_{cc}")
    return f"compute_{max(older)}", False


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
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(image)
                os.replace(tmp, path)
            except OSError:
                pass  # an unwritable cache only costs a compile per process
        _memory[key] = image
        return image


__all__ = [
    "KernelCompileError",
    "cached_image",
    "compile_source",
    "nvrtc_version",
    "options_for",
    "ptx_of",
    "supported_archs",
    "target_for",
]
