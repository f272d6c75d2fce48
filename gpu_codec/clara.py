"""Clara Train 3.1 federated-learning components (``fed_learn.components``), on the gpu_codec engine.

Someone arriving from Clara Train 3.1 finds its processor model:

* a data context (:class:`DataContext`, alias ``FLContext``) holding the model (name -> tensor, left where it
  lives: GPU tensors stay on the GPU) and its metadata, and an app context (:class:`AppContext`, alias
  ``ApplicationContext``) holding the round, phase, task and the global model of the round;
* :class:`DataProcessor` with ``process(data_ctx, app_ctx)`` and ``abort(app_ctx)``;
* :class:`DataCompressor` / :class:`DataDeCompressor`: the model (or its delta against the app context's global
  model) replaced in the data context by a :class:`~gpu_codec.Payload`, which stays on the device until it is
  serialized for sending, and back;
* :class:`ModelEncryptor` / :class:`ModelDecryptor`: AES-256-GCM (``cryptography``) over the serialized payload,
  the key read from a file or from an environment variable named in the config. A tampered or wrongly keyed
  model raises :class:`DecryptionError` and is never decoded;
* :class:`ProcessorChain`: ``pre_processors`` run in order on the way out, ``post_processors`` in reverse on the
  way in (list each post-processor beside the pre-processor it undoes); an abort or an error leaves the data
  context as it was before the chain ran;
* :class:`DictModelReaderWriter` and :class:`PTModelReaderWriter` (``initialize``, ``apply_model``,
  ``extract_model``, ``get_local_models``), :class:`MetricManager` and the metadata generators
  :class:`IteratorNumberGenerator`, :class:`BestMetricGenerator`, :class:`InitialValidationMetricGenerator`.

TensorFlow 1.x components are not provided. Compression must run before encryption (compressing ciphertext gains
nothing); a chain in the other order is refused with :class:`ProcessorOrderError`. A lone :class:`ModelEncryptor`
encrypts the whole model losslessly.

>>> import numpy as np
>>> chain = ProcessorChain.from_config({"pre_processors": [
...     {"name": "IteratorNumberGenerator", "args": {"field": "n_iter"}},
...     {"name": "DataCompressor", "args": {"fraction": 0.5}}]})
>>> glob = {"w": np.zeros(4, np.float32)}
>>> ctx = DataContext(model={"w": np.array([0.0, 3.0, -1.0, 8.0], np.float32)})
>>> app = AppContext(round_number=2, global_model=glob, n_iter=120)
>>> blob = serialize(chain.process_outgoing(ctx, app))            # the one device-to-host copy
>>> server = deserialize(blob)
>>> _ = chain.process_incoming(server, app)
>>> server.get_model()["w"].tolist(), server.get_metadata("n_iter")
([0.0, 3.0, 0.0, 8.0], 120)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib
import math
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import adapt
from . import engine as _engine
from .arrays import array_kind
from .errors import GpuCodecError, InvalidInputError

__all__ = [
    "PROCESSORS",
    "AppContext",
    "ApplicationContext",
    "BestMetricGenerator",
    "ClaraError",
    "DataCompressor",
    "DataContext",
    "DataDeCompressor",
    "DataProcessor",
    "DecryptionError",
    "DictModelReaderWriter",
    "EncryptionKeyError",
    "FLContext",
    "InitialValidationMetricGenerator",
    "IteratorNumberGenerator",
    "MetadataGenerator",
    "MetricManager",
    "MetricsError",
    "ModelDecryptor",
    "ModelEncryptor",
    "PTModelReaderWriter",
    "ProcessingAbortedError",
    "ProcessorChain",
    "ProcessorOrderError",
    "build_processor",
    "deserialize",
    "serialize",
]

CLARA_KEY = "gpu_codec.clara"  # payload metadata: {"delta": bool, "round": int}
CLARA_META_KEY = "clara.metadata"  # payload metadata: the data context's metadata, carried to the receiver


# ---------------------------------------------------------------- errors


class ClaraError(GpuCodecError):
    """Base class of the Clara adapter's errors."""


class ProcessingAbortedError(ClaraError, RuntimeError):
    """A processor chain was aborted; the data context is as it was before the chain ran."""


class ProcessorOrderError(ClaraError, ValueError):
    """A processor got the model in a form it does not take (compressing an encrypted model, ...)."""


class EncryptionKeyError(ClaraError, ValueError):
    """No key, or a key that is not 32 bytes (raw, hex or base64)."""


