"""gpu_codec as an OpenFL compression pipeline, built on OpenFL's own types (extra ``openfl``).

OpenFL compresses every tensor a collaborator or the aggregator sends through the plan's
``compression_pipeline``: a ``TransformationPipeline`` whose ``forward`` gives the bytes of a ``NamedTensor`` and a
list of metadata dicts that travel as ``MetadataProto``s, and whose ``backward`` rebuilds the array. OpenFL's
``TensorCodec`` wraps it with the ``TensorKey`` tag logic (``compressed`` / ``lossy_compressed``, ``delta``, the
lossless pipeline for what must arrive exactly). This module plugs gpu_codec into that place:

* :class:`GpuCodecTransformer`, a subclass of OpenFL's ``openfl.pipelines.pipeline.Transformer``: one array in,
  one gpu_codec payload (exact top-k, then any codec stages) out, its shape in ``metadata["int_list"]`` (so the
  metadata fits ``MetadataProto`` unchanged); ``lossy`` as OpenFL's transformers declare it;
* :class:`GpuCodecPipeline`, a subclass of OpenFL's ``TransformationPipeline`` holding that transformer. Give it to
  OpenFL's own ``TensorCodec``, or name it in the plan::

      compression_pipeline:
        template: gpu_codec.openfl.GpuCodecPipeline
        settings: {fraction: 0.01, pipeline: [{id: quantize, dtype: float16}, {id: zstd, level: 3}]}

  A lossy one leaves OpenFL's ``TensorCodec`` to send what must be exact (the first model, ``require_lossless``)
  through OpenFL's ``NoCompressionPipeline``; ``fraction=None`` makes a lossless pipeline that keeps every entry
  and can serve as both.

The input may be NumPy, CuPy or torch (CPU or CUDA); on the GPU only the compressed bytes cross to the host.
:meth:`GpuCodecPipeline.backward` reads the bytes with gpu_codec's validating reader (never pickle), checks them
against the metadata's shape, caps the dense output (``max_output_bytes``) and raises gpu_codec errors
(:class:`~gpu_codec.errors.PayloadError`, :class:`~gpu_codec.errors.InvalidInputError`) on bad input. It leaves
the caller's metadata list as it was (OpenFL's own pipelines pop from it). The tag checks are OpenFL's own
(assertions in its ``TensorCodec``).

Tested with OpenFL 1.9, whose pins (``grpcio<1.66``, ``protobuf<6``) exclude flwr (``grpcio>=1.70``): the
``openfl`` and ``flower`` extras cannot share one environment. OpenFL 1.9's own float32 pipeline calls
``np.reshape(newshape=...)``, which NumPy 2.4 removed, so the extra asks for ``numpy<2.4``.

>>> import numpy as np
>>> from openfl.pipelines import TensorCodec
>>> from openfl.utilities import TensorKey
>>> codec = TensorCodec(GpuCodecPipeline(fraction=0.25))
>>> key = TensorKey("conv1.weight", "col1", 3, False, ("trained",))
>>> delta_key, delta = codec.generate_delta(key, np.array([1., 9., 2., -7.], np.float32), np.zeros(4, np.float32))
>>> ckey, blob, meta = codec.compress(delta_key, delta)
>>> ckey.tags, type(blob).__name__, meta
(('delta', 'lossy_compressed', 'trained'), 'bytes', [{'int_list': [4]}])
>>> dkey, back = codec.decompress(ckey, blob, meta)
>>> dkey.tags, back.tolist()
(('delta', 'lossy_decompressed', 'trained'), [0.0, 9.0, 0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import adapt, dtypes
from . import engine as _engine
from .engine import DEFAULT_MAX_OUTPUT_BYTES
from .errors import InvalidInputError

try:
    from openfl.pipelines.pipeline import TransformationPipeline, Transformer
except ImportError as _e:
    raise ImportError(f"gpu_codec.openfl needs OpenFL: pip install 'gpu_codec[openfl]' ({_e})") from _e

__all__ = ["GpuCodecPipeline", "GpuCodecTransformer"]

_LIKES = ("numpy", "cupy", "torch")


def _float_input(data: Any) -> Any:
    """``data`` as a floating-point array of its own kind; integers and booleans become float32 (as OpenFL's own
    pipelines cast them)."""
    if np.isscalar(data) or isinstance(data, (list, tuple)):
        data = np.asarray(data)
    kind = adapt.array_kind(data)
    dt = str(data.dtype).replace("torch.", "")
    if dt in dtypes.FLOAT_DTYPES:
        return data
    if dt == "bool" or dt.startswith(("int", "uint")):
        return data.float() if kind == "torch" else data.astype(np.float32)
    raise InvalidInputError(f"expected an array of real numbers, got dtype {dt}")


def _shape_of(metadata: Any) -> tuple[int, ...]:
    """The shape a transformer's metadata declares (a dict, or OpenFL's view of a ``MetadataProto``)."""
    if not isinstance(metadata, Mapping) or "int_list" not in metadata:
        raise InvalidInputError(f"metadata must be a mapping with 'int_list' (the shape), got {metadata!r}")
    got = metadata["int_list"]
    try:
        sizes = list(got) if not isinstance(got, (str, bytes, Mapping)) else None
    except TypeError:
        sizes = None
    if sizes is None or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in sizes):
        raise InvalidInputError(f"metadata 'int_list' must be a list of integers, got {got!r:.80}")
    return tuple(int(s) for s in sizes)


class GpuCodecTransformer(Transformer):
    """One array to one gpu_codec payload and back: OpenFL's ``Transformer`` contract.

    Parameters are those of :class:`GpuCodecPipeline`.

    >>> t = GpuCodecTransformer(fraction=0.5)
    >>> blob, meta = t.forward(np.array([[3.0, -1.0], [0.5, -4.0]], np.float32))
    >>> t.lossy, meta, t.backward(blob, meta).tolist()
    (True, {'int_list': [2, 2]}, [[3.0, 0.0], [0.0, -4.0]])
    """

    name = "tensor"  # the payload's one tensor name (OpenFL's pipelines see the array, not its key)

    def __init__(
        self,
        pipeline: Any = None,
        *,
        fraction: float | None = 0.01,
        scope: str = "global",
        score: Any = "magnitude",
        like: str = "numpy",
        max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        self._stages = adapt.pipeline_configs(pipeline)
        if fraction is not None:
            fraction = _engine.check_fraction(fraction)
        if like not in _LIKES:
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        self.fraction = fraction
        self.scope = scope
        self.score = score
        self.like = like
        self.max_output_bytes = max_output_bytes
        self.lossy = adapt.is_lossy(fraction, self._stages)

    def get_config(self) -> dict:
        """The constructor's arguments, as JSON (a custom score function is written ``"custom"``)."""
        return {
            "pipeline": self._stages,
            "fraction": self.fraction,
            "scope": self.scope,
            "score": self.score if isinstance(self.score, str) else "custom",
            "like": self.like,
            "max_output_bytes": self.max_output_bytes,
        }

    def forward(self, data: Any, serialize: bool = True, **kwargs: Any) -> tuple[Any, dict]:
        """Compress one array: ``(payload bytes, {"int_list": shape})``. With ``serialize=False`` the
        :class:`~gpu_codec.Payload` itself (still on the GPU) instead of its bytes. Other keyword arguments
        (OpenFL passes some, such as ``lossless``) are ignored, as OpenFL's own transformers ignore them."""
        data = _float_input(data)
        payload = adapt.engine_compress(
            {self.name: data}, fraction=self.fraction, scope=self.scope, score=self.score, pipeline=self._stages
        )
        shape = [int(s) for s in data.shape]
        return (payload.to_bytes() if serialize else payload), {"int_list": shape}

    def backward(self, data: Any, metadata: Any, like: str | None = None, **kwargs: Any) -> Any:
        """Decompress to a dense array of the metadata's shape, in the sent dtype (bfloat16: float32 unless
        ``like="torch"``), as ``like`` (default: the constructor's)."""
        like = like or self.like
        if like not in _LIKES:
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        shape = _shape_of(metadata)
        if isinstance(data, _engine.Payload):
            payload = data
        elif isinstance(data, (bytes, bytearray, memoryview)):
            payload = _engine.Payload.from_bytes(data)
        else:
            raise InvalidInputError(f"expected the payload's bytes, got {type(data).__name__}")
        names = [r.name for r in payload.tensors]
        if names != [self.name]:
            raise InvalidInputError(f"expected a payload of one tensor {self.name!r}, got {names}")
        rec = payload.tensors[0]
        if tuple(rec.shape) != shape:
            raise InvalidInputError(f"the metadata gives shape {shape}, the payload holds {tuple(rec.shape)}")
        out = _engine.decompress(payload, like=like, max_output_bytes=self.max_output_bytes)[self.name]
        return adapt.cast_to_logical(out, rec.dtype, like)


