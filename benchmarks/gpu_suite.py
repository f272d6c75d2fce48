#!/usr/bin/env python3
"""The GPU suite: every check that needs a real GPU, in one command, with a JSON summary.

    pip install -q --no-deps --no-build-isolation -e . ; python3 benchmarks/gpu_suite.py --out OUTDIR

Steps, in order (each recorded in OUTDIR/summary.json as pass / fail / skip, with seconds and details):
  env        the device, driver, CUDA runtime, CuPy and NVRTC versions
  pytest     python -m pytest -m gpu: the test suite's GPU-marked tests                     -> pytest_gpu.log
  parity     KernelOps(CupyRunner()) against the NumPy backend (cpu_fallback.select.topk_select and the
             scatter twin) to the byte, on large random inputs (up to --max-n elements)
  cases      the emulated test cases (gpu_codec/testing/kernel_cases.py) on the device: every kernel against its twin,
             buffer by buffer, exactly as tests/test_emulated_kernels.py runs them on the CPU emulator
  sanitizer  compute-sanitizer memcheck, racecheck and synccheck over --workload, a short run that launches
             every kernel at least once and checks its output                            -> sanitizer_<tool>.log
  resources  registers, shared memory and spills from ptxas (benchmarks/kernel_resources.py) -> resources.txt
  glue       the CuPy / torch glue on the device: the caller's torch stream (with and without
             __cuda_stream__) reaching CuPy; compress, decompress, aggregate and error feedback on a side torch
             stream behind queued work, equal to the CPU's bytes; subnormals through every stage and pipeline
             (CuPy's -ftz kernels would flush them); nvCOMP's frames (odd tensor sizes, so staged alignment)
             decoded by the CPU zstandard library; compress(blocking=False) against the blocking bytes; DRAM
             bytes per element of the fused scan and the candidate selection under ncu -> ncu_traffic.log;
             the fused scan's loads under ncu (fused_scan_f32's 128-bit loads against fused_scan's 32-bit ones
             on the same fp32 inputs, and its scalar loads on misaligned ones: load requests, sectors, DRAM
             bytes and time per element; fused_scan_h16's 64-bit loads against fused_scan's on fp16
             inputs) -> ncu_scan.log.
             With --runner emulated: the subnormal checks on the emulated backend, the rest skipped.
A human-readable log goes to OUTDIR/suite.log. The exit status is 1 if any step failed. Steps stop being started
once --budget-s seconds have passed (540 by default), so a run under a time limit still writes its summary.

--runner emulated runs the steps that do not need a GPU (cases, parity on small inputs, the workload) on the CPU
emulator instead: CPU CI tests the suite itself that way (tests/test_emulated_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = ("env", "pytest", "parity", "cases", "sanitizer", "resources", "glue")
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
_EXTRA_PYTHONPATH: list[str] = []


def _ensure_importable() -> None:
    """Make ``gpu_codec`` importable from this checkout even where ``pip install -e .`` could not run (the
    package maps kernels/ and cpu_fallback/ into it, so a plain sys.path entry is not enough).

    A ``gpu_codec`` installed from elsewhere (a wheel on PYTHONPATH) is not this checkout's: the steps run in
    processes started in the checkout, whose own ``gpu_codec/`` comes first there, so it is mapped too."""
    try:
        import gpu_codec.kernels

        import gpu_codec.backends.kernels

        if Path(gpu_codec.__file__).resolve().parent == (ROOT / "gpu_codec").resolve():
            return
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="gpu_codec_src_"))
    pkg = tmp / "gpu_codec"
    pkg.mkdir()
    for f in (ROOT / "gpu_codec").iterdir():
        if f.name != "__pycache__":
            (pkg / f.name).symlink_to(f)
    (pkg / "kernels").symlink_to(ROOT / "kernels")
    (pkg / "cpu_fallback").symlink_to(ROOT / "cpu_fallback")
    sys.path.insert(0, str(tmp))
    _EXTRA_PYTHONPATH.append(str(tmp))
    for m in [m for m in sys.modules if m == "gpu_codec" or m.startswith("gpu_codec.")]:
        del sys.modules[m]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if _EXTRA_PYTHONPATH:
        env["PYTHONPATH"] = os.pathsep.join(_EXTRA_PYTHONPATH + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _cases_module():
    from gpu_codec.testing import kernel_cases

    return kernel_cases


class CountingRunner:
    """A runner that forwards to another and counts the launches per kernel (``counts``; ``launches`` in all)
    and the read-backs to the host (``reads``)."""

    def __init__(self, inner):
        self.inner = inner
        self.xp = inner.xp
        self.counts: dict[str, int] = {}
        self.reads = 0

    @property
    def launches(self) -> int:
        return sum(self.counts.values())

    def launch(self, name, grid, block, args):
        self.counts[name] = self.counts.get(name, 0) + 1
        self.inner.launch(name, grid, block, args)

    def ptr(self, a):
        return self.inner.ptr(a)

    def to_host(self, a):
        self.reads += 1
        return self.inner.to_host(a)


def make_runner(kind: str):
    if kind == "emulated":
        from gpu_codec.backends.emulated import EmulatorRunner

        return EmulatorRunner()
    from gpu_codec.backends.gpu import CupyRunner

    return CupyRunner()


def _sync(runner) -> None:
    xp = runner.xp
    if xp.__name__ == "cupy":
        xp.cuda.Device().synchronize()


# ------------------------------------------------------------------------------------------------- the steps


class Suite:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "runner": args.runner, "steps": {}}
        self.log_f = open(self.out / "suite.log", "w")  # noqa: SIM115 (open for the whole run, closed at its end)

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self.log_f.write(msg + "\n")
        self.log_f.flush()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.t0, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))

    def record(self, step: str, status: str, t: float, **details) -> None:
        self.summary["steps"][step] = {"status": status, "seconds": round(time.monotonic() - t, 1), **details}
        self.log(f"== {step}: {status.upper()} ({self.summary['steps'][step]['seconds']} s)")
        self.save()

    def run_step(self, step: str) -> None:
        if step in self.args.skip:
            self.summary["steps"][step] = {"status": "skip", "reason": "--skip"}
            self.save()
            return
        if self.left() <= 0:
            self.summary["steps"][step] = {"status": "skip", "reason": f"budget of {self.args.budget_s} s spent"}
            self.log(f"== {step}: SKIP (budget spent)")
            self.save()
            return
        self.log(f"== {step} ...")
        t = time.monotonic()
        try:
            getattr(self, "step_" + step)(t)
        except Exception as e:
            self.log(traceback.format_exc())
            self.record(step, "fail", t, error=f"{type(e).__name__}: {e}")

    # -- env
    def step_env(self, t):
        info = {"python": sys.version.split()[0], "platform": platform.platform(), "runner": self.args.runner}
        try:
            import numpy

            info["numpy"] = numpy.__version__
        except ImportError:
            pass
        try:
            import cupy

            info["cupy"] = cupy.__version__
            try:
                info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
                info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
                n = cupy.cuda.runtime.getDeviceCount()
                info["devices"] = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
                cc = cupy.cuda.Device(0).compute_capability
                info["compute_capability"] = cc
            except Exception as e:
                info["cuda_error"] = f"{type(e).__name__}: {e}"
            try:
                from cupy.cuda import nvrtc

                info["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
            except Exception as e:
                info["nvrtc_error"] = str(e)
        except ImportError as e:
            info["cupy_error"] = str(e)
        if shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True)
            info["nvidia_smi"] = r.stdout.strip()
        info["compute_sanitizer"] = self.sanitizer_path()
        info["nvcc"] = shutil.which("nvcc")
        self.summary["env"] = info
        self.log(json.dumps(info, indent=1, default=str))
        if self.args.runner == "cupy" and not info.get("devices"):
            self.record("env", "fail", t, error="no CUDA device visible to CuPy")
        else:
            self.record("env", "pass", t)

    # -- pytest
    def pytest_command(self) -> list[str]:
        # from a checkout without the package installed, the package made importable comes before the checkout's
        # own folder, which pyproject.toml's pythonpath puts first (its gpu_codec/ lacks kernels/ and cpu_fallback/)
        paths = ["-o", "pythonpath=" + " ".join([*_EXTRA_PYTHONPATH, "."])] if _EXTRA_PYTHONPATH else []
        return [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            *paths,
            *self.args.pytest_args,
        ]

    def step_pytest(self, t):
        if self.args.runner != "cupy":
            return self.record("pytest", "skip", t, reason="needs a GPU (--runner cupy)")
        try:
            import pytest  # noqa: F401
        except ImportError:
            return self.record("pytest", "skip", t, reason="pytest is not installed here")
        timeout = max(30.0, min(self.args.pytest_timeout, self.left()))
        logp = self.out / "pytest_gpu.log"
        with open(logp, "w") as f:
            try:
                r = subprocess.run(
                    self.pytest_command(),
                    check=False,
                    cwd=ROOT,
                    env=_env(),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                )
                rc = r.returncode
            except subprocess.TimeoutExpired:
                rc = None
        tail = logp.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        if rc is None:
            return self.record("pytest", "fail", t, error=f"timed out after {timeout:.0f} s", log=logp.name)
        status = {0: "pass", 5: "skip"}.get(rc, "fail")
        self.record(
            "pytest",
            status,
            t,
            returncode=rc,
            last_line=tail[0],
            log=logp.name,
            **({"reason": "no test is marked gpu"} if rc == 5 else {}),
        )

    # -- parity on large inputs
    def step_parity(self, t):
        kc = _cases_module()
        runner = make_runner(self.args.runner)
        max_n = int(self.args.max_n if self.args.max_n else (1e8 if self.args.runner == "cupy" else 2e4))
        results, failed = [], False
        cases = [("topk", c) for c in kc.large_topk_cases(max_n)] + [
            ("scatter", c) for c in kc.large_scatter_cases(max_n)
        ]
        for kind, case in cases:
            if self.left() <= 0:
                results.append({"case": case.name, "status": "skip", "reason": "budget"})
                continue
            t1 = time.monotonic()
            m = kc.topk_vs_reference(runner, case) if kind == "topk" else kc.scatter_vs_reference(runner, case)
            _sync(runner)
            results.append(
                {
                    "case": case.name,
                    "elements": int(sum(case.sizes)),
                    "status": "fail" if m else "pass",
                    "seconds": round(time.monotonic() - t1, 1),
                    "mismatches": m[:10],
                }
            )
            self.log(f"   {case.name}: {'FAIL ' + m[0] if m else 'equal to the byte'} ({results[-1]['seconds']} s)")
            failed |= bool(m)
        self.record("parity", "fail" if failed else "pass", t, max_n=max_n, cases=results)

    # -- the emulated cases on the device
    def step_cases(self, t):
        kc = _cases_module()
        runner = make_runner(self.args.runner)
        groups = [
            ("topk", kc.topk_cases(), kc.topk_vs_reference),
            ("topk_stepwise", kc.topk_cases(), kc.topk_stepwise),
            ("topk_stepwise_u64", kc.topk_cases()[::4], lambda r, c: kc.topk_stepwise(r, c, wide=True)),
            ("topk_fused", kc.topk_cases(), kc.topk_fused_stepwise),
            ("topk_fused_bracket", kc.topk_cases(), lambda r, c: kc.topk_fused_stepwise(r, c, own="one")),
            ("topk_fused_multi", kc.topk_cases(), lambda r, c: kc.topk_fused_stepwise(r, c, select="multi")),
            ("scatter", kc.scatter_cases(), kc.scatter_vs_reference),
            ("scatter_stepwise", kc.scatter_cases(), kc.scatter_stepwise),
            ("dense", kc.topk_cases(), kc.dense_vs_reference),
            ("quantize", kc.quant_cases(), kc.quant_stepwise),
            ("rice", kc.rice_cases(), kc.rice_stepwise),
            ("floats", [3001, 1 << 20], lambda r, n: kc.float_steps(r, f"floats_{n}", n)),
            ("gather_copy", [kc.GATHER_SIZES, (1 << 20, 3, 1 << 18)], kc.gather_copy_vs_twin),
            ("gather_entries", [kc.GATHER_SIZES, (1 << 20, 3, 1 << 18)], kc.gather_entries_vs_twin),
        ]
        failures, n = [], 0
        for gname, cases, fn in groups:
            if self.args.quick:
                cases = cases[::7]
            for case in cases:
                n += 1
                try:
                    m = fn(runner, case)
                except Exception as e:
                    m = [f"{type(e).__name__}: {e}"]
                if m:
                    cname = getattr(case, "name", str(case))
                    failures.append({"group": gname, "case": cname, "mismatches": m[:10]})
                    self.log(f"   {gname}/{cname}: FAIL {m[0]}")
        self.log(f"   {n - len(failures)} of {n} cases equal to the byte")
        self.record("cases", "fail" if failures else "pass", t, cases=n, failures=failures)

    # -- compute-sanitizer
    def sanitizer_path(self) -> str | None:
        if self.args.sanitizer:
            return self.args.sanitizer
        found = shutil.which("compute-sanitizer")
        if found:
            return found
        for p in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
            if os.path.exists(p):
                return p
        return None

    def sanitizer_command(self, tool: str) -> list[str]:
        cs = self.sanitizer_path() or "compute-sanitizer"
        extra = {"memcheck": ["--leak-check", "no"], "racecheck": ["--racecheck-report", "all"]}.get(tool, [])
        return [
            cs,
            "--tool",
            tool,
            "--error-exitcode",
            "86",
            "--print-limit",
            "100",
            *extra,
            sys.executable,
            str(Path(__file__).resolve()),
            "--workload",
            "--runner",
            "cupy",
            "--out",
            str(self.out),
        ]

    def step_sanitizer(self, t):
        if self.args.runner != "cupy":
            return self.record("sanitizer", "skip", t, reason="needs a GPU (--runner cupy)")
        if not self.sanitizer_path():
            return self.record("sanitizer", "fail", t, error="compute-sanitizer not found (give --sanitizer PATH)")
        results, failed = {}, False
        for tool in self.args.sanitizer_tools:
            if self.left() <= 0:
                results[tool] = {"status": "skip", "reason": "budget"}
                continue
            logp = self.out / f"sanitizer_{tool}.log"
            t1 = time.monotonic()
            timeout = max(30.0, min(300.0, self.left()))
            try:
                r = subprocess.run(
                    self.sanitizer_command(tool),
                    check=False,
                    cwd=ROOT,
                    env=_env(),
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                text, rc = r.stdout + r.stderr, r.returncode
            except subprocess.TimeoutExpired as e:
                text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s", None
            if isinstance(text, bytes):
                text = text.decode(errors="replace")
            logp.write_text(text)
            res = parse_sanitizer(text)
            ok = rc == 0 and res["summary_found"] and res["errors"] == 0 and "workload: ok" in text
            results[tool] = {
                "status": "pass" if ok else "fail",
                "returncode": rc,
                **res,
                "seconds": round(time.monotonic() - t1, 1),
                "log": logp.name,
            }
            self.log(f"   {tool}: {'clean' if ok else 'FAILED'} (rc {rc}, {res})")
            failed |= not ok
        self.record("sanitizer", "fail" if failed else "pass", t, tools=results)

    # -- resources
    def step_resources(self, t):
        sys.path.insert(0, str(HERE))
        import kernel_resources as kr

        have, why = kr.nvrtc_available()
        tools = (["nvrtc"] if have else []) + (["nvcc"] if shutil.which("nvcc") else [])
        if not tools:
            return self.record("resources", "skip", t, reason=f"neither NVRTC ({why}) nor nvcc")
        archs = tuple(self.args.arch)
        rep = kr.collect(archs, tuple(tools))
        table = kr.format_table(rep.rows)
        (self.out / "resources.txt").write_text(table + "\n\n" + "\n".join(rep.problems) + "\n")
        self.log(table)
        self.record(
            "resources",
            "fail" if rep.problems else "pass",
            t,
            tools=tools,
            archs=list(archs),
            problems=rep.problems,
            log="resources.txt",
        )

    # -- the glue around the kernels
    def step_glue(self, t):
        results: dict[str, dict] = {}
        checks = [("subnormals", glue_subnormals)]
        if self.args.runner == "cupy":
            checks += [
                ("streams", glue_streams),
                ("nvcomp", glue_nvcomp),
                ("nonblocking", glue_nonblocking),
                ("ncu_traffic", lambda r: glue_ncu(self.out)),
                ("ncu_scan_loads", lambda r: glue_scan_ncu(self.out)),
            ]
        for name, fn in checks:
            t1 = time.monotonic()
            try:
                problems = fn(self.args.runner)
                status = "skip" if problems and problems[0].startswith("skip:") else ("fail" if problems else "pass")
            except Exception as e:
                problems, status = [f"{type(e).__name__}: {e}"], "fail"
                self.log(traceback.format_exc())
            results[name] = {"status": status, "seconds": round(time.monotonic() - t1, 1), "problems": problems[:10]}
            self.log(f"   {name}: {status.upper()} {problems[0] if problems else ''}")
        failed = any(r["status"] == "fail" for r in results.values())
        self.record("glue", "fail" if failed else "pass", t, checks=results)


# ------------------------------------------------------------------------------------ glue checks (step glue)


def _glue_update(n: int, seed: int):
    import numpy as np

    from gpu_codec.testing import kernel_cases as kc

    rng = np.random.default_rng(seed)
    base = {"w": rng.standard_normal(n).astype(np.float32), "d": rng.standard_normal(n // 8)}
    new = {"w": base["w"] + kc.subnormal_mix(n, np.float32, seed), "d": base["d"] + rng.standard_normal(n // 8)}
    tiny = {"w": kc.subnormal_mix(n, np.float32, seed + 1), "d": kc.subnormal_mix(n // 8, np.float64, seed + 2)}
    return base, new, tiny


def _glue_pipelines():
    from gpu_codec.testing.ftz_audit import audit_pipelines

    return audit_pipelines()


def _glue_bytes(backend_name: str, n: int) -> dict[str, bytes]:
    """Every stage's bytes on subnormal-rich inputs: compress per pipeline, decompress, aggregate (with and
    without a base), error feedback."""
    import numpy as np

    import gpu_codec
    from gpu_codec.testing import use_backend

    base, new, tiny = _glue_update(n, 7)
    out: dict[str, bytes] = {}
    with use_backend(backend_name):
        for name, pipe in _glue_pipelines().items():
            ef = gpu_codec.ErrorFeedback()
            p = gpu_codec.compress(new, base, fraction=0.2, pipeline=pipe, residual=ef)
            q = gpu_codec.compress(tiny, fraction=0.5, pipeline=pipe)
            out[f"{name}/compress"] = p.to_bytes() + q.to_bytes()
            out[f"{name}/residual"] = ef.to_bytes()
            for k, v in gpu_codec.decompress(q.to_bytes()).items():
                out[f"{name}/decompress/{k}"] = np.asarray(v).tobytes()
            for k, v in gpu_codec.aggregate([q, q], weights=[1.0, 0.75]).items():
                out[f"{name}/aggregate/{k}"] = np.asarray(v).tobytes()
            for k, v in gpu_codec.aggregate([p], base=base).items():
                out[f"{name}/aggregate_base/{k}"] = np.asarray(v).tobytes()
    return out


def glue_subnormals(runner: str) -> list[str]:
    n = 1 << 16 if runner == "cupy" else 1500
    got = _glue_bytes("gpu" if runner == "cupy" else "emulated", n)
    want = _glue_bytes("cpu", n)
    return [f"{k}: differs from the CPU's bytes" for k in want if got.get(k) != want[k]]


def glue_streams(runner: str) -> list[str]:
    """On a side torch stream, behind a long matmul queued on it: compress / decompress / aggregate / error
    feedback (from_bytes) give the CPU's bytes; caller_stream wraps that stream's handle, also for a torch
    stream without __cuda_stream__."""
    import numpy as np

    try:
        import torch
    except ImportError:
        return ["skip: torch is not installed"]
    if not torch.cuda.is_available():
        return ["skip: torch sees no CUDA device"]
    import gpu_codec
    from gpu_codec.backends.gpu import caller_stream
    from gpu_codec.testing import use_backend

    problems = []
    base, new, _ = _glue_update(1 << 20, 3)
    with use_backend("cpu"):
        ef0 = gpu_codec.ErrorFeedback()
        gpu_codec.compress(new, base, fraction=0.01, residual=ef0)
        want_p = gpu_codec.compress(new, base, fraction=0.01, residual=ef0).to_bytes()
        want_agg = {k: np.asarray(v) for k, v in gpu_codec.aggregate([want_p], base=base).items()}
        ef_blob = gpu_codec.ErrorFeedback()
        gpu_codec.compress(new, base, fraction=0.01, residual=ef_blob)
        saved = ef_blob.to_bytes()
    side = torch.cuda.Stream()

    class OldStream:  # a torch stream as releases before the CUDA stream protocol had it
        def __init__(self, s):
            self.cuda_stream = s.cuda_stream

    with use_backend("gpu"), torch.cuda.stream(side):
        if caller_stream(torch.cuda.current_device()).ptr != side.cuda_stream:
            problems.append("caller_stream is not the current torch stream")
        orig = torch.cuda.current_stream
        torch.cuda.current_stream = lambda d=None: OldStream(orig(d))
        try:
            if caller_stream(torch.cuda.current_device()).ptr != side.cuda_stream:
                problems.append("caller_stream lost a torch stream without __cuda_stream__")
        finally:
            torch.cuda.current_stream = orig
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            a = a @ a / 64  # queued work on the caller's stream ahead of the call
        tb = {k: torch.from_numpy(v).cuda() for k, v in base.items()}
        tn = {k: torch.from_numpy(v).cuda() for k, v in new.items()}
        ef = gpu_codec.ErrorFeedback.from_bytes(saved)  # uploads queued on the current stream
        got_p = gpu_codec.compress(tn, tb, fraction=0.01, residual=ef).to_bytes()
        if got_p != want_p:
            problems.append("compress after ErrorFeedback.from_bytes on a side stream differs from the CPU")
        agg = gpu_codec.Aggregator(base=tb)
        agg.add(got_p)
        got_agg = agg.result()
        for k, v in want_agg.items():
            if got_agg[k].cpu().numpy().tobytes() != v.tobytes():
                problems.append(f"Aggregator.result()[{k!r}] on a side stream differs from the CPU")
    return problems


def glue_nvcomp(runner: str) -> list[str]:
    """nvCOMP's zstd frames for tensors of odd sizes (staged to aligned chunk starts), decoded by zstandard."""
    import numpy as np

    try:
        from nvidia import nvcomp  # noqa: F401
    except Exception as e:
        return [f"skip: nvCOMP is not importable ({type(e).__name__})"]
    import cupy

    from gpu_codec.backends import get_backend
    from gpu_codec.codecs.nvcomp import Nvcomp
    from gpu_codec.testing import use_backend
    from gpu_codec.testing.nvcomp import check_frames

    sizes = [5, 0, 9, (1 << 20) + 3, 1, (1 << 24) + 7]
    rng = np.random.default_rng(0)
    raws = [rng.integers(0, 16, n, dtype=np.uint8).tobytes() for n in sizes]
    codec = Nvcomp()
    with use_backend("gpu"):
        backend = get_backend()
        with backend.stream([]):
            flat = cupy.asarray(np.frombuffer(b"".join(raws), np.uint8))
            buffers = codec.compress_parts(flat, sizes, backend)
    return check_frames(buffers, raws, codec.chunk)


