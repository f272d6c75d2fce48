"""The GPU backend's CuPy glue, checked without a GPU: device choice, the caller's stream, torch's allocator,
NVML by UUID and the backend probe. (Runs where CuPy and torch import; the kernels themselves are checked by the
emulator and the NVRTC tests.)"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import numpy as np
import pytest

from gpu_codec import backends
from gpu_codec.arrays import Tensor
from gpu_codec.errors import InvalidInputError

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
gpu = pytest.importorskip("gpu_codec.backends.cupy")


def _t(kind, device):
    return Tensor(np.zeros(1, np.float32), "float32", (1,), kind, device)


def test_device_comes_from_the_inputs_and_mixed_devices_are_rejected():
    assert gpu.device_of([_t("numpy", None), None]) is None
    assert gpu.device_of([_t("torch", torch.device("cuda:1")), _t("torch", torch.device("cuda", 1))]) == 1
    assert gpu.device_of([_t("cupy", 2), _t("numpy", None), _t("torch", torch.device("cpu"))]) == 2
    with pytest.raises(InvalidInputError, match="different CUDA devices"):
        gpu.device_of([_t("torch", torch.device("cuda:0")), _t("torch", torch.device("cuda:1"))])
    with pytest.raises(InvalidInputError, match="different CUDA devices"):
        gpu.device_of([_t("cupy", 0), _t("torch", torch.device("cuda:1"))])


class _FakeTorchStream:
    def __init__(self, ptr):
        self.cuda_stream = ptr

    def __cuda_stream__(self):
        return (0, self.cuda_stream)


def test_caller_stream_wraps_torch_stream_without_deprecation(monkeypatch):
    """CuPy 14 deprecates ExternalStream (a DeprecationWarning, an error under our filterwarnings): the torch
    stream goes through Stream.from_external and keeps its handle."""
    seen = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: seen.append(d) or _FakeTorchStream(0xBEEF))
    s = gpu.caller_stream(1)
    assert isinstance(s, cupy.cuda.Stream) and s.ptr == 0xBEEF and seen == [1]
    src = Path(gpu.__file__).read_text()
    assert "RawModule(code" not in src


def test_caller_stream_on_cupy_13(monkeypatch):
    """CuPy 13 (allowed by the extras' lower bound) has no Stream.from_external: ExternalStream, with the device."""
    made = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _FakeTorchStream(0xCAFE))
    monkeypatch.setattr(cupy.cuda, "Stream", type("Stream13", (), {}))
    monkeypatch.setattr(cupy.cuda, "ExternalStream", lambda ptr, dev: made.append((ptr, dev)) or "ext")
    assert gpu.caller_stream(3) == "ext" and made == [(0xCAFE, 3)]


def test_torch_allocator_functions(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _FakeTorchStream(7 + d))
    monkeypatch.setattr(
        torch.cuda,
        "caching_allocator_alloc",
        lambda size, dev, stream: calls.append(("alloc", size, dev, stream.cuda_stream)) or 4096,
    )
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", lambda ptr: calls.append(("free", ptr)))
    malloc, free = gpu.torch_malloc_free()
    assert malloc(256, 1) == 4096
    free(4096, 1)
    assert calls == [("alloc", 256, 1, 8), ("free", 4096)]
    assert callable(gpu.torch_allocator())


def test_nvml_looks_up_by_uuid_and_reports_mig():
    uuid = backends.format_uuid(bytes(range(16)))
    assert backends.format_uuid("MIG-" + uuid) == uuid and backends.format_uuid("GPU-" + uuid) == uuid
    with pytest.raises(ValueError):
        backends.format_uuid(b"\x01\x02")

    def fake(known):
        def by_uuid(u):
            if u not in known:
                raise RuntimeError("NVML_ERROR_NOT_FOUND")
            return known[u]

        return types.SimpleNamespace(
            nvmlDeviceGetHandleByUUID=by_uuid, nvmlDeviceIsMigDeviceHandle=lambda h: h.startswith("mig")
        )

    h, mig = backends._nvml_handle(fake({"GPU-" + uuid: "gpu-handle"}), uuid)
    assert (h, mig) == ("gpu-handle", False)
    h, mig = backends._nvml_handle(fake({"MIG-" + uuid: "mig-handle"}), uuid)
    assert (h, mig) == ("mig-handle", True)
    with pytest.raises(LookupError):
        backends._nvml_handle(fake({}), uuid)
    assert "nvmlDeviceGetHandleByIndex" not in Path(backends.__file__).read_text()


def test_probe_needs_nvrtc_and_falls_back_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(backends, "_nvrtc_probe", lambda: (False, "OSError: libnvrtc.so.12 not found"))
    ok, why = backends.gpu_probe()
    assert not ok and "NVRTC cannot be loaded" in why
    monkeypatch.delenv(backends.ENV, raising=False)
    backends.reset_backend()
    try:
        with caplog.at_level(logging.INFO, logger="gpu_codec"):
            b = backends.get_backend()
        assert b.name == "cpu" and "NVRTC cannot be loaded" in caplog.text
        assert backends.backend_info()["allocator"] == "numpy"
    finally:
        backends.reset_backend()


def test_real_nvrtc_probe_reports_a_version():
    ok, why = backends._nvrtc_probe()
    if not ok:
        pytest.skip(why)
    assert why.startswith("NVRTC ")