class GpuCodecPipeline(TransformationPipeline):
    """gpu_codec as OpenFL's ``TransformationPipeline`` (one :class:`GpuCodecTransformer`).

    Parameters
    ----------
    pipeline
        Codec stages after top-k (a list of stage configs such as ``[{"id": "zstd", "level": 3}]``, or a
        ``gpu_codec.Pipeline``), or None.
    fraction
        Share of entries kept by top-k, in (0, 1]; None keeps every entry (lossless unless a stage is lossy).
    scope, score
        As for :func:`gpu_codec.compress`.
    like
        What :meth:`backward` returns by default: ``"numpy"`` (OpenFL's nparray), ``"cupy"`` or ``"torch"`` (on the
        GPU when the GPU backend is in use). ``backward(..., like=...)`` overrides it per call.
    max_output_bytes
        Cap on the dense output a received payload may declare, checked before anything is allocated (None: no
        cap).

    ``forward(data, serialize=False)`` returns the :class:`~gpu_codec.Payload` itself (still on the GPU) instead of
    bytes; :meth:`backward` accepts either.

    >>> p = GpuCodecPipeline(fraction=None)
    >>> blob, meta = p.forward(np.array([[1.5, -2.0], [0.0, 3.25]], np.float32))
    >>> p.is_lossy(), meta, p.backward(blob, meta).tolist()
    (False, [{'int_list': [2, 2]}], [[1.5, -2.0], [0.0, 3.25]])
    """

    def __init__(
        self,
        pipeline: Any = None,
        *,
        fraction: float | None = 0.01,
        scope: str = "global",
        score: Any = "magnitude",
        like: str = "numpy",
        max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        transformer = GpuCodecTransformer(
            pipeline, fraction=fraction, scope=scope, score=score, like=like, max_output_bytes=max_output_bytes
        )
        super().__init__(transformers=[transformer])

    @property
    def transformer(self) -> GpuCodecTransformer:
        return self.transformers[0]

    def get_config(self) -> dict:
        """The constructor's arguments, as JSON: the ``settings`` of an OpenFL plan."""
        return self.transformer.get_config()

    def backward(self, data: Any, transformer_metadata: Any, **kwargs: Any) -> Any:
        """Decompress what :meth:`forward` produced, given its metadata list (one dict, or OpenFL's view of one
        ``MetadataProto``, per transformer); the list is left as it was."""
        if isinstance(transformer_metadata, Mapping):
            transformer_metadata = [transformer_metadata]
        if not isinstance(transformer_metadata, Sequence) or isinstance(transformer_metadata, (str, bytes)):
            raise InvalidInputError(
                f"transformer_metadata must be a list of metadata dicts, got {type(transformer_metadata).__name__}"
            )
        if len(transformer_metadata) != len(self.transformers):
            raise InvalidInputError(
                f"expected one metadata entry per transformer ({len(self.transformers)}), "
                f"got {len(transformer_metadata)}"
            )
        return super().backward(data, list(transformer_metadata), **kwargs)