class DecryptionError(ClaraError, ValueError):
    """An encrypted model that fails authentication (tampered, or encrypted with another key). Nothing was decoded."""


class MetricsError(ClaraError, ValueError):
    """Metrics that are not finite numbers, or names outside the configured groups."""


# ---------------------------------------------------------------- contexts


class DataContext(dict):
    """What flows through a processor chain: the model (``"model"``), its metadata (``"metadata"``), and any
    other properties. The model is a mapping name -> tensor, a :class:`~gpu_codec.Payload`, or bytes."""

    MODEL = "model"
    METADATA = "metadata"

    def __init__(self, model: Any = None, metadata: Mapping[str, Any] | None = None, **props: Any) -> None:
        super().__init__(props)
        self[self.MODEL] = model
        self[self.METADATA] = dict(metadata or {})

    def get_model(self) -> Any:
        return self.get(self.MODEL)

    def set_model(self, model: Any) -> None:
        self[self.MODEL] = model

    def add_metadata(self, field: str, value: Any) -> None:
        self[self.METADATA][field] = value

    def get_metadata(self, field: str, default: Any = None) -> Any:
        return self[self.METADATA].get(field, default)

    def get_all_metadata(self) -> dict[str, Any]:
        return self[self.METADATA]

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self[self.METADATA] = dict(metadata)

    def get_prop(self, key: str, default: Any = None) -> Any:
        return self.get(key, default)

    def set_prop(self, key: str, value: Any) -> None:
        self[key] = value

    def set_props(self, props: Mapping[str, Any]) -> None:
        self.update(props)

    def clone(self) -> DataContext:
        """A shallow copy (the model's tensors are shared, the metadata dict is not)."""
        c = DataContext()
        c.update(self)
        c[self.METADATA] = dict(self[self.METADATA])
        return c


FLContext = DataContext


class AppContext(dict):
    """The overall app context: ``round``, ``phase``, ``task``, ``global_model`` (the model received this round,
    the base of deltas) and anything else (``n_iter``, ``best_metric``, ``initial_metric`` for the generators)."""

    def __init__(
        self, round_number: int = 0, phase: str = "train", task: str = "train", global_model: Any = None, **props: Any
    ) -> None:
        super().__init__(props)
        self.update(round=round_number, phase=phase, task=task, global_model=global_model)

    @property
    def round_number(self) -> int:
        return self.get("round", 0)

    @property
    def phase(self) -> str:
        return self.get("phase", "")

    @property
    def task(self) -> str:
        return self.get("task", "")

    @property
    def global_model(self) -> Any:
        return self.get("global_model")


ApplicationContext = AppContext


# ---------------------------------------------------------------- processors


class DataProcessor:
    """Base of every processor: ``process(data_ctx, app_ctx)`` transforms the data context in place;
    ``abort(app_ctx)`` (from any thread) stops the run in progress, or the next run if none is."""

    def __init__(self) -> None:
        self._aborted = threading.Event()

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        raise NotImplementedError

    def abort(self, app_ctx: AppContext | None = None) -> None:
        self._aborted.set()

    def _check_abort(self) -> None:
        if self._aborted.is_set():
            raise ProcessingAbortedError(f"{type(self).__name__} was aborted")

    def _reset_abort(self) -> None:
        self._aborted.clear()

    def inverse(self) -> DataProcessor | None:
        """The processor that undoes this one on the receiving side (None where nothing needs undoing)."""
        return None

    def get_config(self) -> dict[str, Any]:
        return {}


def _require_mapping_model(model: Any, who: str) -> Mapping[str, Any]:
    if isinstance(model, (bytes, bytearray, memoryview)):
        if bytes(model[: len(_ENV_MAGIC)]) == _ENV_MAGIC:
            raise ProcessorOrderError(
                f"{who} got an encrypted model: list it before ModelEncryptor in "
                "pre_processors (compress first, then encrypt)"
            )
        raise ProcessorOrderError(f"{who} got a serialized model; it takes a mapping name -> tensor")
    if isinstance(model, _engine.Payload):
        raise ProcessorOrderError(f"{who} got a model that is already compressed")
    if not isinstance(model, Mapping):
        raise InvalidInputError(
            f"{who}: the data context's model must be a mapping name -> tensor, got {type(model).__name__}"
        )
    return model


