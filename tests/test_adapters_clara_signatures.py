"""The Clara Train 3.1 ``fed_learn.components`` methods keep the signatures Clara documents, so code written for
Clara calls ours unchanged. Additions are allowed only as keyword-only parameters with defaults."""

from __future__ import annotations

import inspect

import pytest

from gpu_codec import clara as C

REQUIRED = inspect.Parameter.empty

# class, method: Clara's parameters after self, each (name, default or REQUIRED)
SEED = {
    ("ModelSaver", "initialize"): [("builder", None)],
    ("ModelSaver", "save_model"): [("model", REQUIRED), ("is_best", REQUIRED)],
    ("PTModelSaver", "initialize"): [("builder", None)],
    ("PTModelSaver", "save_model"): [("model", REQUIRED), ("is_best", REQUIRED)],
    ("PTModelSaver", "close"): [],
    ("ModelValidator", "validate_model"): [("configer", REQUIRED), ("checkpoint", REQUIRED)],
    ("ModelValidator", "close"): [],
    ("ModelVisualizer", "visualize"): [("model_data", REQUIRED)],
    ("TensorboardModelVisualizer", "visualize"): [("model_data", REQUIRED)],
    ("ModelEvaluator", "initialize"): [("builder", None)],
    ("ModelEvaluator", "evaluate"): [],
    ("ModelEvaluator", "get_metric"): [],
    ("DataProcessor", "process"): [("data_ctx", REQUIRED), ("app_ctx", REQUIRED)],
    ("DataProcessor", "abort"): [("app_ctx", REQUIRED)],
    ("DataCompressor", "process"): [("data_ctx", REQUIRED), ("app_ctx", REQUIRED)],
    ("DataDeCompressor", "process"): [("data_ctx", REQUIRED), ("app_ctx", REQUIRED)],
    ("ModelEncryptor", "process"): [("data_ctx", REQUIRED), ("app_ctx", REQUIRED)],
    ("ModelDecryptor", "process"): [("data_ctx", REQUIRED), ("app_ctx", REQUIRED)],
    ("DictModelReaderWriter", "apply_model"): [("model_params", REQUIRED), ("options", None)],
}


@pytest.mark.parametrize(("cls", "method"), sorted(SEED), ids=lambda x: x)
def test_signature_is_claras(cls, method):
    params = list(inspect.signature(getattr(getattr(C, cls), method)).parameters.values())
    assert params[0].name == "self"
    positional = [p for p in params[1:] if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == SEED[cls, method]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in positional)
    extras = [p for p in params[1:] if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert all(p.default is not REQUIRED for p in extras), [p.name for p in extras]
