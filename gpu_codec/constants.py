"""The one home of the numbers shared by Python and the kernels: launch sizes, dtype codes, criteria, modes.

The kernels (kernels/*.cu) define none of these: every one comes from here as a ``-D`` flag
(:func:`compile_options`), and kernels/common.cuh stops the compile with ``#error`` where one is missing. The
CuPy runner, the emulator, the NVRTC tests and benchmarks/kernel_resources.py all compile with these flags.

>>> CHUNK == BLOCK * ITEMS
True
>>> "-DBLOCK=256" in compile_options()
True
>>> index_dtype(1 << 32), index_dtype((1 << 32) + 1)
(dtype('uint32'), dtype('uint64'))
"""

from __future__ import annotations

import functools
import math
from enum import IntEnum

import numpy as np

# Launch sizes: a block of BLOCK threads handles a chunk of CHUNK = BLOCK * ITEMS elements that never straddles
# a tensor; the single-block passes (cand_select per segment, rice_scan) run SCAN_THREADS and RICE_SCAN_THREADS
# threads; the chunk scan of the top-k selection runs blocks of CHUNK_SCAN_THREADS threads, one chunk a thread.
BLOCK = 256
ITEMS = 16
CHUNK = BLOCK * ITEMS
WARPS = BLOCK // 32
SCAN_THREADS = 1024
CHUNK_SCAN_THREADS = 256
CHUNK_SCAN_PART = 3  # u64 partials per chunk-scan block (kernels/topk.cu, "The chunk scan")
RICE_SCAN_THREADS = 1024

U64_MAX = 0xFFFFFFFFFFFFFFFF  # "no error" in the kernels' error words
NO_SEG_THRESHOLD = 0xFFFFFFFF  # threshold of a segment with k = 0: above every finite key

# Logical dtype codes of the tensors the kernels read and write.
DT_F32, DT_F16, DT_BF16, DT_F64 = 0, 1, 2, 3

# Score criteria (fl4health's six, plus the default magnitude of the delta) and user scores.
CRIT_MAGNITUDE = 0  # |w - w0 (+ residual)|
CRIT_LARGEST_FINAL = 1  # |w|
CRIT_SMALLEST_FINAL = 2  # -|w|
CRIT_LARGEST_CHANGE = 3  # |w - w0|
CRIT_SMALLEST_CHANGE = 4  # -|w - w0|
CRIT_LARGEST_INCREASE = 5  # |w| - |w0|
CRIT_SMALLEST_INCREASE = 6  # -(|w| - |w0|)
CRIT_EXTERNAL = 7  # a user score array per tensor

# Residual rounding modes (error feedback): what the receiver decodes for a kept value.
QMODE_EXACT, QMODE_F16, QMODE_BF16 = 0, 1, 2
# quantize_cast's target (the same codes as the residual modes it implies).
Q_F16, Q_BF16 = QMODE_F16, QMODE_BF16
# Scatter modes: write into zeros, or add onto a copy of the base.
SCATTER_ZEROS, SCATTER_ADD = 0, 1


# The same codes as enums, for the op contract between the engine and the backends (each member is its code: a
# kernel argument takes it as it is).
class DType(IntEnum):
    """A tensor's logical dtype."""

    F32 = DT_F32
    F16 = DT_F16
    BF16 = DT_BF16
    F64 = DT_F64


class Criterion(IntEnum):
    """What a kept entry is chosen by (largest first)."""

    MAGNITUDE = CRIT_MAGNITUDE
    LARGEST_FINAL = CRIT_LARGEST_FINAL
    SMALLEST_FINAL = CRIT_SMALLEST_FINAL
    LARGEST_CHANGE = CRIT_LARGEST_CHANGE
    SMALLEST_CHANGE = CRIT_SMALLEST_CHANGE
    LARGEST_INCREASE = CRIT_LARGEST_INCREASE
    SMALLEST_INCREASE = CRIT_SMALLEST_INCREASE
    EXTERNAL = CRIT_EXTERNAL


class Rounding(IntEnum):
    """What the receiver decodes for a kept value, which the error-feedback residual of a kept entry accounts for."""

    EXACT = QMODE_EXACT
    F16 = QMODE_F16
    BF16 = QMODE_BF16


class ScatterMode(IntEnum):
    """Where kept entries are written: into zeros, or added onto a copy of the base."""

    ZEROS = SCATTER_ZEROS
    ADD = SCATTER_ADD


