"""The ``gpu-codec`` commands: demo, compress, decompress, apply, inspect, info, bench.

``gpu-codec demo`` is the main job on a built-in default: clients compress updates of a synthetic model, the
server decompresses and sums them; it prints sizes, ratio, times and the backend. The other commands work on
checkpoint files (torch ``.pt``, ``.safetensors``, ``.npz``) and payload files.

Outputs are checked before any work and never destroy anything (:mod:`gpu_codec.cli.outputs`): an input is
never an output, an existing file is replaced only with ``--force`` (atomically, keeping its mode), devices and
FIFOs are written through, ``-o -`` is stdout (the report then goes to stderr).

Exit status: 0 on success, 2 for a user's mistake (bad arguments, unreadable or invalid input files, a bad
payload, a refused output; one line on stderr, no traceback), 1 for an internal error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import gpu_codec

from ..decode import DEFAULT_MAX_OUTPUT_BYTES
from ..dtypes import CRITERIA
from ..errors import (
    BackendUnavailableError,
    GpuCodecError,
    InvalidInputError,
)
from ..format import v2
from ..synthetic import smallest_model_params
from .args import (
    DEFAULT_PIPELINE,
    STAGE_NAMES,
    UsageError,
    default_pipeline,
    int_at_least,
    parse_cap,
    parse_fraction,
    parse_pipeline,
)
from .checkpoints import (
    FORMATS,
    check_input,
    checkpoint_format,
    dtype_name,
    is_float_tensor,
    read_checkpoint,
    write_checkpoint,
    writer_ready,
)
from .outputs import STDOUT, Target, describe, resolve_output, write_output

PROG = "gpu-codec"
BACKEND_ENV = "GPU_CODEC_BACKEND"
SCORES = tuple(CRITERIA)  # the score names the engine knows, in its order
DEFAULT_DENSE_PIPELINE = "fp16,zstd"  # --fraction dense: no indices to code, so no rice stage
_DEMO_CODECS = {"raw": "raw", "fp16": "fp16,rice,zstd", "ternary": "ternary,rice,zstd"}
_FORMAT_NAMES = {"npz": "npz", "safetensors": "safetensors", "pt": "torch"}  # --format -> checkpoint format


# --- output ----------------------------------------------------------------------------------------------------


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun that goes with it.

    >>> plural(1, "client"), plural(4, "client"), plural(1_000, "tensor")
    ('1 client', '4 clients', '1,000 tensors')
    """
    return f"{n:,} {word if n == 1 else words or word + 's'}"


def _emit(a: argparse.Namespace, doc: dict, lines: Sequence[str]) -> None:
    """The report: on stdout, or on stderr where stdout carries the output file (``-o -``)."""
    stream = sys.stderr if getattr(a, "output", None) == STDOUT else sys.stdout
    if a.json:
        print(json.dumps(doc, indent=2, ensure_ascii=True, default=str), file=stream)
    else:
        for line in lines:
            print(line, file=stream)


def _progress(a: argparse.Namespace, total: int, desc: str, unit: str = "step"):
    """A progress bar on stderr that shows only after a second, only on a terminal, never with --quiet/--json."""
    from tqdm import tqdm

    quiet = getattr(a, "quiet", False) or getattr(a, "json", False)
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, delay=1.0, disable=True if quiet else None
    )


@contextlib.contextmanager
def _backend(choice: str | None, option: str = "--backend") -> Iterator[None]:
    """Force a backend for one command (``auto`` leaves the environment's choice), then restore; ``option`` is
    what an error names (the option that chose it)."""
    if not choice or choice == "auto":
        yield
        return
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = choice
    gpu_codec.reset_backend()
    try:
        try:
            gpu_codec.backend_info()  # a forced GPU that is not there fails here, before any file is read
        except BackendUnavailableError as e:
            raise BackendUnavailableError(str(e).replace(f"{BACKEND_ENV}={choice}", f"{option} {choice}")) from None
        yield
    finally:
        if old is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = old
        gpu_codec.reset_backend()


