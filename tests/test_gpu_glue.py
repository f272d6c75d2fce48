"""The GPU backend's CuPy glue, checked without a GPU: device choice, the caller's stream, torch's allocator,
NVML by UUID and the backend probe. (Runs where CuPy and torch import; the kernels themselves are checked by the
emulator and the NVRTC tests.)"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gpu_codec import backends
from gpu_codec import errors as gpu_codec_errors
from gpu_codec.arrays import Tensor, TensorTable
from gpu_codec.errors import InvalidInputError

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
gpu = pytest.importorskip("gpu_codec.backends.gpu")


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


def test_a_tensor_table_gives_the_same_device_and_stream_choice_as_its_tensors():
    """compress and decompress pass the tables of their inputs (columns, no object a tensor): the device and
    whether torch's stream and allocator are used come from the table's columns as from the tensors."""
    cases = [
        [_t("numpy", None), _t("numpy", None)],
        [_t("torch", torch.device("cuda:1")), _t("torch", torch.device("cuda", 1))],
        [_t("cupy", 2), _t("numpy", None), _t("torch", torch.device("cpu"))],
        [_t("torch", torch.device("cpu"))],
    ]
    for ts in cases:
        table = TensorTable.of(ts)
        assert gpu.device_of(table) == gpu.device_of(ts)
        assert gpu._has_torch_cuda(table) == gpu._has_torch_cuda(ts)
    assert gpu._has_torch_cuda(TensorTable.of(cases[1])) and not gpu._has_torch_cuda(TensorTable.of(cases[2]))
    mixed = TensorTable.of([_t("torch", torch.device("cuda:0"))]) + TensorTable.of([_t("cupy", 1)])
    with pytest.raises(InvalidInputError, match="different CUDA devices"):
        gpu.device_of(mixed)


class _FakeTorchStream:
    """torch.cuda.Stream from late 2025 on (2.13): the raw handle and the CUDA stream protocol."""

    def __init__(self, ptr):
        self.cuda_stream = ptr

    def __cuda_stream__(self):
        return (0, self.cuda_stream)


class _OldTorchStream:
    """torch.cuda.Stream before the protocol (2.9 and older): only the raw handle."""

    def __init__(self, ptr):
        self.cuda_stream = ptr


class _Cupy14Stream:
    """CuPy 14's ``Stream.from_external`` contract (cupy/cuda/stream.pyx): it calls ``obj.__cuda_stream__()``
    (AttributeError without it), wants a tuple of two ints with version 0, and takes the current device."""

    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id

    @classmethod
    def from_external(cls, obj):
        try:
            result = obj.__cuda_stream__()
        except AttributeError:
            raise AttributeError(f"{type(obj).__name__} does not implement __cuda_stream__") from None
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError("__cuda_stream__() must return a 2-tuple")
        version, ptr = result
        if not isinstance(version, int) or not isinstance(ptr, int):
            raise TypeError("__cuda_stream__() must return (int, int)")
        if version != 0:
            raise ValueError("only version 0 is supported")
        s = cls(ptr, "current")
        s._foreign_stream_ref = obj
        return s


def _cupy13_surface(monkeypatch, made):
    """CuPy 13: no ``Stream.from_external``; ``ExternalStream(ptr, device_id=-1)``, not deprecated."""
    monkeypatch.setattr(cupy.cuda, "Stream", type("Stream13", (), {}))

    class ExternalStream13:
        def __init__(self, ptr, device_id=-1):
            made.append((ptr, device_id))
            self.ptr, self.device_id = ptr, device_id

    monkeypatch.setattr(cupy.cuda, "ExternalStream", ExternalStream13)


@pytest.mark.parametrize("torch_stream", [_FakeTorchStream, _OldTorchStream], ids=["torch-protocol", "torch-old"])
@pytest.mark.parametrize("surface", ["cupy-installed", "cupy14", "cupy13"])
def test_caller_stream_on_every_cupy_and_torch(monkeypatch, surface, torch_stream):
    """Every pair of CuPy API surface (13: ExternalStream; 14: Stream.from_external, which reads only
    ``__cuda_stream__``) and torch stream (with and without ``__cuda_stream__``) gives a stream with the torch
    stream's handle, with no deprecation warning (an error under the test filters)."""
    seen, made = [], []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: seen.append(d) or torch_stream(0xBEEF))
    if surface == "cupy14":
        monkeypatch.setattr(cupy.cuda, "Stream", _Cupy14Stream)
    elif surface == "cupy13":
        _cupy13_surface(monkeypatch, made)
    s = gpu.caller_stream(1)
    assert s.ptr == 0xBEEF and seen == [1]
    if surface == "cupy13":
        assert made == [(0xBEEF, 1)]
    elif surface == "cupy-installed" and hasattr(cupy.cuda.Stream, "from_external"):
        assert isinstance(s, cupy.cuda.Stream)
    src = Path(gpu.__file__).read_text()
    assert "RawModule(code" not in src


