"""OpenFL's ``TensorKey`` and ``TensorCodec``, with gpu_codec as a compression pipeline.

A re-creation, on purpose: OpenFL 1.9 installs on Python 3.10 to 3.12, but pins ``grpcio<1.66``,
``protobuf<6`` and ``Flask==3.1.1`` and brings pandas and scikit-learn; its gRPC pin excludes flwr (which needs
``grpcio>=1.70``), so it cannot share an environment with :mod:`gpu_codec.flower`, and its pins would decide the
versions of a whole application for the sake of a named tuple and a codec. The names below mirror OpenFL 1.9's
source: ``openfl.utilities.types.TensorKey``, ``openfl.utilities.utils.change_tags``,
``openfl.pipelines.pipeline`` (``Transformer``, ``Float32NumpyArrayToBytes``, ``TransformationPipeline``),
``openfl.pipelines.no_compression_pipeline`` and ``openfl.pipelines.tensor_codec.TensorCodec``. A ``TensorKey``
here is a named tuple of the same fields, so it compares equal to OpenFL's.

Someone arriving from OpenFL (``openfl.pipelines``, ``openfl.utilities``) finds:

* :class:`TensorKey` ``(tensor_name, origin, round_number, report, tags)`` and :func:`change_tags`;
* :class:`TensorCodec` with OpenFL's ``compress``, ``decompress``, ``generate_delta``, ``apply_delta``,
  ``find_dependencies`` and ``set_lossless_pipeline``, and OpenFL's tag logic (``compressed`` /
  ``lossy_compressed`` / ``lossy_decompressed``, ``delta``, ``model``; an ``aggregator`` origin keeps its tags);
* :class:`GpuCodecPipeline`: gpu_codec in OpenFL's pipeline shape (``forward(data) -> (bytes, metadata)``,
  ``backward(data, transformer_metadata)``, ``is_lossy()``). It takes NumPy, CuPy or torch (CPU or CUDA) input;
  on the GPU only the compressed bytes cross to the host. ``metadata`` uses OpenFL's ``int_list`` key, so it fits
  OpenFL's ``MetadataProto`` unchanged;
* :class:`NoCompressionPipeline`, OpenFL's lossless default (float32 bytes), byte for byte what OpenFL sends.

Deliberate differences: where OpenFL asserts, this module raises a gpu_codec error (:class:`TensorTagError`,
:class:`LossyPipelineError`, :class:`~gpu_codec.errors.InvalidInputError`), so ``python -O`` cannot skip the
checks; ``TensorCodec`` also accepts a list of codec stage configs or a ``gpu_codec.Pipeline`` and wraps it in a
:class:`GpuCodecPipeline`.

>>> import numpy as np
>>> codec = TensorCodec(GpuCodecPipeline(fraction=0.25))
>>> key = TensorKey("conv1.weight", "col1", 3, False, ("trained",))
>>> delta_key, delta = codec.generate_delta(key, np.array([1., 9., 2., -7.], np.float32), np.zeros(4, np.float32))
>>> ckey, blob, meta = codec.compress(delta_key, delta)
>>> ckey.tags, type(blob).__name__
(('delta', 'lossy_compressed', 'trained'), 'bytes')
>>> dkey, back = codec.decompress(ckey, blob, meta)
>>> dkey.tags, back.tolist()
(('delta', 'lossy_decompressed', 'trained'), [0.0, 9.0, 0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import adapt, dtypes
from . import engine as _engine
from .arrays import array_kind
from .errors import GpuCodecError, InvalidInputError

__all__ = [
    "Float32NumpyArrayToBytes",
    "GpuCodecPipeline",
    "LossyPipelineError",
    "NoCompressionPipeline",
    "TensorCodec",
    "TensorKey",
    "TensorTagError",
    "TransformationPipeline",
    "Transformer",
    "change_tags",
]


class TensorTagError(GpuCodecError, ValueError):
    """A TensorKey whose tags do not allow the operation (decompressing an uncompressed tensor, ...)."""


class LossyPipelineError(GpuCodecError, ValueError):
    """A lossy pipeline where a lossless one is required."""


class TensorKey(NamedTuple):
    """OpenFL's tensor identity: ``(tensor_name, origin, round_number, report, tags)``."""

    tensor_name: str
    origin: str
    round_number: int
    report: bool
    tags: tuple[str, ...]


def change_tags(
    tags: Sequence[str], *, add_field: str | None = None, remove_field: str | None = None
) -> tuple[str, ...]:
    """OpenFL's tag edit: deduplicate, add and/or remove one field, return sorted.

    >>> change_tags(("trained", "delta"), add_field="compressed")
    ('compressed', 'delta', 'trained')
    """
    tags = list(set(tags))
    if add_field is not None and add_field not in tags:
        tags.append(add_field)
    if remove_field is not None:
        if remove_field in tags:
            tags.remove(remove_field)
        else:
            raise TensorTagError(f"{remove_field} not in tags {tuple(tags)}")
    return tuple(sorted(tags))