def backend_info(a: argparse.Namespace | None = None) -> dict:
    """:func:`gpu_codec.backend_info`, with a backend chosen by ``--backend`` reported as such (the command line
    passes the choice to the library through the environment variable, which the user did not set)."""
    info = dict(gpu_codec.backend_info())
    choice = getattr(a, "backend", None)
    if choice and choice != "auto":
        forced = f"forced by {BACKEND_ENV}={choice}"
        info["reason"] = str(info["reason"]).replace(forced, f"forced by --backend {choice}")
    return info


def _read_payload(path: str) -> tuple[bytes, Any]:
    check_input(path)
    with open(path, "rb") as f:
        blob = f.read()
    return blob, gpu_codec.Payload.from_bytes(blob)  # a cut payload: the reader's PayloadTruncatedError


def header_split(blob: bytes) -> tuple[int, int]:
    """(header bytes, data bytes) of a serialized payload, as they lie in ``blob``: for version 1 the prefix and JSON
    header (u32 header length at bytes 12..16; data starts at 16 + that), for versions 2 and 3 the prefix and the
    stored tensor table (with the pipeline and metadata). Data counts every byte after the header, checksum
    included.

    >>> p = gpu_codec.compress({"w": np.ones(8, np.float32)}, fraction=0.5)
    >>> for blob in (p.to_bytes(), p.to_bytes(version=1)):
    ...     h, d = header_split(blob)
    ...     print(blob[8], h + d == len(blob), h < d)
    2 True True
    1 True False
    """
    (version,) = struct.unpack_from("<I", blob, 8)
    if version == 1:
        (hlen,) = struct.unpack_from("<I", blob, 12)
        h = 16 + hlen
    else:
        h = v2.header_length(blob)
    return int(h), len(blob) - int(h)


def _output_nbytes(payload: Any, with_base: bool) -> int:
    """Bytes of the dense tensors a decompress would allocate (the base's dtypes, else fp32/fp64 deltas)."""
    if with_base:
        return int(payload.dense_nbytes)
    return sum(math.prod(r.shape) * (8 if r.dtype == "float64" else 4) for r in payload.tensors)


def _check_output_cap(payload: Any, with_base: bool, cap: int | None) -> dict:
    """decompress's keyword for ``--max-output-bytes`` (None: no cap), the payload checked against it first, so that
    the error names the option."""
    if cap is not None:
        need = _output_nbytes(payload, with_base)
        if need > cap:
            raise InvalidInputError(
                f"the payload decodes to {need:,} bytes of dense tensors, over --max-output-bytes {cap:,} "
                "(a larger N, or 'none', accepts it)"
            )
    return {"max_output_bytes": cap}  # (the engine checks it too)


def _split_float(path: str, tensors: dict[str, Any], skip: bool) -> tuple[dict[str, Any], list[str]]:
    keep, skipped = {}, []
    for k, v in tensors.items():
        if is_float_tensor(v):
            keep[k] = v
        elif skip:
            skipped.append(k)
        else:
            raise InvalidInputError(
                f"{describe(path)}: tensor {describe(repr(k))} is {dtype_name(v)}, not a float tensor; "
                "pass --skip-non-float to leave such tensors out of the payload"
            )
    if not keep:
        raise InvalidInputError(f"{describe(path)} holds no float tensors to compress")
    return keep, skipped


# --- commands --------------------------------------------------------------------------------------------------


