"""gpu_codec.openfl without OpenFL: the package imports, the adapter names the extra to install."""

from __future__ import annotations

import subprocess
import sys


def test_the_module_needs_openfl_and_the_package_does_not():
    code = (
        "import sys; sys.modules['openfl'] = None\n"
        "import gpu_codec\n"
        "gpu_codec.compress({'w': [1.0, 2.0]}, fraction=0.5)\n"
        "try:\n"
        "    import gpu_codec.openfl\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.startswith("gpu_codec.openfl needs OpenFL: pip install 'gpu_codec[openfl]'"), out.stdout
