"""Logical dtypes, score criteria and residual modes by name, with their kernel codes (:mod:`gpu_codec.constants`)."""

from __future__ import annotations

import numpy as np

from .constants import CRIT_EXTERNAL, DT_BF16, DT_F16, DT_F32, DT_F64, Criterion, DType, Rounding, index_dtype

# Logical dtype name -> (kernel code, storage NumPy dtype). bfloat16 is stored as its uint16 bit pattern, since
# neither NumPy nor CuPy has a native bfloat16.
FLOAT_DTYPES: dict[str, tuple[DType, np.dtype]] = {
    "float32": (DType.F32, np.dtype("<f4")),
    "float16": (DType.F16, np.dtype("<f2")),
    "bfloat16": (DType.BF16, np.dtype("<u2")),
    "float64": (DType.F64, np.dtype("<f8")),
}


_NAMES: dict = {}


def dtype_name(dt) -> str:
    """``np.dtype(dt).name``, remembered per dtype (NumPy builds the name string on every access, a few µs: a cost
    per tensor that adds up on updates of a thousand tensors).

    >>> dtype_name(np.float32), dtype_name(np.dtype("<u4"))
    ('float32', 'uint32')
    """
    try:
        return _NAMES[dt]
    except KeyError:
        name = _NAMES[dt] = np.dtype(dt).name
        return name
    except TypeError:  # not hashable: no cache
        return np.dtype(dt).name


def value_dtype(logical: str) -> str:
    """The dtype a delta of ``logical`` is computed and kept in: fp64 for fp64, fp32 for every other float."""
    return "float64" if logical == "float64" else "float32"


def storage_dtype(logical: str) -> np.dtype:
    return FLOAT_DTYPES[logical][1]


def code(logical: str) -> DType:
    return FLOAT_DTYPES[logical][0]


_CODES = {name: v[0] for name, v in FLOAT_DTYPES.items()}


def codes(logical: list[str]) -> list[DType]:
    """:func:`code` of each name, in one C loop.

    >>> [int(c) for c in codes(["float32", "bfloat16"])] == [int(code("float32")), int(code("bfloat16"))]
    True
    """
    return list(map(_CODES.__getitem__, logical))


# Score criteria (fl4health's six, plus the default magnitude of the delta).
CRITERIA: dict[str, Criterion] = {
    "magnitude": Criterion.MAGNITUDE,
    "largest_final_magnitude": Criterion.LARGEST_FINAL,
    "smallest_final_magnitude": Criterion.SMALLEST_FINAL,
    "largest_magnitude_change": Criterion.LARGEST_CHANGE,
    "smallest_magnitude_change": Criterion.SMALLEST_CHANGE,
    "largest_increase_in_magnitude": Criterion.LARGEST_INCREASE,
    "smallest_increase_in_magnitude": Criterion.SMALLEST_INCREASE,
}

# Residual rounding modes (error feedback): what the receiver decodes for a kept value.
# Selection scopes: one threshold over the whole update, or one per tensor.
SCOPES = ("global", "per_tensor")

QMODES: dict[str, Rounding] = {"exact": Rounding.EXACT, "float16": Rounding.F16, "bfloat16": Rounding.BF16}

__all__ = [
    "CRITERIA",
    "CRIT_EXTERNAL",
    "DT_BF16",
    "DT_F16",
    "DT_F32",
    "DT_F64",
    "FLOAT_DTYPES",
    "QMODES",
    "SCOPES",
    "code",
    "index_dtype",
    "storage_dtype",
    "value_dtype",
]
