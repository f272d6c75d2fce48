#!/usr/bin/env python3
"""Registers, shared memory, stack frame and spills of every kernel in kernels/*.cu, as ptxas reports them.

No GPU is needed: each source (includes expanded, as the CuPy runner compiles it) goes through NVRTC
(``cupy.cuda.nvrtc`` with ``--ptxas-options=-v``, for a CUBIN) and, where ``nvcc`` is on PATH, through
``nvcc -cubin -Xptxas -v`` as well. Exits 1 if any kernel spills to local memory (spill stores or loads, a stack
frame or lmem above 0: none of ours is meant to), if a compile warns, or if a kernel is missing from the report.

    python3 benchmarks/kernel_resources.py                       # sm_80 and sm_90, every tool found
    python3 benchmarks/kernel_resources.py --arch sm_90 --tool nvrtc --json resources.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import resources

from gpu_codec.constants import compile_options

OPTIONS = compile_options()  # exactly what every device compile of the package uses
DEFAULT_ARCHS = ("sm_80", "sm_90")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for ([^\s]+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_LMEM = re.compile(r"(\d+) bytes lmem")
_BARRIERS = re.compile(r"used (\d+) barriers")


@dataclass
class Resources:
    function: str
    arch: str
    tool: str
    source: str = ""
    entry: bool = False
    registers: int = 0
    smem_bytes: int = 0
    lmem_bytes: int = 0
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    barriers: int = 0

    @property
    def spills(self) -> bool:
        return (
            self.spill_store_bytes > 0 or self.spill_load_bytes > 0 or self.stack_frame_bytes > 0 or self.lmem_bytes > 0
        )


@dataclass
class Report:
    rows: list[Resources] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)


def parse_ptxas(log: str, arch: str, tool: str, source: str = "") -> list[Resources]:
    """Per-function resources from a ``ptxas -v`` log (NVRTC's program log or nvcc's stderr).

    >>> log = '''ptxas info    : Compiling entry function 'k' for 'sm_90'
    ... ptxas info    : Function properties for k
    ... ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
    ... ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 384 bytes cmem[0]'''
    >>> r = parse_ptxas(log, "sm_90", "nvrtc")[0]
    >>> (r.function, r.entry, r.registers, r.smem_bytes, r.stack_frame_bytes, r.spills)
    ('k', True, 40, 1024, 8, True)
    """
    rows: dict[str, Resources] = {}
    current: Resources | None = None
    for line in log.replace("\x00", "").splitlines():
        m = _ENTRY.search(line)
        if m:
            current = rows.setdefault(m.group(1), Resources(m.group(1), m.group(2) or arch, tool, source))
            current.entry = True
            continue
        m = _PROPS.search(line)
        if m:
            current = rows.setdefault(m.group(1), Resources(m.group(1), arch, tool, source))
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.stack_frame_bytes, current.spill_store_bytes, current.spill_load_bytes = map(int, m.groups())
        m = _USED.search(line)
        if m:
            current.registers = int(m.group(1))
            s, lm, b = _SMEM.search(line), _LMEM.search(line), _BARRIERS.search(line)
            current.smem_bytes = int(s.group(1)) if s else 0
            current.lmem_bytes = int(lm.group(1)) if lm else 0
            current.barriers = int(b.group(1)) if b else 0
    return list(rows.values())


def _ptxas_only(log: str) -> str:
    """The log without ptxas' own -v lines: what is left is a warning or an error."""
    keep = [
        ln
        for ln in log.replace("\x00", "").splitlines()
        if ln.strip() and not ln.startswith("ptxas info") and not _FRAME.search(ln)
    ]
    return "\n".join(keep)


def nvrtc_available() -> tuple[bool, str]:
    try:
        from cupy.cuda import nvrtc

        return True, "NVRTC " + ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"


def nvrtc_compile(source: str, name: str, arch: str, extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Compile with NVRTC to a CUBIN; returns (ok, program log)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*OPTIONS, f"--gpu-architecture={arch}", *extra])
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        return ok, nvrtc.getProgramLog(prog).replace("\x00", "")
    finally:
        nvrtc.destroyProgram(prog)


