"""NVIDIA FLARE filters: the gpu_codec engine where NVFlare puts a compressor (extra ``nvflare``).

Four :class:`~nvflare.apis.dxo_filter.DXOFilter` subclasses, in two pairs, each recording what it did in the DXO
meta as NVFlare's own ``ModelQuantizer`` / ``ModelDequantizer`` do (the compressor sets
``MetaKey.PROCESSED_ALGORITHM`` and a ``"gpu_codec"`` entry, the decompressor removes both), and keeping every
other meta entry (``NUM_STEPS_CURRENT_ROUND``, ...):

* :class:`UpdateCompressor` (client, task result) and :class:`UpdateDecompressor` (server, task result): the
  client's ``WEIGHT_DIFF`` DXO becomes its exact top-k entries through any codec pipeline, with error feedback
  kept per site across rounds; ``WEIGHTS`` go dense through the pipeline (top-k of raw weights would zero
  most of the model). A corrupt or foreign payload reaching the server is rejected with one log line naming the
  client and the round, and the result comes back as ``TASK_RESULT_FILTER_ERROR``: the controller drops that
  contribution and aggregates the others (``FedAvg`` with ``ignore_result_error=True``, or its default dynamic
  mode while enough clients remain).
* :class:`ModelCompressor` (server, task data) and :class:`ModelDecompressor` (client, task data): the global
  model on the way down, dense through a pipeline (fp16 + zstd by default), compressed once for all clients.

:class:`SizeMeter` records the serialized size of each shareable (NVFlare's own FOBS serialization) as a JSON
line, for measuring what goes on the wire. :class:`ClaraFilter` runs Clara processors
(:mod:`gpu_codec.clara`) as an NVFlare filter.

Torch tensors in a DXO are compressed where they live (a CUDA tensor on the GPU backend never passes through
the host before serialization); the receiver gets the sender's kind back (NumPy or torch), on ``device``.
The payload travels as bytes in the DXO (``data["gpu_codec.payload"]``): NVFlare serializes it with FOBS,
and the receiver parses it with gpu_codec's own validating reader, never with pickle.

>>> import numpy as np
>>> from gpu_codec.nvflare import PAYLOAD_KEY, compress_params, decompress_params
>>> data, meta = compress_params({"w": np.array([0.0, 3.0, -1.0, 8.0], np.float32)}, fraction=0.5)
>>> sorted(data), meta["nnz"]
(['gpu_codec.payload'], 2)
>>> decompress_params(data, meta)["w"].tolist()
[0.0, 3.0, 0.0, 8.0]
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import adapt
from . import engine as _engine
from .arrays import array_kind
from .engine import DEFAULT_MAX_OUTPUT_BYTES
from .errors import GpuCodecError, InvalidInputError, PayloadError

__all__ = [
    "ALGORITHM",
    "META_KEY",
    "PAYLOAD_KEY",
    "ClaraFilter",
    "ModelCompressor",
    "ModelDecompressor",
    "SizeMeter",
    "UpdateCompressor",
    "UpdateDecompressor",
    "compress_params",
    "decompress_params",
]

PAYLOAD_KEY = "gpu_codec.payload"  # DXO data key holding the serialized payload
META_KEY = "gpu_codec"  # DXO meta key: what the filter did
ALGORITHM = "gpu_codec"  # the value of MetaKey.PROCESSED_ALGORITHM
DEFAULT_DOWN_PIPELINE = [{"id": "quantize", "dtype": "float16"}, {"id": "zstd", "level": 3}]
_FLOATS = ("float16", "float32", "float64", "bfloat16")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- framework-free core


def _kind_of(value: Any) -> str | None:
    try:
        return array_kind(value)
    except InvalidInputError:
        return None


def _is_float(value: Any) -> bool:
    return "float" in str(getattr(value, "dtype", ""))


def compress_params(
    params: Mapping[str, Any],
    *,
    fraction: float | None = 0.01,
    scope: str = "global",
    score: str = "magnitude",
    pipeline: Any = None,
    residual: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compress a DXO's params: ``(data, meta)``, ``data`` holding the payload bytes under :data:`PAYLOAD_KEY`
    and, unchanged, every entry that is not a floating-point array (step counters, integer buffers).
    With ``fraction=None`` (dense) the pipeline's index and top-k stages are left out.

    ``meta`` says what was done: ``fraction``, ``pipeline``, ``nnz``, ``dense_nbytes``, ``nbytes``, ``ratio``,
    the sender's array ``kind`` and the names passed through.
    """
    if not isinstance(params, Mapping):
        raise InvalidInputError(f"DXO data must be a mapping name -> array, got {type(params).__name__}")
    if PAYLOAD_KEY in params:
        raise InvalidInputError(f"the DXO already holds {PAYLOAD_KEY!r}: it is compressed already")
    tensors = {k: v for k, v in params.items() if _kind_of(v) is not None and _is_float(v)}
    rest = {k: v for k, v in params.items() if k not in tensors}
    kinds = {_kind_of(v) for v in tensors.values()}
    stages = adapt.pipeline_configs(pipeline)
    if fraction is None:
        stages = adapt.dense_stages(stages)
    payload = _engine.compress(tensors, fraction=fraction, scope=scope, score=score, residual=residual, pipeline=stages)
    data: dict[str, Any] = {PAYLOAD_KEY: payload.to_bytes(), **rest}
    meta = {
        "compressed": True,
        "fraction": fraction,
        "pipeline": stages,
        "nnz": int(payload.nnz),
        "dense_nbytes": int(payload.dense_nbytes),
        "nbytes": len(data[PAYLOAD_KEY]),
        "ratio": round(payload.dense_nbytes / max(1, len(data[PAYLOAD_KEY])), 3),
        "kind": "torch" if "torch" in kinds else "numpy",
        "passed_through": sorted(rest),
    }
    return data, meta