# ---------------------------------------------------------------- OpenFL's lossless default


class Transformer:
    """OpenFL's transformer contract: ``forward(data) -> (data, metadata)``, ``backward(data, metadata)``."""

    lossy = False

    def forward(self, data: Any, **kwargs: Any) -> tuple[Any, dict]:
        raise NotImplementedError

    def backward(self, data: Any, metadata: dict, **kwargs: Any) -> Any:
        raise NotImplementedError


class Float32NumpyArrayToBytes(Transformer):
    """OpenFL's: cast to float32, send the C-order bytes, the shape in ``metadata["int_list"]``. GPU input is
    copied to the host (the bytes are the wire form)."""

    def __init__(self) -> None:
        self.lossy = False

    def forward(self, data: Any, **kwargs: Any) -> tuple[bytes, dict]:
        data = _to_host_numpy(data)
        if data.dtype != np.float32:
            data = data.astype(np.float32)
        return data.tobytes(order="C"), {"int_list": list(data.shape)}

    def backward(self, data: Any, metadata: dict, **kwargs: Any) -> np.ndarray:
        array_shape = tuple(metadata["int_list"])
        flat_array = np.frombuffer(data, dtype=np.float32)
        return np.reshape(flat_array, array_shape, order="C")


class TransformationPipeline:
    """OpenFL's sequential pipeline of transformers; lossy if any transformer is."""

    def __init__(self, transformers: list, **kwargs: Any) -> None:
        self.transformers = transformers

    def forward(self, data: Any, **kwargs: Any) -> tuple[Any, list[dict]]:
        transformer_metadata = []
        data = data.copy() if hasattr(data, "copy") else data
        for transformer in self.transformers:
            data, metadata = transformer.forward(data=data, **kwargs)
            transformer_metadata.append(metadata)
        return data, transformer_metadata

    def backward(self, data: Any, transformer_metadata: list[dict], **kwargs: Any) -> Any:
        transformer_metadata = list(transformer_metadata)  # OpenFL pops the caller's list; we leave it intact
        for transformer in self.transformers[::-1]:
            data = transformer.backward(data=data, metadata=transformer_metadata.pop(), **kwargs)
        return data

    def is_lossy(self) -> bool:
        return any(transformer.lossy for transformer in self.transformers)


