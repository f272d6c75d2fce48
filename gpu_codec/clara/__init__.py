"""Clara Train 3.1 federated-learning components (``fed_learn.components``), on the gpu_codec engine.

A re-creation, on purpose: Clara Train 3.1 was distributed as NVIDIA's Clara Train SDK container image, not as a
package that installs with pip, and its federated-learning part lives on as NVIDIA FLARE, which
:mod:`gpu_codec.nvflare` builds on with FLARE's own types. What follows mirrors Clara Train 3.1's documented
``fed_learn.components`` API (class names, constructor arguments and method signatures; a test checks each
signature), with the gpu_codec engine doing the work.

Someone arriving from Clara Train 3.1 finds its processor model:

* a data context (:class:`DataContext`, alias ``FLContext``) holding the model (name -> tensor, left where it
  lives: GPU tensors stay on the GPU) and its metadata, and an app context (:class:`AppContext`, alias
  ``ApplicationContext``) holding the round, phase, task and the global model of the round;
* :class:`DataProcessor` with ``process(data_ctx, app_ctx)`` and ``abort(app_ctx)``;
* :class:`DataCompressor` / :class:`DataDeCompressor`: the model (or its delta against the app context's global
  model) replaced in the data context by a :class:`~gpu_codec.Payload`, which stays on the device until it is
  serialized for sending, and back;
* :class:`ModelEncryptor` / :class:`ModelDecryptor`: AES-GCM (``cryptography``, 16/24/32-byte keys) over the
  serialized payload, the key given as bytes or read from a file or an environment variable named in the config.
  The round (or other app-context values, ``bind``) is authenticated with it: a tampered, wrongly keyed or
  replayed model raises :class:`DecryptionError` and is never decoded;
* :class:`ProcessorChain`: ``pre_processors`` run in order on the way out, ``post_processors`` in reverse on the
  way in (list each post-processor beside the pre-processor it undoes); an abort or an error leaves the data
  context as it was before the chain ran;
* the model processors: :class:`ModelProcessor` (the contract: ``initialize(fitter)``, ``apply_model``,
  ``extract_model``, ``get_local_models``), :class:`DictModelReaderWriter` and :class:`PTModelReaderWriter`;
* :class:`ModelSaver` and :class:`PTModelSaver` (torch checkpoints, read back with ``weights_only=True``),
  :class:`ModelEvaluator`, :class:`ModelValidator`, :class:`ModelVisualizer` and
  :class:`TensorboardModelVisualizer` (model-diff histograms for TensorBoard);
* :class:`MetricManager` (a 2-level metric map, encoded into one level for metadata), the metadata generators
  :class:`MetadataGenerator`, :class:`IteratorNumberGenerator`, :class:`BestMetricGenerator`,
  :class:`InitialValidationMetricGenerator`, and :class:`RoundRobinClientFieldProcessor` /
  :class:`RoundRobinClientStateProcessor`.

The modules, by concern: ``context`` (contexts, errors), ``processors``, ``encryption``, ``metadata``,
``round_robin``, ``chain`` (chains, configs, serialization), ``reader_writers``, ``metrics``, ``savers``,
``evaluation``, ``visualizers``. :mod:`gpu_codec.nvflare` runs these processors as NVIDIA FLARE filters.

TensorFlow 1.x components (``TFModelReaderWriter``, ``TFModelSaver``, ``TFKerasV1ModelSaver``,
``TFModelValidator``) are not provided: TensorFlow 1.x has had no release since 2021 and does not install on
the Python versions gpu_codec supports, and its sessions and graph collections have no counterpart in
TensorFlow 2; PyTorch or framework-free equivalents cover each of them.

Compression must run before encryption (compressing ciphertext gains nothing); a chain in the other order is
refused with :class:`ProcessorOrderError`. A lone :class:`ModelEncryptor` encrypts the whole model losslessly.

>>> import numpy as np
>>> chain = ProcessorChain.from_config({"pre_processors": [
...     {"name": "IteratorNumberGenerator", "args": {"field": "n_iter"}},
...     {"name": "DataCompressor", "args": {"fraction": 0.5}}]})
>>> glob = {"w": np.zeros(4, np.float32)}
>>> ctx = DataContext(model={"w": np.array([0.0, 3.0, -1.0, 8.0], np.float32)})
>>> app = AppContext(round_number=2, global_model=glob, n_iter=120)
>>> blob = serialize(chain.process_outgoing(ctx, app))            # where it leaves the device
>>> server = deserialize(blob)
>>> _ = chain.process_incoming(server, app)
>>> server.get_model()["w"].tolist(), server.get_metadata("n_iter")
([0.0, 3.0, 0.0, 8.0], 120)
"""

from __future__ import annotations

from .chain import PROCESSORS, ProcessorChain, build_processor, deserialize, serialize
from .context import (
    CLARA_KEY,
    CLARA_META_KEY,
    ENVELOPE_MAGIC,
    AppContext,
    ApplicationContext,
    ClaraError,
    DataContext,
    DecryptionError,
    EncryptionKeyError,
    FLContext,
    MetricsError,
    ProcessingAbortedError,
    ProcessorOrderError,
)
from .encryption import KEY_SIZES, KeyFilePermissionWarning, ModelDecryptor, ModelEncryptor
from .evaluation import ModelEvaluator, ModelValidator
from .metadata import BestMetricGenerator, InitialValidationMetricGenerator, IteratorNumberGenerator, MetadataGenerator
from .metrics import MetricManager
from .processors import DataCompressor, DataDeCompressor, DataProcessor
from .reader_writers import DictModelReaderWriter, ModelProcessor, PTModelReaderWriter
from .round_robin import RoundRobinClientFieldProcessor, RoundRobinClientStateProcessor
from .savers import ModelSaver, PTModelSaver
from .visualizers import ModelVisualizer, TensorboardModelVisualizer

__all__ = [
    "CLARA_KEY",
    "CLARA_META_KEY",
    "ENVELOPE_MAGIC",
    "KEY_SIZES",
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
    "KeyFilePermissionWarning",
    "MetadataGenerator",
    "MetricManager",
    "MetricsError",
    "ModelDecryptor",
    "ModelEncryptor",
    "ModelEvaluator",
    "ModelProcessor",
    "ModelSaver",
    "ModelValidator",
    "ModelVisualizer",
    "PTModelReaderWriter",
    "PTModelSaver",
    "ProcessingAbortedError",
    "ProcessorChain",
    "ProcessorOrderError",
    "RoundRobinClientFieldProcessor",
    "RoundRobinClientStateProcessor",
    "TensorboardModelVisualizer",
    "build_processor",
    "deserialize",
    "serialize",
]