def _payload_bytes(blob: Any) -> Any:
    """What a DXO carries under :data:`PAYLOAD_KEY`, where it is bytes (anything else a peer put there is a
    PayloadError: ``bytes(2**33)`` would allocate 8 GiB)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise PayloadError(f"the DXO's {PAYLOAD_KEY!r} is a {type(blob).__name__}, not bytes (the serialized payload)")
    return blob


def decompress_params(
    data: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    *,
    like: str | None = None,
    device: Any = None,
    max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
) -> dict[str, Any]:
    """Undo :func:`compress_params`: dense arrays in their own dtypes, as ``like`` (default: the sender's kind,
    NumPy or torch) on ``device`` (torch only), plus the entries that were passed through.

    Raises :class:`~gpu_codec.errors.PayloadError` for anything that is not a valid gpu_codec payload.
    """
    payload = _engine.Payload.from_bytes(_payload_bytes(data.get(PAYLOAD_KEY) if isinstance(data, Mapping) else None))
    kind = like or (meta or {}).get("kind") or "numpy"
    if kind not in ("numpy", "torch", "cupy"):
        raise InvalidInputError(f"like must be 'numpy', 'torch' or 'cupy', got {kind!r}")
    kw = {"max_output_bytes": max_output_bytes}
    dense = _engine.decompress(payload, like=kind, **kw)
    out = {}
    for r in payload.tensors:
        v = adapt.cast_to_logical(dense[r.name], r.dtype, kind)
        if kind == "torch" and device is not None:
            v = v.to(device)
        out[r.name] = v
    for k, v in data.items():
        if k != PAYLOAD_KEY:
            if k in out:
                raise PayloadError(f"tensor {k!r} is both in the payload and passed through")
            out[k] = v
    return out


# ---------------------------------------------------------------- NVFlare filters

try:
    from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
    from nvflare.apis.dxo_filter import DXOFilter
    from nvflare.apis.filter import Filter
    from nvflare.apis.fl_constant import ReservedKey, ReturnCode
    from nvflare.apis.shareable import make_reply
    from nvflare.app_common.app_constant import AppConstants
except ImportError as _e:  # pragma: no cover - nvflare is an optional extra
    _IMPORT_ERROR: ImportError | None = _e

    class DXOFilter:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                "gpu_codec.nvflare needs NVIDIA FLARE: pip install 'gpu_codec[nvflare]'"
            ) from _IMPORT_ERROR

    Filter = DXOFilter  # type: ignore[misc,assignment]
else:
    _IMPORT_ERROR = None

_UPDATE_KINDS = ["WEIGHTS", "WEIGHT_DIFF"]


def _round_of(shareable: Any, fl_ctx: Any) -> Any:
    r = shareable.get_header(AppConstants.CURRENT_ROUND, None)
    if r is None and fl_ctx is not None:
        r = fl_ctx.get_prop(AppConstants.CURRENT_ROUND, None)
    return r


def _local_round(shareable: Any, fl_ctx: Any) -> Any:
    """The round as this party knows it (its own context first; the sender's header only when it has none)."""
    r = fl_ctx.get_prop(AppConstants.CURRENT_ROUND, None) if fl_ctx is not None else None
    return shareable.get_header(AppConstants.CURRENT_ROUND, None) if r is None else r


def _peer_of(shareable: Any, fl_ctx: Any) -> str:
    name = shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, None)
    if not name and fl_ctx is not None:
        peer = fl_ctx.get_peer_context()
        name = peer.get_identity_name() if peer is not None else None
    return str(name or "?")


