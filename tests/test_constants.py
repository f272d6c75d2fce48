"""One home for the launch constants and codes: gpu_codec/constants.py, passed to every compile as -D flags."""

from __future__ import annotations

import re

import numpy as np

from gpu_codec import constants, dtypes
from gpu_codec.backends import emulated
from gpu_codec.backends.sources import _files, kernel_files, kernel_source

_DEFINED = re.compile(r"^\s*#\s*define\s+([A-Z_][A-Z0-9_]*)", re.M)
_GUARD = re.compile(r"#ifndef\s+([A-Z_][A-Z0-9_]*)\s*\n#error")
_MACRO_USE = re.compile(r"\b([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|BLOCK|ITEMS|CHUNK|WARPS)\b")


def _code(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"[^"\n]*"', '""', text)


def test_every_constant_the_kernels_use_is_passed():
    passed = set(constants.defines())
    for f in kernel_files():
        src = _code(kernel_source(f))
        local = set(_DEFINED.findall(src))
        used = set(_MACRO_USE.findall(src)) - local
        assert used <= passed, f"{f} uses {sorted(used - passed)}, which compile_options() does not pass"
        assert not (local & passed), f"{f} defines {sorted(local & passed)} itself: constants.py is their home"


def test_common_header_only_guards():
    text = _files().joinpath("common.cuh").read_text()
    assert set(_GUARD.findall(text)) == set(constants.defines())
    assert not set(_DEFINED.findall(_code(text))) & set(constants.defines())


def test_flags_come_from_constants_everywhere():
    opts = constants.compile_options()
    for k, v in constants.defines().items():
        assert f"-D{k}={v}" in opts
    assert constants.defines() == emulated.DEFINES
    assert "--fmad=false" in opts and "-ftz=false" in opts
    assert constants.CHUNK == constants.BLOCK * constants.ITEMS and constants.WARPS * 32 == constants.BLOCK


def test_codes_by_name_use_the_constants():
    assert {n: c for n, (c, _) in dtypes.FLOAT_DTYPES.items()} == {
        "float32": constants.DT_F32,
        "float16": constants.DT_F16,
        "bfloat16": constants.DT_BF16,
        "float64": constants.DT_F64,
    }
    assert dtypes.CRITERIA["magnitude"] == constants.CRIT_MAGNITUDE and dtypes.CRIT_EXTERNAL == constants.CRIT_EXTERNAL
    assert len(set(dtypes.CRITERIA.values()) | {dtypes.CRIT_EXTERNAL}) == 8
    assert dtypes.index_dtype is constants.index_dtype
    assert constants.index_dtype(1 << 32) == np.uint32 and constants.index_dtype((1 << 32) + 1) == np.uint64


def test_a_missing_constant_stops_the_compile(tmp_path):
    """common.cuh has no defaults: a source built without the -D flags fails with #error."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        import pytest

        pytest.skip("no C++ compiler")
    (tmp_path / "k.cpp").write_text(
        "#define __device__\n#define __forceinline__ inline\n" + kernel_source("scatter.cu")
    )
    flags = [f for f in constants.define_flags() if not f.startswith("-DBLOCK=")]
    r = subprocess.run(
        [cxx, "-fsyntax-only", *flags, "k.cpp"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert r.returncode != 0 and "BLOCK must be defined" in r.stderr