def cmd_demo(a: argparse.Namespace) -> int:
    from gpu_codec.synthetic import synthetic_model, synthetic_update

    info = backend_info(a)
    on_gpu = info["backend"] == "gpu"
    if on_gpu:  # the model lives on the device, as after training; nothing full-size comes back to the host
        import cupy as xp
    else:
        xp = np
    spec = default_pipeline(a.fraction, _DEMO_CODECS[a.codec]) if a.pipeline is None else a.pipeline
    pipeline = parse_pipeline(spec) or None
    base_host = synthetic_model(a.params, seed=0)
    n = sum(v.size for v in base_host.values())
    dense_bytes = sum(v.nbytes for v in base_host.values())
    base = {k: xp.asarray(v) for k, v in base_host.items()}
    if a.fraction is None:
        kept_per_client = n
    elif a.scope == "global":
        kept_per_client = gpu_codec.kept_count(a.fraction, n)
    else:
        kept_per_client = sum(gpu_codec.kept_count(a.fraction, v.size) for v in base.values())
    total = None
    t_c, t_d, sizes = [], [], []
    with _progress(a, a.clients, "clients", "client") as bar:
        for c in range(a.clients):
            new = {k: xp.asarray(v) for k, v in synthetic_update(base_host, seed=100 + c).items()}
            t0 = time.perf_counter()
            blob = gpu_codec.compress(new, base, fraction=a.fraction, scope=a.scope, pipeline=pipeline).to_bytes()
            t1 = time.perf_counter()
            upd = gpu_codec.decompress(blob, like="cupy" if on_gpu else None)  # the server's dense delta
            t2 = time.perf_counter()
            t_c.append(t1 - t0)
            t_d.append(t2 - t1)
            sizes.append(len(blob))
            total = upd if total is None else {k: total[k] + upd[k] for k in total}
            bar.update()
    touched = sum(int(xp.count_nonzero(v)) for v in total.values())
    size = float(np.mean(sizes))
    doc = {
        "backend": info["backend"],
        "backend_reason": info["reason"],
        "tensors": len(base),
        "parameters": n,
        "dense_bytes": dense_bytes,
        "fraction": a.fraction,
        "scope": a.scope,
        "clients": a.clients,
        "pipeline": spec,
        "payload_bytes_mean": size,
        "bytes_per_kept_parameter": size / max(1, kept_per_client),
        "ratio": dense_bytes / size,
        "compress_ms_median": 1e3 * float(np.median(t_c)),
        "decompress_ms_median": 1e3 * float(np.median(t_d)),
        "parameters_touched": touched,
    }
    frac = "dense" if a.fraction is None else f"fraction {a.fraction} ({a.scope})"
    _emit(
        a,
        doc,
        [
            f"backend: {info['backend']} ({describe(info['reason'])})",
            f"model: {plural(len(base), 'tensor')}, {plural(n, 'parameter')}, {dense_bytes / 2**20:.1f} MiB dense; "
            f"{frac}, {plural(a.clients, 'client')}",
            f"payload ({spec}): {size / 1024:.1f} KiB per client, {doc['bytes_per_kept_parameter']:.2f} B per kept "
            f"parameter, ratio {doc['ratio']:.1f}x",
            f"compress: {doc['compress_ms_median']:.1f} ms, decompress: {doc['decompress_ms_median']:.1f} ms "
            "(median per client)",
            f"aggregate: {plural(touched, 'parameter')} touched by the summed update",
        ],
    )
    return 0


