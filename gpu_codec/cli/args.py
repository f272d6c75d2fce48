"""The command line's argument types and pipeline names, shared by the commands (:mod:`gpu_codec.cli.commands`)
and the benchmark command (:mod:`gpu_codec.cli.bench`), which both import from here and not from each other.
"""

from __future__ import annotations

import argparse
import contextlib
import decimal
import math
import re
from collections.abc import Callable
from typing import Any

import gpu_codec

from ..errors import GpuCodecError, InvalidInputError
from .outputs import describe

STAGE_NAMES = ("raw", "fp32", "fp16", "bf16", "int8[:block]", "ternary", "rice", "zstd[:level]", "nvcomp")
DEFAULT_PIPELINE = "fp16,rice,zstd"  # after top-k: fp16 values, Rice-coded indices, zstd


class UsageError(InvalidInputError):
    """A mistake in the command line itself (exit status 2)."""


# --- argument types --------------------------------------------------------------------------------------------


def parse_density(text: str) -> float:
    """``bench --fractions``: a number in (0, 1] (no ``dense``: dense mode has no top-k to time).

    >>> parse_density("0.01")
    0.01
    >>> parse_density("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a number in (0, 1] (dense mode has no top-k to time), got '0'
    >>> parse_density("dense")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a number in (0, 1] (dense mode has no top-k to time), got 'dense'
    """
    try:
        f = parse_fraction(text) if text.strip().lower() != "dense" else None
    except argparse.ArgumentTypeError:
        f = None
    if f is None:
        raise argparse.ArgumentTypeError(
            f"must be a number in (0, 1] (dense mode has no top-k to time), got {describe(repr(text))}"
        )
    return f


def parse_fraction(text: str) -> float | None:
    """``--fraction``: a number in (0, 1], or ``dense`` (None: keep every entry).

    >>> parse_fraction("0.01"), parse_fraction("dense")
    (0.01, None)
    >>> parse_fraction("nan")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a number in (0, 1] or 'dense', got 'nan'
    """
    if text.strip().lower() == "dense":
        return None
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1] or 'dense', got {describe(repr(text))}")
    return f


_POWER = re.compile(r"([0-9]+)\s*(?:\^|\*\*)\s*([0-9]+)")


def parse_count(text: str) -> int:
    """A whole number as the help writes them: ``5000000``, ``5_000_000``, ``2e6``, ``1.5e3`` or ``2^14``
    (also ``2**14``); the one parser behind every count option (``--params``, ``--clients``, ``--sizes``...).

    >>> parse_count("2e6"), parse_count("2^14"), parse_count("5_000_000"), parse_count("1.5e3")
    (2000000, 16384, 5000000, 1500)
    >>> parse_count("2.5")
    Traceback (most recent call last):
    ...
    ValueError: must be an integer such as 2000000, 2e6 or 2^21, got '2.5'
    """
    t = str(text).strip().replace("_", "")
    bad = ValueError(f"must be an integer such as 2000000, 2e6 or 2^21, got {describe(repr(text))}")
    m = _POWER.fullmatch(t)
    if m:
        b, e = int(m.group(1)), int(m.group(2))
        if b > 1 and e * math.log2(b) > 128:  # far past every limit; never build the number
            raise ValueError(f"{describe(repr(text))} is too large")
        return b**e
    if not re.fullmatch(r"[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?", t):
        raise bad
    try:
        d = decimal.Decimal(t)
    except decimal.InvalidOperation:
        raise bad from None
    if d.adjusted() > 40:  # more than 40 digits: far past every limit
        raise ValueError(f"{describe(repr(text))} is too large")
    if d != d.to_integral_value():
        raise bad
    return int(d)