def glue_nonblocking(runner: str) -> list[str]:
    """compress(blocking=False) on a side torch stream: the pending payload's bytes equal the blocking call's."""
    try:
        import torch
    except ImportError:
        return ["skip: torch is not installed"]
    import gpu_codec
    from gpu_codec.testing import use_backend

    base, new, _ = _glue_update(1 << 20, 5)
    with use_backend("gpu"):
        tb = {k: torch.from_numpy(v).cuda() for k, v in base.items()}
        tn = {k: torch.from_numpy(v).cuda() for k, v in new.items()}
        want = gpu_codec.compress(tn, tb, fraction=0.01).to_bytes()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                a = a @ a / 64
            pending = gpu_codec.compress(tn, tb, fraction=0.01, blocking=False)
            got = pending.to_bytes()
    return [] if got == want else ["compress(blocking=False) bytes differ from the blocking call's"]


NCU_N = 1 << 24  # elements of the update ncu measures (one global segment of 4096 chunks: cand_hist's path)
NCU_KERNELS = ("fused_scan", "cand_hist", "cand_select", "radix_pick", "cand_count", "cand_write_u32")  # a prefix each
NCU_SCAN_METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__time_duration.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
)
# the scan step's launches, in order, after a warm-up compress of each dtype (which gives error feedback a
# residual): fp32, fused_scan_f32 on aligned arrays, fused_scan on the same, fused_scan_f32 on arrays one element
# into their allocations; fp16, fused_scan_h16 on aligned arrays and fused_scan on the same
NCU_SCAN_GROUPS = (
    ("float32", (("vector", "fused_scan_f32"), ("general", "fused_scan"), ("misaligned", "fused_scan_f32"))),
    ("float16", (("vector_h16", "fused_scan_h16"), ("general_h16", "fused_scan"))),
)
NCU_SCAN_RUNS = tuple(run for _, runs in NCU_SCAN_GROUPS for run in runs)
_NCU_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def ncu_workload() -> int:
    """What ncu profiles: one fp32 compress of NCU_N elements against a base, global scope, on the GPU."""
    import cupy
    import numpy as np

    import gpu_codec
    from gpu_codec.testing import use_backend

    rng = np.random.default_rng(0)
    base = {"w": cupy.asarray(rng.standard_normal(NCU_N).astype(np.float32))}
    new = {"w": base["w"] + cupy.asarray(rng.standard_normal(NCU_N).astype(np.float32))}
    with use_backend("gpu"):
        gpu_codec.compress(new, base, fraction=0.01).to_bytes()
    print("ncu workload: ok")
    return 0


