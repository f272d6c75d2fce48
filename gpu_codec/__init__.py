"""gpu_codec: GPU compression of federated-learning model updates.

Exact top-k sparsification of ``update - base`` on the GPU (CuPy kernels) or the CPU (a NumPy fallback that
produces the same bytes), codec stages after it, one safe versioned wire format, and decompression back to dense
tensors of the caller's kind on the caller's device.

The package face is the verbs below, the codec classes and the errors. The framework adapters
(:mod:`gpu_codec.clara`, :mod:`gpu_codec.openfl`, :mod:`gpu_codec.fl4health`, :mod:`gpu_codec.flower`,
:mod:`gpu_codec.nvflare`) load on first use, with the framework they need.

>>> import numpy as np, gpu_codec
>>> blob = gpu_codec.compress({"w": np.arange(10, dtype=np.float32)}, fraction=0.2).to_bytes()
>>> gpu_codec.decompress(blob)["w"].tolist()
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0]
"""

import importlib
from typing import Any

from .aggregate import Aggregator, aggregate
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
from .engine import Payload, SparseEntries, compress, decompress, encode_coo, kept_count
from .error_feedback import ErrorFeedback
from .errors import (  # every error class stays reachable as gpu_codec.<Name>
    BackendUnavailableError,
    BaseMismatchError,
    CodecConfigError,
    GpuCodecError,
    InvalidInputError,
    PayloadChecksumError,
    PayloadDtypeError,
    PayloadError,
    PayloadHeaderError,
    PayloadIndexError,
    PayloadLayoutError,
    PayloadLimitError,
    PayloadTruncatedError,
    PayloadValueError,
    UnknownCodecError,
    UnsupportedVersionError,
)
from .format import TensorRecord

__version__ = "0.1.0"

_ADAPTERS = ("clara", "fl4health", "flower", "nvflare", "openfl")

__all__ = [
    "Aggregator",
    "BackendUnavailableError",
    "ErrorFeedback",
    "GpuCodecError",
    "Int8Blockwise",
    "InvalidInputError",
    "Nvcomp",
    "Payload",
    "PayloadError",
    "Pipeline",
    "Quantize",
    "RiceIndices",
    "SparseEntries",
    "Ternary",
    "TopK",
    "Zstd",
    "aggregate",
    "backend_info",
    "compress",
    "decompress",
    "encode_coo",
    "get_backend",
    "get_codec",
    "kept_count",
    "register_codec",
    "reset_backend",
]


def __getattr__(name: str) -> Any:
    """Load a framework adapter module on first access (``gpu_codec.clara``, ...)."""
    if name in _ADAPTERS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