# Rice coding of index gaps: the parameter rule a writer must follow and a reader checks.
MAX_K = 40  # gaps are < 2^40 (the format's element limit)
# Small tensors coded together on the host (the NumPy Rice and fp16/bf16 coders, a Rice decode of records read from
# bytes): a tensor of at most TOGETHER_MOST entries joins others, in batches of at most TOGETHER_BATCH entries.
TOGETHER_MOST = 4096
TOGETHER_BATCH = 1 << 16
_LN2 = math.log(2.0)


@functools.lru_cache(maxsize=1 << 12)  # (a table's checks ask for each tensor's several times)
def rice_param(nnz: int, numel: int) -> int:
    """The Rice parameter for ``nnz`` kept indices among ``numel``: the largest k with 2^k <= ln2 x mean gap.

    For geometric gaps of mean m this is the optimal power-of-two Golomb parameter (about 8.1 bits per index
    at 1% density, where the entropy is about 8.08).

    >>> rice_param(1, 100), rice_param(100, 10_000), rice_param(10, 10), rice_param(0, 5)
    (6, 6, 0, 0)
    """
    if nnz <= 0 or numel <= nnz:
        return 0
    mean = (numel - nnz) / nnz
    x = mean * _LN2
    if x < 2.0:
        return 0
    return min(MAX_K, math.floor(math.log2(x)))


def max_bits(nnz, numel, k):
    """An upper bound on the stream length: the gaps add up to at most ``numel - nnz`` (of ints, or of int64
    arrays, element by element).

    >>> max_bits(2, 100, 3), max_bits(np.array([2, 5]), np.array([100, 4]), np.array([3, 0])).tolist()
    (20, [20, 5])
    """
    gaps = np.maximum(numel - nnz, 0) if isinstance(numel, np.ndarray) else max(0, numel - nnz)
    return nnz * (k + 1) + (gaps >> k)


_DEFINE_NAMES = (
    "BLOCK",
    "ITEMS",
    "CHUNK",
    "WARPS",
    "SCAN_THREADS",
    "CHUNK_SCAN_THREADS",
    "CHUNK_SCAN_PART",
    "RICE_SCAN_THREADS",
    "DT_F32",
    "DT_F16",
    "DT_BF16",
    "DT_F64",
    "CRIT_MAGNITUDE",
    "CRIT_LARGEST_FINAL",
    "CRIT_SMALLEST_FINAL",
    "CRIT_LARGEST_CHANGE",
    "CRIT_SMALLEST_CHANGE",
    "CRIT_LARGEST_INCREASE",
    "CRIT_SMALLEST_INCREASE",
    "CRIT_EXTERNAL",
    "QMODE_EXACT",
    "QMODE_F16",
    "QMODE_BF16",
    "Q_F16",
    "Q_BF16",
    "SCATTER_ZEROS",
    "SCATTER_ADD",
)


def defines() -> dict[str, int]:
    """Every constant the kernels take, by macro name."""
    g = globals()
    return {name: int(g[name]) for name in _DEFINE_NAMES}


def define_flags() -> tuple[str, ...]:
    """The ``-D`` flags of :func:`defines`."""
    return tuple(f"-D{k}={v}" for k, v in defines().items())


# Language, and no multiply-add contraction (--fmad=false) so the device rounds exactly where the NumPy twins
# do; subnormals are kept (-ftz=false), divisions and square roots are IEEE-rounded.
BASE_OPTIONS = ("-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")


def compile_options() -> tuple[str, ...]:
    """The NVRTC options every device compile of kernels/*.cu uses (the runtime and the CI compile test alike),
    less the target architecture."""
    return (*BASE_OPTIONS, *define_flags())


U32_INDEX_NUMEL = 1 << 32  # the largest element count whose flat indices are stored as uint32


def index_dtype(numel: int) -> np.dtype:
    """The flat-index dtype of a tensor of ``numel`` elements: uint32 where every index fits, else uint64."""
    return np.dtype("<u4") if numel <= U32_INDEX_NUMEL else np.dtype("<u8")


def index_itemsizes(numels: np.ndarray) -> np.ndarray:
    """:func:`index_dtype`'s itemsize for each of an array of element counts.

    >>> index_itemsizes(np.array([0, 1 << 32, (1 << 32) + 1])).tolist()
    [4, 4, 8]
    """
    return np.where(numels <= U32_INDEX_NUMEL, 4, 8)


__all__ = [name for name in globals() if name.isupper()] + [
    "compile_options",
    "define_flags",
    "defines",
    "index_dtype",
    "index_itemsizes",
]