def ncu_scan_workload(backend: str = "gpu", n: int = NCU_N) -> int:
    """What the scan step profiles, per dtype of NCU_SCAN_GROUPS: a warm-up compress that gives error feedback a
    residual, then the group's compresses of n elements against a base with that residual (the scan reads new,
    base and residual and writes the new residual), global scope; a group's payloads must be equal. ``backend``
    "emulated" and a small n check the workload itself on the CPU."""
    import numpy as np

    import gpu_codec
    from gpu_codec.testing import kernel_cases as kc
    from gpu_codec.testing import use_backend

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(n).astype(np.float32)
    w = w0 + rng.standard_normal(n).astype(np.float32)
    with use_backend(backend) as b:
        xp = b.runner.xp

        def at(values, shift, dtype):
            a = xp.empty(values.size + 1, dtype=dtype)[shift : shift + values.size]
            a[...] = xp.asarray(values.astype(dtype))
            return a

        for dtype, runs in NCU_SCAN_GROUPS:
            ef = gpu_codec.ErrorFeedback()
            gpu_codec.compress({"w": at(w0 * 0.5, 0, dtype)}, {"w": at(w0, 0, dtype)}, fraction=0.01, residual=ef)
            state = ef.to_bytes()
            blobs = []
            for name, _ in runs:
                shift = 1 if name.startswith("misaligned") else 0
                new, base = {"w": at(w, shift, dtype)}, {"w": at(w0, shift, dtype)}
                with kc.forced(scan="fused_scan" if name.startswith("general") else ""):
                    res = gpu_codec.ErrorFeedback.from_bytes(state)
                    blobs.append(gpu_codec.compress(new, base, fraction=0.01, residual=res).to_bytes())
            if len(set(blobs)) != 1:
                print(f"ncu scan workload: the {dtype} scans gave different payloads")
                return 1
    print("ncu scan workload: ok")
    return 0