def cmd_compress(a: argparse.Namespace) -> int:
    if a.base is not None and a.base_opt is not None:
        raise UsageError("give BASE either as the second argument or as --base, not both")
    base_path = a.base if a.base is not None else a.base_opt
    _check_base_path(base_path)
    if a.fingerprint_base and not base_path:
        raise UsageError(
            "--fingerprint-base needs BASE: the fingerprint is of the checkpoint the update is made against"
        )
    spec = default_pipeline(a.fraction) if a.pipeline is None else a.pipeline
    pipeline = parse_pipeline(spec)
    target = resolve_output(a.output, inputs=[a.new, base_path], force=a.force)
    with _progress(a, 4 if base_path else 3, "compress") as bar:
        new_ck = read_checkpoint(a.new)
        bar.update()
        new, skipped = _split_float(a.new, new_ck.tensors, a.skip_non_float)
        base = None
        if base_path:
            base_ck = read_checkpoint(base_path)
            for k in skipped:  # (left out of the payload, it must be one apply copies from the base)
                if k in base_ck.tensors and is_float_tensor(base_ck.tensors[k]):
                    raise InvalidInputError(
                        f"tensor {describe(repr(k))} is {dtype_name(new_ck.tensors[k])} in {describe(a.new)} but "
                        f"{dtype_name(base_ck.tensors[k])} in {describe(base_path)}: --skip-non-float leaves out only "
                        "tensors that are not float in both"
                    )
            base = {k: v for k, v in base_ck.tensors.items() if k not in set(skipped)}
            bar.update()
        gpu_codec.backend_info()  # choosing the backend (probing CuPy and the driver) is not compress time
        t0 = time.perf_counter()
        payload = gpu_codec.compress(
            new,
            base,
            fraction=a.fraction,
            scope=a.scope,
            score=a.score,
            pipeline=pipeline or None,
            metadata={"skipped": skipped} if skipped else None,
            fingerprint_base=a.fingerprint_base,
        )
        blob = payload.to_bytes()
        dt = time.perf_counter() - t0
        bar.update()
        write_output(target, lambda f: f.write(blob))
        bar.update()
    h, d = header_split(blob)
    n = sum(math.prod(r.shape) for r in payload.tensors)
    doc = {
        "output": a.output,
        "bytes": len(blob),
        "header_nbytes": h,
        "data_nbytes": d,
        "tensors": len(payload.tensors),
        "parameters": n,
        "kept": payload.nnz,
        "bytes_per_kept_parameter": len(blob) / max(1, payload.nnz),
        "dense_nbytes": payload.dense_nbytes,
        "ratio": payload.dense_nbytes / len(blob),
        "pipeline": payload.pipeline,
        "skipped": skipped,
        "base_fingerprint": payload.base_fingerprint,
        "seconds": dt,
        "backend": payload.backend,
    }
    lines = [
        f"{_name(a.output)}: {len(blob):,} bytes (header {h:,}, data {d:,}); {payload.nnz:,} of "
        f"{plural(n, 'entry', 'entries')} kept, {doc['bytes_per_kept_parameter']:.2f} B per kept parameter, "
        f"ratio {doc['ratio']:.1f}x, {dt * 1e3:.1f} ms ({payload.backend})"
    ]
    if skipped:
        lines.append(
            f"left out {plural(len(skipped), 'non-float tensor')}: {', '.join(describe(s) for s in skipped[:8])}"
        )
    _emit(a, doc, lines)
    return 0


def _decode(a: argparse.Namespace, payload: Any, base_ck: Any) -> tuple[dict[str, Any], list[str]]:
    """Dense tensors from a payload: base + delta in the base's order (non-float base tensors copied), or the
    delta alone."""
    names = [r.name for r in payload.tensors]
    if base_ck is None:
        kwargs = _check_output_cap(payload, False, a.max_output_bytes)
        return gpu_codec.decompress(payload, **kwargs), []
    in_payload = set(names)
    copied = [k for k, v in base_ck.tensors.items() if k not in in_payload and not is_float_tensor(v)]
    base = {k: v for k, v in base_ck.tensors.items() if k not in set(copied)}
    kwargs = _check_output_cap(payload, True, a.max_output_bytes)
    out = gpu_codec.decompress(payload, base, **kwargs)
    return {k: out.get(k, v) for k, v in base_ck.tensors.items()}, copied


def _name(path: str) -> str:
    return "stdout" if path == STDOUT else describe(path)


def _write_decoded(
    a: argparse.Namespace, target: Target, fmt: str, what: str, payload_path: str, base_path: str | None
) -> int:
    with _progress(a, 4, what) as bar:
        _blob, payload = _read_payload(payload_path)
        bar.update()
        base_ck = read_checkpoint(base_path) if base_path is not None else None
        bar.update()
        tensors, copied = _decode(a, payload, base_ck)
        bar.update()
        write_checkpoint(target, tensors, fmt)
        bar.update()
    doc = {
        "output": a.output,
        "format": fmt,
        "tensors": len(tensors),
        "from_payload": len(payload.tensors),
        "copied_from_base": copied,
        "base": base_path,
    }
    lines = [f"{_name(a.output)}: {plural(len(tensors), 'tensor')} ({fmt})"]
    if copied:
        lines.append(f"copied {plural(len(copied), 'non-float tensor')} from the base unchanged")
    _emit(a, doc, lines)
    return 0