def test_stream_handle_follows_the_protocol():
    h = gpu._StreamHandle(0xCAFE, owner="torch stream")
    assert h.__cuda_stream__() == (0, 0xCAFE) and h.owner == "torch stream"


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


def _fake_nvml(uuids, mig_mode=False):
    """A pynvml with one GPU at PCI bus 0000:1A:00.0 (uuids[0]) and its MIG instances (uuids[1:])."""
    handles = {"gpu": uuids[0], **{f"mig{i}": u for i, u in enumerate(uuids[1:])}}

    def by_uuid(u):
        for h, v in handles.items():
            if u in ("GPU-" + v, "MIG-" + v):
                return h
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def by_bus(bus):
        if bus != "0000:1A:00.0":
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "gpu"

    return types.SimpleNamespace(
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByPciBusId=by_bus,
        nvmlDeviceIsMigDeviceHandle=lambda h: h.startswith("mig"),
        nvmlDeviceGetMigMode=lambda h: [int(mig_mode), int(mig_mode)],
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=lambda h, i: (
            f"mig{i}" if i < len(uuids) - 1 else (_ for _ in ()).throw(RuntimeError("NVML_ERROR_NOT_FOUND"))
        ),
        nvmlDeviceGetUUID=lambda h: ("MIG-" if h.startswith("mig") else "GPU-") + handles[h],
    )


def test_nvml_finds_a_device_whose_uuid_cupy_cut_at_a_zero_byte():
    # CuPy reads cudaDeviceProp.uuid as a C string: 2bb4bfa0-dac2-5986-1a00-... comes back as its first 9 bytes
    # (seen on a real device), so the UUID alone cannot name it.
    whole = bytes.fromhex("2bb4bfa0dac259861a00c3e200693bba")
    cut = whole[: whole.index(0)]
    assert len(cut) == 9
    nvml = _fake_nvml([backends.format_uuid(whole)])
    assert backends._nvml_handle(nvml, whole) == ("gpu", False)  # (16 bytes: by UUID, as before)
    assert backends._nvml_handle(nvml, cut, "0000:1A:00.0") == ("gpu", False)
    with pytest.raises(LookupError, match="PCI bus"):
        backends._nvml_handle(nvml, cut)  # (no bus id: nothing to look it up by)
    with pytest.raises(LookupError):
        backends._nvml_handle(nvml, cut + b"\x01", "0000:1A:00.0")  # (not a prefix cut at a zero byte)
    # a MIG instance of that GPU, cut the same way, is told from its parent by the rest of its prefix
    mig = bytes.fromhex("2bb4bfa0dac259861a01c3e200693bba")
    other = bytes.fromhex("77b4bfa0dac2598600000000000000aa")
    nvml = _fake_nvml([backends.format_uuid(mig), backends.format_uuid(other), backends.format_uuid(whole)], True)
    assert backends._nvml_handle(nvml, other[: other.index(0)], "0000:1A:00.0") == ("mig0", True)
    assert backends._nvml_handle(nvml, cut, "0000:1A:00.0") == ("mig1", True)
    same = _fake_nvml([backends.format_uuid(whole), backends.format_uuid(whole)], True)
    with pytest.raises(LookupError, match="2 devices"):
        backends._nvml_handle(same, cut, "0000:1A:00.0")