def parse_ncu_csv(text: str) -> dict[str, float]:
    """DRAM bytes (read + write) per kernel name from ``ncu --csv`` output."""
    import csv
    import io

    rows = [ln for ln in text.splitlines() if ln.startswith('"')]
    out: dict[str, float] = {}
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        name = (r.get("Kernel Name") or "").split("(")[0]
        if r.get("Metric Name", "").startswith("dram__bytes"):
            v = float(str(r.get("Metric Value", "0")).replace(",", ""))
            out[name] = out.get(name, 0.0) + v * _NCU_UNITS.get(r.get("Metric Unit", "byte"), 1)
    return out


_NCU_TIME_UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


def parse_ncu_launches(text: str) -> list[dict]:
    """Per profiled launch, in order: its kernel name and every metric of ``ncu --csv`` output (bytes in bytes,
    times in seconds, counts as they are)."""
    import csv
    import io

    rows = [ln for ln in text.splitlines() if ln.startswith('"')]
    out: dict[str, dict] = {}
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        launch = out.setdefault(r.get("ID", ""), {"kernel": (r.get("Kernel Name") or "").split("(")[0]})
        unit = r.get("Metric Unit", "")
        scale = _NCU_UNITS.get(unit) or _NCU_TIME_UNITS.get(unit) or 1
        launch[r.get("Metric Name", "")] = float(str(r.get("Metric Value", "0")).replace(",", "")) * scale
    return [out[k] for k in sorted(out, key=lambda k: int(k) if k.isdigit() else k)]


