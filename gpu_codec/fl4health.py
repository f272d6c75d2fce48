"""fl4health's parameter packers, sparse COO exchanger and score functions, on the gpu_codec engine.

A re-creation, on purpose: every fl4health release (0.1.0 to 0.4.2) requires Python < 3.11, so on Python 3.11
and later (gpu_codec supports 3.10 on) there is no fl4health to build on. The classes follow fl4health's
published source, ``fl4health/parameter_exchange/`` (``parameter_packer.py``, ``sparse_coo_parameter_exchanger.py``,
``parameter_selection_criteria.py``, ``parameter_exchanger_base.py``, ``partial_parameter_exchanger.py``), from
after ``ParameterPackerFedProx`` was renamed ``ParameterPackerAdaptiveConstraint`` (the release they were taken
from is not recorded); the packed layouts are what make the two interoperate, and the tests check them.

Someone arriving from fl4health (``fl4health.parameter_exchange``) finds the same classes, methods and packed
layouts here, so a stock fl4health peer reads what we send and we read what it sends:

* :class:`ParameterPacker` and every packer of fl4health: :class:`ParameterPackerWithControlVariates`,
  :class:`ParameterPackerWithClippingBit`, :class:`ParameterPackerAdaptiveConstraint` (formerly
  ``ParameterPackerFedProx``), :class:`ParameterPackerWithLayerNames` and :class:`SparseCooParameterPacker`
  (with ``extract_coo_info_from_dense``). Each packed list is exactly fl4health's; the sparse COO one is
  ``[values_1..n, indices_1..n, shapes_1..n, names]`` where ``values_i`` is 1-D in the tensor's dtype,
  ``indices_i`` is int64 of shape ``(nnz_i, ndim_i)`` (``torch.nonzero`` order), ``shapes_i`` is a 1-D int64
  array and ``names`` is one NumPy unicode array of the tensor names.
* :class:`SparseCooParameterExchanger` with ``generate_parameter_scores``, ``select_parameters``,
  ``push_parameters`` and ``pull_parameters`` on torch ``nn.Module`` (CPU or CUDA), and the six score functions
  (:func:`largest_final_magnitude_scores` ...) with fl4health's signature ``(model, initial_model)``.
* :class:`CompactSparseExchanger`: the same selection, sent as one gpu_codec payload (a uint8 array) instead of
  fl4health's 12 to 36 bytes per entry.

Selection runs on the engine (:func:`gpu_codec.compress` with ``fraction=sparsity_level``, ``scope="global"``):
on the GPU for CUDA models, with only the kept entries copied to the host. The six score functions are mapped to
the engine's built-in criteria (scores computed inside the kernel, never materialized); any other score function
is called and its scores handed to the engine. Differences from fl4health, on purpose:

* exactly ``k = ceil(sparsity_level x N)`` entries are kept (``N`` counted over tensors with at least one
  dimension; ``k`` from the decimal value written, so ``0.07 x 100`` keeps 7). fl4health keeps every entry whose
  score ties the k-th (more than k), and computes k in binary floating point (``0.07 x 100`` keeps 8);
* a kept entry whose value is exactly 0 is sent (fl4health drops it, and a tensor whose kept values are all 0);
* scores are compared in fp32 (as the kernels compute them), so fp64 scores that differ only beyond fp32
  precision tie, broken by tensor order then lowest index;
* 0-d tensors take no part (fl4health scores them but never sends them); integer buffers (BatchNorm's
  ``num_batches_tracked``) are scored as float64 and sent in their own dtype; bfloat16 values travel as float32
  (NumPy has no bfloat16; fl4health raises there).

``fl4health_compat=True`` reproduces fl4health's own selection exactly (its threshold, its ties, its zeros), with
torch operations on the model's device. :meth:`SparseCooParameterExchanger.pull_parameters` decodes through the
engine's scatter, which checks every index; it accepts entries in any order but rejects repeated ones (fl4health
would sum them). As in fl4health, a pulled tensor is replaced by its sparse values (zeros elsewhere).

>>> import numpy as np, torch
>>> model = torch.nn.Linear(3, 2)
>>> with torch.no_grad():
...     _ = model.weight.copy_(torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])); _ = model.bias.zero_()
>>> ex = SparseCooParameterExchanger(0.25, largest_final_magnitude_scores)   # k = ceil(0.25 x 8) = 2
>>> packed = ex.push_parameters(model)
>>> [a.tolist() for a in packed]
[[-5.0, 3.0], [[0, 1], [1, 0]], [2, 3], ['weight']]
>>> fresh = torch.nn.Linear(3, 2)
>>> ex.pull_parameters(packed, fresh)
>>> fresh.weight.tolist()                    # "bias" was not sent: it keeps its own values
[[0.0, -5.0, 0.0], [3.0, 0.0, 0.0]]
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import numpy as np

from . import adapt
from . import engine as _engine
from .codecs import Pipeline
from .errors import InvalidInputError, PayloadError, PayloadIndexError

__all__ = [
    "CompactSparseExchanger",
    "PackedLayoutError",
    "ParameterExchanger",
    "ParameterPacker",
    "ParameterPackerAdaptiveConstraint",
    "ParameterPackerFedProx",
    "ParameterPackerWithClippingBit",
    "ParameterPackerWithControlVariates",
    "ParameterPackerWithLayerNames",
    "PartialParameterExchanger",
    "ScoreGenFunction",
    "SparseCooParameterExchanger",
    "SparseCooParameterPacker",
    "largest_final_magnitude_scores",
    "largest_increase_in_magnitude_scores",
    "largest_magnitude_change_scores",
    "smallest_final_magnitude_scores",
    "smallest_increase_in_magnitude_scores",
    "smallest_magnitude_change_scores",
]

logger = logging.getLogger("gpu_codec.fl4health")

T = TypeVar("T")
NDArray = np.ndarray
NDArrays = list  # list[np.ndarray], as flwr.common.typing.NDArrays
ScoreGenFunction = Callable[[Any, Any], Mapping[str, Any]]

COMPACT_MARKER = "gpu_codec.fl4health"


class PackedLayoutError(PayloadError):
    """A packed parameter list that does not follow the packer's layout (count, shapes, dtypes, names)."""


