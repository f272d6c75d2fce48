"""Fuzz the decoder for a set time and record what it tried and what came out.

Two engines, over the same oracle (:func:`gpu_codec.testing.fuzz.check`: a decode with finite values of the
declared shapes, or a PayloadError; anything else is a finding):

* ``atheris`` (coverage-guided libFuzzer, used when ``atheris`` imports): the fuzzer's input is the payload
  without its checksum, which is recomputed, so its byte mutations reach every check past the checksum; the seed
  corpus is the golden payloads and a fresh payload of every pipeline;
* ``mutate`` (pure Python): structure-aware mutations of :func:`gpu_codec.testing.fuzz.mutate` (header nodes
  replaced by junk or deleted, data bytes flipped, set, inserted or cut, prefix and header text flipped,
  truncation), from the same seeds; a mutant with an outcome not seen before joins the seeds;
* ``table`` (pure Python): :func:`gpu_codec.testing.fuzz.mutate_table` on version 2/3 payloads (fields of the
  binary tensor table replaced by their bounds, off-by-one counts and lengths, non-canonical varints, codes past
  their tables, other stage codes; fields and tensor entries deleted, repeated or swapped; flags, table length
  and data damaged), and whatever decodes must read the same in tests/spec_reader.py, the independent reader.

Findings are grouped by exception type and message (numbers stripped); the first input of each is written under
``benchmarks/results/fuzz_findings/``. Run: ``python benchmarks/fuzz_decoder.py --seconds 60`` (NumPy backend);
writes benchmarks/results/fuzz_decoder.json.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class Recorder:
    def __init__(self, engine: str, seconds: float, out: Path, findings_dir: Path):
        self.engine, self.seconds, self.out, self.findings_dir = engine, seconds, out, findings_dir
        self.t0 = time.time()
        self.runs = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.findings: dict[str, dict] = {}
        self.last_write = 0.0

    def record(self, blob: bytes, fn) -> str:
        self.runs += 1
        try:
            outcome = fn(blob)
        except Exception as e:  # a finding: anything but a PayloadError (or a non-finite decode)
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            key = f"{type(e).__name__}: {re.sub(r'[0-9]+', 'N', msg)}"
            outcome = "FINDING " + type(e).__name__
            f = self.findings.get(key)
            if f is None:
                digest = hashlib.sha1(blob).hexdigest()[:12]
                self.findings_dir.mkdir(parents=True, exist_ok=True)
                path = self.findings_dir / f"{digest}.bin"
                path.write_bytes(blob)
                tb = traceback.extract_tb(e.__traceback__)[-1]
                self.findings[key] = {
                    "count": 1,
                    "example": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
                    "raised_at": f"{Path(tb.filename).name}:{tb.lineno}",
                    "message": msg,
                }
            else:
                f["count"] += 1
        self.outcomes[outcome] += 1
        if time.time() - self.last_write > 5:
            self.write()
        return outcome

    def write(self) -> None:
        self.last_write = time.time()
        res = {
            "engine": self.engine,
            "seconds": round(time.time() - self.t0, 1),
            "target_seconds": self.seconds,
            "inputs": self.runs,
            "inputs_per_second": round(self.runs / max(1e-9, time.time() - self.t0), 1),
            "outcomes": dict(self.outcomes.most_common()),
            "findings": self.findings,
            "python": sys.version.split()[0],
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(res, indent=1) + "\n")


def run_mutate(rec: Recorder, seeds: dict[str, bytes], seconds: float, seed: int) -> None:
    from gpu_codec.testing import fuzz

    rng = random.Random(seed)
    pool = list(seeds.values())
    seen: set[str] = set()
    junk = [None, True, False, -1, 0, 1, 2**31, 2**32, 2**63, 2**64, 10**40, 1.5, 1e308, "", "x", "float32",
            "uint64", "zstd", "rice", [], [0, 2**63], [1] * 9, {}, {"role": "values"}, "\ud800"]  # fmt: skip

    def op():
        k = rng.choice(["header", "header", "delete", "flip", "flip", "byte", "insert", "cut", "body_flip",
                        "body_byte", "truncate"])  # fmt: skip
        pos = rng.randrange(2**31)
        if k == "header":
            return (k, pos, rng.choice(junk) if rng.random() < 0.8 else rng.randrange(-(2**40), 2**40))
        if k in ("delete", "truncate"):
            return (k, pos)
        if k == "insert":
            return (k, pos, rng.randbytes(rng.randrange(1, 9)))
        return (k, pos, rng.randrange(256))

    base = fuzz.seed_base()
    end = time.time() + seconds
    while time.time() < end:
        parent = rng.choice(pool)
        blob = fuzz.mutate(parent, [op() for _ in range(rng.randrange(1, 5))])
        with_base = rng.random() < 0.3
        outcome = rec.record(blob, lambda b, wb=with_base: fuzz.check(b, base if wb else None))
        if outcome not in seen and len(pool) < 2000:  # keep inputs that reached a new outcome
            seen.add(outcome)
            pool.append(blob)


def run_table(rec: Recorder, seconds: float, seed: int) -> None:
    from gpu_codec.testing import fuzz

    sys.path.insert(0, str(ROOT))
    from tests import spec_reader

    rng = random.Random(seed)
    seeds = fuzz.seed_corpus_v2(ROOT / "tests" / "golden")
    names = sorted(seeds)
    base = fuzz.seed_base()
    end = time.time() + seconds
    while time.time() < end:
        name = rng.choice(names)
        blob = fuzz.mutate_table(seeds[name], rng, rng.randrange(1, 4))
        b = base if rng.random() < 0.3 and not name.startswith("golden") else None
        rec.record(blob, lambda x, b=b: fuzz.check_against(x, spec_reader.read, b))


def run_atheris(rec: Recorder, seeds: dict[str, bytes], seconds: float, seed: int) -> None:
    import atheris

    from gpu_codec.testing import fuzz  # instrumented: main() imported it under atheris.instrument_imports

    corpus = Path(tempfile.mkdtemp(prefix="gpu_codec_fuzz_"))
    for name, blob in seeds.items():
        (corpus / (name.replace("/", "_") + ".bin")).write_bytes(blob[:-4])  # the fuzzer's input: no checksum

    def one(data: bytes) -> None:
        blob = data + (zlib.crc32(data) & 0xFFFFFFFF).to_bytes(4, "little")
        rec.record(blob, fuzz.check)

    argv = [
        sys.argv[0],
        f"-max_total_time={int(seconds)}",
        f"-seed={seed + 1}",  # libFuzzer takes 0 as "random"
        "-max_len=65536",
        "-rss_limit_mb=4096",
        str(corpus),
    ]
    atheris.Setup(argv, one)
    atheris.Fuzz()  # exits the process when the time is up: the recorder has written on the way


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--engine", choices=("auto", "atheris", "mutate", "table"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("GPU_CODEC_BACKEND", "cpu")
    warnings.simplefilter("error")  # as the test suite runs: a warning on hostile input is a finding too
    engine = a.engine
    if engine == "auto":
        try:
            import atheris
        except ImportError:
            engine = "mutate"
        else:
            engine = "atheris"
    if engine == "atheris":
        import atheris

        with atheris.instrument_imports(include=["gpu_codec"]):  # coverage of the package's Python code
            from gpu_codec.testing import fuzz
    else:
        from gpu_codec.testing import fuzz

    seeds = fuzz.seed_corpus(ROOT / "tests" / "golden")
    out = a.out or RESULTS / f"fuzz_decoder_{engine}.json"
    rec = Recorder(engine, a.seconds, out, out.parent / "fuzz_findings")
    import atexit

    atexit.register(rec.write)
    if engine == "atheris":
        rec.write()
        run_atheris(rec, seeds, a.seconds, a.seed)
    elif engine == "table":
        run_table(rec, a.seconds, a.seed)
    else:
        run_mutate(rec, seeds, a.seconds, a.seed)
    rec.write()
    print(json.dumps({k: v for k, v in json.loads(out.read_text()).items() if k != "findings"}, indent=1))
    print(f"{len(rec.findings)} distinct findings; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