def scan_loads(launches: list[dict]) -> tuple[dict, list[str]]:
    """Per element of each NCU_SCAN_RUNS launch: DRAM bytes, load requests, sectors a request, time (ns) and DRAM
    GB/s; and the problems: a launch missing or another kernel, a vector scan's aligned loads (fused_scan_f32's,
    fused_scan_h16's) not fewer requests than fused_scan's on the same inputs, or a vector scan moving more DRAM
    bytes than fused_scan (beyond 2 %)."""
    scans = [x for x in launches if x["kernel"].startswith("fused_scan")]
    want = [k for _, runs in NCU_SCAN_GROUPS for k in (runs[0][1], *(k for _, k in runs))]  # each group's warm-up
    if [x["kernel"] for x in scans] != want:
        return {}, [f"ncu profiled scans {[x['kernel'] for x in scans]}, expected {want}"]
    warm, at = set(), 0
    for _, runs in NCU_SCAN_GROUPS:
        warm.add(at)
        at += 1 + len(runs)
    scans = [x for i, x in enumerate(scans) if i not in warm]
    per = {}
    for (name, _), x in zip(NCU_SCAN_RUNS, scans):
        dram = x.get("dram__bytes_read.sum", 0.0) + x.get("dram__bytes_write.sum", 0.0)
        req = x.get("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", 0.0)
        sec = x.get("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", 0.0)
        t = x.get("gpu__time_duration.sum", 0.0)
        per[name] = {
            "kernel": x["kernel"],
            "dram_bytes_per_element": round(dram / NCU_N, 3),
            "load_requests_per_element": round(req / NCU_N, 4),
            "sectors_per_request": round(sec / req, 2) if req else 0.0,
            "ns_per_element": round(t / NCU_N * 1e9, 4),
            "dram_gb_per_s": round(dram / t / 1e9, 1) if t else 0.0,
        }
    problems = []
    for vector, general, others in (("vector", "general", ("misaligned",)), ("vector_h16", "general_h16", ())):
        kernel = per[vector]["kernel"]
        if not per[vector]["load_requests_per_element"] < per[general]["load_requests_per_element"]:
            problems.append(f"{kernel}'s loads are not wider than fused_scan's: {per}")
        for name in (vector, *others):
            if per[name]["dram_bytes_per_element"] > 1.02 * per[general]["dram_bytes_per_element"]:
                problems.append(f"{kernel} ({name}) moved more DRAM bytes than fused_scan: {per}")
    return per, problems