class NoCompressionPipeline(TransformationPipeline):
    """OpenFL's lossless default: float32 bytes.

    >>> blob, meta = NoCompressionPipeline().forward(np.arange(3, dtype=np.float64))
    >>> len(blob), meta, NoCompressionPipeline().backward(blob, meta).tolist()
    (12, [{'int_list': [3]}], [0.0, 1.0, 2.0])
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(transformers=[Float32NumpyArrayToBytes()], **kwargs)


def _to_host_numpy(data: Any) -> np.ndarray:
    if np.isscalar(data) or isinstance(data, np.ndarray):
        return np.asarray(data)
    kind = array_kind(data)
    if kind == "cupy":
        return data.get()
    t = data.detach()
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    return t.cpu().numpy()


# ---------------------------------------------------------------- gpu_codec as an OpenFL pipeline


class GpuCodecPipeline:
    """gpu_codec in OpenFL's pipeline shape.

    Parameters
    ----------
    pipeline
        Codec stages after top-k (a list of stage configs such as ``[{"id": "zstd", "level": 3}]``, or a
        ``gpu_codec.Pipeline``), or None.
    fraction
        Share of entries kept by top-k, in (0, 1]; None sends every entry (dense).
    scope, score
        As for :func:`gpu_codec.compress`.
    like
        What :meth:`backward` returns by default: ``"numpy"`` (OpenFL's nparray), ``"cupy"`` or ``"torch"`` (on the
        GPU when the GPU backend is in use). ``backward(..., like=...)`` overrides it per call.

    ``forward(data, serialize=False)`` returns the :class:`~gpu_codec.Payload` itself (still on the GPU) instead of
    bytes; :meth:`backward` accepts either.

    >>> p = GpuCodecPipeline(fraction=None)
    >>> blob, meta = p.forward(np.array([[1.5, -2.0], [0.0, 3.25]], np.float32))
    >>> p.is_lossy(), meta, p.backward(blob, meta).tolist()
    (False, [{'int_list': [2, 2]}], [[1.5, -2.0], [0.0, 3.25]])
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
    ) -> None:
        self._stages = adapt.pipeline_configs(pipeline)
        if fraction is not None:
            fraction = _engine.check_fraction(fraction)
        if like not in ("numpy", "cupy", "torch"):
            raise InvalidInputError(f"like must be 'numpy', 'cupy' or 'torch', got {like!r}")
        self.fraction = fraction
        self.scope = scope
        self.score = score
        self.like = like
        self._lossy = adapt.is_lossy(fraction, self._stages)
        self.lossy = self._lossy
        self.transformers = [self]

    def get_config(self) -> dict:
        return {
            "pipeline": self._stages,
            "fraction": self.fraction,
            "scope": self.scope,
            "score": self.score if isinstance(self.score, str) else "custom",
            "like": self.like,
        }

    def is_lossy(self) -> bool:
        return self._lossy

    def forward(self, data: Any, serialize: bool = True, **kwargs: Any) -> tuple[Any, list[dict]]:
        """Compress one array; returns ``(payload bytes, [{"int_list": shape}])``."""
        if np.isscalar(data):
            data = np.asarray(data)
        kind = array_kind(data)
        dt = str(data.dtype).replace("torch.", "")
        if dt not in dtypes.FLOAT_DTYPES:  # OpenFL's own pipelines cast to float32 too
            data = data.float() if kind == "torch" else data.astype(np.float32)
        payload = adapt.engine_compress(
            {self.name: data}, fraction=self.fraction, scope=self.scope, score=self.score, pipeline=self._stages
        )
        shape = [int(s) for s in data.shape]
        return (payload.to_bytes() if serialize else payload), [{"int_list": shape}]

    def backward(self, data: Any, transformer_metadata: Any, like: str | None = None, **kwargs: Any) -> Any:
        """Decompress to a dense array of the original shape, in the original dtype (bfloat16: float32 unless
        ``like="torch"``)."""
        if isinstance(transformer_metadata, Mapping):
            transformer_metadata = [transformer_metadata]
        if not transformer_metadata:
            raise InvalidInputError("metadata must be included for decompression")
        payload = data if isinstance(data, _engine.Payload) else _engine.Payload.from_bytes(data)
        if [r.name for r in payload.tensors] != [self.name]:
            raise InvalidInputError(
                f"expected a payload of one tensor {self.name!r}, got {[r.name for r in payload.tensors]}"
            )
        like = like or self.like
        rec = payload.tensors[0]
        out = _engine.decompress(payload, like=like)[self.name]
        return adapt.cast_to_logical(out, rec.dtype, like)


def _as_pipeline(p: Any) -> Any:
    if hasattr(p, "forward") and hasattr(p, "backward") and hasattr(p, "is_lossy"):
        return p
    if (isinstance(p, Sequence) and not isinstance(p, (str, bytes))) or hasattr(p, "get_config"):
        return GpuCodecPipeline(p)
    raise InvalidInputError(
        f"compression_pipeline must have forward, backward and is_lossy (an OpenFL pipeline or "
        f"a GpuCodecPipeline), or be codec stage configs; got {type(p).__name__}"
    )


# ---------------------------------------------------------------- TensorCodec (OpenFL's logic)


