"""The package as a user installs it: a wheel built from this checkout (``python -m pip wheel --no-deps``),
installed with ``pip install --no-deps --no-index`` into a fresh virtual environment, and the demo, the command
line and the kernel sources used from there, not from the checkout.

The wheel is built without build isolation by an interpreter whose setuptools is new enough for
pyproject.toml (77: the SPDX ``license`` string): the one running the tests, else the base interpreter of its
virtual environment; where neither is, pip builds it in isolation (that fetches setuptools from the index).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import gpu_codec
from gpu_codec.cli.commands import DEFAULT_PIPELINE, parse_pipeline

ROOT = Path(__file__).resolve().parents[1]
MIN_SETUPTOOLS = 77
TIMEOUT = 300


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", FLWR_TELEMETRY_ENABLED="0", PYTHONWARNINGS="default")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return r


def _setuptools_major(python: str) -> int | None:
    probe = "import setuptools, pip; print(setuptools.__version__)"
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    m = re.match(r"(\d+)", r.stdout.strip()) if r.returncode == 0 else None
    return int(m.group(1)) if m else None


def _builder() -> tuple[str, list[str]]:
    """(python, extra pip options) that build the wheel, offline where the setuptools at hand allows."""
    for python in (sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3")):
        major = _setuptools_major(python) if python else None
        if major is not None and major >= MIN_SETUPTOOLS:
            return python, ["--no-build-isolation"]
    return sys.executable, []


def _version() -> str:
    m = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert m
    return m.group(1)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel from a copy of the checkout (the build writes build/ and egg-info beside its sources) and
    install it into a fresh virtual environment."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "*.pyc", "build", "dist")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("gpu_codec", "kernels", "cpu_fallback"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    python, opts = _builder()
    _run([python, "-m", "pip", "wheel", "--no-deps", *opts, "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    wheels = list((tmp / "dist").glob("gpu_codec-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # the dependencies where this interpreter has them (the tests may run in a virtual environment of their own);
    # these folders come after the new environment's own, so its gpu_codec is the one imported
    deps = {str(Path(m.__file__).resolve().parents[1]) for m in _dependency_modules()}
    (site / "_gpu_codec_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheels[0])], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return {"wheel": wheels[0], "venv": venv, "python": py, "cli": venv / "bin" / "gpu-codec", "work": work}


def _dependency_modules() -> list:
    import tqdm
    import zstandard

    return [np, tqdm, zstandard]


def test_the_wheel_ships_the_kernels_and_the_command_line(installed):
    with zipfile.ZipFile(installed["wheel"]) as zf:
        names = set(zf.namelist())
    cu = {p.name for p in (ROOT / "kernels").glob("*.cu")}
    assert cu and {f"gpu_codec/kernels/{n}" for n in cu} <= names
    assert {f"gpu_codec/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cuh")} <= names
    assert "gpu_codec/cli/outputs.py" in names and "gpu_codec/cpu_fallback/__init__.py" in names
    # every module of the checkout's packages (a subpackage left out of pyproject.toml's list is not shipped)
    shipped_from = {"gpu_codec": ROOT / "gpu_codec", "gpu_codec/cpu_fallback": ROOT / "cpu_fallback"}
    for where, folder in shipped_from.items():
        for py in folder.rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert f"{where}/{py.relative_to(folder).as_posix()}" in names, py
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(installed["wheel"]) as zf:
        assert "gpu-codec = gpu_codec.cli:main" in zf.read(entry).decode()
        # the license the metadata declares, shipped with its text
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in meta
        lic = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert zf.read(lic) == (ROOT / "LICENSE").read_bytes()
    # imported from the environment, not from the checkout, and reading the kernel sources from there; every
    # module of the package imported (but __main__; the adapters' optional imports aside), each from the
    # environment: a module missing from the wheel would otherwise be found in the checkout (an editable install)
    probe = (
        "import json, pkgutil, sys, gpu_codec\n"
        "OPTIONAL = ('flwr', 'nvflare', 'openfl', 'fl4health', 'cupy', 'torch', 'safetensors', 'matplotlib')\n"
        "from gpu_codec.backends.sources import kernel_files\n"
        "for m in pkgutil.walk_packages(gpu_codec.__path__, 'gpu_codec.'):\n"
        "    if m.name.endswith('.__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        __import__(m.name)\n"
        "    except ImportError as e:\n"
        "        cause = e if e.name else e.__cause__\n"
        "        if (getattr(cause, 'name', None) or '').split('.')[0] not in OPTIONAL:\n"
        "            raise\n"
        "files = {n: getattr(m, '__file__', None) for n, m in sys.modules.items() if n.startswith('gpu_codec')}\n"
        "print(json.dumps({'file': gpu_codec.__file__, 'kernels': kernel_files(), 'modules': files}))\n"
    )
    doc = json.loads(_run([str(installed["python"]), "-c", probe], cwd=installed["work"]).stdout)
    assert Path(doc["file"]).resolve().is_relative_to(installed["venv"].resolve()), doc["file"]
    assert len(doc["modules"]) > 40
    for name, file in doc["modules"].items():
        assert file and Path(file).resolve().is_relative_to(installed["venv"].resolve()), (name, file)
    assert set(doc["kernels"]) == cu
    shipped = Path(doc["file"]).parent / "kernels"
    for n in cu:
        assert (shipped / n).read_bytes() == (ROOT / "kernels" / n).read_bytes()


def test_the_installed_command_line_runs(installed):
    cli, work = str(installed["cli"]), installed["work"]
    assert _run([cli, "--version"], cwd=work).stdout == f"gpu-codec {_version()}\n"
    demo = json.loads(_run([cli, "demo", "--params", "2e5", "--clients", "2", "--json", "-q"], cwd=work).stdout)
    assert demo["clients"] == 2 and demo["parameters"] >= 200_000 and demo["ratio"] > 10
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": np.zeros(30, np.float32)}
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    np.savez(work / "base.npz", **base)
    np.savez(work / "new.npz", **new)
    _run([cli, "compress", "new.npz", "base.npz", "-o", "u.gcodec", "--fraction", "0.05", "-q"], cwd=work)
    blob = (work / "u.gcodec").read_bytes()
    want = gpu_codec.compress(new, base, fraction=0.05, pipeline=parse_pipeline(DEFAULT_PIPELINE)).to_bytes()
    assert blob == want  # the same bytes as this checkout
    doc = json.loads(_run([cli, "inspect", "u.gcodec", "--json"], cwd=work).stdout)
    assert doc["bytes"] == len(blob) and doc["kept"] == gpu_codec.kept_count(0.05, 1230)
    assert [t["name"] for t in doc["tensors"]] == ["w", "b"]
    _run([cli, "apply", "base.npz", "u.gcodec", "-o", "model.npz", "-q"], cwd=work)
    want = gpu_codec.decompress(blob, base)
    with np.load(work / "model.npz") as z:
        for k in base:
            np.testing.assert_array_equal(z[k], want[k])