def _kind_name(kind: Any) -> str:
    return str(getattr(kind, "value", kind))


def _meta_copy(dxo: Any) -> dict[str, Any]:
    """The DXO's meta for a new DXO, without the filter history (NVFlare carries that over itself)."""
    return {k: v for k, v in dxo.meta.items() if k != MetaKey.FILTER_HISTORY}


def _json_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {k: adapt.json_safe(v) for k, v in meta.items()}


class _Compressing(DXOFilter):
    """Shared part of the two compressing filters."""

    def __init__(self, fraction: float | None, scope: str, score: str, pipeline: Any) -> None:
        super().__init__(supported_data_kinds=list(_UPDATE_KINDS), data_kinds_to_filter=list(_UPDATE_KINDS))
        self.fraction = None if fraction is None else _engine.check_fraction(fraction)
        self.scope = scope
        self.score = score
        self.pipeline = adapt.pipeline_configs(pipeline)

    def _compress(self, dxo: Any, fraction: float | None, residual: Any, fl_ctx: Any, where: str) -> Any:
        data, info = compress_params(
            dxo.data, fraction=fraction, scope=self.scope, score=self.score, pipeline=self.pipeline, residual=residual
        )
        new = DXO(data_kind=dxo.data_kind, data=data, meta=_meta_copy(dxo))
        new.set_meta_prop(MetaKey.PROCESSED_ALGORITHM, ALGORITHM)
        new.set_meta_prop(META_KEY, _json_meta({**info, "by": type(self).__name__, "where": where}))
        self.log_info(
            fl_ctx,
            f"gpu_codec: compressed {_kind_name(dxo.data_kind)} {where}: "
            f"{info['dense_nbytes']} -> {info['nbytes']} bytes "
            f"(x{info['ratio']}, {info['nnz']} entries kept)",
        )
        return new


