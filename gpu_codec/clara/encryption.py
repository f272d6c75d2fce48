"""AES-GCM encryption of the serialized model: ModelEncryptor and ModelDecryptor.

The key is AES-128, AES-192 or AES-256 (16, 24 or 32 bytes), given as bytes, or read from a file or an
environment variable (raw bytes, hex digits or base64). The envelope's header and the values of the app
context named by ``bind`` (the round, by default) are the AES-GCM associated data: an envelope replayed into
another round, or into another context, fails authentication and nothing is decoded.

>>> import numpy as np
>>> from gpu_codec.clara import AppContext, DataContext, DataDeCompressor
>>> enc, dec = ModelEncryptor(key=bytes(range(16))), ModelDecryptor(key=bytes(range(16)))
>>> ctx = DataContext(model={"w": np.arange(3, dtype=np.float32)})
>>> enc.process(ctx, AppContext(round_number=4))
>>> dec.process(ctx, AppContext(round_number=4))
>>> DataDeCompressor().process(ctx, AppContext(round_number=4)); ctx.get_model()["w"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
import struct
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .. import adapt
from .. import engine as _engine
from ..errors import InvalidInputError
from .context import ENVELOPE_MAGIC, AppContext, DataContext, DecryptionError, EncryptionKeyError, ProcessorOrderError
from .processors import DataProcessor, header_metadata

__all__ = ["DEFAULT_KEY_ENV", "KEY_SIZES", "KeyFilePermissionWarning", "ModelDecryptor", "ModelEncryptor"]

KEY_SIZES = (16, 24, 32)  # AES-128, AES-192, AES-256
DEFAULT_KEY_ENV = "GPU_CODEC_MODEL_KEY"  # where a processor given no key reads it (Clara's configs give none)
_ENV_VERSION = 2  # 2: the bound app-context values are in the associated data
_ENV_HEAD = struct.Struct("<8sB8s12s")  # magic, version, key id, nonce; then ciphertext + 16-byte tag


class KeyFilePermissionWarning(UserWarning):
    """A key file that users other than its owner can read or write."""


def _decode_key(raw: bytes, where: str) -> bytes:
    text = raw.strip()
    if re.fullmatch(rb"[0-9a-fA-F]+", text) and len(text) // 2 in KEY_SIZES and len(text) % 2 == 0:
        return binascii.unhexlify(text)
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) in KEY_SIZES:
        return key
    if len(raw) in KEY_SIZES:
        return raw
    raise EncryptionKeyError(
        f"the key in {where} must be 16, 24 or 32 bytes: raw, hex digits or base64 "
        f"(got {len(raw)} bytes that decode to none of these)"
    )


def _check_key_file_mode(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(
            f"key file {path!r} is accessible to other users (mode {stat.S_IMODE(mode):o}); chmod 600 it",
            KeyFilePermissionWarning,
            stacklevel=4,
        )


def _load_key(key_file: str | None, key_env: str | None, key: Any) -> bytes:
    given = [x is not None for x in (key_file, key_env, key)]
    if sum(given) > 1:
        raise EncryptionKeyError(
            "give exactly one of key_file (a path), key_env (an environment variable name) or key (bytes)"
        )
    if not any(given):  # (Clara's configs name the processors with no arguments: the key comes from outside)
        if not os.environ.get(DEFAULT_KEY_ENV):
            raise EncryptionKeyError(
                f"with no key_file, key_env or key, the key is read from the environment variable "
                f"{DEFAULT_KEY_ENV} (hex or base64), which is not set"
            )
        key_env = DEFAULT_KEY_ENV
    if key is not None:
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise EncryptionKeyError(
                f"key must be bytes (16, 24 or 32 of them), got {type(key).__name__}; a hex or base64 text key "
                "goes in key_file or key_env"
            )
        key = bytes(key)
        if len(key) not in KEY_SIZES:
            raise EncryptionKeyError(f"key must be 16, 24 or 32 bytes (AES-128/192/256), got {len(key)}")
        return key
    if key_file is not None:
        if not isinstance(key_file, (str, os.PathLike)):
            raise EncryptionKeyError(f"key_file must be a path, got {type(key_file).__name__}")
        key_file = os.fspath(key_file)
        try:
            with open(key_file, "rb") as f:
                data = f.read(4096)
        except OSError as e:
            raise EncryptionKeyError(f"cannot read key file {key_file!r}: {e.strerror}") from None
        _check_key_file_mode(key_file)
        return _decode_key(data, f"key file {key_file!r}")
    if not isinstance(key_env, str):
        raise EncryptionKeyError(f"key_env must be the name of an environment variable, got {key_env!r}")
    value = os.environ.get(key_env)
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


def _bound(bind: tuple[str, ...], app_ctx: AppContext) -> bytes:
    """The app-context values named by ``bind``, as canonical JSON (part of the associated data)."""
    values = {}
    for name in bind:
        v = app_ctx.round_number if name == "round" else app_ctx.get(name)
        try:
            values[name] = adapt.json_safe(v)
        except InvalidInputError:
            raise InvalidInputError(f"app_ctx[{name!r}] (bound into the encryption) must be a JSON value") from None
    return json.dumps(values, sort_keys=True, separators=(",", ":")).encode()


class _KeyedProcessor(DataProcessor):
    def __init__(
        self,
        key_file: str | None = None,
        key_env: str | None = None,
        key: bytes | None = None,
        bind: Sequence[str] = ("round",),
    ) -> None:
        super().__init__()
        if isinstance(bind, str) or not all(isinstance(b, str) for b in bind):
            raise InvalidInputError(f"bind must be a list of app-context keys, got {bind!r}")
        self.key_file, self.key_env = key_file, key_env
        self.bind = tuple(bind)
        self._key = _load_key(key_file, key_env, key)
        self._key_id = _key_id(self._key)
        self._cipher = _aesgcm(self._key)

    def get_config(self) -> dict[str, Any]:
        return {"key_file": self.key_file, "key_env": self.key_env, "bind": list(self.bind)}  # never the key


class ModelEncryptor(_KeyedProcessor):
    """Encrypt the serialized model with AES-GCM; the data context's model becomes the encrypted bytes.

    Parameters
    ----------
    key_file, key_env, key
        At most one: a file holding the key (raw, hex digits or base64; a warning if others can read it), an
        environment variable holding it (hex or base64), or the key as 16, 24 or 32 bytes. None of them (as
        Clara's configs give it, ``"args": {}``): the environment variable ``GPU_CODEC_MODEL_KEY``.
    bind
        App-context entries bound into the associated data (default ``("round",)``; ``()`` binds nothing,
        ``("round", "task")`` also the task). The decryptor must see the same values.

    A compressed model (a Payload) is serialized here, where it leaves the device; an uncompressed one is
    first packed losslessly. Envelope: ``b"GCAESGCM"``, version, an 8-byte key id, a fresh 96-bit nonce, then
    ciphertext and tag; the header and the bound values are authenticated.
    """

    def inverse(self) -> ModelDecryptor:
        d = ModelDecryptor(key=self._key, bind=self.bind)
        d.key_file, d.key_env = self.key_file, self.key_env
        return d

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To encrypt the data_ctx."""
        self._check_abort()
        model = data_ctx.get_model()
        if isinstance(model, (bytes, bytearray, memoryview)) and bytes(model[: len(ENVELOPE_MAGIC)]) == ENVELOPE_MAGIC:
            raise ProcessorOrderError("ModelEncryptor got a model that is already encrypted")
        if isinstance(model, Mapping):
            model = adapt.engine_compress(model, fraction=None, metadata=header_metadata(data_ctx, False, app_ctx))
        if isinstance(model, _engine.Payload):
            blob = model.to_bytes()
        elif isinstance(model, (bytes, bytearray, memoryview)):
            blob = bytes(model)  # an already serialized payload
        else:
            raise InvalidInputError(
                f"ModelEncryptor: expected a model mapping, a Payload or bytes, got {type(model).__name__}"
            )
        nonce = os.urandom(12)
        head = _ENV_HEAD.pack(ENVELOPE_MAGIC, _ENV_VERSION, self._key_id, nonce)
        aad = head + _bound(self.bind, app_ctx)
        self._check_abort()
        data_ctx.set_model(head + self._cipher.encrypt(nonce, blob, aad))


class ModelDecryptor(_KeyedProcessor):
    """Undo :class:`ModelEncryptor` (same key and ``bind``): authenticate and decrypt, then parse the payload
    (a :class:`~gpu_codec.Payload` replaces the bytes). A wrong key, any changed byte, or an envelope made for
    another round (or other bound values) raises :class:`DecryptionError` before anything is decoded."""

    def process(self, data_ctx: DataContext, app_ctx: AppContext) -> None:
        """To decrypt the data_ctx."""
        self._check_abort()
        model = data_ctx.get_model()
        if isinstance(model, (Mapping, _engine.Payload)):
            raise ProcessorOrderError("ModelDecryptor got a model that is not encrypted")
        if not isinstance(model, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"ModelDecryptor: expected encrypted bytes, got {type(model).__name__}")
        blob = bytes(model)
        if len(blob) < _ENV_HEAD.size + 16 or blob[: len(ENVELOPE_MAGIC)] != ENVELOPE_MAGIC:
            raise DecryptionError("not an encrypted gpu_codec model (bad magic or too short)")
        _, version, key_id, nonce = _ENV_HEAD.unpack_from(blob, 0)
        if version != _ENV_VERSION:
            raise DecryptionError(
                f"encrypted model version {version} is not supported (this reader knows {_ENV_VERSION})"
            )
        if key_id != self._key_id:
            raise DecryptionError("the model was encrypted with a different key (key id mismatch); nothing was decoded")
        from cryptography.exceptions import InvalidTag

        aad = blob[: _ENV_HEAD.size] + _bound(self.bind, app_ctx)
        try:
            plain = self._cipher.decrypt(nonce, blob[_ENV_HEAD.size :], aad)
        except InvalidTag:
            raise DecryptionError(
                "authentication failed: the encrypted model was altered, or it was made for another "
                f"{'/'.join(self.bind) or 'context'} than {_bound(self.bind, app_ctx).decode()}; nothing was decoded"
            ) from None
        self._check_abort()
        data_ctx.set_model(_engine.Payload.from_bytes(plain))
