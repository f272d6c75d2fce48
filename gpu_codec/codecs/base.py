"""The codec contract (numcodecs style) and the base class of each stage kind.

A codec has a stable ``codec_id``, a config that is exactly the constructor's arguments plus ``"id"``,
``from_config`` to rebuild it, and a ``lossless`` flag (OpenFL's ``lossy``, inverted). Every stage of a
:class:`~gpu_codec.Pipeline` is a codec of one ``stage`` kind, in this order: ``"sparsify"`` (top-k,
:class:`~gpu_codec.codecs.topk.TopK`), ``"values"`` (:class:`ValueCodec`: how kept values are stored),
``"indices"`` (:class:`IndexCodec`: how kept positions are stored), ``"bytes"`` (:class:`BytesCodec`: a
lossless compressor over each tensor's buffers). Runtime state never enters a config.

A value or index codec declares its wire *forms* (:class:`Form`: the tag a tensor record carries, the codec
fields it needs and how each is stored, its buffer layout and its decoder) next to its encoder, in its own module;
a codec's config fields are declared the same way (``wire_fields``). The registry collects the declarations
(:func:`gpu_codec.codecs.registry.wire_layouts`), and the wire format writes and reads what they say: a registered
codec is written in the current version. Adding a codec is one module and one line in the registry (or one
:func:`~gpu_codec.codecs.register_codec` call for a codec of one's own).

>>> from gpu_codec.codecs import Quantize
>>> q = Quantize("float16")
>>> q.get_config(), q.lossless
({'id': 'quantize', 'dtype': 'float16'}, False)
>>> Quantize.from_config(q.get_config()) == q
True
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import CodecConfigError
from ..format import TensorRecord
from ..format.schema import Field, FormSpec, StageSpec

if TYPE_CHECKING:
    from ..backends import Backend

STAGES = ("sparsify", "values", "indices", "bytes")

# role -> (allowed buffer dtypes, element count), in buffer order
Layout = dict[str, tuple[tuple[str, ...], int]]


@dataclass(frozen=True)
class Form:
    """One way of storing a tensor's kept values (or indices) on the wire.

    ``tag`` is what a record's codec dict says (``"v"`` or ``"i"``); ``fields`` the codec-dict keys the form
    uses, each a :class:`~gpu_codec.format.schema.Field` (how the compact table stores it: once with the form, or
    in each tensor entry) or a name that ``derive(nnz, numel)`` computes (stored nowhere); ``layout(rec, n)`` the
    buffers it needs for ``n`` entries (raising ``PayloadHeaderError`` on a bad field); ``decode(rec, bufs, n,
    backend)`` the fp32/fp64 values (or flat indices) as a backend array. ``part(rec, bufs, a, b)`` gives the
    buffers of entries ``[a, b)`` alone, for ``a`` a multiple of ``unit(rec)``, so a dense tensor decodes a slice
    at a time (default: every buffer holds one item per entry). ``code``: the form's one-byte code in the table,
    fixed forever, for the built-in forms only (a form of one's own is written by its tag). ``many(cols, n)``
    (optional) is ``layout`` of every record of ``cols`` (:class:`~gpu_codec.format.common.Columns`) at once, ``n``
    an int64 array: ``{role: (allowed dtypes, counts array)}``, or None where any record might fail ``layout`` (its
    fields are not all checked here: the caller checks that each codec dict holds exactly the form's keys).
    """

    tag: str
    fields: tuple[Field | str, ...]
    layout: Callable[[TensorRecord, int], Layout]
    decode: Callable[..., Any]
    part: Callable[[TensorRecord, dict, int, int], dict] | None = None
    unit: Callable[[TensorRecord], int] | None = None
    code: int | None = None
    derive: Callable[[int, int], dict] | None = None
    many: Callable[..., dict | None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The codec-dict keys of the form."""
        return tuple(f if isinstance(f, str) else f.name for f in self.fields)

    def spec(self) -> FormSpec:
        """What the wire format needs to store the form (:class:`~gpu_codec.format.schema.FormSpec`)."""
        declared = [f for f in self.fields if isinstance(f, Field)]
        return FormSpec(
            self.tag,
            self.code,
            tuple(f for f in declared if f.per == "form"),
            tuple(f for f in declared if f.per == "tensor"),
            tuple(f for f in self.fields if isinstance(f, str)),
            self.derive,
        )

    def slice(self, rec: TensorRecord, bufs: dict, a: int, b: int) -> dict:
        """The buffers of entries ``[a, b)``."""
        if self.part is not None:
            return self.part(rec, bufs, a, b)
        return {role: buf[a:b] for role, buf in bufs.items()}

    def step(self, rec: TensorRecord) -> int:
        """Slices must start at a multiple of this."""
        return 1 if self.unit is None else self.unit(rec)


_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> (its __init__, weakly; its arguments)


def _init_params(cls: type) -> tuple[str, ...]:
    """The names of ``cls.__init__``'s arguments but ``self``, read once an ``__init__`` (a decode reads a codec's
    config on every call, and ``inspect.signature`` costs about 10 µs); a class made and dropped at run time is not
    kept alive, and one whose ``__init__`` is replaced is read again."""
    init = cls.__init__
    hit = _PARAMS.get(cls)
    if hit is not None and hit[0]() is init:
        return hit[1]
    params = tuple(p for p in inspect.signature(init).parameters if p != "self")
    _PARAMS[cls] = (weakref.ref(init), params)
    return params


class Codec:
    """Base class of every codec. Subclasses set ``codec_id`` and ``stage`` and store each constructor
    argument under an attribute of the same name."""

    codec_id: ClassVar[str] = ""
    stage: ClassVar[str] = ""
    # the config in the compact table: a one-byte code (fixed forever, built-in codecs only; others are stored as
    # JSON) and how each constructor argument is stored
    wire_code: ClassVar[int | None] = None
    wire_fields: ClassVar[tuple[Field, ...]] = ()

    @classmethod
    def stage_spec(cls) -> StageSpec | None:
        """The compact form of the codec's configs, where it has one."""
        return None if cls.wire_code is None else StageSpec(cls.codec_id, cls.wire_code, cls.wire_fields)

    @classmethod
    def _params(cls) -> list[str]:
        return list(_init_params(cls))

    def get_config(self) -> dict[str, Any]:
        """A JSON dict: ``{"id": codec_id, <each constructor argument>: value}``."""
        return {"id": self.codec_id, **{p: getattr(self, p) for p in self._params()}}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Rebuild a codec from :meth:`get_config`'s dict (missing arguments take their defaults)."""
        if not isinstance(config, Mapping):
            raise CodecConfigError(f"a codec config must be a mapping, got {type(config).__name__}")
        cfg = dict(config)
        cid = cfg.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise CodecConfigError(f"config id {cid!r} does not match codec {cls.codec_id!r}")
        unknown = sorted(set(cfg) - set(cls._params()))
        if unknown:
            raise CodecConfigError(f"codec {cls.codec_id!r} takes {cls._params()}, got unknown field(s) {unknown}")
        return cls(**cfg)

    @property
    def lossless(self) -> bool:
        """True where decoding gives back exactly what was encoded."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash((self.codec_id, tuple(sorted((k, repr(v)) for k, v in self.get_config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self._params())
        return f"{type(self).__name__}({args})"


def check_choice(codec: str, name: str, value: Any, choices: tuple) -> Any:
    if not isinstance(value, str) or value not in choices:
        raise CodecConfigError(f"{codec}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def check_int(codec: str, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecConfigError(f"{codec}: {name} must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise CodecConfigError(f"{codec}: {name} must be in [{lo}, {hi}], got {value}")
    return int(value)


class ValueOverflow(Exception):
    """Raised by a value codec (when its host reads come back) where the values of the tensor at ``position`` would
    decode past float32's range: :meth:`~gpu_codec.codecs.Pipeline.encode` refuses it, naming the tensor, before
    any residual is committed."""

    def __init__(self, position: int, what: str):
        super().__init__(position, what)
        self.position, self.what = position, what


class ValueCodec(Codec):
    """A ``values`` stage: encodes every tensor's kept values in one batch and fixes the error-feedback residual
    of each kept entry to ``value - decoded`` (``res`` lists are None where there is no residual). A codec whose
    decoded values can leave float32's range raises :class:`ValueOverflow` for such a tensor."""

    stage = "values"
    forms: ClassVar[tuple[Form, ...]] = ()

    @property
    def tag(self) -> str:
        """The form this configuration writes (the ``"v"`` of each record)."""
        return self.forms[0].tag

    def encode_values(
        self, values: list[Any], indices: list[Any], res: list[Any], backend: Backend
    ) -> list[tuple[dict, dict, dict]]:
        """Per tensor: (codec fields, buffers by role, buffer dtype names that differ from the array's)."""
        raise NotImplementedError


class IndexCodec(Codec):
    """An ``indices`` stage: encodes every tensor's ascending flat indices in one batch."""

    stage = "indices"
    forms: ClassVar[tuple[Form, ...]] = ()

    @property
    def tag(self) -> str:
        """The form this configuration writes (the ``"i"`` of each record)."""
        return self.forms[0].tag

    def encode_indices(self, indices: list[Any], numels: list[int], backend: Backend) -> list[tuple[dict, dict, dict]]:
        """Per tensor: (codec fields, buffers by role, buffer dtype names that differ from the array's)."""
        raise NotImplementedError


class BytesCodec(Codec):
    """A ``bytes`` stage: wraps each tensor's buffers (its inner encoding's layout, concatenated without
    padding) into one ``compressed`` buffer of encoding :attr:`encoding`; decoding is standard zstd."""

    stage = "bytes"
    encoding: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()  # codec-dict keys of the wrapper beyond inner, ic, raw and zbytes
    # raw bytes per zstd frame of the records it writes (wire format v3 holds records of several frames); None:
    # one frame per record, whatever its size
    chunk: ClassVar[int | None] = None

    @property
    def lossless(self) -> bool:
        return True

    # compresses on the host (compress_host): a device encode then reads the coded buffers with its other host
    # reads, in one copy
    on_host: ClassVar[bool] = False

    def compress_parts(self, flat: Any, sizes: list[int], backend: Backend) -> list[bytes]:
        """Compress each record's slice of ``flat`` (uint8, in the backend's memory): codecs that compress where
        the buffers lie (not :attr:`on_host`)."""
        raise NotImplementedError

    def compress_host(self, raws: list[bytes]) -> list[bytes]:
        """Compress each record's bytes, on the host (codecs with :attr:`on_host`)."""
        raise NotImplementedError

    def extra_fields(self) -> dict:
        """The wrapper's own codec-dict fields (e.g. nvCOMP's algorithm)."""
        return {}

    @classmethod
    def check_fields(cls, rec: TensorRecord) -> None:
        """Reject a wrapped record whose own fields this reader cannot decode (``PayloadHeaderError``)."""