def _check_base_path(path: str | None) -> None:
    """An empty BASE (an unset shell variable, say) is a mistake, not "no base"."""
    if path is not None and not path.strip():
        raise UsageError("the base path is empty (leave BASE out to go without one)")


def cmd_decompress(a: argparse.Namespace) -> int:
    _check_base_path(a.base)
    target = resolve_output(a.output, inputs=[a.payload, a.base], force=a.force)
    suffix = os.path.splitext(a.output)[1].lower() if target.kind != "stdout" else ""
    if a.format:
        fmt = _FORMAT_NAMES[a.format]
        if suffix in FORMATS and FORMATS[suffix] != fmt:
            raise UsageError(
                f"--format {a.format} writes {fmt}, but the output {describe(a.output)} names {FORMATS[suffix]} "
                "(drop --format, or name the output for its format)"
            )
    elif target.kind == "stdout" or (target.kind == "through" and suffix not in FORMATS):
        raise UsageError(f"decompress to {_name(a.output)} needs --format npz|safetensors|pt (no suffix to go by)")
    else:
        fmt = checkpoint_format(a.output)
    writer_ready(fmt, _name(a.output))  # (a missing package refused before the payload is decoded)
    return _write_decoded(a, target, fmt, "decompress", a.payload, a.base)


def cmd_apply(a: argparse.Namespace) -> int:
    target = resolve_output(a.output, inputs=[a.base, a.payload], force=a.force)
    fmt = checkpoint_format(a.base)
    out_suffix = os.path.splitext(a.output)[1].lower()
    if out_suffix in FORMATS and FORMATS[out_suffix] != fmt:
        raise UsageError(
            f"apply writes the base's format ({fmt}); the output {describe(a.output)} names {FORMATS[out_suffix]} "
            "(use decompress --base to change format)"
        )
    return _write_decoded(a, target, fmt, "apply", a.payload, a.base)


def _tensor_row(r: Any) -> dict:
    """What inspect shows of one record: the encoding with what it wraps (``sparse+zstd``), the encoded bytes
    before the lossless stage, and the bytes it takes on the wire (None inside a frame shared by all tensors)."""
    own = sum(int(np.asarray(b).nbytes) for b in (getattr(r, "buffers", None) or {}).values())
    codec = dict(getattr(r, "codec", None) or {})
    inner = codec.get("inner") if r.encoding in ("zstd", "nvcomp") else None
    if getattr(r, "frame", None) is not None:
        raw, wire = int(r.frame.nbytes), None
    else:
        raw, wire = (int(codec["raw"]) if inner and "raw" in codec else own), own
    return {
        "name": r.name,
        "dtype": r.dtype,
        "shape": list(r.shape),
        "encoding": r.encoding,
        "inner": inner,
        "nnz": int(r.nnz),
        "raw_nbytes": raw,
        "wire_nbytes": wire,
        "codec": codec,
    }


