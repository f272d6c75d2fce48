"""Doctest collection: an adapter module whose framework is not installed is left out (it says what to install)."""

import importlib.util

_FRAMEWORKS = {"gpu_codec/flower.py": "flwr", "gpu_codec/openfl.py": "openfl"}
collect_ignore = [path for path, module in _FRAMEWORKS.items() if importlib.util.find_spec(module) is None]
