"""gpu_codec.openfl's tests in an environment of their own, the last step of the README's test command.

OpenFL pins ``grpcio<1.66`` and flwr needs ``grpcio>=1.70``, so the two cannot share an environment and the main
suite (which has flwr) skips the OpenFL tests. This makes a throwaway virtual environment, installs this checkout
with the ``openfl`` extra, pytest and the CPU build of torch into it, runs the OpenFL tests and the module's
doctests there, and removes it. About a minute, most of it installing OpenFL and torch.

    python3 tests/openfl_env.py
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ["tests/test_adapters_openfl.py", "tests/test_adapters_openfl_extra.py", "gpu_codec/openfl.py"]
INSTALL = ["-e", ".[openfl]", "pytest>=8", "torch==2.13.0"]  # the CPU build of torch, never an unpinned one


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="gpu-codec-openfl-") as env:
        py = pathlib.Path(env) / "bin" / "python"
        steps = [
            [sys.executable, "-m", "venv", env],
            [str(py), "-m", "pip", "install", "-q", *INSTALL],
            [str(py), "-m", "pytest", "-p", "no:cacheprovider", *TESTS],
        ]
        for cmd in steps:
            rc = subprocess.run(cmd, check=False, cwd=ROOT).returncode
            if rc:
                print(f"openfl_env: {' '.join(cmd[:4])} ... exited with {rc}", file=sys.stderr)
                return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