class UpdateCompressor(_Compressing):
    """Client-side task-result filter: compress the ``WEIGHT_DIFF`` (or ``WEIGHTS``) DXO a client sends.

    Parameters
    ----------
    fraction
        Share of entries of a ``WEIGHT_DIFF`` kept (exact top-k), in (0, 1]; ``None``: dense.
    pipeline
        Codec stages after top-k (configs or a :class:`gpu_codec.Pipeline`), e.g.
        ``[{"id": "quantize", "dtype": "float16"}, {"id": "rice"}, {"id": "zstd"}]``.
    scope, score
        As for :func:`gpu_codec.compress`.
    weights_fraction
        The fraction for ``WEIGHTS`` DXOs; ``None`` (the default): dense, only the pipeline applies.
    error_feedback
        Keep what top-k leaves out of a ``WEIGHT_DIFF`` and add it to the next round's (per site, in memory);
        where the model's dtype or a shape changes, the residual starts over, with a warning (a tensor a DXO does
        not carry keeps its residual: a site's DXOs may carry parts of the model).
    state_dir
        Where to also keep the error-feedback state on disk (``<state_dir>/<site>.gcef``), so a restarted
        client resumes it; None: memory only.
    """

    def __init__(
        self,
        fraction: float | None = 0.01,
        pipeline: Any = None,
        scope: str = "global",
        score: str = "magnitude",
        weights_fraction: float | None = None,
        error_feedback: bool = True,
        state_dir: str | None = None,
    ) -> None:
        super().__init__(fraction, scope, score, pipeline)
        self.weights_fraction = None if weights_fraction is None else _engine.check_fraction(weights_fraction)
        self.error_feedback = bool(error_feedback)
        self.state_dir = state_dir
        self._states: dict[str, Any] = {}
        self._site_locks: dict[str, threading.Lock] = {}  # one a site: its check, compress and save go together
        self._lock = threading.Lock()

    def _state_path(self, site: str) -> str | None:
        if not self.state_dir:
            return None
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in site)
        return os.path.join(self.state_dir, f"{safe}.gcef")

    def residual_state(self, site: str) -> Any:
        """The error-feedback state of ``site`` (created, or loaded from ``state_dir``, on first use)."""
        with self._lock:
            if site not in self._states:
                path = self._state_path(site)
                if path and os.path.exists(path):
                    self._states[site] = _engine_ef().load(path)
                else:
                    self._states[site] = _engine_ef()()
            return self._states[site]

    def process_dxo(self, dxo: Any, shareable: Any, fl_ctx: Any) -> Any:
        if dxo.get_meta_prop(META_KEY) is not None:
            self.log_info(fl_ctx, "gpu_codec: the DXO is compressed already, left as it is")
            return None
        site = fl_ctx.get_identity_name() or "?"
        diff = dxo.data_kind == DataKind.WEIGHT_DIFF
        fraction = self.fraction if diff else self.weights_fraction
        residual = self.residual_state(site) if (diff and self.error_feedback and fraction is not None) else None
        what = f"at {site} round {_round_of(shareable, fl_ctx)}"
        if residual is None:
            return self._compress(dxo, fraction, None, fl_ctx, what)
        with self._lock:
            turn = self._site_locks.setdefault(site, threading.Lock())
        with turn:  # (two tasks of one site at once: the residual checked, used and saved by one, then the other)
            changed = adapt.restart_if_changed(residual, dxo.data)
            if changed:
                self.log_warning(
                    fl_ctx, f"gpu_codec: the model changed ({', '.join(changed)}): the residual starts over"
                )
            new = self._compress(dxo, fraction, residual, fl_ctx, what)
            if self._state_path(site):
                os.makedirs(self.state_dir, exist_ok=True)
                residual.save(self._state_path(site))
        return new


def _engine_ef() -> Any:
    from .error_feedback import ErrorFeedback

    return ErrorFeedback


def _check_not_emptied(dxo: Any) -> None:
    """A DXO with no data whose meta says it is compressed has lost its payload: a PayloadError, not a model."""
    info = dxo.get_meta_prop(META_KEY)
    if isinstance(info, Mapping) and info.get("compressed"):
        raise PayloadError(f"the DXO's meta says it is compressed, but it holds no data (no {PAYLOAD_KEY!r})")