def cmd_inspect(a: argparse.Namespace) -> int:
    blob, payload = _read_payload(a.payload)
    h, d = header_split(blob)
    (version,) = struct.unpack_from("<I", blob, 8)
    tensors = [_tensor_row(r) for r in payload.tensors]
    mode = "records" if version == 1 else v2.DATA_MODES[(blob[12] >> v2.DATA_SHIFT) & 3]
    doc = {
        "file": a.payload,
        "version": int(version),
        "bytes": len(blob),
        "header_nbytes": h,
        "data_nbytes": d,
        "data_mode": mode,
        "pipeline": payload.pipeline,
        "metadata": payload.metadata,
        "base_fingerprint": payload.base_fingerprint,
        "dense_nbytes": payload.dense_nbytes,
        "ratio": payload.dense_nbytes / len(blob),
        "kept": payload.nnz,
        "tensors": tensors,
    }
    lines = [
        f"{describe(a.payload)}: format v{version}, {len(blob):,} bytes (header {h:,}, data {d:,}), "
        f"{payload.nnz:,} {'entry' if payload.nnz == 1 else 'entries'} kept, ratio {doc['ratio']:.1f}x",
        f"pipeline: {describe(json.dumps(payload.pipeline))}",
    ]
    if payload.metadata:
        lines.append(f"metadata: {describe(json.dumps(payload.metadata))}")
    if payload.base_fingerprint is not None:
        lines.append(f"base fingerprint: {payload.base_fingerprint} (applied only to that base)")
    raw_total = sum(t["raw_nbytes"] for t in tensors)
    if mode == "zstd":
        lines.append(
            f"data: one zstd frame of {d - 4:,} bytes over all {plural(len(tensors), 'tensor')} "
            f"({raw_total:,} bytes before zstd, so no wire bytes per tensor)"
        )
    elif mode == "plain":
        lines.append(f"data: the tensors' {raw_total:,} bytes stored plainly (zstd would not have made them smaller)")
    names = [describe(t["name"]) for t in tensors]
    w = min(max([len(n) for n in names] + [4]), 60)
    lines.append(
        f"{'name':<{w}}  {'dtype':<8} {'shape':<18} {'encoding':<14} {'kept':>10} {'raw bytes':>10} {'wire bytes':>10}"
    )
    for n, t in zip(names, tensors):
        enc = f"{t['inner']}+{t['encoding']}" if t["inner"] else t["encoding"]
        wire = "shared" if t["wire_nbytes"] is None else f"{t['wire_nbytes']:,}"
        lines.append(
            f"{n:<{w}}  {t['dtype']:<8} {t['shape']!s:<18} {enc:<14} {t['nnz']:>10,} {t['raw_nbytes']:>10,} {wire:>10}"
        )
    _emit(a, doc, lines)
    return 0