def test_nvml_info_reports_a_device_whose_uuid_has_a_zero_byte(monkeypatch):
    whole = bytes.fromhex("2bb4bfa0dac259861a00c3e200693bba")
    nvml = _fake_nvml([backends.format_uuid(whole)])
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150754820096)
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    nvml.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 13000
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, which: 1980
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM = 0, 1
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda d: {"uuid": whole[:9]})
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda d: "0000:1A:00.0", raising=False)
    info = backends._nvml_info()
    assert info.get("uuid") == backends.format_uuid(whole), info
    assert info["name"] == "NVIDIA H200" and info["driver"] == "580.159.04" and not info["mig"]


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


@pytest.fixture
def nvrtc_12_4(monkeypatch):
    """An NVRTC 12.4 that knows sm_50 .. sm_90 (not Blackwell's sm_100 / sm_120)."""
    from gpu_codec.backends import nvrtc

    monkeypatch.setattr(nvrtc, "supported_archs", lambda: (50, 60, 70, 75, 80, 86, 89, 90))
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (12, 4))
    return nvrtc


def test_target_for_known_newer_and_unknown_architectures(nvrtc_12_4):
    nv = nvrtc_12_4
    assert nv.target_for(90, driver=12040) == ("sm_90", True)
    assert nv.target_for(87, driver=12000) == ("sm_86", True)  # same major: 8.6 SASS runs on 8.7, no JIT
    # a device NVRTC does not know: PTX only where the driver is as new as NVRTC
    assert nv.target_for(120, driver=12080) == ("compute_90", False)
    assert nv.target_for(100, driver=12040) == ("compute_90", False)
    with pytest.raises(gpu_codec_errors.BackendUnavailableError, match=r"needs a driver for CUDA 12\.4.*12\.2"):
        nv.target_for(120, driver=12020)
    with pytest.raises(gpu_codec_errors.BackendUnavailableError, match="no architecture at or below sm_35"):
        nv.target_for(35, driver=12080)
    assert "does not know sm_120" in nv.describe_target(120, driver=12080)
    assert nv.describe_target(90, driver=12040) == "CUBIN for sm_90 (NVRTC 12.4)"


@pytest.mark.parametrize(("driver", "backend"), [(12020, "cpu"), (12080, "gpu")])
def test_unknown_architecture_falls_back_with_the_reason(monkeypatch, nvrtc_12_4, driver, backend):
    """A faked Blackwell device (sm_120) with an NVRTC that does not know it: with a driver older than NVRTC the
    probe refuses the GPU and backend_info() says why; with a newer one the GPU backend loads PTX."""
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(backends, "_nvrtc_probe", lambda: (True, "NVRTC 12.4"))
    monkeypatch.setattr(nvrtc_12_4, "driver_version", lambda: driver)
    monkeypatch.setattr(cupy.cuda, "Device", lambda d=0: types.SimpleNamespace(compute_capability="120", id=0))
    monkeypatch.setattr(backends, "_nvml_info", lambda: {})
    monkeypatch.delenv(backends.ENV, raising=False)
    backends.reset_backend()
    try:
        b = backends.get_backend()
        info = backends.backend_info()
        assert b.name == backend == info["backend"]
        if backend == "cpu":
            assert "the kernels cannot load" in info["reason"] and "sm_120" in info["reason"]
        else:
            assert "PTX for compute_90" in info["kernels"] and "sm_120" in info["reason"]
    finally:
        backends.reset_backend()


