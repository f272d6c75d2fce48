"""How a codec's config and its per-tensor fields are stored in the compact table of wire format v2, as the codecs
declare it: this package knows how to write and read each *kind* of field; which codec has which fields, codes and
ranges is said once, by the codec (:mod:`gpu_codec.codecs`), and reaches the writer and the reader through
:class:`WireTables` (what :func:`gpu_codec.codecs.wire_layouts` returns).

A :class:`Field` is one named value: ``varint`` (an integer in [lo, hi]), ``u8`` (an integer in [lo, hi] in one
byte), ``choice`` (one of ``choices``, as its index in one byte), ``decimal`` (a float in (0, 1] as its shortest
decimal ``m x 10^-e``, two varints) or ``f32`` (a finite, non-negative float32, its 4 bits LE).

>>> Field("level", "u8", lo=1, hi=22).encode(3)
b'\\x03'
>>> Field("fraction", "decimal").encode(0.01)
b'\\x01\\x02'
>>> Field("dtype", "choice", choices=("float32", "float16")).encode("bfloat16")
Traceback (most recent call last):
...
gpu_codec.format.schema.Unrepresentable: dtype 'bfloat16'
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from ..errors import PayloadHeaderError
from .common import LayoutRule, is_int, req

KINDS = ("varint", "u8", "choice", "decimal", "f32")
MAX_FRACTION_DIGITS = 10**17
MAX_FRACTION_EXP = 400
MAX_TAG = 64  # bytes of a named form's tag
_F32 = struct.Struct("<f")


class Unrepresentable(Exception):
    """A record or config the v2 table has no field for (the writer then falls back to v1)."""


def uvarint(n: int) -> bytes:
    """Unsigned LEB128: 7 bits per byte, least significant group first, high bit set on every byte but the last.

    >>> uvarint(0), uvarint(127), uvarint(300)
    (b'\\x00', b'\\x7f', b'\\xac\\x02')
    """
    if 0 <= n < 0x80:  # one byte: most fields of a table
        return _ONE_BYTE[n]
    if n < 0:
        raise Unrepresentable(f"negative integer {n}")
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_ONE_BYTE = [bytes([b]) for b in range(0x80)]


def uvarints(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """:func:`uvarint` of each of ``values`` (non-negative integers below 2^64), end to end, and each one's byte
    count: every value coded by a few array operations over them all, not a call a value.

    >>> data, counts = uvarints(np.array([0, 127, 300, 8388, 1 << 40], np.uint64))
    >>> data == b"".join(uvarint(x) for x in (0, 127, 300, 8388, 1 << 40)), counts.tolist()
    (True, [1, 1, 2, 2, 6])
    """
    v = np.asarray(values, np.uint64).reshape(-1)
    counts = np.ones(v.size, np.int64)
    for j in range(1, 10):  # a byte more for each 7 bits past the first 7
        more = v >= np.uint64(1 << (7 * j))
        if not more.any():
            break
        counts += more
    owner = np.repeat(np.arange(v.size), counts)
    place = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)  # each byte's place in its value
    data = (v[owner] >> (7 * place).astype(np.uint64)) & np.uint64(0x7F)
    data[place < counts[owner] - 1] |= np.uint64(0x80)
    return data.astype(np.uint8).tobytes(), counts


def decimal_of(f: float) -> tuple[int, int]:
    """A float in (0, 1] as (m, e), its shortest round-tripping decimal m x 10^-e."""
    sign, digits, exp = Decimal(repr(f)).as_tuple()
    if sign or not is_int(exp):
        raise Unrepresentable(f"fraction {f!r}")
    m, e = int("".join(map(str, digits))), -exp
    if e < 0:
        m, e = m * 10**-e, 0
    while e and m % 10 == 0:  # 1.0 is (1, 0), not (10, 1)
        m, e = m // 10, e - 1
    return m, e


def f32_ok(b: bytes) -> bool:
    return int.from_bytes(b, "little") < 0x7F800000  # finite, sign bit clear


@dataclass(frozen=True)
class Field:
    """One named field of a stage config or of a tensor's codec dict, as the v2 table stores it.

    A form's field is stored in each tensor entry (``per="tensor"``: ternary's mu, Rice's bit count) or once with
    the form (``per="form"``: int8's block size). ``empty``: for a per-tensor field, the value it must have where
    the tensor keeps nothing (it is then not stored); None stores it always.
    """

    name: str
    kind: str
    lo: int = 0
    hi: int = 0
    choices: tuple[str, ...] = ()
    empty: Any = None
    per: str = "tensor"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "u8" and not 0 <= self.lo <= self.hi <= 255:
            raise ValueError(f"field {self.name!r}: a u8 range must lie in [0, 255]")
        if self.kind == "choice" and not 0 < len(self.choices) <= 256:
            raise ValueError(f"field {self.name!r}: a choice needs 1 to 256 choices")
        if self.per not in ("tensor", "form"):
            raise ValueError(f"field {self.name!r}: per must be 'tensor' or 'form', got {self.per!r}")

    def encode(self, value: Any) -> bytes:
        """The field's bytes; :class:`Unrepresentable` where the value is not one the field can hold."""
        k = self.kind
        if k in ("varint", "u8"):
            if not is_int(value) or not self.lo <= value <= self.hi:
                raise Unrepresentable(f"{self.name} {value!r}")
            return uvarint(value) if k == "varint" else bytes([value])
        if k == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise Unrepresentable(f"{self.name} {value!r}")
            return bytes([self.choices.index(value)])
        if k == "decimal":
            if type(value) is not float or not 0.0 < value <= 1.0:
                raise Unrepresentable(f"{self.name} {value!r}")
            m, e = decimal_of(value)
            return uvarint(m) + uvarint(e)
        if type(value) not in (float, int) or isinstance(value, bool):  # f32
            raise Unrepresentable(f"{self.name} {value!r}")
        try:
            b = _F32.pack(value)
        except (OverflowError, struct.error):
            raise Unrepresentable(f"{self.name} {value!r}") from None
        if _F32.unpack(b)[0] != value or not f32_ok(b):
            raise Unrepresentable(f"{self.name} {value!r}")
        return b

    def encode_many(self, values: list) -> list[bytes]:
        """:meth:`encode` of each of ``values`` (a varint's with one check over the list).

        >>> Field("bits", "varint", hi=1 << 62).encode_many([0, 300])
        [b'\\x00', b'\\xac\\x02']
        """
        if (
            self.kind == "varint"
            and values
            and set(map(type, values)) == {int}
            and self.lo <= min(values)
            and max(values) <= self.hi
        ):
            return list(map(uvarint, values))
        return list(map(self.encode, values))

    def decode(self, r: Any) -> Any:
        """Read the field from ``r`` (the v2 reader), every bound checked (``PayloadHeaderError``)."""
        k = self.kind
        if k == "varint":
            v = r.varint(self.name, self.hi)
            req(v >= self.lo, PayloadHeaderError, f"{r.what}: {self.name} {v} is below {self.lo}")
            return v
        if k == "u8":
            v = r.u8(self.name)
            req(
                self.lo <= v <= self.hi,
                PayloadHeaderError,
                f"{r.what}: {self.name} {v} is not in [{self.lo}, {self.hi}]",
            )
            return v
        if k == "choice":
            c = r.u8(self.name)
            req(c < len(self.choices), PayloadHeaderError, f"{r.what}: unknown {self.name} code {c}")
            return self.choices[c]
        if k == "decimal":
            m = r.varint(f"{self.name} digits", MAX_FRACTION_DIGITS)
            e = r.varint(f"{self.name} exponent", MAX_FRACTION_EXP)
            f = float(Decimal(m).scaleb(-e))
            req(0.0 < f <= 1.0, PayloadHeaderError, f"{r.what}: {self.name} {m}e-{e} is not in (0, 1]")
            req(decimal_of(f) == (m, e), PayloadHeaderError, f"{r.what}: {self.name} {m}e-{e} is not in shortest form")
            return f
        b = r.take(4, self.name)
        req(f32_ok(b), PayloadHeaderError, f"{r.what}: {self.name} bits 0x{b[::-1].hex()} are not finite, >= 0")
        return _F32.unpack(b)[0]


@dataclass(frozen=True)
class StageSpec:
    """A codec config stored compactly: its one-byte ``code`` then ``fields`` in order. A config with exactly
    ``"id"`` and these keys, each value one its field can hold, is stored so; any other as JSON."""

    codec_id: str
    code: int
    fields: tuple[Field, ...] = ()

    def encode(self, cfg: Mapping) -> bytes:
        if set(cfg) != {"id", *(f.name for f in self.fields)}:
            raise Unrepresentable(f"no compact code for {cfg!r}")
        return bytes([self.code]) + b"".join(f.encode(cfg[f.name]) for f in self.fields)

    def decode(self, r: Any) -> dict:
        return {"id": self.codec_id, **{f.name: f.decode(r) for f in self.fields}}


@dataclass(frozen=True)
class FormSpec:
    """A value or index form in the table: its one-byte ``code`` (None: written by its tag), ``params`` stored
    once with the form (int8's block), ``fields`` stored in each tensor entry that uses it (ternary's mu, Rice's
    bit count), and the ``derived`` fields, which ``derive(nnz, numel)`` computes from the counts and which are
    not stored (Rice's parameter)."""

    tag: str
    code: int | None = None
    params: tuple[Field, ...] = ()
    fields: tuple[Field, ...] = ()
    derived: tuple[str, ...] = ()
    derive: Callable[[int, int], dict] | None = None

    def keys(self) -> set[str]:
        return {f.name for f in (*self.params, *self.fields)} | set(self.derived)


class WireTables(dict):
    """The layout rule of each encoding (a mapping, as :func:`gpu_codec.format.unpack` takes it) and the v2 table's
    declarations: ``stages`` (by code), ``value_forms`` and ``index_forms`` (by tag)."""

    def __init__(
        self,
        layouts: Mapping[str, LayoutRule],
        stages: list[StageSpec] = (),  # type: ignore[assignment]
        value_forms: Mapping[str, FormSpec] | None = None,
        index_forms: Mapping[str, FormSpec] | None = None,
    ):
        super().__init__(layouts)
        self.stages: dict[int, StageSpec] = {}
        self.stage_of: dict[str, StageSpec] = {}
        for s in stages:
            if s.code in self.stages or not 0 < s.code < 0xFF:
                raise ValueError(f"stage code {s.code} of {s.codec_id!r} is taken or out of range")
            self.stages[s.code] = self.stage_of[s.codec_id] = s
        self.value_forms = dict(value_forms or {})
        self.index_forms = dict(index_forms or {})
        self.value_codes = _codes(self.value_forms, "value")
        self.index_codes = _codes(self.index_forms, "index")


def _codes(forms: Mapping[str, FormSpec], what: str) -> dict[int, FormSpec]:
    out: dict[int, FormSpec] = {}
    for f in forms.values():
        if f.code is not None:
            if f.code in out or not 0 <= f.code < NAMED:
                raise ValueError(f"{what} form code {f.code} of {f.tag!r} is taken or out of range")
            out[f.code] = f
    return out


NAMED = 0xFF  # a form code: the form's tag follows (varint length, UTF-8), for forms without a code of their own


def tables_of(layouts: Mapping[str, LayoutRule] | None) -> WireTables:
    """The declarations carried by ``layouts`` (none where it is a plain mapping of layout rules)."""
    if isinstance(layouts, WireTables):
        return layouts
    return WireTables(layouts or {})


def form_bytes(spec: FormSpec, params: Mapping) -> bytes:
    if spec.code is not None:
        head = bytes([spec.code])
    else:
        tag = spec.tag.encode("utf-8")
        if not 0 < len(tag) <= MAX_TAG:
            raise Unrepresentable(f"form tag {spec.tag!r}")
        head = bytes([NAMED]) + uvarint(len(tag)) + tag
    return head + b"".join(f.encode(params[f.name]) for f in spec.params)


def read_form(r: Any, by_code: Mapping[int, FormSpec], by_tag: Mapping[str, FormSpec], what: str) -> tuple:
    """(spec, params) of a value or index form."""
    c = r.u8(f"{what} form")
    if c == NAMED:
        n = r.varint(f"{what} form tag length", MAX_TAG)
        raw = r.take(n, f"a {what} form tag")
        try:
            tag = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadHeaderError(f"{r.what}: {what} form tag {raw!r} is not UTF-8") from None
        spec = by_tag.get(tag)
        req(
            spec is not None and spec.code is None,
            PayloadHeaderError,
            f"{r.what}: {what} form {tag!r} is not known to this reader (register its codec)",
        )
    else:
        spec = by_code.get(c)
        req(spec is not None, PayloadHeaderError, f"{r.what}: unknown {what} form code {c}")
    return spec, tuple((f.name, f.decode(r)) for f in spec.params)


__all__ = [
    "NAMED",
    "Field",
    "FormSpec",
    "StageSpec",
    "Unrepresentable",
    "WireTables",
    "decimal_of",
    "f32_ok",
    "tables_of",
    "uvarint",
]
