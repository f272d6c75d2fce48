"""The base fingerprint: an optional 8-byte digest, stored in a payload, of the base it was made against, so that
applying the update to another base is refused (see docs/FORMAT.md, "Base fingerprint").

It is a *sampled* hash: BLAKE2b with an 8-byte digest over, for each tensor in payload order, its name, dtype code
and element count, and the raw bits of at most :data:`SAMPLES` of its elements, at the fixed positions
``(j * numel) // m`` for ``j < m = min(numel, SAMPLES)`` of the flat tensor. Every element of a tensor of at most
:data:`SAMPLES` elements is hashed. The samples are gathered where the tensor lives (on the GPU: one small gather
per tensor, then one copy of at most ``8 * SAMPLES`` bytes per tensor to the host); nothing else moves and nothing
is computed per element. It catches a wrong base (another round's model, another model of the same shapes: they
differ nearly everywhere), not a base altered in a few elements, and it is no defence against tampering.

>>> import numpy as np
>>> w = np.arange(1000, dtype=np.float32)
>>> fp = fingerprint([("w", "float32", w)])
>>> len(fp), fp == fingerprint([("w", "float32", w.copy())])
(16, True)
>>> w2 = w.copy(); w2[sample_positions(1000)[5]] += 1
>>> fp == fingerprint([("w", "float32", w2)])
False
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import BaseMismatchError, PayloadHeaderError

SAMPLES = 256  # elements hashed per tensor, at most
NBYTES = 8  # the digest's length on the wire
DTYPE_CODES = ("float32", "float16", "bfloat16", "float64")  # as the v2 table's dtype codes
_STORAGE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8"}
_HEX = re.compile(r"[0-9a-f]{16}")
_HEAD = struct.Struct("<IBQ")


def sample_positions(numel: int) -> np.ndarray:
    """The flat positions hashed in a tensor of ``numel`` elements: ``(j * numel) // m``, ``m = min(numel,
    SAMPLES)`` (increasing, all distinct).

    >>> sample_positions(3).tolist(), sample_positions(1024)[:3].tolist()
    ([0, 1, 2], [0, 4, 8])
    """
    m = min(numel, SAMPLES)
    return (np.arange(m, dtype=np.int64) * numel) // m if m else np.zeros(0, np.int64)


class _Host:
    xp = np
    to_host = staticmethod(np.asarray)
    asarray = staticmethod(np.asarray)


def fingerprint(tensors: Iterable[tuple[str, str, Any]], backend: Any = _Host) -> str:
    """The base fingerprint, 16 lowercase hex digits, of ``(name, dtype, flat array)`` tensors in payload order.

    Arrays are the tensors' storage (bfloat16 as uint16 bit patterns) on ``backend``'s device (default NumPy):
    its ``asarray``, ``xp`` (NumPy or CuPy) and ``to_host`` gather the samples there and copy only them.
    """
    h = hashlib.blake2b(digest_size=NBYTES)
    for name, dtype, a in tensors:
        a = backend.asarray(a)
        numel = int(a.size)
        nb = name.encode("utf-8")
        h.update(_HEAD.pack(len(nb), DTYPE_CODES.index(dtype), numel) + nb)
        pos = sample_positions(numel)
        if pos.size:
            flat = a.reshape(-1)
            picked = flat[backend.xp.asarray(pos)] if pos.size < numel else flat
            h.update(np.ascontiguousarray(np.asarray(backend.to_host(picked)), _STORAGE[dtype]).tobytes())
    return h.hexdigest()


def check_base(stored: str, tensors: Iterable[tuple[str, str, Any]], backend: Any = _Host) -> None:
    """Refuse (:class:`~gpu_codec.errors.BaseMismatchError`) a base whose fingerprint is not ``stored``."""
    got = fingerprint(tensors, backend)
    if got != stored:
        raise BaseMismatchError(
            f"the base given is not the one this payload was made against (base fingerprint {got}, the payload "
            f"records {stored}); nothing was decoded"
        )


def check_hex(x: Any, what: str = "base fingerprint") -> str:
    """A fingerprint as a header stores it: exactly 16 lowercase hex digits (PayloadHeaderError otherwise)."""
    if not isinstance(x, str) or not _HEX.fullmatch(x):
        raise PayloadHeaderError(f"{what} must be 16 lowercase hex digits, got {str(x)[:40]!r}")
    return x


__all__ = ["NBYTES", "SAMPLES", "check_base", "check_hex", "fingerprint", "sample_positions"]