def _run_ncu(out_dir, metrics: str, kernels: str, workload: str, log: str):
    """This script's ``workload`` flag under ``ncu --csv`` (the ``metrics`` of the kernels matching the regex
    ``kernels``), its output kept in out_dir/``log``: the completed process, or the step's problems as a list (ncu
    missing, or the run failing)."""
    ncu = shutil.which("ncu") or ("/usr/local/cuda/bin/ncu" if os.path.exists("/usr/local/cuda/bin/ncu") else None)
    if not ncu:
        return ["skip: ncu is not installed"]
    cmd = [ncu, "--csv", "--metrics", metrics, "--kernel-name", "regex:" + kernels]
    cmd += [sys.executable, str(Path(__file__).resolve()), workload]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    (Path(out_dir) / log).write_text(r.stdout + r.stderr)
    if r.returncode != 0 or "workload: ok" not in r.stdout:
        return [f"ncu failed (exit {r.returncode}); see {log}"]
    return r


def glue_scan_ncu(out_dir) -> list[str]:
    """The fused scan's loads under Nsight Compute (ncu_scan_workload): fused_scan_f32's 128-bit loads issue fewer
    requests than fused_scan's on the same inputs, and neither its aligned nor its misaligned run moves more DRAM
    bytes; the times per element are logged (not judged)."""
    r = _run_ncu(out_dir, ",".join(NCU_SCAN_METRICS), "^fused_scan", "--ncu-scan-workload", "ncu_scan.log")
    if isinstance(r, list):
        return r
    per, problems = scan_loads(parse_ncu_launches(r.stdout))
    print("ncu scan loads: " + json.dumps(per))
    return problems


