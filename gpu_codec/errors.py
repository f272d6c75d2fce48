"""Exception types of gpu_codec.

Every error the library raises on bad input or a bad payload is one of these. Each subclasses the built-in
exception a caller would naturally catch (``ValueError`` for bad values, ``RuntimeError`` for an unusable
backend), so ``except ValueError`` keeps working.

>>> from gpu_codec.errors import PayloadChecksumError, PayloadError
>>> issubclass(PayloadChecksumError, PayloadError) and issubclass(PayloadError, ValueError)
True
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "BaseMismatchError",
    "CodecConfigError",
    "GpuCodecError",
    "InvalidInputError",
    "PayloadChecksumError",
    "PayloadDtypeError",
    "PayloadError",
    "PayloadHeaderError",
    "PayloadIndexError",
    "PayloadLayoutError",
    "PayloadLimitError",
    "PayloadTruncatedError",
    "PayloadValueError",
    "UnknownCodecError",
    "UnsupportedVersionError",
]


class GpuCodecError(Exception):
    """Base class of every error raised by gpu_codec."""


class InvalidInputError(GpuCodecError, ValueError):
    """An update, base or argument that cannot be compressed as given (names the tensor where one is at fault)."""


class BackendUnavailableError(GpuCodecError, RuntimeError):
    """The requested backend cannot run here (for example ``GPU_CODEC_BACKEND=gpu`` on a machine without a GPU)."""


class UnknownCodecError(GpuCodecError, ValueError):
    """A codec id that is not registered."""


class CodecConfigError(GpuCodecError, ValueError):
    """A codec configuration with a missing, unknown, mistyped or out-of-range field."""


class PayloadError(GpuCodecError, ValueError):
    """A payload that is not a valid gpu_codec payload. Nothing is decoded from it."""


class PayloadHeaderError(PayloadError):
    """Bad magic, truncated payload, oversized or malformed header."""


class UnsupportedVersionError(PayloadError):
    """A payload written in a format version this reader does not know."""


class PayloadChecksumError(PayloadError):
    """The checksum does not match the payload's bytes."""


class PayloadLayoutError(PayloadError):
    """Buffer offsets or lengths that are not contiguous, overlap, or disagree with dtype and shape."""


class PayloadTruncatedError(PayloadLayoutError):
    """A payload shorter than its own header or tensor table declares: cut off in storage or in transit. It is
    reported instead of the checksum mismatch that a cut payload also shows."""


class PayloadDtypeError(PayloadError):
    """A dtype outside the whitelist."""


class PayloadLimitError(PayloadError):
    """A shape, element count or tensor count beyond the reader's limits."""


class PayloadIndexError(PayloadError):
    """A sparse index out of range, repeated, or not strictly increasing."""


class PayloadValueError(PayloadError):
    """A value that is not finite, or a finite delta that takes the base out of its dtype's range (fp16
    60000 + 60000): the result would be inf, so nothing is decoded and the base is left as it was."""


class BaseMismatchError(PayloadError):
    """A payload that records the fingerprint of the base it was made against, applied to another base: the
    update would be added to the wrong model. Nothing is decoded."""