class TensorCodec:
    """Tracks the compression dependencies of tensors and wraps a compression pipeline with TensorKey logic.

    A lossy ``compression_pipeline`` gets a :class:`NoCompressionPipeline` as its lossless pipeline; a lossless
    one serves as both.
    """

    def __init__(self, compression_pipeline: Any) -> None:
        self.compression_pipeline = _as_pipeline(compression_pipeline)
        if self.compression_pipeline.is_lossy():
            self.lossless_pipeline = NoCompressionPipeline()
        else:
            self.lossless_pipeline = self.compression_pipeline

    def set_lossless_pipeline(self, lossless_pipeline: Any) -> None:
        """Use ``lossless_pipeline`` for tensors that need lossless compression; a lossy one is refused."""
        lossless_pipeline = _as_pipeline(lossless_pipeline)
        if lossless_pipeline.is_lossy() is not False:
            raise LossyPipelineError("The provided pipeline is not lossless")
        self.lossless_pipeline = lossless_pipeline

    def compress(
        self, tensor_key: TensorKey, data: Any, require_lossless: bool = False, **kwargs: Any
    ) -> tuple[TensorKey, Any, list[dict]]:
        """Compress ``data``; the returned key gains ``compressed`` (lossless) or ``lossy_compressed``."""
        if require_lossless:
            compressed_nparray, metadata = self.lossless_pipeline.forward(data, **kwargs)
        else:
            compressed_nparray, metadata = self.compression_pipeline.forward(data, **kwargs)
        tensor_name, origin, round_number, report, tags = tensor_key
        if not self.compression_pipeline.is_lossy() or require_lossless:
            new_tags = change_tags(tags, add_field="compressed")
        else:
            new_tags = change_tags(tags, add_field="lossy_compressed")
        return TensorKey(tensor_name, origin, round_number, report, new_tags), compressed_nparray, metadata

    def decompress(
        self,
        tensor_key: TensorKey,
        data: Any,
        transformer_metadata: list[dict],
        require_lossless: bool = False,
        **kwargs: Any,
    ) -> tuple[TensorKey, Any]:
        """Decompress ``data``; ``lossy_compressed`` becomes ``lossy_decompressed``, ``compressed`` is dropped."""
        tensor_name, origin, round_number, report, tags = tensor_key
        if not transformer_metadata:
            raise InvalidInputError("metadata must be included for decompression")
        if "compressed" not in tags and "lossy_compressed" not in tags:
            raise TensorTagError("Cannot decompress an uncompressed tensor")
        if require_lossless and "compressed" not in tags:
            raise TensorTagError("Cannot losslessly decompress lossy tensor")
        if require_lossless or "compressed" in tags:
            decompressed_nparray = self.lossless_pipeline.backward(data, transformer_metadata, **kwargs)
        else:
            decompressed_nparray = self.compression_pipeline.backward(data, transformer_metadata, **kwargs)
        if "lossy_compressed" in tags:
            new_tags = change_tags(tags, add_field="lossy_decompressed", remove_field="lossy_compressed")
        else:
            new_tags = change_tags(tags, remove_field="compressed")
        return TensorKey(tensor_name, origin, round_number, report, new_tags), decompressed_nparray

    @staticmethod
    def generate_delta(tensor_key: TensorKey, nparray: Any, base_model_nparray: Any) -> tuple[TensorKey, Any]:
        """``nparray - base_model_nparray`` (NumPy, CuPy or torch, on their device); the key gains ``delta``."""
        tensor_name, origin, round_number, report, tags = tensor_key
        if not np.isscalar(nparray) and tuple(nparray.shape) != tuple(base_model_nparray.shape):
            raise InvalidInputError(
                f"Shape of updated layer ({tuple(nparray.shape)}) is not equal to base layer "
                f"shape of ({tuple(base_model_nparray.shape)})"
            )
        if "model" in tags:
            raise TensorTagError("The tensorkey should be provided from the layer with new weights, not the base model")
        new_tags = change_tags(tags, add_field="delta")
        return TensorKey(tensor_name, origin, round_number, report, new_tags), nparray - base_model_nparray

    @staticmethod
    def apply_delta(
        tensor_key: TensorKey, delta: Any, base_model_nparray: Any, creates_model: bool = False
    ) -> tuple[TensorKey, Any]:
        """``base_model_nparray + delta``; the key loses ``delta`` at the aggregator, else becomes ``("model",)``."""
        tensor_name, origin, round_number, report, tags = tensor_key
        if not np.isscalar(base_model_nparray) and tuple(delta.shape) != tuple(base_model_nparray.shape):
            raise InvalidInputError(
                f"Shape of delta ({tuple(delta.shape)}) is not equal to shape of model layer "
                f"({tuple(base_model_nparray.shape)})"
            )
        if "aggregator" in origin and not creates_model:
            new_tags = change_tags(tags, remove_field="delta")
            new_key = TensorKey(tensor_name, origin, round_number, report, new_tags)
        else:
            new_key = TensorKey(tensor_name, origin, round_number, report, ("model",))
        return new_key, base_model_nparray + delta

    def find_dependencies(self, tensor_key: TensorKey, send_model_deltas: bool) -> list[TensorKey]:
        """The tensors needed to build ``tensor_key``: for a model tensor of round >= 1 sent as deltas, the
        previous round's model and this round's aggregated (compressed) delta.

        >>> deps = TensorCodec(GpuCodecPipeline(fraction=0.1)).find_dependencies(
        ...     TensorKey("w", "aggregator_x", 2, False, ("model",)), send_model_deltas=True)
        >>> [(k.round_number, k.tags) for k in deps]
        [(1, ('model',)), (2, ('aggregated', 'delta', 'lossy_compressed'))]
        """
        tensor_key_dependencies = []
        tensor_name, origin, round_number, report, tags = tensor_key
        if "model" in tags and send_model_deltas and round_number >= 1:
            # the new model is the previous model plus this round's aggregated delta
            tensor_key_dependencies.append(TensorKey(tensor_name, origin, round_number - 1, report, tags))
            if self.compression_pipeline.is_lossy():
                new_tags: tuple[str, ...] = ("aggregated", "delta", "lossy_compressed")
            else:
                new_tags = ("aggregated", "delta", "compressed")
            tensor_key_dependencies.append(TensorKey(tensor_name, origin, round_number, report, new_tags))
        return tensor_key_dependencies