# ---------------------------------------------------------------- packers (fl4health's layouts, exactly)


class ParameterPacker(ABC, Generic[T]):
    """Packs model weights with additional parameters into one flat list of NumPy arrays, and back."""

    @abstractmethod
    def pack_parameters(self, model_weights: NDArrays, additional_parameters: T) -> NDArrays:
        raise NotImplementedError

    @abstractmethod
    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, T]:
        raise NotImplementedError


class ParameterPackerWithControlVariates(ParameterPacker[NDArrays]):
    """SCAFFOLD: model weights followed by control variates; ``size_of_model_params`` splits them.

    >>> p = ParameterPackerWithControlVariates(1)
    >>> p.unpack_parameters(p.pack_parameters([np.ones(2)], [np.zeros(3)]))
    ([array([1., 1.])], [array([0., 0., 0.])])
    """

    def __init__(self, size_of_model_params: int) -> None:
        self.size_of_model_params = size_of_model_params
        super().__init__()

    def pack_parameters(self, model_weights: NDArrays, additional_parameters: NDArrays) -> NDArrays:
        return model_weights + additional_parameters

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, NDArrays]:
        _need(
            len(packed_parameters) >= self.size_of_model_params,
            f"a control-variates packing holds at least the model's {self.size_of_model_params} arrays",
        )
        return packed_parameters[: self.size_of_model_params], packed_parameters[self.size_of_model_params :]


class ParameterPackerWithClippingBit(ParameterPacker[float]):
    """Model weights followed by a 0-d float64 array holding the clipping bound.

    >>> p = ParameterPackerWithClippingBit()
    >>> p.unpack_parameters(p.pack_parameters([np.ones(1)], 0.5))
    ([array([1.])], 0.5)
    """

    def pack_parameters(self, model_weights: NDArrays, additional_parameters: float) -> NDArrays:
        return model_weights + [np.array(additional_parameters)]

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, float]:
        _need(len(packed_parameters) >= 1, "a clipping-bit packing holds at least the clipping bound")
        split_size = len(packed_parameters) - 1
        return packed_parameters[:split_size], _scalar(packed_parameters[split_size], "clipping bound")


