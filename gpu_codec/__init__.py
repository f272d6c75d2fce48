"""gpu_codec: GPU compression of federated-learning model updates.

Exact top-k sparsification of ``update - base`` on the GPU (CuPy kernels) or the CPU (a NumPy fallback that
produces the same bytes), one safe versioned wire format, and decompression back to dense tensors of the
caller's kind on the caller's device.

>>> import numpy as np, gpu_codec
>>> blob = gpu_codec.compress({"w": np.arange(10, dtype=np.float32)}, fraction=0.2).to_bytes()
>>> gpu_codec.decompress(blob)["w"].tolist()
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0]
"""

from . import clara, fl4health, flower, openfl  # the seed APIs; torch, flwr and cryptography load on first use
from .backends import backend_info, get_backend, reset_backend
from .codecs import (
    Int8Blockwise,
    Nvcomp,
    Pipeline,
    Quantize,
    RiceIndices,
    Ternary,
    TopK,
    Zstd,
    get_codec,
    register_codec,
)
from .engine import Payload, compress, decompress, kept_count
from .error_feedback import ErrorFeedback
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .format import TensorRecord

__version__ = "0.1.0"

__all__ = [
    "Payload",
    "TensorRecord",
    "backend_info",
    "compress",
    "decompress",
    "get_backend",
    "kept_count",
    "reset_backend",
    *_errors_all,
    "clara",
    "fl4health",
    "flower",
    "openfl",
    "ErrorFeedback",
    "Int8Blockwise",
    "Nvcomp",
    "Pipeline",
    "Quantize",
    "RiceIndices",
    "Ternary",
    "TopK",
    "Zstd",
    "get_codec",
    "register_codec",
]
