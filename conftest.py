"""Doctest collection: an adapter module whose framework is not installed is left out (it says what to install)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("flwr") else ["gpu_codec/flower.py"]