class ParameterPackerAdaptiveConstraint(ParameterPacker[float]):
    """Model weights followed by a 0-d array holding the adaptive constraint variable (FedProx's mu, Ditto ...)."""

    def pack_parameters(self, model_weights: NDArrays, extra_adaptive_variable: float) -> NDArrays:
        return model_weights + [np.array(extra_adaptive_variable)]

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, float]:
        _need(len(packed_parameters) >= 1, "an adaptive-constraint packing holds at least the constraint variable")
        split_size = len(packed_parameters) - 1
        return packed_parameters[:split_size], float(_scalar(packed_parameters[split_size], "constraint variable"))


ParameterPackerFedProx = ParameterPackerAdaptiveConstraint  # fl4health's former name


class ParameterPackerWithLayerNames(ParameterPacker[list]):
    """Model weights followed by one NumPy unicode array of their layer names.

    >>> p = ParameterPackerWithLayerNames()
    >>> packed = p.pack_parameters([np.ones(1)], ["fc.weight"])
    >>> packed[-1].dtype, p.unpack_parameters(packed)[1]
    (dtype('<U9'), ['fc.weight'])
    """

    def pack_parameters(self, model_weights: NDArrays, weights_names: list[str]) -> NDArrays:
        return model_weights + [np.array(weights_names)]

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, list[str]]:
        _need(len(packed_parameters) >= 1, "a layer-names packing holds at least the names array")
        split_size = len(packed_parameters) - 1
        names = _names(packed_parameters[split_size])
        _need(len(names) == split_size, f"a layer-names packing has {len(names)} names for {split_size} arrays")
        return packed_parameters[:split_size], names


def _scalar(packed: Any, what: str) -> float | int:
    """The one finite real number a packing's last array holds (fl4health packs it as a 0-d array); a
    PackedLayoutError otherwise (a string, an object, NaN, several values).

    >>> _scalar(np.array(0.5), "bound"), _scalar(np.array([3]), "bound")
    (0.5, 3)
    """
    ok = isinstance(packed, (np.ndarray, np.generic)) and packed.size == 1 and packed.dtype.kind in "iuf"
    value = packed.reshape(-1)[0].item() if ok else None
    _need(ok and math.isfinite(value), f"the {what} must be one finite number in a NumPy array")
    return value


def _names(packed: Any) -> list[str]:
    """The names array of a packing as a list of str (one name packs as a 0-d array); PackedLayoutError where it
    is not an array of strings."""
    names = packed.tolist() if isinstance(packed, np.ndarray) else None
    if isinstance(names, str):
        names = [names]
    _need(
        isinstance(names, list) and all(isinstance(n, str) for n in names),
        f"the packing's last array holds the tensor names, got {getattr(packed, 'dtype', type(packed).__name__)}",
    )
    return names


class SparseCooParameterPacker(ParameterPacker[tuple]):
    """Sparse COO tensors: ``values..., indices..., shapes..., names`` (see the module docstring).

    >>> import torch
    >>> vals, idx, shape = SparseCooParameterPacker.extract_coo_info_from_dense(torch.tensor([[0., 2.], [3., 0.]]))
    >>> vals.tolist(), idx.tolist(), shape.tolist(), idx.dtype, shape.dtype
    ([2.0, 3.0], [[0, 1], [1, 0]], [2, 2], dtype('int64'), dtype('int64'))
    """

    def pack_parameters(self, model_parameters: NDArrays, additional_parameters: tuple) -> NDArrays:
        parameter_indices, tensor_shapes, tensor_names = additional_parameters
        return model_parameters + parameter_indices + tensor_shapes + [np.array(tensor_names)]

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, tuple]:
        _need(
            len(packed_parameters) % 3 == 1,
            f"a sparse COO packing holds 3n + 1 arrays (values, indices, shapes, names), got {len(packed_parameters)}",
        )
        split_size = (len(packed_parameters) - 1) // 3
        model_parameters = packed_parameters[:split_size]
        parameter_indices = packed_parameters[split_size : (2 * split_size)]
        tensor_shapes = packed_parameters[(2 * split_size) : (3 * split_size)]
        tensor_names = _names(packed_parameters[3 * split_size])
        return model_parameters, (parameter_indices, tensor_shapes, tensor_names)

    @staticmethod
    def extract_coo_info_from_dense(x: Any) -> tuple[NDArray, NDArray, NDArray]:
        """The nonzero values of ``x``, their indices ``(nnz, ndim)`` (int64) and ``x``'s shape, as NumPy arrays.

        bfloat16 values come back as float32 (NumPy has no bfloat16).
        """
        import torch

        x = _as_torch(x)
        selected_parameters = x[torch.nonzero(x, as_tuple=True)]
        if selected_parameters.dtype == torch.bfloat16:
            selected_parameters = selected_parameters.float()
        selected_indices = torch.nonzero(x, as_tuple=False).cpu().numpy()
        tensor_shape = np.array(list(x.shape))
        return selected_parameters.cpu().numpy(), selected_indices, tensor_shape


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise PackedLayoutError(msg)