class _Decompressing(DXOFilter):
    def __init__(self, like: str | None, device: Any, max_output_bytes: int | None) -> None:
        super().__init__(supported_data_kinds=list(_UPDATE_KINDS), data_kinds_to_filter=list(_UPDATE_KINDS))
        if like not in (None, "numpy", "torch", "cupy"):
            raise InvalidInputError(f"like must be None, 'numpy', 'torch' or 'cupy', got {like!r}")
        self.like = like
        self.device = device
        self.max_output_bytes = max_output_bytes

    def process(self, shareable: Any, fl_ctx: Any) -> Any:
        if shareable.get_return_code() == ReturnCode.OK:
            try:
                dxo = from_shareable(shareable)
            except Exception:  # (not a DXO: NVFlare's filter passes it on)
                dxo = None
            if dxo is not None and not dxo.data:  # (NVFlare's filter passes a DXO without data on unread)
                _check_not_emptied(dxo)
        return super().process(shareable, fl_ctx)

    def _decompress(self, dxo: Any) -> Any:
        info = dxo.get_meta_prop(META_KEY)
        if not isinstance(info, Mapping) or not info.get("compressed"):
            if PAYLOAD_KEY in dxo.data:
                raise PayloadError(f"the DXO holds {PAYLOAD_KEY!r} but its meta does not say it is compressed")
            return None  # an uncompressed DXO: nothing to undo
        like = self.like or info.get("kind") or "numpy"
        dense = decompress_params(dxo.data, info, like=like, device=self.device, max_output_bytes=self.max_output_bytes)
        # our meta entries removed, as NVFlare's ModelDequantizer removes its own: a workflow that relays a result's
        # meta into the next task (Cyclic: ``model.meta = result.meta``) would otherwise send a dense model marked
        # compressed, which the compressor leaves as it is and the next client's decompressor refuses
        meta = {k: v for k, v in _meta_copy(dxo).items() if k != META_KEY}
        if meta.get(MetaKey.PROCESSED_ALGORITHM) == ALGORITHM:
            del meta[MetaKey.PROCESSED_ALGORITHM]
        return DXO(data_kind=dxo.data_kind, data=dense, meta=meta)


class UpdateDecompressor(_Decompressing):
    """Server-side task-result filter: a client's compressed update back to dense arrays before aggregation.

    A payload that does not parse (corrupt, truncated, another format, tensors that disagree with the meta, or
    missing from a DXO whose meta says it is compressed, which NVFlare's own filter would pass on unread) is
    rejected: one error line in the server log names the client, the task and the round, and the result is
    replaced by ``TASK_RESULT_FILTER_ERROR``, so the controller drops that contribution and goes on with the
    others. Nothing from the rejected payload reaches the aggregator.

    Parameters
    ----------
    like
        The array kind handed on: None (the sender's kind), ``"numpy"`` or ``"torch"``.
    device
        For torch output: where the tensors go (None: the CPU).
    max_output_bytes
        Cap on the dense output one payload may declare, as in :func:`gpu_codec.decompress` (4 GiB by default;
        None: no cap).
    """

    def __init__(
        self, like: str | None = None, device: Any = None, max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES
    ) -> None:
        super().__init__(like, device, max_output_bytes)

    def process_dxo(self, dxo: Any, shareable: Any, fl_ctx: Any) -> Any:
        return self._decompress(dxo)

    def process(self, shareable: Any, fl_ctx: Any) -> Any:
        try:
            return super().process(shareable, fl_ctx)
        except (GpuCodecError, ValueError, TypeError, KeyError, MemoryError) as e:
            peer = _peer_of(shareable, fl_ctx)
            task = shareable.get_header(ReservedKey.TASK_NAME, None) or fl_ctx.get_prop(ReservedKey.TASK_NAME, "?")
            self.log_error(
                fl_ctx,
                f"gpu_codec: rejected the {task} result of {peer} in round {_round_of(shareable, fl_ctx)}: "
                f"{type(e).__name__}: {e}; this contribution is dropped",
            )
            reply = make_reply(ReturnCode.TASK_RESULT_FILTER_ERROR)
            reply.set_peer_props(shareable.get_peer_props() or {})  # later filters and logs still see who sent it
            reply.set_header(AppConstants.CURRENT_ROUND, _round_of(shareable, fl_ctx))
            return reply


