"""Flower: a gpu_codec payload in Flower's own ``Array``, a client ``Mod`` and a server strategy wrapper.

Built on flwr's types (``flwr.app.Array``, ``ArrayRecord``, ``Message``, ``flwr.serverapp.strategy.Strategy``);
this module needs flwr: ``pip install 'gpu_codec[flower]'``.

* A compressed update travels as one ``flwr.app.Array`` (:func:`payload_array`) with ``dtype="gpu_codec.v1"``,
  ``stype="numpy.ndarray"`` and data = a ``.npy`` guard header followed by the payload's wire format: a stock
  Flower peer that calls ``Array.numpy()`` on it gets ``ValueError: ... gpu_codec.v1 ... pip install
  'gpu_codec[flower]'`` instead of a silent misread. :func:`holds_payload` and :func:`array_payload` read it back
  (validated); an Array of the earlier form (``stype="gpu_codec.v1"``, no guard) is still read.
* :func:`compressed_record` and :func:`decompress_record`: ``update - base`` as a flwr ``ArrayRecord`` holding one
  compressed Array, and back to dense tensors (NumPy, CuPy or torch, on the base's device), under a cap on the
  output. :func:`read_numpy` reads a plain Array checking its ``.npy`` header against its bytes before anything
  is allocated (``Array.numpy()`` allocates what the header declares).

In a Flower app:

* :func:`compression_mod`: a client ``Mod`` (a callable over flwr's ``Message``). It decodes a compressed global
  model before the ``ClientApp`` sees it (:func:`decode_record`), and compresses the ``ArrayRecord`` of a train
  reply as top-k of ``reply - received model`` (error feedback kept in the client's ``Context.state`` across
  rounds), when the server said it can decode it.
* :class:`CompressedStrategy`: a ``flwr.serverapp.strategy.Strategy`` wrapping ``FedAvg`` or any strategy with
  the same hooks. It sends the global model compressed (lossless by default), says so in the train config, and,
  under FedAvg's rule, aggregates the replies with :func:`gpu_codec.aggregate` straight from the sparse form
  (FedAvg's weighted mean, the same bytes in any arrival order); a strategy with a rule of its own aggregates the
  replies' decoded models itself; metrics stay the wrapped strategy's.

>>> import numpy as np
>>> import flwr.app
>>> update = {"w": np.array([0.5, -4.0, 0.0, 2.0], np.float32), "b": np.zeros(2, np.float32)}
>>> rec = compressed_record(update, fraction=0.5)       # keep ceil(0.5 x 6) = 3 entries
>>> isinstance(rec, flwr.app.ArrayRecord), list(rec), rec["gpu_codec"].dtype, rec["gpu_codec"].stype
(True, ['gpu_codec'], 'gpu_codec.v1', 'numpy.ndarray')
>>> {k: v.tolist() for k, v in decompress_record(rec).items()}
{'w': [0.5, -4.0, 0.0, 2.0], 'b': [0.0, 0.0]}
>>> rec["gpu_codec"].numpy()     # what a stock peer sees: flwr's own reader stops at the guard
Traceback (most recent call last):
...
ValueError: descr is not a valid dtype descriptor: "gpu_codec.v1 ... pip install 'gpu_codec[flower]' ..."
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import adapt
from . import engine as _engine
from .aggregate import Aggregator, shown_weight
from .arrays import array_kind
from .error_feedback import ErrorFeedback
from .errors import GpuCodecError, InvalidInputError, PayloadLayoutError, PayloadLimitError

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.serverapp.strategy import Strategy
except ImportError as _e:
    raise ImportError(f"gpu_codec.flower needs flwr: pip install 'gpu_codec[flower]' ({_e})") from _e

__all__ = [
    "ACCEPT_KEY",
    "STYPE_GPU_CODEC",
    "STYPE_NUMPY",
    "CompressedStrategy",
    "array_payload",
    "compressed_record",
    "compression_mod",
    "decode_record",
    "decompress_record",
    "holds_payload",
    "payload_array",
    "read_numpy",
]

STYPE_NUMPY = "numpy.ndarray"
STYPE_GPU_CODEC = "gpu_codec.v1"  # the dtype of a compressed Array (its stype, in records made before the guard)
ACCEPT_KEY = "gpu_codec.accept"  # config entry a server sends when it decodes gpu_codec replies
DEFAULT_KEY = "gpu_codec"
_EF_STATE = "gpu_codec.error_feedback"
_FLOAT_NPY = frozenset({"float16", "float32", "float64"})
_GUARD_NOTE = f"{STYPE_GPU_CODEC} payload: a gpu_codec compressed update and not a NumPy array"
log = logging.getLogger(__name__)


def _npy_guard() -> bytes:
    """A ``.npy`` v1 header whose dtype descriptor is a message: ``np.load`` stops there with a ValueError."""
    descr = (  # no commas: NumPy would read them as a list of fields
        f"{_GUARD_NOTE}; to read it pip install 'gpu_codec[flower]' and decode it with gpu_codec.flower"
    )
    head = repr({"descr": descr, "fortran_order": False, "shape": (0,)}).encode("ascii")
    head += b" " * ((-(10 + len(head) + 1)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head


_GUARD = _npy_guard()


# ============================================================ a payload in a flwr Array


def payload_array(payload: Any) -> Array:
    """A compressed update (a :class:`~gpu_codec.Payload`, or its bytes, validated here rather than at the
    receiver) as one ``flwr.app.Array``: ``dtype="gpu_codec.v1"``, ``stype="numpy.ndarray"``, data = a ``.npy``
    guard header that stock readers stop at, then the payload (a payload made on the GPU is copied to the host
    here, once).

    >>> import gpu_codec
    >>> p = gpu_codec.compress({"w": np.arange(4, dtype=np.float32)}, fraction=0.5)
    >>> a = payload_array(p)
    >>> holds_payload(a), a.shape == (len(a.data),), array_payload(a).to_bytes() == p.to_bytes()
    (True, True, True)
    """
    if isinstance(payload, (bytes, bytearray, memoryview)):
        blob = bytes(payload)
        _engine.Payload.from_bytes(blob)
    elif isinstance(payload, _engine.Payload):
        blob = payload.to_bytes()
    else:
        raise InvalidInputError(f"expected a gpu_codec Payload or its bytes, got {type(payload).__name__}")
    return Array(dtype=STYPE_GPU_CODEC, shape=(len(_GUARD) + len(blob),), stype=STYPE_NUMPY, data=_GUARD + blob)


def _left_out(server_round: int, m: Any, i: int, e: Exception) -> None:
    log.warning(
        "round %d: the reply of node %d is left out of the aggregation: reply %d: %s",
        server_round,
        m.metadata.src_node_id,
        i,
        e,
    )


def _fedavg_rule(strategy: Any) -> bool:
    """Whether ``strategy`` aggregates arrays by FedAvg's rule (flwr's ``FedAvg`` and ``FedProx``, or a subclass
    that keeps FedAvg's ``aggregate_train``): :class:`CompressedStrategy` then averages the replies from their sparse
    form; any other rule (FedMedian, FedAdam, differential privacy's clipping and noise, ...) is the wrapped
    strategy's, run on the decoded models."""
    try:
        from flwr.serverapp.strategy import FedAvg
    except ImportError:  # (an older flwr: no strategy of this kind to match)
        return False
    return getattr(type(strategy), "aggregate_train", None) is FedAvg.aggregate_train


def holds_payload(a: Any) -> bool:
    """Whether a flwr ``Array`` carries a gpu_codec payload (either form), without copying its data."""
    if a.stype == STYPE_GPU_CODEC:
        return True
    return a.stype == STYPE_NUMPY and a.dtype == STYPE_GPU_CODEC and a.data[: len(_GUARD)] == _GUARD


def array_payload(a: Any) -> Any:
    """The :class:`~gpu_codec.Payload` a flwr ``Array`` holds, parsed and validated (hostile bytes raise a
    :class:`~gpu_codec.errors.PayloadError`)."""
    if not holds_payload(a):
        raise TypeError(f"Array has stype '{a.stype}' and dtype '{a.dtype}': it holds no gpu_codec payload")
    blob = a.data
    if a.stype == STYPE_NUMPY:
        blob = memoryview(blob)[len(_GUARD) :]
    return _engine.Payload.from_bytes(blob)


def read_numpy(a: Any, *, max_bytes: int | None = None) -> np.ndarray:
    """A plain flwr ``Array`` (``stype="numpy.ndarray"``) as a NumPy array: its ``.npy`` header is read first, and
    the array is made only if the bytes after it are exactly what the header declares (never unpickled), and at
    most ``max_bytes`` (``None``: no cap beyond the data itself).

    >>> read_numpy(Array(np.arange(3, dtype=np.float32)), max_bytes=12).tolist()
    [0.0, 1.0, 2.0]
    """
    if holds_payload(a):
        raise InvalidInputError(
            "this Array holds a gpu_codec payload, not an array: use array_payload() or decompress_record()"
        )
    if a.stype != STYPE_NUMPY:
        raise TypeError(f"Unsupported serialization type for numpy conversion: '{a.stype}'")
    out = _read_npy(a.data, max_bytes)
    if a.dtype == "bfloat16" and out.dtype == np.uint16:  # records of earlier gpu_codec versions
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


def _read_npy(data: bytes, max_bytes: int | None) -> np.ndarray:
    """A ``.npy`` array whose header is checked before anything is allocated: no object dtype, the declared bytes
    within ``max_bytes``, and exactly that many bytes after the header (``np.load`` allocates what the header says
    before it reads)."""
    f = io.BytesIO(data)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except ValueError as e:
        if _GUARD_NOTE in str(e):
            raise
        raise PayloadLayoutError(f"not a valid .npy array: {e}") from None
    if dtype.hasobject:
        raise PayloadLayoutError("the .npy array has an object dtype, which cannot be read without pickle")
    problem = adapt.declared_shape_problem(shape)  # (before its sizes are multiplied)
    if problem is not None:
        raise PayloadLayoutError(f"the .npy array declares a shape no array can have: it {problem}")
    nbytes = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and nbytes > max_bytes:
        raise PayloadLimitError(f"the .npy array declares {nbytes} bytes, over the cap of {max_bytes}")
    if len(data) - f.tell() != nbytes:
        raise PayloadLayoutError(
            f"the .npy array declares {dtype}{list(shape)} ({nbytes} bytes), its data holds {len(data) - f.tell()}"
        )
    flat = np.frombuffer(memoryview(data)[f.tell() :], dtype=dtype)
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


# ============================================================ records


def compressed_record(
    update: Mapping[str, Any],
    base: Mapping[str, Any] | None = None,
    *,
    key: str = DEFAULT_KEY,
    fraction: float | None = 0.01,
    scope: str = "global",
    score: Any = "magnitude",
    pipeline: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> ArrayRecord:
    """Compress ``update - base`` (:func:`gpu_codec.compress`: NumPy, CuPy or torch tensors on any device;
    ``fraction=None`` for dense) into a flwr ``ArrayRecord`` holding one compressed Array under ``key``."""
    payload = adapt.engine_compress(
        update, base, fraction=fraction, scope=scope, score=score, pipeline=pipeline, metadata=metadata
    )
    return ArrayRecord({key: payload_array(payload)})


def decompress_record(
    record: Any,
    base: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
) -> dict[str, Any]:
    """Dense tensors from a flwr ``ArrayRecord``: every compressed Array decompressed (``base + delta`` where
    ``base`` is given, returned as the base's kind on its device, else the delta as ``like``), every plain Array
    as its value (as ``like``, or as the base's kind where the base has that name).

    ``max_output_bytes`` caps the dense output of the whole record, as :func:`gpu_codec.decompress` counts it
    (each Array is refused before it is decoded if it declares more than what is left); ``None``: no cap.

    >>> rec = compressed_record({"w": np.zeros(10**6, np.float32)}, fraction=1e-6)
    >>> decompress_record(rec, max_output_bytes=1 << 20)
    Traceback (most recent call last):
    ...
    gpu_codec.errors.PayloadLimitError: payload declares 4000000 bytes of dense output (1 tensors), over ...
    """
    left = _check_cap(max_output_bytes)
    out: dict[str, Any] = {}
    for key in record:
        arr = record[key]
        if holds_payload(arr):
            payload = array_payload(arr)
            b = None
            if base is not None:
                b = {r.name: base[r.name] for r in payload.tensors if r.name in base}
            dense = _engine.decompress(payload, base=b or None, like=like, max_output_bytes=left)
            left = _spent(left, dense.values())
            clash = set(dense) & set(out)
            if clash:
                raise InvalidInputError(f"tensors {sorted(clash)[:5]} appear in more than one Array")
            out.update(dense)
        elif arr.stype == STYPE_NUMPY:
            if key in out:
                raise InvalidInputError(f"tensor {key!r} appears in more than one Array")
            kind = array_kind(base[key]) if base is not None and key in base else (like or "numpy")
            out[key] = _as_kind(arr, kind, base[key] if base is not None and key in base else None, left)
            left = _spent(left, [out[key]])
        else:
            raise TypeError(f"Array {key!r} has stype '{arr.stype}', which gpu_codec cannot read")
    return out


def _check_cap(cap: Any) -> int | None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
        raise InvalidInputError(f"max_output_bytes must be a non-negative integer or None, got {cap!r}")
    return cap


def _spent(left: int | None, arrays: Any) -> int | None:
    """What is left of a cap once ``arrays`` were made."""
    return None if left is None else max(0, left - sum(int(a.nbytes) for a in arrays))


def _as_kind(arr: Any, kind: str, like_tensor: Any, max_bytes: int | None = None) -> Any:
    a = read_numpy(arr, max_bytes=max_bytes)
    if kind == "torch":
        import torch

        t = torch.from_numpy(np.asarray(a, order="C"))  # (a 0-d array stays 0-d)
        dev = getattr(like_tensor, "device", None)
        return t.to(dev) if dev is not None else t
    if kind == "cupy":
        import cupy

        if like_tensor is not None:
            with cupy.cuda.Device(like_tensor.device.id):
                return cupy.asarray(a)
        return cupy.asarray(a)
    if kind != "numpy":
        raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {kind!r}")
    return a


# ============================================================ Flower apps: models in messages


def _is_compressed(record: Any) -> bool:
    return any(holds_payload(a) for a in record.values())


def _decode_model(record: Any, max_output_bytes: int | None) -> dict[str, np.ndarray]:
    """A flwr ArrayRecord (compressed or not) as name -> NumPy array, in the sender's order and dtypes (a payload's
    float16 comes back as float16; bfloat16, which ``.npy`` lacks, as float32), at most ``max_output_bytes`` of
    output in all (each Array refused before it is decoded if it declares more than what is left)."""
    left = _check_cap(max_output_bytes)
    out: dict[str, np.ndarray] = {}
    sent = None  # the sender's order of every array, as the payload's metadata records it
    for k in record:
        a = record[k]
        if not holds_payload(a):
            if k in out:
                raise InvalidInputError(f"tensor {k!r} appears twice in the record")
            out[k] = read_numpy(a, max_bytes=left)
            left = _spent(left, [out[k]])
            continue
        payload = array_payload(a)
        dense = _engine.decompress(payload, max_output_bytes=left)
        left = _spent(left, dense.values())
        for r in payload.tensors:
            if r.name in out:
                raise InvalidInputError(f"tensor {r.name!r} appears twice in the record")
            out[r.name] = adapt.cast_to_logical(dense[r.name], r.dtype, "numpy")
        order = payload.metadata.get("order")
        if isinstance(order, list) and all(isinstance(n, str) for n in order):
            sent = order
    if sent is not None and len(sent) == len(out) and set(sent) == set(out):  # (else the record's own order)
        return {n: out[n] for n in sent}
    return out


def decode_record(record: Any, *, max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES) -> Any:
    """A flwr ``ArrayRecord`` holding gpu_codec payloads as a plain flwr ``ArrayRecord`` of NumPy arrays (a
    record with none is returned as it is). ``max_output_bytes`` caps the record's dense output, as
    :func:`decompress_record` does (``PayloadLimitError`` before anything over it is decoded)."""
    if not _is_compressed(record):
        return record
    return ArrayRecord({k: Array(v) for k, v in _decode_model(record, max_output_bytes).items()})


def _split_floats(arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None) -> list[str]:
    names = []
    for n, a in arrays.items():
        if a.dtype.name not in _FLOAT_NPY:
            continue
        if base is not None and (n not in base or base[n].shape != a.shape or base[n].dtype != a.dtype):
            continue
        names.append(n)
    return names


def _compressed_record(
    arrays: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray] | None,
    key: str,
    *,
    fraction: float | None,
    scope: str = "global",
    pipeline: Any = None,
    residual: Any = None,
) -> tuple[Any, list[str]]:
    """(flwr ArrayRecord with one compressed Array under ``key`` and the other arrays plain, compressed names)."""
    if key in arrays:
        raise InvalidInputError(f"the record already has an array named {key!r}; pass another key")
    names = _split_floats(arrays, base)
    out = ArrayRecord()
    if names:
        payload = _engine.compress(
            {n: arrays[n] for n in names},
            None if base is None else {n: base[n] for n in names},
            fraction=fraction,
            scope=scope,
            pipeline=pipeline,
            residual=residual,
            metadata={"order": list(arrays)},
        )
        out[key] = payload_array(payload)
    for n, a in arrays.items():
        if n not in names:
            out[n] = Array(np.asarray(a))
    return out, names


def compression_mod(
    fraction: float | None = 0.01,
    *,
    scope: str = "global",
    pipeline: Any = None,
    error_feedback: bool = True,
    key: str = DEFAULT_KEY,
    max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
) -> Callable[[Any, Any, Callable[[Any, Any], Any]], Any]:
    """A Flower client ``Mod``: compressed models in, compressed train replies out.

    Incoming: every ``ArrayRecord`` holding gpu_codec payloads is decoded to a plain one before the
    ``ClientApp`` runs. Outgoing, for a train message whose config carries ``gpu_codec.accept`` (what
    :class:`CompressedStrategy` sends): each ``ArrayRecord`` of the reply that has a received counterpart becomes
    top-k of ``reply - received`` (float arrays of matching shape and dtype, in one payload under ``key``; other
    arrays stay plain). Without that config entry the reply goes out as it is, so a stock server is never sent a
    record it cannot read.

    Parameters
    ----------
    fraction, scope, pipeline
        As for :func:`gpu_codec.compress` (``fraction=None``: dense, value codecs only).
    error_feedback
        Keep what compression dropped in ``context.state`` (as a checksummed gpu_codec record, no pickle) and add
        it to the next round's delta; where the model's dtype or a shape changes (flwr's FedAdam returns a float32
        model as float64), the residual starts over, with a warning; a layer gone from the model has its residual
        discarded.
    key
        Name of the compressed Array in the record.
    max_output_bytes
        Cap on the dense output of each incoming record, as :func:`decode_record` applies it.

    >>> mod = compression_mod(0.05, pipeline=[{"id": "quantize", "dtype": "float16"}])
    >>> callable(mod)
    True
    """
    if fraction is not None:
        fraction = _engine.check_fraction(fraction)
    pipeline_cfg = adapt.pipeline_configs(pipeline)
    cap = _check_cap(max_output_bytes)

    def gpu_codec_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        received: dict[str, dict[str, np.ndarray]] = {}
        accepts = False
        if msg.has_content():
            content = msg.content
            # (a train message of a server that decodes payloads: the models received are what replies are
            # compressed against; any other message's arrays are handed on as they came, not read here)
            accepts = msg.metadata.message_type.split(".")[0] == "train" and any(
                c.get(ACCEPT_KEY) == STYPE_GPU_CODEC for c in content.config_records.values()
            )
            for rk in list(content.array_records.keys()):
                rec = content.array_records[rk]
                if _is_compressed(rec):
                    rec = decode_record(rec, max_output_bytes=cap)
                    content[rk] = rec
                if accepts:
                    received[rk] = {k: rec[k].numpy() for k in rec}
        reply = call_next(msg, context)
        if not accepts or reply.has_error() or not reply.has_content():
            return reply
        for rk in list(reply.content.array_records.keys()):
            if rk not in received:
                continue
            rec = reply.content.array_records[rk]
            arrays = {k: rec[k].numpy() for k in rec}
            ef, changed = None, []
            state_key = f"{_EF_STATE}.{rk}"
            if error_feedback:
                saved = context.state.config_records.get(state_key)
                ef = ErrorFeedback.from_bytes(saved["state"]) if saved is not None else ErrorFeedback()
                # (the reply is the whole model: a residual of a float array it no longer has is discarded)
                floats = {n: arrays[n] for n in _split_floats(arrays, None)}
                changed = adapt.restart_if_changed(ef, floats, whole=True)
                if changed:
                    what = "its error-feedback residual starts over" if not len(ef) else "their residuals are dropped"
                    log.warning("the model changed (%s): %s", ", ".join(changed), what)
            new_rec, names = _compressed_record(
                arrays, received[rk], key, fraction=fraction, scope=scope, pipeline=pipeline_cfg, residual=ef
            )
            if names:
                reply.content[rk] = new_rec
            if ef is not None and (names or changed):  # (a state started over is saved so, said once)
                context.state[state_key] = ConfigRecord({"state": ef.to_bytes()})
        return reply

    return gpu_codec_mod


def _weighted_plain_mean(entries: list[tuple[float, np.ndarray]], total: float) -> np.ndarray:
    """Weighted mean of dense arrays in an order fixed by their bytes (so by content, not arrival). Where a weight
    near fp64's range takes a product or the sum past it, each array is weighed by its share of the total
    instead (a mean stays within its arrays' range).

    >>> _weighted_plain_mean([(1e307, np.array([40], np.int64)), (1e307, np.array([41], np.int64))], 2e307)
    array([40])
    """
    entries = sorted(entries, key=lambda e: (hashlib.sha256(e[1].tobytes()).digest(), e[0]))
    acc = np.zeros(entries[0][1].shape, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        for w, a in entries:
            acc += w * a.astype(np.float64)
        mean = acc / total
        if not np.isfinite(mean).all():
            mean[...] = 0.0
            for w, a in entries:
                mean += (w / total) * a.astype(np.float64)
    dt = entries[0][1].dtype
    if dt.kind in "iub":
        mean = np.rint(mean)
    return mean.astype(dt)


class CompressedStrategy(Strategy):
    """Wraps a Flower strategy (``FedAvg``, or any with the same hooks and keys) to send the global model
    compressed and aggregate compressed replies from their sparse form.

    Parameters
    ----------
    strategy
        The wrapped strategy: it samples nodes, builds the messages and aggregates the metrics; its
        ``weighted_by_key`` and ``arrayrecord_key`` are used.
    downlink
        Codec stages for the global model sent down, dense (``fraction=None``); the default, zstd, is lossless.
        ``None``: the model goes down uncompressed.
    key
        Name of the compressed Array in the records.
    max_output_bytes
        Cap on the memory of the round's :class:`~gpu_codec.Aggregator` (its ``max_output_bytes``: 20 bytes
        per fp32 parameter of the global model, more for a reply sending every entry sparse); a reply that
        needs more is left out. Default 4 GiB; ``None``: no cap.

    Where the wrapped strategy aggregates by FedAvg's rule (flwr's ``FedAvg``, ``FedProx``, or a subclass keeping
    FedAvg's ``aggregate_train``), the arrays a round produces are ``received + sum(w_i delta_i) / sum(w_i)``,
    where ``received`` is the model the clients decoded, computed from the sparse form; :func:`gpu_codec.aggregate`
    makes it the same to the byte in any arrival order. Any other rule (FedMedian, FedTrimmedAvg, FedAdam,
    differential privacy's clipping and noise) stays the wrapped strategy's: it gets each reply's model decoded
    onto ``received`` (one dense model a reply) and aggregates them itself.

    Fleets may be mixed: a reply without a payload (a client without :func:`compression_mod`) is taken
    losslessly beside compressed ones, and a node whose reply says it could not read the compressed model (a stock
    Flower client fails on the ``.npy`` guard) is logged and sent the model uncompressed from then on. A reply that
    cannot be used (a bad payload, arrays that do not match the global model, a bad weight, metric names the other
    replies do not have, which flwr's own check refuses the whole round for) is logged and left out of the arrays
    and the metrics, and the round goes on with the others; a round with no positive weight gives ``(None,
    None)``, said in the log. Non-float arrays are averaged densely, in an order fixed by their content, and an
    integer or bool array's mean is rounded to the nearest integer in its own dtype (FedAvg's rule gives a float64
    mean: BatchNorm's ``num_batches_tracked`` would then change dtype between rounds, and a client sending back the
    dtype it loaded would no longer match the global model). The arrays come back in the global model's order.
    """

    def __init__(
        self,
        strategy: Any,
        *,
        downlink: Any = ({"id": "zstd", "level": 3},),
        key: str = DEFAULT_KEY,
        max_output_bytes: int | None = _engine.DEFAULT_MAX_OUTPUT_BYTES,
    ):
        for hook in ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate"):
            if not callable(getattr(strategy, hook, None)):
                raise InvalidInputError(f"the wrapped strategy has no {hook}() hook")
        self.max_output_bytes = _check_cap(max_output_bytes)
        self._plain_nodes: set[int] = set()  # nodes that cannot read a compressed model
        self.strategy = strategy
        self.downlink = None if downlink is None else adapt.pipeline_configs(list(downlink))
        if self.downlink and any(s["id"] == "topk" for s in self.downlink):
            raise InvalidInputError("the global model goes down dense: a downlink pipeline takes no topk stage")
        self.key = key
        # (the record sent last, what it held (adapt.content_key), the record the clients got, what they decode)
        self._sent: tuple[Any, Any, Any, dict[str, np.ndarray]] | None = None
        self._trained: dict[str, np.ndarray] | None = None  # the model configure_train sent: the deltas' base

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    @property
    def weighted_by_key(self) -> str:
        return getattr(self.strategy, "weighted_by_key", "num-examples")

    def summary(self) -> None:
        if hasattr(self.strategy, "summary"):
            self.strategy.summary()

    # ---------------------------------------------------------------- down

    def _down(self, arrays: Any) -> Any:
        """The record sent for ``arrays`` (compressed once per model: a record changed in place since is sent
        anew), remembering what clients decode."""
        key = adapt.content_key(arrays)
        if self._sent is not None and self._sent[0] is arrays and key is not None and key == self._sent[1]:
            return self._sent[2]
        plain = {k: arrays[k].numpy() for k in arrays}
        if self.downlink is None:
            sent = arrays
        else:
            sent, _ = _compressed_record(plain, None, self.key, fraction=None, pipeline=self.downlink)
        self._sent = (arrays, key, sent, _decode_model(sent, None))
        return sent

    def _with_down(self, messages: Any, arrays: Any) -> list:
        sent = self._down(arrays)
        out = []
        for m in messages:
            if m.metadata.dst_node_id not in self._plain_nodes:  # those get the model as it is
                # a RecordDict of its own: the wrapped strategy may give every message the same one
                m.content = RecordDict({k: (sent if v is arrays else v) for k, v in m.content.items()})
            out.append(m)
        return out

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
        config[ACCEPT_KEY] = STYPE_GPU_CODEC
        out = self._with_down(self.strategy.configure_train(server_round, arrays, config, grid), arrays)
        self._trained = self._sent[3]  # (an evaluation configured before the replies come sends its own model)
        return out

    def configure_evaluate(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
        return self._with_down(self.strategy.configure_evaluate(server_round, arrays, config, grid), arrays)

    def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        self._note_unreadable(server_round, replies)
        return self.strategy.aggregate_evaluate(server_round, replies)

    def _note_unreadable(self, server_round: int, replies: list) -> None:
        """Nodes whose reply is the error a stock client gives on the compressed model: sent it plain from now."""
        for m in replies:
            if not m.has_error() or _GUARD_NOTE not in str(m.error.reason):
                continue
            node = m.metadata.src_node_id
            if self.downlink is not None and node not in self._plain_nodes:
                self._plain_nodes.add(node)
                log.warning(
                    "round %d: node %d could not read the compressed global model (gpu_codec is not installed "
                    "there); it is sent the model uncompressed from the next round on",
                    server_round,
                    node,
                )

    # ---------------------------------------------------------------- up

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
        replies = self._screened(server_round, list(replies))
        self._note_unreadable(server_round, replies)
        if not _fedavg_rule(self.strategy):  # (its own rule: it gets the models, decoded)
            decoded = self._decoded_replies(server_round, replies)
            if not any(not m.has_error() and self._weight(m.content) > 0 for m in decoded):
                return self._nothing(server_round)
            return self.strategy.aggregate_train(server_round, decoded)
        valid = [m for m in replies if not m.has_error()]
        if not valid:  # (only errors: the wrapped strategy logs them and has nothing to aggregate)
            return self.strategy.aggregate_train(server_round, replies)
        arrays, taken = self._aggregate(server_round, valid)
        if arrays is None:
            return self._nothing(server_round)
        # the wrapped strategy sees the replies taken, with empty arrays: it checks, logs and aggregates metrics
        kept = {id(m) for m in taken}
        stubbed = []
        for m in replies:
            if m.has_error():
                stubbed.append(m)
            elif id(m) in kept:
                rd = RecordDict(
                    {k: (ArrayRecord() if k in m.content.array_records else v) for k, v in m.content.items()}
                )
                stubbed.append(Message(content=rd, metadata=m.metadata))
        _, metrics = self.strategy.aggregate_train(server_round, stubbed)
        return arrays, metrics

    @staticmethod
    def _nothing(server_round: int) -> tuple[None, None]:
        log.warning("round %d: no reply with a positive weight could be aggregated", server_round)
        return None, None

    def _weight(self, content: Any) -> float:
        """A reply's weight: the ``weighted_by_key`` entry of its one MetricRecord, a non-negative number."""
        metrics = list(content.metric_records.values())
        if len(metrics) != 1:
            raise InvalidInputError(f"it holds {len(metrics)} MetricRecords, expected one")
        key = self.weighted_by_key
        if key not in metrics[0]:
            raise InvalidInputError(f"its MetricRecord has no {key!r}")
        w = metrics[0][key]
        try:  # (an in-process message may carry any int: one past fp64's range is no weight either)
            fine = not isinstance(w, bool) and isinstance(w, (int, float)) and math.isfinite(w) and w >= 0
        except OverflowError:
            fine = False
        if not fine:
            raise InvalidInputError(f"its weight {key!r} is {shown_weight(w)}, not a non-negative number")
        return float(w)

    def _screened(self, server_round: int, replies: list) -> list:
        """The replies the wrapped strategy's checks of the records would take, each checked alone: one ArrayRecord,
        one MetricRecord with a weight (:meth:`_weight`), and the metric names most replies have (a reply that
        differs is logged and left out, where the wrapped strategy would refuse the whole round); replies with an
        error passed on."""
        ok: dict[int, frozenset] = {}  # position of each reply that passed -> its metric names
        for i, m in enumerate(replies):
            if m.has_error():
                continue
            try:
                if len(m.content.array_records) != 1:
                    raise InvalidInputError(f"it holds {len(m.content.array_records)} ArrayRecords, expected one")
                self._weight(m.content)
            except GpuCodecError as e:
                _left_out(server_round, m, i, e)
                continue
            ok[i] = frozenset(next(iter(m.content.metric_records.values())).keys())
        names = list(ok.values())
        common = max(dict.fromkeys(names), key=names.count) if names else None  # (the most replies'; first of a tie)
        for i, got in ok.items():
            if got != common:
                e = InvalidInputError(f"its metrics {sorted(got)[:5]} are not the other replies' {sorted(common)[:5]}")
                _left_out(server_round, replies[i], i, e)
        return [m for i, m in enumerate(replies) if m.has_error() or ok.get(i) == common]

    def _received(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """The global model the clients decoded this round, and its float arrays' names."""
        if self._trained is None:
            raise InvalidInputError("aggregate_train before configure_train: no global model to add deltas to")
        base = self._trained
        return base, _split_floats(base, None)

    def _decoded_replies(self, server_round: int, replies: list) -> list:
        """The replies as a stock client would have sent them, for a wrapped strategy with a rule of its own: each
        reply's model decoded onto the global model it was made against (``received + delta``), its plain arrays as
        they came, in the global model's order; replies with an error passed on; a reply that cannot be read is
        logged and left out, as :meth:`_aggregate` leaves it out."""
        base, floats = self._received()
        plain = {n for n in base if n not in floats}
        out = []
        for i, m in enumerate(replies):
            if m.has_error():
                out.append(m)
                continue
            try:
                _, payload, others = self._read_reply(m.content, base, floats, plain)
                if payload is not None:
                    cap = self.max_output_bytes
                    others.update(_engine.decompress(payload, {n: base[n] for n in floats}, max_output_bytes=cap))
            except GpuCodecError as e:
                _left_out(server_round, m, i, e)
                continue
            record = ArrayRecord({n: Array(np.asarray(others[n])) for n in base})
            content = RecordDict({k: (record if k in m.content.array_records else v) for k, v in m.content.items()})
            out.append(Message(content=content, metadata=m.metadata))
        return out

    def _aggregate(self, server_round: int, replies: list) -> tuple[Any, list]:
        """(the new model, or None if no reply could be used; the replies used)."""
        base, floats = self._received()
        agg = None
        if floats:
            agg = Aggregator(base={n: base[n] for n in floats}, max_output_bytes=self.max_output_bytes)
        plain: dict[str, list[tuple[float, np.ndarray]]] = {n: [] for n in base if n not in floats}
        weights, taken = [], []
        for i, m in enumerate(replies):
            try:
                w, payload, others = self._read_reply(m.content, base, floats, set(plain))
                if payload is not None:
                    agg.add(payload, w)  # a payload it refuses leaves the accumulator as it was
            except GpuCodecError as e:
                _left_out(server_round, m, i, e)
                continue
            for n, a in others.items():
                plain[n].append((w, a))
            weights.append(w)
            taken.append(m)
        try:  # (with float arrays the Aggregator refused a weight that takes the sum past fp64's range)
            total = math.fsum(weights)
        except OverflowError:
            total = math.inf
        if not taken or not 0 < total < math.inf:
            if taken and total == math.inf:
                log.warning("round %d: the replies' weights sum past fp64's range", server_round)
            return None, taken
        merged = agg.result() if agg is not None else {}
        merged.update({n: _weighted_plain_mean(v, total) for n, v in plain.items()})
        return ArrayRecord({n: Array(np.asarray(merged[n])) for n in base}), taken

    def _read_reply(
        self, content: Any, base: dict[str, np.ndarray], floats: list[str], plain: set[str]
    ) -> tuple[float, Any, dict[str, np.ndarray]]:
        """One reply's weight, payload (a reply without one: its full model, compressed losslessly) and plain
        arrays, each checked against the global model before it is read (a reply :meth:`_screened` took)."""
        w = self._weight(content)
        rec = next(iter(content.array_records.values()))
        keys = [k for k in rec if holds_payload(rec[k])]
        if len(keys) > 1:
            raise PayloadLayoutError(f"it holds {len(keys)} gpu_codec payloads, expected one")
        others = {}
        for k in rec:
            if k in keys:
                continue
            want = base.get(k)
            a = rec[k]
            if want is None or a.stype != STYPE_NUMPY or (a.dtype, tuple(a.shape)) != (str(want.dtype), want.shape):
                expected = "nothing" if want is None else f"{want.dtype}{list(want.shape)}"
                raise InvalidInputError(f"its array {k!r} is {a.dtype}{list(a.shape)}, expected {expected}")
            arr = read_numpy(a, max_bytes=want.nbytes)
            if arr.dtype != want.dtype or arr.shape != want.shape:
                raise InvalidInputError(f"its array {k!r} holds {arr.dtype}{list(arr.shape)}")
            others[k] = arr
        payload = array_payload(rec[keys[0]]) if keys else None
        if payload is None and floats:  # a client without the mod: its full model, taken losslessly
            missing = [n for n in floats if n not in others]
            if missing:
                raise InvalidInputError(f"it lacks arrays {missing[:5]} of the global model")
            full = {n: others.pop(n) for n in floats}
            payload = _engine.compress(full, {n: base[n] for n in floats}, fraction=None)
        if payload is not None and not floats:
            raise InvalidInputError("it holds a payload, but the global model has no float array")
        if set(others) != plain:
            raise InvalidInputError(f"it carries plain arrays {sorted(others)[:5]}, expected {sorted(plain)[:5]}")
        return w, payload, others