def glue_ncu(out_dir) -> list[str]:
    """DRAM traffic per kernel under Nsight Compute: fused_scan_f32 reads new and base once (8 B an element, fp32),
    and the selection on the candidates adds little."""
    dram = "dram__bytes_read.sum,dram__bytes_write.sum"
    r = _run_ncu(out_dir, dram, "|".join(NCU_KERNELS), "--ncu-workload", "ncu_traffic.log")
    if isinstance(r, list):
        return r
    per = {k: v / NCU_N for k, v in parse_ncu_csv(r.stdout).items()}
    problems = []
    if "fused_scan_f32" not in per:
        problems.append(f"no fused_scan_f32 in ncu's report: {sorted(per)}")
    elif per["fused_scan_f32"] > 8.8:
        problems.append(f"fused_scan_f32 moved {per['fused_scan_f32']:.2f} B an element (new and base: 8)")
    sel = sum(per.get(k, 0.0) for k in ("cand_hist", "cand_select", "radix_pick"))
    if sel > 0.5:
        problems.append(f"the selection on the candidates moved {sel:.2f} B an element")
    print("ncu bytes per element: " + json.dumps({k: round(v, 3) for k, v in per.items()}))
    return problems


def parse_sanitizer(text: str) -> dict:
    """Error counts from a compute-sanitizer log.

    >>> parse_sanitizer("========= ERROR SUMMARY: 0 errors")
    {'errors': 0, 'hazards': 0, 'summary_found': True}
    >>> parse_sanitizer("========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)")
    {'errors': 1, 'hazards': 3, 'summary_found': True}
    """
    errors, hazards, found = 0, 0, False
    for m in re.finditer(r"ERROR SUMMARY: (\d+) errors?", text):
        errors += int(m.group(1))
        found = True
    for m in re.finditer(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text):
        hazards += int(m.group(1))
        errors += int(m.group(2))
        found = True
    return {"errors": errors, "hazards": hazards, "summary_found": found}


# ------------------------------------------------------------------------------------------- the workload