class ModelCompressor(_Compressing):
    """Server-side task-data filter: the global model on the way down, dense through ``pipeline`` (fp16 + zstd
    by default), compressed once and the same DXO given to every client of the round (compressed again where the
    model changed since, even in place within the round, as NVFlare's cyclic relay adds each client's diff).

    ``fraction`` applies to ``WEIGHT_DIFF`` task data only (a server sending model deltas); ``WEIGHTS`` always
    go dense.
    """

    def __init__(
        self, pipeline: Any = "default", fraction: float | None = None, scope: str = "global", score: str = "magnitude"
    ) -> None:
        super().__init__(fraction, scope, score, DEFAULT_DOWN_PIPELINE if pipeline == "default" else pipeline)
        self._lock = threading.Lock()
        # (the data dict compressed last, its DXO, the round, what it held: adapt.content_key)
        self._last: tuple[Any, Any, Any, Any] | None = None

    def process_dxo(self, dxo: Any, shareable: Any, fl_ctx: Any) -> Any:
        if dxo.get_meta_prop(META_KEY) is not None:
            return None
        rnd = _round_of(shareable, fl_ctx)
        with self._lock:  # one global model, many clients: compress it once per round
            # (the same dict may have been changed in place since: a relay's controller adds each client's diff
            # into it within one round; what it holds tells)
            key = adapt.content_key(dxo.data) if isinstance(dxo.data, dict) else None
            last = self._last
            if last is not None and last[0] is dxo.data and last[2] == rnd and key is not None and key == last[3]:
                done = last[1]  # a fresh DXO around the same bytes: each client's filter history is its own
                return DXO(data_kind=done.data_kind, data=done.data, meta=_meta_copy(done))
            fraction = self.fraction if dxo.data_kind == DataKind.WEIGHT_DIFF else None
            new = self._compress(dxo, fraction, None, fl_ctx, f"for round {rnd}")
            self._last = (dxo.data, new, rnd, key)
            return new


class ModelDecompressor(_Decompressing):
    """Client-side task-data filter: undo :class:`ModelCompressor` (``like`` / ``device`` as for
    :class:`UpdateDecompressor`; a CUDA ``device`` puts the received model straight on the GPU)."""

    def __init__(
        self, like: str | None = None, device: Any = None, max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES
    ) -> None:
        super().__init__(like, device, max_output_bytes)

    def process_dxo(self, dxo: Any, shareable: Any, fl_ctx: Any) -> Any:
        return self._decompress(dxo)


class SizeMeter(Filter):
    """A filter that changes nothing and records the size of the shareable as NVFlare serializes it (FOBS), one
    JSON line per shareable, logged (``gpu_codec size: {...}`` in the site's job log) and, when ``output_file``
    is given, appended to it: site, peer, task, round, bytes, the DXO's data kind, the filters it went through,
    the return code and the time (Unix seconds). Put it last in a chain to measure what goes on the wire.

    A relative ``output_file`` lands in the job's run directory on each site, so an exported job carries no
    path of the machine it was built on. (The argument is not called ``path``: NVFlare reads a component's
    ``path`` as its class path.)"""

    def __init__(self, output_file: str | None = None, label: str = "") -> None:
        super().__init__()
        self.output_file = output_file
        self.label = label
        self._lock = threading.Lock()

    def _output_path(self, fl_ctx: Any) -> str | None:
        if not self.output_file or os.path.isabs(self.output_file):
            return self.output_file
        from nvflare.apis.fl_constant import FLContextKey

        workspace = fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
        job_id = fl_ctx.get_job_id()
        if workspace is None or not job_id:
            return self.output_file
        return os.path.join(workspace.get_run_dir(job_id), self.output_file)

    def process(self, shareable: Any, fl_ctx: Any) -> Any:
        from nvflare.fuel.utils import fobs

        try:
            n = len(fobs.dumps(shareable))
        except Exception as e:
            self.log_warning(fl_ctx, f"gpu_codec SizeMeter: cannot serialize the shareable: {e}")
            return shareable
        try:
            dxo = from_shareable(shareable)
            kind, history = dxo.data_kind, list(dxo.get_filter_history() or [])
        except Exception:
            kind, history = None, []
        rec = {
            "label": self.label,
            "site": fl_ctx.get_identity_name(),
            "peer": _peer_of(shareable, fl_ctx),
            "task": shareable.get_header(ReservedKey.TASK_NAME, None) or fl_ctx.get_prop(ReservedKey.TASK_NAME, None),
            "round": _round_of(shareable, fl_ctx),
            "bytes": n,
            "data_kind": None if kind is None else _kind_name(kind),
            "filters": history,
            "rc": shareable.get_return_code(),
            "time": round(time.time(), 3),
        }
        line = json.dumps(rec, default=str)
        self.log_info(fl_ctx, f"gpu_codec size: {line}")
        path = self._output_path(fl_ctx)
        if path:
            with self._lock, open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return shareable


