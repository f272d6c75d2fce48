"""The GPU scripts test this checkout, also where another ``gpu_codec`` is importable first (a wheel installed on
PYTHONPATH, as on a GPU machine without network): their pytest and timing processes start in the checkout, where
its own ``gpu_codec/`` directory comes first, so the scripts must not settle for the other package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_package_from_elsewhere_is_not_taken_for_the_checkout(tmp_path):
    other = tmp_path / "site" / "gpu_codec"
    for d in (other, other / "kernels", other / "backends"):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (other / "backends" / "kernels.py").write_text("")
    code = (
        "import sys; sys.path.append(sys.argv[1]);"
        "from benchmarks import gpu_suite as g; g._ensure_importable();"
        "import gpu_codec, gpu_codec.cpu_fallback; print(gpu_codec.__file__); print(g._env()['PYTHONPATH'])"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    package, pythonpath = r.stdout.splitlines()
    mapped = Path(package).parent.parent
    assert mapped.name.startswith("gpu_codec_src_") and (mapped / "gpu_codec" / "cpu_fallback").resolve() == (
        ROOT / "cpu_fallback"
    )
    assert pythonpath.split(os.pathsep)[0] == str(mapped)  # (the steps' processes see the checkout first)