def _as_torch(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x
    return adapt.backend_to_torch(x if type(x).__module__.startswith("cupy") else np.asarray(x))


# ---------------------------------------------------------------- score functions (fl4health's, exactly)


def largest_final_magnitude_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``|w|`` for every tensor of ``model.state_dict()``."""
    import torch

    return {name: torch.abs(v) for name, v in model.state_dict().items()}


def smallest_final_magnitude_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``-|w|``."""
    import torch

    return {name: (-1) * torch.abs(v) for name, v in model.state_dict().items()}


def _initial_states(model: Any, initial_model: Any | None, fn: str) -> tuple[dict, dict]:
    if initial_model is None:
        raise InvalidInputError(f"{fn} compares against the initial model: initial_model must not be None")
    return model.state_dict(), initial_model.state_dict()


def largest_magnitude_change_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``|w - w0|``."""
    import torch

    cur, init = _initial_states(model, initial_model, "largest_magnitude_change_scores")
    return {name: torch.abs(v - init[name]) for name, v in cur.items()}


def smallest_magnitude_change_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``-|w - w0|``."""
    import torch

    cur, init = _initial_states(model, initial_model, "smallest_magnitude_change_scores")
    return {name: (-1) * torch.abs(v - init[name]) for name, v in cur.items()}


def largest_increase_in_magnitude_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``|w| - |w0|``."""
    import torch

    cur, init = _initial_states(model, initial_model, "largest_increase_in_magnitude_scores")
    return {name: torch.abs(v) - torch.abs(init[name]) for name, v in cur.items()}


def smallest_increase_in_magnitude_scores(model: Any, initial_model: Any | None) -> dict[str, Any]:
    """``-(|w| - |w0|)``."""
    import torch

    cur, init = _initial_states(model, initial_model, "smallest_increase_in_magnitude_scores")
    return {name: (-1) * (torch.abs(v) - torch.abs(init[name])) for name, v in cur.items()}


# Score function name -> engine criterion (kernel-computed). fl4health's own functions map by name too.
_CRITERIA = {
    "largest_final_magnitude_scores": "largest_final_magnitude",
    "smallest_final_magnitude_scores": "smallest_final_magnitude",
    "largest_magnitude_change_scores": "largest_magnitude_change",
    "smallest_magnitude_change_scores": "smallest_magnitude_change",
    "largest_increase_in_magnitude_scores": "largest_increase_in_magnitude",
    "smallest_increase_in_magnitude_scores": "smallest_increase_in_magnitude",
}
_OWN_SCORE_FNS = {
    f.__name__: f
    for f in (
        largest_final_magnitude_scores,
        smallest_final_magnitude_scores,
        largest_magnitude_change_scores,
        smallest_magnitude_change_scores,
        largest_increase_in_magnitude_scores,
        smallest_increase_in_magnitude_scores,
    )
}


def _engine_criterion(fn: Any) -> str | None:
    name = getattr(fn, "__name__", None)
    if name not in _CRITERIA:
        return None
    if _OWN_SCORE_FNS.get(name) is fn:
        return _CRITERIA[name]
    if (getattr(fn, "__module__", "") or "").startswith("fl4health."):
        return _CRITERIA[name]
    return None


# ---------------------------------------------------------------- exchangers


class ParameterExchanger(ABC):
    """fl4health's exchanger contract: what a client sends (push) and how it loads what it receives (pull)."""

    @abstractmethod
    def push_parameters(self, model: Any, initial_model: Any | None = None, config: Any = None) -> NDArrays:
        raise NotImplementedError

    @abstractmethod
    def pull_parameters(self, parameters: NDArrays, model: Any, config: Any = None) -> None:
        raise NotImplementedError


class PartialParameterExchanger(ParameterExchanger, Generic[T]):
    """An exchanger that sends a selection of the parameters, packed with a :class:`ParameterPacker`."""

    def __init__(self, parameter_packer: ParameterPacker[T]) -> None:
        super().__init__()
        self.parameter_packer = parameter_packer

    def pack_parameters(self, model_weights: NDArrays, additional_parameters: T) -> NDArrays:
        return self.parameter_packer.pack_parameters(model_weights, additional_parameters)

    def unpack_parameters(self, packed_parameters: NDArrays) -> tuple[NDArrays, T]:
        return self.parameter_packer.unpack_parameters(packed_parameters)

    @abstractmethod
    def select_parameters(self, model: Any, initial_model: Any | None = None) -> tuple[NDArrays, T]:
        raise NotImplementedError


def _floating(t: Any) -> Any:
    import torch

    return t if t.is_floating_point() else t.to(torch.float64)


def _check_sparsity(sparsity_level: Any) -> float:
    return _engine.check_fraction(sparsity_level, "sparsity_level")


class _EngineSelection:
    """Shared by both exchangers: the engine's exact top-k over a model, and the kept entries' model values."""

    sparsity_level: float
    score_gen_function: ScoreGenFunction

    def generate_parameter_scores(self, model: Any, initial_model: Any | None) -> dict[str, Any]:
        """Calling the score generating function to produce parameter scores."""
        return self.score_gen_function(model, initial_model)

    def _engine_select(self, model: Any, initial_model: Any | None) -> tuple[dict, Any]:
        state = model.state_dict()
        crit = _engine_criterion(self.score_gen_function)
        if crit is not None:
            needs_base = crit not in ("largest_final_magnitude", "smallest_final_magnitude")
            names = [n for n, t in state.items() if t.dim() > 0]
            base = None
            if needs_base:
                _, init = _initial_states(model, initial_model, self.score_gen_function.__name__)
                missing = [n for n in names if n not in init]
                if missing:
                    raise InvalidInputError(f"the initial model lacks tensors {missing[:5]}")
                base = {n: _floating(init[n]) for n in names}
            update = {n: _floating(state[n]) for n in names}
            score: Any = crit
        else:
            scores = self.generate_parameter_scores(model, initial_model)
            if not isinstance(scores, Mapping):
                raise InvalidInputError(
                    f"the score function must return a dict name -> scores, got {type(scores).__name__}"
                )
            names = []
            for n, s in scores.items():
                if n not in state:
                    raise InvalidInputError(f"the score function scored {n!r}, which is not in the model's state_dict")
                if tuple(s.shape) != tuple(state[n].shape):
                    raise InvalidInputError(
                        f"tensor {n!r}: scores have shape {tuple(s.shape)}, the tensor has {tuple(state[n].shape)}"
                    )
                if s.dim() > 0:
                    names.append(n)
            update = {n: _floating(state[n]) for n in names}
            fscores = {n: _floating(scores[n]) for n in names}
            base = None

            def score(_update: Any, _base: Any) -> dict:
                return fscores

        if not names:
            raise InvalidInputError("the model has no tensor with at least one dimension to select from")
        payload = adapt.engine_compress(update, base, fraction=self.sparsity_level, scope="global", score=score)
        return state, payload

    @staticmethod
    def _kept(state: dict, payload: Any):
        """(record, tensor, kept flat indices as torch int64 on the tensor's device) for tensors with entries."""
        for rec in payload.tensors:
            if rec.nnz == 0:
                continue
            t = state[rec.name]
            idx = adapt.backend_to_torch(rec.buffers["indices"].astype(np.int64), t.device)
            yield rec, t, idx


class SparseCooParameterExchanger(_EngineSelection, PartialParameterExchanger[tuple]):
    """fl4health's sparse COO exchanger: send the ``sparsity_level`` share of a model's entries with the highest
    scores, in :class:`SparseCooParameterPacker`'s layout.

    Parameters
    ----------
    sparsity_level
        Share of entries sent, in (0, 1].
    score_gen_function
        ``f(model, initial_model) -> {name: scores}``; the six functions of this module (or fl4health's own) run
        as kernel criteria.
    fl4health_compat
        Reproduce fl4health's selection exactly (threshold on the k-th score, every tie kept, zeros dropped)
        instead of the engine's exact top-k.
    """

    def __init__(
        self, sparsity_level: float, score_gen_function: ScoreGenFunction, *, fl4health_compat: bool = False
    ) -> None:
        self.sparsity_level = _check_sparsity(sparsity_level)
        self.parameter_packer: SparseCooParameterPacker = SparseCooParameterPacker()
        self.score_gen_function = score_gen_function
        self.fl4health_compat = bool(fl4health_compat)

    def _check_unique_score(self, param_scores: Any) -> None:
        import torch

        if len(torch.unique(input=param_scores, sorted=False, return_inverse=False, return_counts=False)) == 1:
            logger.warning(
                "All parameters have the same score. The number of parameters selected may not match "
                "the intended sparsity level."
            )

    def select_parameters(self, model: Any, initial_model: Any | None = None) -> tuple[NDArrays, tuple]:
        """The selected values and ``(indices, shapes, names)``, as :class:`SparseCooParameterPacker` packs them."""
        if self.fl4health_compat:
            return self._fl4health_select(model, initial_model)
        state, payload = self._engine_select(model, initial_model)
        values, indices, shapes, names = [], [], [], []
        import torch

        for rec, t, idx in self._kept(state, payload):
            v = t.reshape(-1)[idx]
            if v.dtype == torch.bfloat16:
                v = v.float()
            coords = _unravel(idx, tuple(t.shape))
            values.append(v.cpu().numpy())
            indices.append(coords.cpu().numpy())
            shapes.append(np.array(list(t.shape)))
            names.append(rec.name)
        logger.info("Sparsity level used to select parameters for exchange: %s", self.sparsity_level)
        return values, (indices, shapes, names)

    def _fl4health_select(self, model: Any, initial_model: Any | None) -> tuple[NDArrays, tuple]:
        """fl4health's ``select_parameters``, operation for operation."""
        import torch

        all_parameter_scores = self.generate_parameter_scores(model, initial_model)
        all_scores = torch.cat([val.flatten() for _, val in all_parameter_scores.items()])
        sorted_scores, _ = torch.sort(all_scores, descending=True)
        n_top_scores = math.ceil(len(sorted_scores) * self.sparsity_level)
        if n_top_scores < 1:
            raise InvalidInputError("the model has no entries to select from")
        score_threshold = sorted_scores[(n_top_scores - 1)].item()
        values, indices, shapes, names = [], [], [], []
        model_states = model.state_dict()
        for tensor_name, param_scores in all_parameter_scores.items():
            model_tensor = model_states[tensor_name]
            if model_tensor.shape != param_scores.shape:
                raise InvalidInputError(
                    f"tensor {tensor_name!r}: scores have shape {tuple(param_scores.shape)}, "
                    f"the tensor has {tuple(model_tensor.shape)}"
                )
            self._check_unique_score(param_scores=param_scores)
            model_tensor_sparse = torch.where(param_scores >= score_threshold, model_tensor, 0)
            if not (model_tensor_sparse.shape == torch.Size([]) or (model_tensor_sparse == 0).all()):
                v, i, s = self.parameter_packer.extract_coo_info_from_dense(model_tensor_sparse)
                values.append(v)
                indices.append(i)
                shapes.append(s)
                names.append(tensor_name)
        logger.info("Sparsity level used to select parameters for exchange: %s", self.sparsity_level)
        return values, (indices, shapes, names)

    def push_parameters(self, model: Any, initial_model: Any | None = None, config: Any = None) -> NDArrays:
        selected_parameters, additional_parameters = self.select_parameters(model, initial_model)
        return self.pack_parameters(model_weights=selected_parameters, additional_parameters=additional_parameters)

    def pull_parameters(self, parameters: NDArrays, model: Any, config: Any = None) -> None:
        """Load a sparse COO packing into ``model``: each named tensor becomes its sent values, zeros elsewhere.

        All entries are checked (in range, not repeated) before anything is loaded; a bad packing raises a
        :class:`~gpu_codec.errors.PayloadError` and leaves the model untouched.
        """
        selected_parameters, (indices, shapes, names) = self.parameter_packer.unpack_parameters(parameters)
        _need(
            len(selected_parameters) == len(indices) == len(shapes) == len(names) and len(names) > 0,
            f"a sparse COO packing needs as many values, indices and shapes arrays as names, got "
            f"{len(selected_parameters)}, {len(indices)}, {len(shapes)} and {len(names)} names",
        )
        _load_sparse(model, names, selected_parameters, indices, shapes)


def _load_sparse(model: Any, names: list, values: list, indices: list, shapes: list) -> None:
    import torch

    state = model.state_dict()
    entries, bases, seen = {}, {}, set()
    for v, ind, shp, name in zip(values, indices, shapes, names):
        _need(isinstance(name, str) and name in state, f"tensor {name!r} is not in the model's state_dict")
        _need(name not in seen, f"tensor {name!r} appears twice")
        seen.add(name)
        t = state[name]
        shape = tuple(int(s) for s in t.shape)
        shp, ind, v = np.asarray(shp), np.asarray(ind), np.asarray(v)
        _need(
            shp.ndim == 1 and shp.dtype.kind in "iu" and tuple(shp.tolist()) == shape,
            f"tensor {name!r}: shape {shp.tolist()} differs from the model's {list(shape)}",
        )
        _need(
            v.ndim == 1 and v.dtype.kind in "fiub",
            f"tensor {name!r}: values must be a 1-D numeric array, got {v.dtype}{list(v.shape)}",
        )
        nnz = v.shape[0]
        _need(
            ind.ndim == 2 and ind.shape == (nnz, len(shape)) and (nnz == 0 or ind.dtype.kind in "iu"),
            f"tensor {name!r}: indices must be an integer array of shape ({nnz}, {len(shape)}), got "
            f"{ind.dtype}{list(ind.shape)}",
        )
        try:
            flat = (
                np.ravel_multi_index(tuple(ind.T.astype(np.int64)), shape) if shape and nnz else np.zeros(nnz, np.int64)
            )
        except ValueError:
            raise PayloadIndexError(
                f"tensor {name!r}: a sparse index is out of range for shape {list(shape)}; nothing was loaded"
            ) from None
        order = np.argsort(flat, kind="stable")  # fl4health accepts any order; the engine wants ascending
        flat = flat[order]
        if nnz > 1 and bool(np.any(flat[1:] == flat[:-1])):
            raise PayloadIndexError(f"tensor {name!r}: a sparse index appears twice; nothing was loaded")
        logical = _logical_dtype(t.dtype)
        entries[name] = _engine.SparseEntries(flat, v[order].astype(np.float64), shape, logical)
        bases[name] = torch.zeros(shape, dtype=t.dtype if t.is_floating_point() else torch.float64, device=t.device)
    try:
        payload = _engine.encode_coo(entries)
    except InvalidInputError as e:
        raise PayloadError(f"{e}; nothing was loaded") from None
    dense = _engine.decompress(payload, base=bases)
    for name, d in dense.items():
        state[name] = d if d.dtype == state[name].dtype else d.to(state[name].dtype)
    model.load_state_dict(state, strict=True)


class CompactSparseExchanger(_EngineSelection, ParameterExchanger):
    """The selection of :class:`SparseCooParameterExchanger` (engine mode), sent as one gpu_codec payload.

    ``push_parameters`` returns ``[payload]``: a single 1-D uint8 array (the wire format of
    :meth:`gpu_codec.Payload.to_bytes`, flat uint32 indices and fp32 values: 8 bytes per entry plus a header)
    instead of fl4health's 4-byte value + 8 x ndim index bytes per entry. ``pull_parameters`` checks the payload
    completely and loads it with fl4health's semantics (each sent tensor becomes its values, zeros elsewhere).
    Both ends must use this class: a stock fl4health peer cannot read it.

    >>> import torch
    >>> model = torch.nn.Linear(1000, 100)
    >>> ex = CompactSparseExchanger(0.1, largest_final_magnitude_scores)
    >>> (blob,) = ex.push_parameters(model)
    >>> coo = SparseCooParameterExchanger(0.1, largest_final_magnitude_scores).push_parameters(model)
    >>> blob.dtype, blob.nbytes < sum(a.nbytes for a in coo) / 2
    (dtype('uint8'), True)
    >>> from gpu_codec import Quantize, RiceIndices
    >>> (small,) = CompactSparseExchanger(0.1, largest_final_magnitude_scores,
    ...                                   pipeline=[Quantize("float16"), RiceIndices()]).push_parameters(model)
    >>> small.nbytes < blob.nbytes / 2
    True
    """

    def __init__(self, sparsity_level: float, score_gen_function: ScoreGenFunction, *, pipeline: Any = None) -> None:
        self.sparsity_level = _check_sparsity(sparsity_level)
        self.score_gen_function = score_gen_function
        self.pipeline = Pipeline.from_config(
            adapt.pipeline_configs(pipeline) or []
        )  # stages after top-k, e.g. [Quantize("float16"), RiceIndices()]
        if self.pipeline.topk is not None:
            raise InvalidInputError("CompactSparseExchanger selects with sparsity_level: leave topk out of pipeline")

    def select_payload(self, model: Any, initial_model: Any | None = None) -> _engine.Payload:
        """The selected entries' model values as a :class:`~gpu_codec.Payload` (device-resident on the GPU),
        encoded by ``pipeline``."""
        state, payload = self._engine_select(model, initial_model)
        entries = {}
        for rec, t, idx in self._kept(state, payload):
            v = t.reshape(-1)[idx].to(_torch_value_dtype(rec.dtype))
            entries[rec.name] = _engine.SparseEntries(rec.buffers["indices"], v, rec.shape, rec.dtype)
        return _engine.encode_coo(
            entries, pipeline=self.pipeline, metadata={COMPACT_MARKER: "values"}, selection=payload.pipeline[0]
        )

    def push_parameters(self, model: Any, initial_model: Any | None = None, config: Any = None) -> NDArrays:
        blob = self.select_payload(model, initial_model).to_bytes()
        return [np.frombuffer(blob, dtype=np.uint8)]

    def pull_parameters(self, parameters: NDArrays, model: Any, config: Any = None) -> None:
        _need(len(parameters) == 1, f"a compact packing is one uint8 array, got {len(parameters)} arrays")
        arr = np.asarray(parameters[0])
        _need(
            arr.ndim == 1 and arr.dtype == np.uint8,
            f"a compact packing is a 1-D uint8 array, got {arr.dtype}{list(arr.shape)}",
        )
        payload = _engine.Payload.from_bytes(memoryview(np.ascontiguousarray(arr)))
        _need(
            payload.metadata.get(COMPACT_MARKER) == "values",
            "this payload was not made by CompactSparseExchanger (its header lacks the marker)",
        )
        import torch

        state = model.state_dict()
        bases = {}
        for rec in payload.tensors:
            _need(rec.name in state, f"tensor {rec.name!r} is not in the model's state_dict")
            t = state[rec.name]
            bases[rec.name] = torch.zeros(
                t.shape, dtype=t.dtype if t.is_floating_point() else torch.float64, device=t.device
            )
        dense = _engine.decompress(payload, base=bases)
        for name, d in dense.items():
            state[name] = d if d.dtype == state[name].dtype else d.to(state[name].dtype)
        model.load_state_dict(state, strict=True)


def _logical_dtype(torch_dtype: Any) -> str:
    import torch

    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    return names.get(torch_dtype, "float64")


def _torch_value_dtype(logical: str) -> Any:
    import torch

    return torch.float64 if logical == "float64" else torch.float32


def _unravel(idx: Any, shape: tuple[int, ...]) -> Any:
    """Each flat index's coordinates in ``shape`` (entries x dims, int64), as ``torch.unravel_index`` stacks them;
    by division, since torch 2.1, the oldest supported, has no ``unravel_index``.

    >>> import torch
    >>> _unravel(torch.tensor([0, 5, 11]), (3, 4)).tolist()
    [[0, 0], [1, 1], [2, 3]]
    """
    import torch

    idx = idx.to(torch.int64)
    coords = []
    for size in reversed(shape):
        coords.append(idx % size if size else idx)
        idx = idx // size if size else idx
    return torch.stack(coords[::-1], dim=1) if coords else idx.new_zeros((idx.numel(), 0))
