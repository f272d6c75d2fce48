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
    if xp is np and x.size > CHECK_BLOCK:  # (on the host, a block at a time: no temporary of the tensor's size)
        flat = x.reshape(-1)
        return np.bool_(any(some_nonfinite(flat[s : s + CHECK_BLOCK], dt) for s in range(0, flat.size, CHECK_BLOCK)))
    if dt == DT_BF16:
        return xp.any((x & 0x7F80) == 0x7F80)
    return ~xp.all(xp.isfinite(x))


CHECK_BLOCK = 1 << 18  # elements some_nonfinite tests at a time on the host


def saturate_inf(x, dt: int, xp=np) -> None:
    """Set each inf of ``x`` (a tensor's storage of logical dtype ``dt``, bf16 as uint16 bit patterns) to the
    largest finite value of its sign, in place; NaN and finite values stay as they are.

    >>> from gpu_codec.constants import DT_F16
    >>> x = np.array([0x7F80, 0xFF80, 0x7FC0, 0x3F80], np.uint16)
    >>> saturate_inf(x, DT_BF16); [hex(v) for v in x.tolist()]
    ['0x7f7f', '0xff7f', '0x7fc0', '0x3f80']
    >>> y = np.array([np.inf, -np.inf, 1.0], np.float16); saturate_inf(y, DT_F16); y.tolist()
    [65504.0, -65504.0, 1.0]
    """
    if dt == DT_BF16:  # inf: an exponent of all ones and no mantissa; one less is the largest finite
        x -= ((x & 0x7FFF) == 0x7F80).astype(x.dtype)
        return
    top = np.finfo(x.dtype).max
    xp.clip(x, -top, top, out=x)  # (a NaN stays NaN)


PACK_ALONE = 1 << 18  # elements from which a tensor is checked on its own
PACK_MAX = 1 << 22  # elements of one concatenation of smaller tensors


def first_nonfinite(arrays, dts, xp=np, to_host=np.asarray, sizes=None, join=None) -> int | None:
    """The index of the first of ``arrays`` (storages of logical dtype codes ``dts``) that holds inf or NaN, or
    None, with one read-back (``to_host``) where none does. Tensors of ``PACK_ALONE`` elements or more are
    checked alone; smaller ones of one dtype together, concatenated up to ``PACK_MAX`` elements at a time, so
    that the launches follow the bytes rather than the tensor count (a model's hundreds of biases and norms).
    ``sizes``: each array's size, where the caller has them; ``join(indices)``: those arrays end to end in one new
    array, where the caller joins them without reading each (``xp.concatenate`` of them otherwise).

    >>> from gpu_codec.constants import DT_F16, DT_F32
    >>> a = [np.ones(3, np.float32), np.ones(2, np.float16), np.array([1, np.nan], np.float32)]
    >>> first_nonfinite(a, [DT_F32, DT_F16, DT_F32]), first_nonfinite(a[:2], [DT_F32, DT_F16])
    (2, None)
    """
    groups: list[list[int]] = []  # the tensors of one flag
    packs: dict[int, list[int]] = {}  # dtype -> its open pack of small tensors
    filled: dict[int, int] = {}
    sizes = [int(a.size) for a in arrays] if sizes is None else sizes
    for i, (n, dt) in enumerate(zip(sizes, dts)):
        if n >= PACK_ALONE:
            groups.append([i])
            continue
        pack = packs.get(dt)
        if pack is not None and filled[dt] + n > PACK_MAX:
            groups.append(pack)
            pack = None
        if pack is None:
            packs[dt] = pack = []
            filled[dt] = 0
        pack.append(i)
        filled[dt] += n
    groups.extend(packs.values())
    if not groups:
        return None
    if join is None:
        join = lambda g: xp.concatenate([arrays[i] for i in g])  # noqa: E731
    flags = [some_nonfinite(arrays[g[0]] if len(g) == 1 else join(g), dts[g[0]], xp) for g in groups]
    hit = np.flatnonzero(to_host(xp.stack(flags)))
    if not hit.size:
        return None
    # the error path: the lowest tensor of the flagged groups that fails alone
    known = {groups[j][0] for j in hit if len(groups[j]) == 1}
    for i in sorted(i for j in hit for i in groups[j]):
        if i in known or bool(to_host(some_nonfinite(arrays[i], dts[i], xp))):
            return i
    return None  # (not reached: a flagged pack holds a tensor that fails alone)
