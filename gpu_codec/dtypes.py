"""Logical dtypes and score criteria, with the integer codes the kernels use (kernels/common.cuh, topk.cu)."""

from __future__ import annotations

import numpy as np

# Logical dtype name -> (kernel code, storage NumPy dtype). bfloat16 is stored as its uint16 bit pattern, since
# neither NumPy nor CuPy has a native bfloat16.
FLOAT_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (0, np.dtype("<f4")),
    "float16": (1, np.dtype("<f2")),
    "bfloat16": (2, np.dtype("<u2")),
    "float64": (3, np.dtype("<f8")),
}
DT_F32, DT_F16, DT_BF16, DT_F64 = 0, 1, 2, 3


def value_dtype(logical: str) -> str:
    """The dtype a delta of ``logical`` is computed and kept in: fp64 for fp64, fp32 for every other float."""
    return "float64" if logical == "float64" else "float32"


def storage_dtype(logical: str) -> np.dtype:
    return FLOAT_DTYPES[logical][1]


def code(logical: str) -> int:
    return FLOAT_DTYPES[logical][0]


# Score criteria (fl4health's six, plus the default magnitude of the delta). Codes as in kernels/topk.cu.
CRITERIA: dict[str, int] = {
    "magnitude": 0,
    "largest_final_magnitude": 1,
    "smallest_final_magnitude": 2,
    "largest_magnitude_change": 3,
    "smallest_magnitude_change": 4,
    "largest_increase_in_magnitude": 5,
    "smallest_increase_in_magnitude": 6,
}
CRIT_EXTERNAL = 7

# Residual rounding modes (error feedback): what the receiver decodes for a kept value.
QMODES: dict[str, int] = {"exact": 0, "float16": 1, "bfloat16": 2}


def index_dtype(numel: int) -> np.dtype:
    """The dtype of a tensor's flat indices, everywhere (kernels, twins, wire): uint32 where every index of the
    tensor fits, else uint64.

    >>> index_dtype(1 << 32), index_dtype((1 << 32) + 1)
    (dtype('uint32'), dtype('uint64'))
    """
    return np.dtype("<u4") if numel <= (1 << 32) else np.dtype("<u8")
