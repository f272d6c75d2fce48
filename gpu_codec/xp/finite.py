"""Whether a tensor's storage holds inf or NaN, for any ``xp`` (NumPy or CuPy): read from the bits for bfloat16
(stored as uint16), with ``isfinite`` otherwise (a test, no arithmetic).
"""

from __future__ import annotations

import numpy as np

from ..constants import DT_BF16


def all_finite(x, dt: int, xp=np) -> bool:
    """Whether every element of ``x``, a tensor's storage of logical dtype ``dt`` (bf16 as uint16 bit patterns),
    is finite; ``xp`` is NumPy or CuPy.

    >>> from gpu_codec.constants import DT_F16, DT_F32
    >>> all_finite(np.array([0x3F80, 0x7F80], np.uint16), DT_BF16), all_finite(np.ones(2, np.float16), DT_F16)
    (False, True)
    """
    if dt == DT_BF16:  # an exponent of all ones is inf or NaN
        return not bool(xp.any((x & 0x7F80) == 0x7F80))
    return bool(xp.all(xp.isfinite(x)))


def some_nonfinite(x, dt: int, xp=np):
    """Whether some element of ``x`` is inf or NaN (as :func:`all_finite` reads it), left where ``x`` is: a 0-d
    array of ``xp``, for a caller that reads many such flags at once.

    >>> from gpu_codec.constants import DT_F32
    >>> bool(some_nonfinite(np.array([1.0, np.inf], np.float32), DT_F32))
    True
    """
    if dt == DT_BF16:
        return xp.any((x & 0x7F80) == 0x7F80)
    return ~xp.all(xp.isfinite(x))