class ClaraFilter(Filter):
    """Clara processors (:mod:`gpu_codec.clara`) as an NVFlare filter: the DXO's data becomes a Clara data
    context, ``processors`` run on it in order, and the result goes back into the DXO.

    ``processors`` is a list of processor objects or Clara component configs (``{"name": ..., "args": ...}``),
    so a Clara ``pre_processors`` / ``post_processors`` list maps onto a job's task-result / task-data
    filters. The app context carries the round (``current_round`` as this party knows it: its own context
    first, so a ``ModelDecryptor`` bound to the round rejects an envelope replayed from another round), the
    task name, the site and the DXO meta (``n_iter`` is NVFlare's ``NUM_STEPS_CURRENT_ROUND``); the data
    context's metadata goes into the DXO meta under ``"clara"``. A processor that leaves a compressed or
    encrypted model makes the DXO carry it as bytes under :data:`PAYLOAD_KEY` (a ``ClaraFilter`` with the
    matching post-processors undoes it).
    """

    def __init__(self, processors: list[Any]) -> None:
        super().__init__()
        from .clara import build_processor

        if isinstance(processors, Mapping) or not isinstance(processors, (list, tuple)):
            raise InvalidInputError(f"processors must be a list of processors or configs, got {processors!r}")
        self.processors = [build_processor(p) if isinstance(p, Mapping) else p for p in processors]

    def process(self, shareable: Any, fl_ctx: Any) -> Any:
        from . import clara

        if shareable.get_return_code() != ReturnCode.OK:
            return shareable
        try:
            dxo = from_shareable(shareable)
        except Exception:
            return shareable
        data = dict(dxo.data or {})
        meta = _meta_copy(dxo)
        if PAYLOAD_KEY in data:
            model: Any = bytes(_payload_bytes(data.pop(PAYLOAD_KEY)))
            if not model.startswith(clara.ENVELOPE_MAGIC):
                model = _engine.Payload.from_bytes(model)
        else:
            model = data
        clara_meta = meta.get("clara") or {}
        if not isinstance(clara_meta, Mapping):
            raise PayloadError(f"the DXO meta's 'clara' entry is a {type(clara_meta).__name__}, not a mapping")
        ctx = clara.DataContext(model=model, metadata=clara_meta)
        app = clara.AppContext(
            round_number=_local_round(shareable, fl_ctx) or 0,
            task=shareable.get_header(ReservedKey.TASK_NAME, "") or "",
            site=fl_ctx.get_identity_name(),
            n_iter=meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND),
            meta=meta,
        )
        for p in self.processors:
            p.process(ctx, app)
        out = ctx.get_model()
        if isinstance(out, _engine.Payload):
            out = {PAYLOAD_KEY: out.to_bytes()}
        elif isinstance(out, (bytes, bytearray, memoryview)):
            out = {PAYLOAD_KEY: bytes(out)}
        meta["clara"] = adapt.json_safe(ctx.get_all_metadata())
        new = DXO(data_kind=dxo.data_kind, data=dict(out), meta=meta)
        new.add_filter_history(list(dxo.get_filter_history() or []))
        new.add_filter_history(type(self).__name__)
        return new.update_shareable(shareable)
