"""The ``gpu-codec`` command line (the console script runs :func:`main`).

Commands: ``demo`` (the main job on a built-in synthetic model), ``compress``, ``decompress``, ``apply``,
``inspect``, ``info`` and ``bench``; checkpoints are torch ``.pt``, ``.safetensors`` or ``.npz`` files. Outputs
never destroy anything (:mod:`gpu_codec.cli.outputs`). See ``gpu-codec --help`` and :mod:`gpu_codec.cli.commands`.
"""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