def _base_for(model: Mapping[str, Any], app_ctx: AppContext, who: str) -> dict[str, Any]:
    glob = app_ctx.global_model
    if not isinstance(glob, Mapping):
        raise InvalidInputError(
            f"{who}: the app context holds no global model (app_ctx['global_model']) to take the delta against"
        )
    missing = [n for n in model if n not in glob]
    if missing:
        raise InvalidInputError(f"{who}: the global model lacks tensors {missing[:5]}")
    return {n: glob[n] for n in model}


def _header_metadata(data_ctx: DataContext, delta: bool, app_ctx: AppContext) -> dict[str, Any]:
    return {
        CLARA_KEY: {"delta": delta, "round": adapt.json_safe(app_ctx.round_number)},
        CLARA_META_KEY: adapt.json_safe(data_ctx.get_all_metadata()),
    }


class DataCompressor(DataProcessor):
    """Compress the data context's model in place: a :class:`~gpu_codec.Payload` replaces it (on the GPU when the
    model is there).

    Parameters
    ----------
    fraction, scope, score, pipeline
        As for :func:`gpu_codec.compress` (``fraction=None``: dense, every entry).
    delta
        ``"auto"`` (the default): compress ``model - global_model`` when the app context holds a global model,
        else the model itself; ``True``: require the global model; ``False``: never.

    The data context's metadata (JSON values only) travels in the payload header, so the receiver's
    :class:`DataDeCompressor` restores it.
    """

    def __init__(
        self,
        fraction: float | None = 0.01,
        scope: str = "global",
        score: str = "magnitude",
        pipeline: Any = None,
        delta: bool | str = "auto",
    ) -> None:
        super().__init__()
        if delta not in (True, False, "auto"):
            raise InvalidInputError(f"delta must be True, False or 'auto', got {delta!r}")
        self.fraction = None if fraction is None else _engine.check_fraction(fraction)
        self.scope = scope
        self.score = score
        self.pipeline = adapt.pipeline_configs(pipeline)
        self.delta = delta

    def get_config(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "scope": self.scope,
            "score": self.score,
            "pipeline": self.pipeline,
            "delta": self.delta,
        }

    def inverse(self) -> DataDeCompressor:
        return DataDeCompressor()

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To compress the data_ctx."""
        self._check_abort()
        model = _require_mapping_model(data_ctx.get_model(), "DataCompressor")
        use_delta = self.delta is True or (self.delta == "auto" and isinstance(app_ctx.global_model, Mapping))
        base = _base_for(model, app_ctx, "DataCompressor") if use_delta else None
        payload = adapt.engine_compress(
            model,
            base,
            fraction=self.fraction,
            scope=self.scope,
            score=self.score,
            pipeline=self.pipeline,
            metadata=_header_metadata(data_ctx, use_delta, app_ctx),
        )
        self._check_abort()
        data_ctx.set_model(payload)


def _payload_of(model: Any, who: str) -> Any:
    if isinstance(model, _engine.Payload):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        if bytes(model[: len(_ENV_MAGIC)]) == _ENV_MAGIC:
            raise ProcessorOrderError(f"{who} got an encrypted model: ModelDecryptor must run before it")
        return _engine.Payload.from_bytes(model)
    if isinstance(model, Mapping):
        raise ProcessorOrderError(f"{who} got a model that is not compressed")
    raise InvalidInputError(f"{who}: expected a Payload or bytes, got {type(model).__name__}")


def _decode_payload(
    payload: Any, app_ctx: AppContext | None, local: Mapping[str, Any] | None, like: str | None, who: str
) -> dict[str, Any]:
    """Dense tensors from a payload: ``base + delta`` when the payload is a delta (base: ``local`` if given, else
    the app context's global model), else the values, in their own dtypes."""
    info = payload.metadata.get(CLARA_KEY, {})
    names = [r.name for r in payload.tensors]
    if isinstance(info, Mapping) and info.get("delta"):
        src = local if local is not None else (app_ctx.global_model if app_ctx is not None else None)
        if not isinstance(src, Mapping):
            raise InvalidInputError(f"{who}: the payload is a delta but there is no global model to add it to")
        missing = [n for n in names if n not in src]
        if missing:
            raise InvalidInputError(f"{who}: the base model lacks tensors {missing[:5]}")
        return _engine.decompress(payload, base={n: src[n] for n in names})
    kind = like or "numpy"
    dense = _engine.decompress(payload, like=kind)
    return {r.name: adapt.cast_to_logical(dense[r.name], r.dtype, kind) for r in payload.tensors}


class DataDeCompressor(DataProcessor):
    """Undo :class:`DataCompressor`: the payload (object or bytes) becomes dense tensors again, ``global_model +
    delta`` for a delta (as the global model's kind, on its device), else the values as ``like`` (``"numpy"``,
    ``"cupy"`` or ``"torch"``). The metadata the sender attached is restored into the data context."""

    def __init__(self, like: str | None = None) -> None:
        super().__init__()
        if like not in (None, "numpy", "cupy", "torch"):
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        self.like = like

    def get_config(self) -> dict[str, Any]:
        return {"like": self.like}

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To decompress the data_ctx."""
        self._check_abort()
        payload = _payload_of(data_ctx.get_model(), "DataDeCompressor")
        dense = _decode_payload(payload, app_ctx, None, self.like, "DataDeCompressor")
        self._check_abort()
        sent = payload.metadata.get(CLARA_META_KEY, {})
        if isinstance(sent, Mapping):
            for k, v in sent.items():
                data_ctx.add_metadata(k, v)
        data_ctx.set_model(dense)


# ---------------------------------------------------------------- encryption

_ENV_MAGIC = b"GCAESGCM"
_ENV_VERSION = 1
_ENV_HEAD = struct.Struct("<8sB8s12s")  # magic, version, key id, nonce; then ciphertext + 16-byte tag


def _decode_key(raw: bytes, where: str) -> bytes:
    if len(raw) == 32:
        return raw
    text = raw.strip()
    if re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        return binascii.unhexlify(text)
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) == 32:
        return key
    raise EncryptionKeyError(
        f"the key in {where} must be 32 bytes: raw, 64 hex digits or base64 "
        f"(got {len(raw)} bytes that decode to none of these)"
    )


def _load_key(key_file: str | None, key_env: str | None, key: bytes | None) -> bytes:
    given = [x is not None for x in (key_file, key_env, key)]
    if sum(given) != 1:
        raise EncryptionKeyError(
            "give exactly one of key_file (a path), key_env (an environment variable name) or key (bytes)"
        )
    if key is not None:
        return _decode_key(bytes(key), "the key argument")
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                data = f.read(4096)
        except OSError as e:
            raise EncryptionKeyError(f"cannot read key file {key_file!r}: {e.strerror}") from None
        return _decode_key(data, f"key file {key_file!r}")
    value = os.environ.get(key_env or "")
    if not value:
        raise EncryptionKeyError(f"environment variable {key_env!r} (named as key_env) is not set")
    return _decode_key(value.encode(), f"environment variable {key_env!r}")


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"gpu_codec.clara key id\x00" + key).digest()[:8]


def _aesgcm(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - cryptography is an optional extra
        raise InvalidInputError(
            "ModelEncryptor needs the 'cryptography' package: pip install gpu_codec[crypto]"
        ) from None
    return AESGCM(key)


class _KeyedProcessor(DataProcessor):
    def __init__(self, key_file: str | None = None, key_env: str | None = None, key: bytes | None = None) -> None:
        super().__init__()
        self.key_file, self.key_env = key_file, key_env
        self._key = _load_key(key_file, key_env, key)
        self._key_id = _key_id(self._key)
        self._cipher = _aesgcm(self._key)

    def get_config(self) -> dict[str, Any]:
        return {"key_file": self.key_file, "key_env": self.key_env}  # never the key itself


class ModelEncryptor(_KeyedProcessor):
    """Encrypt the serialized model with AES-256-GCM; the data context's model becomes the encrypted bytes.

    The key comes from ``key_file`` (32 raw bytes, 64 hex digits or base64) or from the environment variable
    named by ``key_env``. A compressed model (a Payload) is serialized here, its one device-to-host copy; an
    uncompressed one is first packed losslessly. Envelope: ``b"GCAESGCM"``, version, an 8-byte key id, a fresh
    96-bit nonce, then ciphertext and tag; the header is authenticated too.
    """

    def inverse(self) -> ModelDecryptor:
        d = ModelDecryptor(key=self._key)
        d.key_file, d.key_env = self.key_file, self.key_env
        return d

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To encrypt the data_ctx."""
        self._check_abort()
        model = data_ctx.get_model()
        if isinstance(model, (bytes, bytearray, memoryview)) and bytes(model[: len(_ENV_MAGIC)]) == _ENV_MAGIC:
            raise ProcessorOrderError("ModelEncryptor got a model that is already encrypted")
        if isinstance(model, Mapping):
            model = adapt.engine_compress(model, fraction=None, metadata=_header_metadata(data_ctx, False, app_ctx))
        if isinstance(model, _engine.Payload):
            blob = model.to_bytes()
        elif isinstance(model, (bytes, bytearray, memoryview)):
            blob = bytes(model)  # an already serialized payload
        else:
            raise InvalidInputError(
                f"ModelEncryptor: expected a model mapping, a Payload or bytes, got {type(model).__name__}"
            )
        nonce = os.urandom(12)
        head = _ENV_HEAD.pack(_ENV_MAGIC, _ENV_VERSION, self._key_id, nonce)
        self._check_abort()
        data_ctx.set_model(head + self._cipher.encrypt(nonce, blob, head))


class ModelDecryptor(_KeyedProcessor):
    """Undo :class:`ModelEncryptor`: authenticate and decrypt, then parse the payload (a
    :class:`~gpu_codec.Payload` replaces the bytes). A wrong key or any changed byte raises
    :class:`DecryptionError` before anything is decoded."""

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To decrypt the data_ctx."""
        self._check_abort()
        model = data_ctx.get_model()
        if isinstance(model, (Mapping, _engine.Payload)):
            raise ProcessorOrderError("ModelDecryptor got a model that is not encrypted")
        if not isinstance(model, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"ModelDecryptor: expected encrypted bytes, got {type(model).__name__}")
        blob = bytes(model)
        if len(blob) < _ENV_HEAD.size + 16 or blob[: len(_ENV_MAGIC)] != _ENV_MAGIC:
            raise DecryptionError("not an encrypted gpu_codec model (bad magic or too short)")
        _, version, key_id, nonce = _ENV_HEAD.unpack_from(blob, 0)
        if version != _ENV_VERSION:
            raise DecryptionError(
                f"encrypted model version {version} is not supported (this reader knows {_ENV_VERSION})"
            )
        if key_id != self._key_id:
            raise DecryptionError("the model was encrypted with a different key (key id mismatch); nothing was decoded")
        from cryptography.exceptions import InvalidTag

        try:
            plain = self._cipher.decrypt(nonce, blob[_ENV_HEAD.size :], blob[: _ENV_HEAD.size])
        except InvalidTag:
            raise DecryptionError(
                "authentication failed: the encrypted model was altered or the key is wrong; nothing was decoded"
            ) from None
        self._check_abort()
        data_ctx.set_model(_engine.Payload.from_bytes(plain))


# ---------------------------------------------------------------- metadata generators


class MetadataGenerator(DataProcessor):
    """Attach ``app_ctx[source]`` to the data context's metadata as ``field`` (skipped when the app context has
    no such value)."""

    source = ""

    def __init__(self, field: str, source: str | None = None) -> None:
        super().__init__()
        if not isinstance(field, str) or not field:
            raise InvalidInputError(f"field must be a non-empty string, got {field!r}")
        self.field = field
        self.source = source or self.source

    def get_config(self) -> dict[str, Any]:
        return {"field": self.field, "source": self.source}

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        self._check_abort()
        if self.source in app_ctx and app_ctx[self.source] is not None:
            data_ctx.add_metadata(self.field, app_ctx[self.source])


class IteratorNumberGenerator(MetadataGenerator):
    """The number of training iterations of this round (``app_ctx["n_iter"]``), as aggregation weight."""

    source = "n_iter"

    def __init__(self, field: str = "n_iter", source: str | None = None) -> None:
        super().__init__(field, source)


class BestMetricGenerator(MetadataGenerator):
    """The best validation metric so far (``app_ctx["best_metric"]``)."""

    source = "best_metric"

    def __init__(self, field: str = "best_validation_metric", source: str | None = None) -> None:
        super().__init__(field, source)


class InitialValidationMetricGenerator(MetadataGenerator):
    """The validation metric of the received global model, before local training (``app_ctx["initial_metric"]``)."""

    source = "initial_metric"

    def __init__(self, field: str = "initial_validation_metric", source: str | None = None) -> None:
        super().__init__(field, source)


# ---------------------------------------------------------------- chains and config

PROCESSORS: dict[str, type[DataProcessor]] = {
    c.__name__: c
    for c in (
        DataCompressor,
        DataDeCompressor,
        ModelEncryptor,
        ModelDecryptor,
        IteratorNumberGenerator,
        BestMetricGenerator,
        InitialValidationMetricGenerator,
    )
}


def build_processor(config: Mapping[str, Any]) -> DataProcessor:
    """A processor from a Clara component config: ``{"name": "DataCompressor", "args": {...}}``, or
    ``{"path": "package.module.Class", "args": {...}}`` for your own component."""
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"a processor config must be a dict with 'name' (or 'path') and 'args', got {config!r}")
    args = config.get("args", {}) or {}
    if not isinstance(args, Mapping):
        raise InvalidInputError(f"processor 'args' must be a dict, got {args!r}")
    if "path" in config:
        mod, _, cls_name = str(config["path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
        except (ImportError, AttributeError, ValueError) as e:
            raise InvalidInputError(f"cannot load processor {config['path']!r}: {e}") from None
    else:
        name = config.get("name")
        if name not in PROCESSORS:
            raise InvalidInputError(f"unknown processor {name!r}; known: {sorted(PROCESSORS)} (or give 'path')")
        cls = PROCESSORS[name]
    try:
        proc = cls(**args)
    except TypeError as e:
        raise InvalidInputError(
            f"processor {config.get('name') or config.get('path')!r}: bad args {dict(args)}: {e}"
        ) from None
    if not isinstance(proc, DataProcessor) and not (hasattr(proc, "process") and hasattr(proc, "abort")):
        raise InvalidInputError(f"{type(proc).__name__} is not a DataProcessor (needs process and abort)")
    return proc


class ProcessorChain:
    """Clara's processor lists. ``pre_processors`` run in order on the way out (:meth:`process_outgoing`);
    ``post_processors`` run in reverse on the way in (:meth:`process_incoming`), so each is listed beside the
    pre-processor it undoes. Without ``post_processors`` the inverses of the pre-processors are used.

    ``reverse_post=False`` runs ``post_processors`` in the order listed instead (a list already written in run
    order). If a processor raises or the chain is aborted, the data context is restored to what it was.
    """

    def __init__(
        self,
        pre_processors: Sequence[Any] = (),
        post_processors: Sequence[Any] | None = None,
        *,
        reverse_post: bool = True,
    ) -> None:
        self.pre_processors = [p if not isinstance(p, Mapping) else build_processor(p) for p in pre_processors]
        if post_processors is None:
            post = [p.inverse() for p in self.pre_processors if hasattr(p, "inverse")]
            self.post_processors = [p for p in post if p is not None]
            reverse_post = True
        else:
            self.post_processors = [p if not isinstance(p, Mapping) else build_processor(p) for p in post_processors]
        self.reverse_post = reverse_post
        self._aborted = threading.Event()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, reverse_post: bool = True) -> ProcessorChain:
        """From a Clara config section holding ``pre_processors`` and (optionally) ``post_processors``."""
        post = config.get("post_processors")
        return cls(config.get("pre_processors", []), post, reverse_post=reverse_post)

    def process_outgoing(self, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        """Run the pre-processors in order (before sending)."""
        return self._run(self.pre_processors, data_ctx, app_ctx)

    def process_incoming(self, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        """Run the post-processors (after receiving)."""
        procs = self.post_processors[::-1] if self.reverse_post else self.post_processors
        return self._run(procs, data_ctx, app_ctx)

    def abort(self, app_ctx: AppContext | None = None) -> None:
        """Stop the run in progress (or the next one) between or inside processors."""
        self._aborted.set()
        for p in self.pre_processors + self.post_processors:
            p.abort(app_ctx)

    def _run(self, procs: list, data_ctx: DataContext, app_ctx: AppContext) -> DataContext:
        saved = dict(data_ctx)
        saved_meta = dict(data_ctx.get(DataContext.METADATA, {}))
        try:
            for p in procs:
                if self._aborted.is_set():
                    raise ProcessingAbortedError("the processor chain was aborted")
                p.process(data_ctx, app_ctx)
        except BaseException:
            data_ctx.clear()
            data_ctx.update(saved)
            data_ctx[DataContext.METADATA] = saved_meta
            self._reset()
            raise
        self._reset()
        return data_ctx

    def _reset(self) -> None:
        self._aborted.clear()
        for p in self.pre_processors + self.post_processors:
            if hasattr(p, "_reset_abort"):
                p._reset_abort()


def serialize(data_ctx: DataContext) -> bytes:
    """The bytes to send: the encrypted model, or the compressed model's wire format (a payload made on the GPU
    is copied to the host here, once)."""
    model = data_ctx.get_model()
    if isinstance(model, _engine.Payload):
        return model.to_bytes()
    if isinstance(model, (bytes, bytearray, memoryview)):
        return bytes(model)
    raise ProcessorOrderError(
        "the model is neither compressed nor encrypted: run DataCompressor or ModelEncryptor before serializing"
    )


def deserialize(blob: bytes | bytearray | memoryview, **props: Any) -> DataContext:
    """A data context holding received bytes, ready for the post-processors (encrypted bytes stay opaque until
    ModelDecryptor; a plain payload is parsed and validated now)."""
    b = bytes(blob)
    model: Any = b if b[: len(_ENV_MAGIC)] == _ENV_MAGIC else _engine.Payload.from_bytes(b)
    return DataContext(model=model, **props)


# ---------------------------------------------------------------- model readers/writers


def _exclude(pattern: str | None) -> Any:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidInputError(f"exclude_vars must be a regular expression, got {pattern!r}: {e}") from None


def _params_from(model_params: Any, local: Mapping[str, Any], like: str | None, who: str) -> Mapping[str, Any]:
    if isinstance(model_params, DataContext):
        model_params = model_params.get_model()
    if isinstance(model_params, Mapping):
        return model_params
    payload = _payload_of(model_params, who)
    return _decode_payload(payload, None, local, like, who)


class DictModelReaderWriter:
    """A training-platform independent model reader-writer: the local model is a dict name -> tensor (NumPy,
    CuPy or torch, any device), held in memory.

    ``exclude_vars`` (a regular expression, as in Clara configs) names variables never read nor written.

    >>> rw = DictModelReaderWriter()
    >>> rw.initialize({"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)})
    >>> rw.apply_model({"w": np.ones(2, np.float32), "unknown": np.ones(1)})
    True
    >>> {k: v.tolist() for k, v in rw.extract_model(["w"]).items()}
    {'w': [1.0, 1.0]}
    """

    def __init__(self, exclude_vars: str | None = None) -> None:
        self.exclude_vars = exclude_vars
        self._exclude = _exclude(exclude_vars)
        self._local: dict[str, Any] = {}

    def _excluded(self, name: str) -> bool:
        return self._exclude is not None and self._exclude.search(name) is not None

    def initialize(self, model: Mapping[str, Any] | None = None, options: Any = None) -> None:
        self._local = {k: v for k, v in (model or {}).items() if not self._excluded(k)}

    def get_local_models(self) -> dict[str, Any]:
        """The local model (the tensors themselves, not copies)."""
        return dict(self._local)

    def extract_model(self, model_vars: Sequence[str] | None = None) -> dict[str, Any]:
        """The local weights whose names are in ``model_vars`` (all when None)."""
        if model_vars is None:
            return dict(self._local)
        return {n: self._local[n] for n in model_vars if n in self._local}

    def apply_model(self, model_params: Any, options: Any = None) -> bool:
        """Assign local variables from ``model_params`` (a dict, a :class:`DataContext`, a Payload or its bytes;
        a delta payload is added to the local model). Returns True if any variable was assigned; with an empty
        local model every received variable is adopted."""
        params = _params_from(model_params, self._local, None, "DictModelReaderWriter")
        adopt = not self._local
        assigned = False
        for name, value in params.items():
            if self._excluded(name) or not (adopt or name in self._local):
                continue
            self._local[name] = value
            assigned = True
        return assigned


class PTModelReaderWriter:
    """A torch ``nn.Module``'s weights in and out of the processor chain, left on the module's device.

    ``get_local_models`` returns the module's state tensors (no copies); ``apply_model`` copies received values
    into them in place, so parameters keep their identity, dtype and device.
    """

    def __init__(self, exclude_vars: str | None = None) -> None:
        self.exclude_vars = exclude_vars
        self._exclude = _exclude(exclude_vars)
        self.model: Any = None

    def _excluded(self, name: str) -> bool:
        return self._exclude is not None and self._exclude.search(name) is not None

    def initialize(self, model: Any, options: Any = None) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InvalidInputError(
                f"PTModelReaderWriter.initialize takes a torch.nn.Module, got {type(model).__name__}"
            )
        self.model = model

    def _state(self) -> dict[str, Any]:
        if self.model is None:
            raise InvalidInputError("PTModelReaderWriter is not initialized: call initialize(model) first")
        return {k: v for k, v in self.model.state_dict().items() if not self._excluded(k)}

    def get_local_models(self) -> dict[str, Any]:
        return self._state()

    def extract_model(self, model_vars: Sequence[str] | None = None) -> dict[str, Any]:
        state = self._state()
        if model_vars is None:
            return state
        return {n: state[n] for n in model_vars if n in state}

    def apply_model(self, model_params: Any, options: Any = None) -> bool:
        """Copy received values into the module's tensors (in place). Returns True if any was assigned."""
        import torch

        state = self._state()
        params = _params_from(model_params, state, "torch", "PTModelReaderWriter")
        assigned = False
        with torch.no_grad():
            for name, value in params.items():
                if name not in state:
                    continue
                dst = state[name]
                src = _to_torch(value, dst.device)
                if tuple(src.shape) != tuple(dst.shape):
                    raise InvalidInputError(
                        f"tensor {name!r}: received shape {tuple(src.shape)}, the model has {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                assigned = True
        return assigned


def _to_torch(value: Any, device: Any) -> Any:
    import torch

    kind = array_kind(value)
    if kind == "torch":
        return value.to(device) if value.device != device else value
    if kind == "cupy":
        return torch.from_dlpack(value).to(device)
    return torch.from_numpy(np.ascontiguousarray(value)).to(device)


# ---------------------------------------------------------------- metrics


class MetricManager:
    """Named groups of metrics, checked and encoded to travel in the data context's metadata.

    ``groups`` maps a group name to the metric names it holds (``{"validation": ["val_acc", "val_loss"]}``);
    without groups every metric goes to group ``"default"``.

    >>> mm = MetricManager({"validation": ["val_acc"], "train": ["loss"]})
    >>> enc = mm.encode_metrics({"val_acc": 0.91, "loss": 0.25})
    >>> enc
    {'train': {'loss': 0.25}, 'validation': {'val_acc': 0.91}}
    >>> mm.decode_metrics(enc) == {"val_acc": 0.91, "loss": 0.25}
    True
    """

    DEFAULT_GROUP = "default"

    def __init__(self, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self.groups: dict[str, list[str]] = {}
        self._group_of: dict[str, str] = {}
        for g, names in (groups or {}).items():
            if not isinstance(g, str) or isinstance(names, str) or not isinstance(names, Sequence):
                raise MetricsError(f"groups must map a group name to a list of metric names, got {g!r}: {names!r}")
            self.groups[g] = list(names)
            for n in names:
                if n in self._group_of:
                    raise MetricsError(f"metric {n!r} is in groups {self._group_of[n]!r} and {g!r}")
                self._group_of[n] = g

    def group_of(self, name: str) -> str:
        if not self.groups:
            return self.DEFAULT_GROUP
        if name not in self._group_of:
            raise MetricsError(f"metric {name!r} is in no group (groups: {sorted(self.groups)})")
        return self._group_of[name]

    def validate_metrics(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Metrics as ``{name: float}``, after checking each is a finite real number of a known group."""
        if not isinstance(metrics, Mapping):
            raise MetricsError(f"metrics must be a mapping name -> number, got {type(metrics).__name__}")
        out = {}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise MetricsError(f"metric names must be strings, got {name!r}")
            self.group_of(name)
            if not isinstance(value, (int, float)) and hasattr(value, "item"):  # NumPy scalars, 1-element tensors
                try:
                    value = value.item()
                except (ValueError, RuntimeError):
                    raise MetricsError(
                        f"metric {name!r} must be a single number, got shape {tuple(getattr(value, 'shape', ()))}"
                    ) from None
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise MetricsError(f"metric {name!r} must be a number, got {type(value).__name__}")
            f = float(value)
            if not math.isfinite(f):
                raise MetricsError(f"metric {name!r} is not finite: {value!r}")
            out[name] = f
        return out

    def encode_metrics(self, metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
        """``{group: {name: value}}``, JSON-safe, groups and names sorted."""
        flat = self.validate_metrics(metrics)
        enc: dict[str, dict[str, float]] = {}
        for name in sorted(flat):
            enc.setdefault(self.group_of(name), {})[name] = flat[name]
        return {g: enc[g] for g in sorted(enc)}

    def decode_metrics(self, encoded: Mapping[str, Any]) -> dict[str, float]:
        """Back to ``{name: value}``, checking every metric sits in its own group."""
        if not isinstance(encoded, Mapping):
            raise MetricsError(f"encoded metrics must be a mapping group -> metrics, got {type(encoded).__name__}")
        flat: dict[str, Any] = {}
        for g, metrics in encoded.items():
            if not isinstance(metrics, Mapping):
                raise MetricsError(f"group {g!r} must map metric names to numbers")
            for name, value in metrics.items():
                if self.group_of(name) != g:
                    raise MetricsError(f"metric {name!r} arrived in group {g!r}, it belongs to {self.group_of(name)!r}")
                if name in flat:
                    raise MetricsError(f"metric {name!r} appears twice")
                flat[name] = value
        return self.validate_metrics(flat)
