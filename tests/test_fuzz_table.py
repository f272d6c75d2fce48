"""Structure-aware fuzzing of the version 2/3 binary tensor table, bounded for CI: 2,000 seeded mutations that
know varints, counts, lengths, codes, pipeline stages and whole tensor entries (gpu_codec.testing.fuzz.
mutate_table), with the checksum recomputed. Every outcome is a decode or one of our PayloadErrors; whatever
decodes reads the same in the independent reader (tests/spec_reader.py), and the two readers accept and reject
the same payloads. (benchmarks/fuzz_decoder.py --engine table runs the same for longer.)"""

from __future__ import annotations

import collections
import functools
import pathlib
import random

import pytest

import gpu_codec
from gpu_codec.testing import fuzz, use_backend
from tests import spec_reader

GOLDEN = pathlib.Path(__file__).parent / "golden"
MUTATIONS = 2000


@functools.lru_cache(maxsize=1)
def corpus() -> dict[str, bytes]:
    with use_backend("cpu"):
        return fuzz.seed_corpus_v2(GOLDEN)


def reference(blob: bytes, base):
    return spec_reader.read(blob, base)


def test_the_fields_of_a_table():
    t = fuzz.table_fields(corpus()["fp16_rice_zstd/records"])
    names = [f.name for f in t.fields]
    assert names[:2] == ["stage count", "stage code"] and "tensor count" in names and "compressed size" in names
    assert {f.role for f in t.fields} >= {"count", "length", "stage", "code", "value", "bytes"}
    assert all(0 <= f.start < f.end <= len(t.table) for f in t.fields)
    assert fuzz.table_fields(corpus()["raw"][:40]) is None
    assert fuzz.table_fields(gpu_codec.compress({"w": [1.0, 2.0]}, fraction=0.5).to_bytes(version=1)) is None


def test_seeds_cover_versions_modes_metadata_and_fingerprints():
    seeds = corpus()
    assert {b[8] for b in seeds.values()} == {2, 3}
    flags = [b[12] for b in seeds.values()]
    assert {f >> 2 & 3 for f in flags} == {0, 1, 2}
    assert any(f & 0x01 for f in flags) and any(f & 0x02 for f in flags) and any(f & 0x10 for f in flags)


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_tables_decode_the_same_or_raise_our_errors(seed):
    seeds = corpus()
    names = sorted(seeds)
    rng = random.Random(seed)
    base = fuzz.seed_base()
    outcomes: collections.Counter[str] = collections.Counter()
    with use_backend("cpu"):
        for _ in range(MUTATIONS // 2):
            name = rng.choice(names)
            blob = fuzz.mutate_table(seeds[name], rng, rng.randrange(1, 4))
            b = base if rng.random() < 0.3 and not name.startswith("golden") else None
            outcome = fuzz.check_against(blob, reference, b)  # anything but our errors propagates
            outcomes[outcome] += 1
            if b is None:  # the readers agree on what is a valid payload
                try:
                    spec_reader.read(blob)
                    spec = "decoded"
                except spec_reader.SpecError:
                    spec = "rejected"
                assert spec == ("decoded" if outcome == "decoded" else "rejected"), (name, outcome)
    assert "PayloadChecksumError" not in outcomes  # every mutant got past the checksum
    assert outcomes["decoded"] >= 20 and outcomes["PayloadHeaderError"] >= 200
    assert {"PayloadLayoutError", "PayloadLimitError", "PayloadTruncatedError"} <= set(outcomes), outcomes