def workload(runner_kind: str) -> int:
    """Launch every kernel at least once on small inputs and check the results (run under compute-sanitizer)."""
    kc = _cases_module()
    inner = make_runner(runner_kind)
    if runner_kind == "cupy":
        import cupy

        cupy.cuda.set_allocator(None)  # one cudaMalloc per array: memcheck sees each buffer's real bounds
    r = CountingRunner(inner)
    topk = kc.TopkCase(
        "workload", (3000, 5000, 300, 0), ("f32", "bf16", "f64", "f16"), res=True, res_out="new", qmode=1, k=0.1
    )
    m = []
    m += kc.topk_stepwise(r, topk)
    m += kc.topk_stepwise(r, topk.with_(name="workload_u64", scope="tensor", res_out="alias"), wide=True)
    m += kc.topk_vs_reference(r, topk.with_(name="workload_ops", pattern="ties"))
    m += kc.topk_fused_stepwise(r, topk.with_(name="workload_fused_own"))  # small segments: selected by their chunks
    # and bracketed by a sample, as larger segments are
    m += kc.topk_fused_stepwise(r, topk.with_(name="workload_fused"), own="one")
    u64 = topk.with_(name="workload_fused_u64", scope="tensor", res_out="alias")
    m += kc.topk_fused_stepwise(r, u64, wide=True, own="one")
    m += kc.topk_fused_stepwise(r, topk.with_(name="workload_fused_miss"), force="miss", own="one")
    m += kc.topk_fused_stepwise(r, topk.with_(name="workload_fused_multi"), select="multi", own="one")
    tied = topk.with_(name="workload_fused_tied", pattern="equal", k=0.01)  # kept by the first keys equal to lo
    m += kc.topk_fused_stepwise(r, tied, own="one")
    m += kc.topk_fused_stepwise(r, tied.with_(name="workload_fused_tied_u64"), wide=True, own="one")
    # fp32 by the delta's magnitude: fused_scan_f32, its 128-bit loads (tails of 1 and 3 elements) and, at arrays
    # one element into their allocations, its scalar loads
    f32 = kc.TopkCase("workload_fused_f32", (4097, 5000, 3, 0), ("f32",) * 4, res=True, res_out="new", qmode=1, k=0.1)
    m += kc.topk_fused_stepwise(r, f32)
    m += kc.topk_fused_stepwise(r, f32.with_(name="workload_fused_f32_misaligned", shift=1))
    h16 = f32.with_(name="workload_fused_h16", dtypes=("bf16", "f16", "bf16", "f16"))  # fused_scan_h16
    m += kc.topk_fused_stepwise(r, h16)
    m += kc.topk_fused_stepwise(r, h16.with_(name="workload_fused_h16_misaligned", shift=1))
    m += kc.scatter_stepwise(r, kc.ScatterCase("workload_scatter", (3000, 700), ("f16", "f64"), mode=1))
    m += kc.scatter_stepwise(
        r,
        kc.ScatterCase(
            "workload_scatter_u64_bad", (3000, 700), ("bf16", "f32"), wide=True, bad="dup", bad_tensor=1, bad_at=5
        ),
    )
    m += kc.quant_stepwise(
        r, kc.QuantCase("workload_quant", (3000, 700, 0), ("f32", "f64", "f32"), ("u32", "u64", "dense"))
    )
    m += kc.dense_vs_reference(r, topk)
    m += kc.rice_stepwise(r, kc.RiceCase("workload_rice", (300, 5000, 0), (30000, 9000, 10)))
    m += kc.rice_stepwise(r, kc.RiceCase("workload_rice_u64", (300, 5000), (1 << 36, 9000), wide=True))
    m += kc.float_steps(r, "workload_floats", 3001)
    m += kc.gather_copy_vs_twin(r)
    m += kc.gather_entries_vs_twin(r)
    _sync(inner)
    from gpu_codec.backends.sources import kernel_signatures

    missing = sorted(set(kernel_signatures()) - set(r.counts))
    print("launches:", json.dumps(dict(sorted(r.counts.items()))))
    for x in m:
        print("MISMATCH", x)
    if missing:
        print("kernels not launched:", ", ".join(missing))
    if m or missing:
        print("workload: FAILED")
        return 1
    print("workload: ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder for summary.json and the logs (required unless --workload)")
    ap.add_argument(
        "--runner",
        choices=("cupy", "emulated"),
        default="cupy",
        help="cupy: the GPU (default); emulated: the CPU emulator (no GPU steps)",
    )
    ap.add_argument(
        "--max-n",
        type=float,
        default=None,
        help="elements of the largest parity case (default 1e8 on a GPU, 2e4 emulated)",
    )
    ap.add_argument("--skip", action="append", default=[], choices=STEPS, help="skip a step (repeatable)")
    ap.add_argument("--quick", action="store_true", help="a subset of the cases (about one in seven)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no step after this many seconds (540)")
    ap.add_argument("--pytest-timeout", type=float, default=240.0, help="seconds for pytest -m gpu (240)")
    ap.add_argument(
        "--pytest-args", nargs=argparse.REMAINDER, default=[], help="further arguments for pytest (must come last)"
    )
    ap.add_argument("--sanitizer", help="path of compute-sanitizer (default: on PATH or /usr/local/cuda/bin)")
    ap.add_argument("--sanitizer-tools", nargs="+", default=list(SANITIZER_TOOLS), choices=SANITIZER_TOOLS)
    ap.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], help="architectures for the resources step")
    ap.add_argument(
        "--workload",
        action="store_true",
        help="internal: launch every kernel once and check it (what compute-sanitizer runs)",
    )
    ap.add_argument("--ncu-workload", action="store_true", help="internal: the compress ncu profiles (glue step)")
    ap.add_argument("--ncu-scan-workload", action="store_true", help="internal: the scans ncu profiles (glue step)")
    args = ap.parse_args(argv)
    _ensure_importable()
    if args.workload:
        return workload(args.runner)
    if args.ncu_workload:
        return ncu_workload()
    if args.ncu_scan_workload:
        return ncu_scan_workload()
    if not args.out:
        ap.error("--out is required")
    suite = Suite(args)
    suite.log(f"gpu_suite: runner {args.runner}, out {suite.out}, budget {args.budget_s:.0f} s")
    for step in STEPS:
        suite.run_step(step)
    failed = [s for s, v in suite.summary["steps"].items() if v["status"] == "fail"]
    suite.summary["result"] = "fail" if failed else "pass"
    suite.save()
    suite.log(
        f"gpu_suite: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed or skipped'} "
        f"({suite.summary['seconds']} s); summary in {suite.out / 'summary.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
