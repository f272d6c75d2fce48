"""Kernel sources shipped inside the package (kernels/ is installed as ``gpu_codec.kernels``).

Sources are read through :mod:`importlib.resources`, so they load from a wheel as from a checkout. Local
``#include "x.cuh"`` lines are expanded in place, which lets NVRTC compile a source with no include path.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_./-]+)"\s*$', re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


def _files():
    return resources.files("gpu_codec.kernels")


def kernel_files() -> list[str]:
    """Names of the ``.cu`` sources, sorted.

    >>> "topk.cu" in kernel_files()
    True
    """
    return sorted(p.name for p in _files().iterdir() if p.name.endswith(".cu"))


@functools.cache
def kernel_source(name: str) -> str:
    """The source of ``name`` with local includes expanded (each header once)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def repl(m: re.Match) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(_files().joinpath(inc).read_text())

        return _INCLUDE.sub(repl, text)

    return expand(_files().joinpath(name).read_text())


def parse_signatures(text: str) -> dict[str, tuple[tuple[str, str], ...]]:
    """Every ``extern "C" __global__`` kernel in ``text``: name -> ((C type, argument name), ...).

    >>> parse_signatures('extern "C" __global__ void k(int n, const float *x) {}')
    {'k': (('int', 'n'), ('const float*', 'x'))}
    """
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for m in _KERNEL.finditer(text):
        args = []
        for a in m.group(2).split(","):
            a = " ".join(a.split())
            if not a:
                continue
            ctype, _, argname = a.rpartition(" ")
            if argname.startswith("*"):
                ctype, argname = ctype + "*", argname.lstrip("*")
            args.append((ctype.replace(" *", "*"), argname))
        out[m.group(1)] = tuple(args)
    return out


@functools.cache
def kernel_signatures() -> dict[str, tuple[str, tuple[tuple[str, str], ...]]]:
    """Every ``extern "C" __global__`` kernel: name -> (source file, ((C type, argument name), ...)).

    >>> file, args = kernel_signatures()["radix_pick"]
    >>> file, [a for _, a in args]
    ('topk.cu', ['nseg', 'shift', 'hist', 'state'])
    """
    out: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
    for f in kernel_files():
        for name, args in parse_signatures(_files().joinpath(f).read_text()).items():
            out[name] = (f, args)
    return out