def int_at_least(lo: int, what: str, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number (:func:`parse_count`) of at least ``lo`` (and at most ``hi``); ``what``
    names the option."""

    def parse(text: str) -> int:
        try:
            v = parse_count(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{what} must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{what} must be at most {hi:,}, got {v:,}")
        return v

    return parse


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "tib": 2**40, "b": 1})


def parse_bytes(text: str) -> int:
    """A byte count: ``1000000``, ``512MiB``, ``2GB``, ``1.5G``, or a count as :func:`parse_count` takes it
    (``1e9``, ``2^30``).

    >>> parse_bytes("512MiB"), parse_bytes("2GB"), parse_bytes("1.5g"), parse_bytes("2^30"), parse_bytes("1e9")
    (536870912, 2000000000, 1500000000, 1073741824, 1000000000)
    """
    with contextlib.suppress(ValueError):
        n = parse_count(text)
        if n >= 0:
            return n
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"must be a byte count such as 1000000, 512MiB or 2GB, got {text!r}")
    n = decimal.Decimal(m.group(1)) * _UNITS[unit]
    if n != n.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got {text!r}")
    return int(n)


def parse_cap(text: str) -> int | None:
    """``--max-output-bytes``: a byte count (:func:`parse_bytes`), or ``none`` for no cap.

    >>> parse_cap("4GiB"), parse_cap("none")
    (4294967296, None)
    """
    return None if text.strip().lower() == "none" else parse_bytes(text)


def _stage_int(arg: str, part: str) -> int:
    """A stage's whole-number argument (``zstd:-3``, ``int8:2^10``), or a UsageError naming the stage."""
    try:
        return parse_count(arg)
    except ValueError:
        raise UsageError(
            f"--pipeline: stage {describe(repr(part.strip()))}: its argument must be a whole number such as 64 "
            f"or 2^10, got {describe(repr(arg))}"
        ) from None


def parse_pipeline(spec: str) -> list[Any]:
    """``--pipeline``: comma-separated stage names -> codecs (``raw``/``fp32`` add no stage).

    Names: raw, fp32, fp16, bf16, int8[:block], ternary, rice, zstd[:level], nvcomp.

    >>> [c.get_config() for c in parse_pipeline("fp16,rice,zstd:5")]
    [{'id': 'quantize', 'dtype': 'float16'}, {'id': 'rice'}, {'id': 'zstd', 'level': 5}]
    >>> parse_pipeline("int8:64")[0].get_config()
    {'id': 'int8', 'block_size': 64}
    >>> parse_pipeline("zstd:abc")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpu_codec.cli.args.UsageError: --pipeline: stage 'zstd:abc': its argument must be a whole number ... got 'abc'
    >>> parse_pipeline("fp16,,zstd")
    Traceback (most recent call last):
    ...
    gpu_codec.cli.args.UsageError: --pipeline 'fp16,,zstd': a stage name is empty (raw: no stage)
    """
    stages: list[Any] = []
    for part in spec.split(","):
        name, _, arg = part.strip().lower().partition(":")
        if not name and not arg:
            raise UsageError(f"--pipeline {describe(repr(spec))}: a stage name is empty (raw: no stage)")
        if name in ("raw", "fp32", "none") and not arg:
            continue
        try:
            if name == "fp16" and not arg:
                stages.append(gpu_codec.Quantize("float16"))
            elif name == "bf16" and not arg:
                stages.append(gpu_codec.Quantize("bfloat16"))
            elif name == "int8":
                stages.append(gpu_codec.Int8Blockwise(_stage_int(arg, part)) if arg else gpu_codec.Int8Blockwise())
            elif name == "ternary" and not arg:
                stages.append(gpu_codec.Ternary())
            elif name == "rice" and not arg:
                stages.append(gpu_codec.RiceIndices())
            elif name == "zstd":
                stages.append(gpu_codec.Zstd(_stage_int(arg, part)) if arg else gpu_codec.Zstd())
            elif name == "nvcomp" and not arg:
                stages.append(gpu_codec.Nvcomp())
            else:
                raise UsageError(
                    f"--pipeline: unknown stage {describe(repr(part.strip()))}; stages are {', '.join(STAGE_NAMES)}"
                )
        except ValueError as e:
            if isinstance(e, UsageError):
                raise
            raise UsageError(f"--pipeline: stage {describe(repr(part.strip()))}: {describe(e)}") from None
    try:
        gpu_codec.Pipeline(stages)  # order and duplicates, checked here so the message names the option
    except GpuCodecError as e:
        raise UsageError(f"--pipeline {describe(repr(spec))}: {describe(e)}") from None
    return stages


def default_pipeline(fraction: float | None, spec: str = DEFAULT_PIPELINE) -> str:
    """The stages used when ``--pipeline`` is not given: ``spec`` after top-k, and the same without its index
    stage (``rice``) for a dense update, which has no indices to code.

    >>> default_pipeline(0.01), default_pipeline(None), default_pipeline(None, "ternary,rice,zstd")
    ('fp16,rice,zstd', 'fp16,zstd', 'ternary,zstd')
    >>> default_pipeline(None, "raw")
    'raw'
    """
    if fraction is not None:
        return spec
    return ",".join(part for part in spec.split(",") if part.strip().lower() != "rice") or "raw"


__all__ = [
    "DEFAULT_PIPELINE",
    "STAGE_NAMES",
    "UsageError",
    "default_pipeline",
    "int_at_least",
    "parse_bytes",
    "parse_count",
    "parse_density",
    "parse_fraction",
    "parse_pipeline",
]
