"""The benchmarks: scripts run as ``python benchmarks/<name>.py``, importable as ``benchmarks.<name>`` (the tests
import the model zoo, :mod:`benchmarks.zoo`, this way)."""