def test_asarray_returns_a_device_array_as_it_is_and_converts_anything_else():
    """GpuBackend.asarray on a fake array module: an array of its own type is returned as it is (no call into the
    module, which cupy.asarray would make a few microseconds a tensor); anything else goes through asarray."""

    class Arr:
        pass

    calls = []
    xp = types.SimpleNamespace(ndarray=Arr, asarray=lambda a: calls.append(a) or ("converted", a))
    backend = gpu.GpuBackend(types.SimpleNamespace(xp=xp))
    a = Arr()
    assert backend.asarray(a) is a and not calls
    host = np.zeros(2, np.float32)
    assert backend.asarray(host) == ("converted", host) and calls == [host]
    calls.clear()
    got = backend.asarrays([a, None, host, a])  # (a model's tensors at once: None stays None)
    assert got[0] is a and got[1] is None and got[2] == ("converted", host) and got[3] is a and calls == [host]


@pytest.mark.parametrize("name", ["cpu", "emulated", "recording"])
def test_asarrays_is_asarray_of_each(name):
    """Every backend's asarrays gives what asarray gives each array (the same array where it is in the backend's
    memory already), None for None."""
    from tests.common import HAS_EMULATOR, use_backend

    if name != "cpu" and not HAS_EMULATOR:
        pytest.skip("no C++20 compiler for the emulator")
    if name == "recording":
        from gpu_codec.testing.recording import RecordingBackend

        backend = RecordingBackend()
    else:
        with use_backend(name):
            backend = backends.get_backend()
    xs = [np.arange(4, dtype=np.float32), None, np.ones(3, np.float16)]
    want = [None if x is None else backend.asarray(x) for x in xs]
    got = backend.asarrays(xs)
    assert got[1] is None and all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got[::2], want[::2]))
    if name == "cpu":
        assert got[0] is xs[0] and got[2] is xs[2]


def test_the_cupy_runner_reads_a_table_of_addresses_as_its_ptr_does_one_by_one():
    """KernelOps' address tables (one entry a tensor) come from the runner's ``ptrs`` in one C loop: the same
    numbers as ``ptr`` of each array (CuPy's ``data.ptr``), checked on stand-ins of CuPy arrays."""
    runner = gpu.CupyRunner()
    arrays = [types.SimpleNamespace(data=types.SimpleNamespace(ptr=p)) for p in (4096, 0x7F0000001000, 8)]
    assert runner.ptrs(arrays) == [runner.ptr(a) for a in arrays] == [4096, 0x7F0000001000, 8]


@pytest.mark.parametrize("sizes", [False, True])
def test_an_address_table_that_skips_empty_arrays_reads_them_in_one_loop_and_zeroes_the_empty_ones(sizes):
    """``KernelOps._ptrs(skip_empty=True)`` over a runner with ``ptrs``: every array's address but the empty ones',
    which are 0 (a kernel reads nothing there), as the one-by-one path gives them; with a None among them, that
    path itself."""
    from gpu_codec.backends.kernels import KernelOps

    class Runner:
        xp = np

        def ptr(self, a):
            return a.addr

        def ptrs(self, arrays):
            return [a.addr for a in arrays]

    def arr(addr, size):
        return types.SimpleNamespace(addr=addr, size=size)

    ops = KernelOps(Runner(), fused=True)
    arrays = [arr(4096, 3), arr(8192, 0), arr(0x7F0000001000, 1), arr(64, 0)]
    kw = {"sizes": [a.size for a in arrays]} if sizes else {}
    got = ops._ptrs(arrays, skip_empty=True, **kw)
    assert got.dtype == np.uint64 and got.tolist() == [4096, 0, 0x7F0000001000, 0]
    assert ops._ptrs(arrays).tolist() == [4096, 8192, 0x7F0000001000, 64]
    assert ops._ptrs([arrays[0], None, arrays[1]], skip_empty=True).tolist() == [4096, 0, 0]