def _optional_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("torch", "safetensors", "matplotlib", "cupy-cuda12x", "cupy-cuda13x", "zstandard", "tqdm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cmd_info(a: argparse.Namespace) -> int:
    info = backend_info(a)
    doc = {"gpu_codec": gpu_codec.__version__, **info, "packages": _optional_versions()}
    lines = [f"gpu_codec {gpu_codec.__version__}", f"backend: {info['backend']} ({describe(info['reason'])})"]
    for k, v in info.items():
        if k not in ("backend", "reason"):
            lines.append(f"{k}: {describe(json.dumps(v, default=str))}")
    lines.append(
        "packages: " + ", ".join(f"{k} {v}" if v else f"{k} (not installed)" for k, v in doc["packages"].items())
    )
    _emit(a, doc, lines)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import bench_command

    return bench_command(a, _emit, _progress, _backend)


# --- parser ----------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (no usage block) through :class:`UsageError`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


_VERBOSE_HELP = "log the backend choice; traceback on internal errors (before or after the command)"
_FORCE_HELP = (
    "replace an existing output file (atomically, keeping its mode); also allows binary output to a terminal. "
    "Never replaces an input, a directory or a device"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gpu-codec`` (every subcommand takes ``--json``, ``-q`` and ``-v``)."""
    # each of these is taken before the subcommand or after it: SUPPRESS, so that a subcommand that is not given
    # one leaves the value the main parser set
    shared = (
        (("--json",), "print one JSON document instead of text (on stdout; on stderr when -o - writes there)"),
        (("-q", "--quiet"), "no progress bar"),
        (("-v", "--verbose"), _VERBOSE_HELP),
    )
    common = argparse.ArgumentParser(add_help=False)
    for flags, text in shared:
        common.add_argument(*flags, action="store_true", default=argparse.SUPPRESS, help=text)
    backend_help = "force a backend (default: the GPU where usable, else the NumPy fallback)"
    backends = ["auto", "cpu", "gpu", "emulated"]
    backend = argparse.ArgumentParser(add_help=False)  # (before the subcommand too: SUPPRESS, as the shared ones)
    backend.add_argument("--backend", choices=backends, default=argparse.SUPPRESS, help=backend_help)
    backend.set_defaults(takes_backend=True)
    out_cap = argparse.ArgumentParser(add_help=False)
    out_cap.add_argument(
        "--max-output-bytes",
        type=parse_cap,
        default=DEFAULT_MAX_OUTPUT_BYTES,
        metavar="N",
        help="refuse a payload that decodes to more dense bytes than N (default 4GiB; 'none': no cap)",
    )
    force = argparse.ArgumentParser(add_help=False)
    force.add_argument("-f", "--force", action="store_true", help=_FORCE_HELP)
    selection = argparse.ArgumentParser(add_help=False)
    selection.add_argument(
        "--fraction", type=parse_fraction, default=0.01, help="share of entries kept, in (0, 1], or 'dense'"
    )
    selection.add_argument(
        "--scope",
        choices=["global", "per_tensor"],
        default="global",
        help="one top-k threshold over the whole update (default) or one per tensor",
    )

    p = _Parser(
        prog=PROG,
        description="Compress model updates between checkpoints (.pt, .safetensors, .npz), decode and inspect "
        "payloads, and benchmark the backends.",
        epilog="Outputs never destroy: an existing file is replaced only with --force, an input never; devices "
        "and FIFOs are written through; -o - is stdout. Numbers take 2000000, 2e6 or 2^21. "
        "Exit status: 0 ok, 2 bad input (one line on stderr), 1 internal error.",
    )
    for flags, text in shared:
        p.add_argument(*flags, action="store_true", help=text)
    p.add_argument("--backend", choices=backends, default=argparse.SUPPRESS, help=backend_help)
    p.add_argument("--version", action="version", version=f"{PROG} {gpu_codec.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    d = sub.add_parser(
        "demo", parents=[common, backend, selection], help="compress and sum updates of a built-in synthetic model"
    )
    d.add_argument(
        "--params",
        type=int_at_least(smallest_model_params(), "--params", 1 << 31),
        default=5_000_000,
        metavar="N",
        help="model size in parameters, e.g. 5000000, 5e6 or 2^22 (default 5e6)",
    )
    d.add_argument("--clients", type=int_at_least(1, "--clients"), default=4, metavar="N", help="clients (default 4)")
    d.add_argument(
        "--codec",
        choices=sorted(_DEMO_CODECS),
        default="fp16",
        help="stages after top-k: raw (u32 + fp32), fp16 (fp16 + Rice + zstd, default), ternary (+ Rice + zstd); "
        "with --fraction dense the Rice stage is left out",
    )
    d.add_argument("--pipeline", help="stages after top-k, overriding --codec (see compress --help)")
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser(
        "compress",
        parents=[common, backend, selection, force],
        help="compress NEW minus BASE (checkpoints: .pt, .safetensors, .npz) into a payload file",
    )
    c.add_argument("new", metavar="NEW", help="the updated checkpoint")
    c.add_argument("base", metavar="BASE", nargs="?", help="the checkpoint it started from (default: zeros)")
    c.add_argument("--base", dest="base_opt", metavar="BASE", help=argparse.SUPPRESS)
    c.add_argument("-o", "--output", required=True, help="payload file to write ('-': stdout)")
    c.add_argument(
        "--pipeline",
        help=f"stages after top-k, comma-separated: {', '.join(STAGE_NAMES)} (default {DEFAULT_PIPELINE}; with "
        f"--fraction dense {DEFAULT_DENSE_PIPELINE}; raw: none)",
    )
    c.add_argument(
        "--score", choices=SCORES, default="magnitude", metavar="NAME", help=f"what top-k ranks by: {', '.join(SCORES)}"
    )
    c.add_argument(
        "--fingerprint-base",
        action="store_true",
        help="record a fingerprint of BASE in the payload, so that decompress, apply and aggregation refuse "
        "another base",
    )
    c.add_argument(
        "--skip-non-float",
        action="store_true",
        help="leave integer/bool tensors (e.g. BatchNorm counters) out of the payload instead of failing",
    )
    c.set_defaults(fn=cmd_compress)

    x = sub.add_parser(
        "decompress",
        parents=[common, backend, out_cap, force],
        help="decode a payload into a checkpoint (format by -o suffix): the delta, or --base plus the delta",
    )
    x.add_argument("payload", metavar="PAYLOAD", help="the payload file")
    x.add_argument("--base", help="checkpoint to add the delta to")
    x.add_argument("-o", "--output", required=True, help="checkpoint to write (.npz, .safetensors or .pt; '-': stdout)")
    x.add_argument(
        "--format",
        choices=sorted(_FORMAT_NAMES),
        help="checkpoint format to write, instead of the -o suffix (needed for -o - and devices)",
    )
    x.set_defaults(fn=cmd_decompress)

    ap = sub.add_parser(
        "apply",
        parents=[common, backend, out_cap, force],
        help="BASE + PAYLOAD -> a new checkpoint in BASE's format",
    )
    ap.add_argument("base", metavar="BASE", help="the checkpoint the payload was made against")
    ap.add_argument("payload", metavar="PAYLOAD", help="the payload file")
    ap.add_argument("-o", "--output", required=True, help="checkpoint to write, in BASE's format ('-': stdout)")
    ap.set_defaults(fn=cmd_apply)

    i = sub.add_parser("inspect", parents=[common], help="check a payload's layout and checksum and list its tensors")
    i.add_argument("payload", metavar="PAYLOAD", help="the payload file")
    i.set_defaults(fn=cmd_inspect)

    b = sub.add_parser("info", parents=[common, backend], help="which backend is used and why")
    b.set_defaults(fn=cmd_info)

    from .bench import add_bench_arguments

    bb = sub.add_parser(
        "bench",
        parents=[common, force],
        help="GPU-vs-CPU report: backends and NumPy/torch baselines, JSON and plots",
    )
    add_bench_arguments(bb)
    bb.set_defaults(fn=cmd_bench)
    return p


def _in_cli_words(message: str) -> str:
    """A library message in the command line's words: its options, not the keywords of the Python API.

    >>> _in_cli_words("compress with fraction=None (dense), which sends float64 values exactly")
    'compress with --fraction dense, which sends float64 values exactly'
    """
    return message.replace("fraction=None (dense)", "--fraction dense").replace("fraction=None", "--fraction dense")


def _fail(message: str) -> None:
    print(f"{PROG}: error: {describe(' '.join(str(message).split()))}", file=sys.stderr)


class _Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``), raised where the command is, so that its cleanup runs as for Ctrl-C: no
    temporary file left beside an output."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


@contextlib.contextmanager
def _terminable() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` while inside (in the main thread; the handler before is put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpu-codec``.

    Parameters
    ----------
    argv
        The arguments after the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 on success, 2 for a user's mistake (one line on stderr, no traceback), 1 for an
        internal error (its traceback with ``-v``).

    >>> main(["demo", "--clients", "0"])
    2
    """
    verbose = False
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help and --version print and stop
            return e.code if isinstance(e.code, int) else 0
        verbose = args.verbose
        if hasattr(args, "backend") and not getattr(args, "takes_backend", False):  # (given before the command)
            raise UsageError(f"--backend does not apply to {args.cmd} (see {PROG} {args.cmd} --help)")
        if sys.stdout is None:  # (``>&-``: what the command prints, or writes with ``-o -``, would be lost)
            _fail("stdout is closed; redirect it (to /dev/null to discard what is printed)")
            return 2
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
        with _terminable(), _backend(getattr(args, "backend", None)):
            return args.fn(args)
    except BrokenPipeError:  # the reader went away (``gpu-codec inspect ... | head``): stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except GpuCodecError as e:  # bad input, a bad payload, a backend that is not there
        _fail(_in_cli_words(str(e)))
        return 2
    except OSError as e:  # a file that cannot be read or written
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _fail(f"{where}{e.strerror or e}")
        return 2
    except MemoryError:  # (an input that decodes to more than this machine holds: said, as a user's limit)
        _fail("out of memory: the inputs need more memory than is available (for a payload: --max-output-bytes)")
        return 2
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except _Terminated:
        _fail("terminated")
        return 143
    except Exception as e:
        _fail(f"internal error: {type(e).__name__}: {e}")
        if verbose:
            traceback.print_exc()
        return 1