_PTX_ENTRY = re.compile(r"\.entry\s+(\w+)")
_PTX_UNROUNDED_MUL = re.compile(r"^\s*(?:@!?%\w+\s+)?mul(?:\.ftz)?(?:\.sat)?\.f(?:16|32|64)\s")
_PTX_FMA = re.compile(r"^\s*(?:@!?%\w+\s+)?fma\.")


def _ptx(source: str, name: str, arch: str, extra: tuple[str, ...] = ()) -> str:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        # an --fmad in extra replaces the package's own (the contraction audit compiles with both settings)
        base = [o for o in OPTIONS if not (o.startswith("--fmad") and any(e.startswith("--fmad") for e in extra))]
        nvrtc.compileProgram(prog, [*base, f"--gpu-architecture={arch.replace('sm_', 'compute_')}", *extra])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _per_entry(ptx: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur = None
    for line in ptx.splitlines():
        m = _PTX_ENTRY.search(line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur:
            out[cur].append(line.strip())
    return out


def contraction_hazards(source: str, name: str, arch: str = "sm_90") -> dict[str, list[str]]:
    """Kernels whose float arithmetic the device may fuse into FMAs, with the PTX lines that show it.

    NVRTC's default ``-fmad=true`` contracts ``a * b + c`` into ``fma.rn`` itself, and leaves other multiplies
    as ``mul.f32`` (no rounding modifier), which ptxas may still fuse with a following add or subtract. A fused
    result rounds once where the NumPy twin (and the CPU emulator) round twice. Found by compiling with and
    without ``--fmad=false``: the multiplies left unrounded, and the FMAs that only -fmad=true creates.
    ``__fmul_rn`` / ``__fadd_rn`` (or ``--fmad=false``) never fuse; an explicit ``fmaf`` is not reported.
    """
    fast = _per_entry(_ptx(source, name, arch, ("--fmad=true",)))
    exact = _per_entry(_ptx(source, name, arch, ("--fmad=false",)))
    out: dict[str, list[str]] = {}
    for k, lines in fast.items():
        muls = [ln for ln in lines if _PTX_UNROUNDED_MUL.match(ln)]
        nf = sum(1 for ln in lines if _PTX_FMA.match(ln))
        ne = sum(1 for ln in exact.get(k, []) if _PTX_FMA.match(ln))
        extra = [f"{nf - ne} fma created by -fmad=true"] if nf > ne else []
        if muls or extra:
            out[k] = muls + extra
    return out


def nvcc_compile(files: dict[str, str], name: str, arch: str, nvcc: str = "nvcc") -> tuple[bool, str]:
    """Compile ``files[name]`` with ``nvcc -cubin -Xptxas -v``, its headers beside it; returns (ok, output).

    The files are written as they are (not include-expanded): an expanded header's ``#pragma once`` would make
    the host compiler warn about a pragma in the main file.
    """
    with tempfile.TemporaryDirectory(prefix="gpu_codec_res_") as d:
        for fn, text in files.items():
            with open(os.path.join(d, fn), "w") as f:
                f.write(text)
        src = os.path.join(d, name)
        cmd = [nvcc, "-cubin", f"-arch={arch}", *OPTIONS, "-Xptxas", "-v", "-o", os.path.join(d, "out.cubin"), src]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
        return r.returncode == 0, (r.stderr + r.stdout)


def collect(archs=DEFAULT_ARCHS, tools=("nvrtc",), sources: dict[str, str] | None = None, nvcc: str = "nvcc") -> Report:
    """Compile every source for every arch with every tool; rows per function, problems found."""
    from gpu_codec.backends.sources import kernel_files, kernel_signatures, kernel_source

    rep = Report()
    if sources is None:
        pkg = resources.files("gpu_codec.kernels")
        raw = {p.name: p.read_text() for p in pkg.iterdir() if p.name.endswith((".cu", ".cuh"))}
        sources = {f: kernel_source(f) for f in kernel_files()}
        expected = {f: {k for k, (ff, _) in kernel_signatures().items() if ff == f} for f in sources}
    else:  # self-contained sources (no includes), by file name
        raw = dict(sources)
        expected = {f: set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)', s)) for f, s in sources.items()}
    for tool in tools:
        for arch in archs:
            for f, text in sources.items():
                if tool == "nvrtc":
                    ok, log = nvrtc_compile(text, f, arch, ("--ptxas-options=-v",))
                else:
                    ok, log = nvcc_compile(raw, f, arch, nvcc)
                rep.logs[f"{tool}/{arch}/{f}"] = log
                if not ok:
                    rep.problems.append(f"{tool} {arch} {f}: compile failed:\n{log.strip()}")
                    continue
                other = _ptxas_only(log)
                if other:
                    rep.problems.append(f"{tool} {arch} {f}: compiler output beyond ptxas -v:\n{other}")
                rows = parse_ptxas(log, arch, tool, f)
                rep.rows.extend(rows)
                got = {r.function for r in rows if r.entry}
                for k in sorted(expected[f] - got):
                    rep.problems.append(f"{tool} {arch} {f}: kernel {k} missing from the ptxas report")
                for r in rows:
                    if r.spills:
                        rep.problems.append(
                            f"{tool} {arch} {f}: {r.function} uses local memory (stack frame {r.stack_frame_bytes} "
                            f"B, spill stores {r.spill_store_bytes} B, spill loads {r.spill_load_bytes} B, lmem "
                            f"{r.lmem_bytes} B)"
                        )
    return rep


def format_table(rows: list[Resources]) -> str:
    head = ("tool", "arch", "source", "kernel", "regs", "smem B", "stack B", "spill st B", "spill ld B", "bars")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r.tool, r.arch, r.source, r.function)):
        lines.append(
            (
                r.tool,
                r.arch,
                r.source,
                r.function + ("" if r.entry else " (device fn)"),
                str(r.registers),
                str(r.smem_bytes),
                str(r.stack_frame_bytes),
                str(r.spill_store_bytes),
                str(r.spill_load_bytes),
                str(r.barriers),
            )
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(ln, widths)).rstrip() for ln in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), help="GPU architectures (default: sm_80 sm_90)")
    ap.add_argument(
        "--tool",
        choices=("auto", "nvrtc", "nvcc", "both"),
        default="auto",
        help="auto: NVRTC, plus nvcc when it is on PATH (default)",
    )
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="the nvcc to use (default: nvcc)")
    ap.add_argument("--json", help="also write the rows and problems to this JSON file")
    args = ap.parse_args(argv)
    have_nvrtc, why = nvrtc_available()
    have_nvcc = shutil.which(args.nvcc) is not None
    if args.tool == "auto":
        tools = (["nvrtc"] if have_nvrtc else []) + (["nvcc"] if have_nvcc else [])
    elif args.tool == "both":
        tools = ["nvrtc", "nvcc"]
    else:
        tools = [args.tool]
    if "nvrtc" in tools and not have_nvrtc:
        print(f"NVRTC is not available: {why}", file=sys.stderr)
        return 2
    if "nvcc" in tools and not have_nvcc:
        print(f"{args.nvcc} is not on PATH", file=sys.stderr)
        return 2
    if not tools:
        print(f"neither NVRTC ({why}) nor nvcc is available", file=sys.stderr)
        return 2
    rep = collect(tuple(args.arch), tuple(tools), nvcc=args.nvcc)
    print(format_table(rep.rows))
    hazards = {}
    if have_nvrtc:
        from gpu_codec.backends.sources import kernel_files, kernel_source

        for f in kernel_files():
            hazards.update(contraction_hazards(kernel_source(f), f))
        if hazards:
            print(
                "\nFMA contraction hazards (PTX float multiply without .rn; ptxas may fuse it with an add, so the "
                "device can differ from the NumPy twin):"
            )
            for k, lines in sorted(hazards.items()):
                print(f"  {k}: {'; '.join(lines[:4])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tools": tools,
                    "archs": args.arch,
                    "rows": [asdict(r) | {"spills": r.spills} for r in rep.rows],
                    "problems": rep.problems,
                    "contraction_hazards": hazards,
                },
                f,
                indent=1,
            )
    if rep.problems:
        print("\nPROBLEMS:", file=sys.stderr)
        for p in rep.problems:
            print("  " + p.replace("\n", "\n    "), file=sys.stderr)
        return 1
    print(
        f"\nok: {len({r.function for r in rep.rows if r.entry})} kernels, {len(args.arch)} arch(s), "
        f"tools {', '.join(tools)}: no spills, no warnings"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
