"""Versions 2 and 3 of docs/FORMAT.md are complete and right: the independent reader (tests/spec_reader.py, which
imports nothing from gpu_codec) reads every golden payload of every version, and fresh payloads of every encoding
in each data mode, to the same bits as gpu_codec.decompress, and computes the same base fingerprint."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec.codecs import wire_layouts
from gpu_codec.format import v2
from tests import spec_reader
from tests.test_format import golden_inputs
from tests.test_format_spec import FRESH, assert_same, update

GOLDEN = sorted((pathlib.Path(__file__).parent / "golden").glob("*.bin"))


def test_the_goldens_hold_every_version():
    assert {p.read_bytes()[8] for p in GOLDEN} == {1, 2, 3}


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_every_golden_payload_reads_the_same(path):
    blob = path.read_bytes()
    ours = assert_same(blob)
    assert list(ours) == [t["name"] for t in gpu_codec.format.unpack(blob, wire_layouts())[0]["tensors"]]
    _, base = golden_inputs()
    if sorted(ours) == sorted(base):  # the goldens of GOLDEN_CASES (the v3 one has inputs of its own)
        assert_same(blob, base, base)


def modes_of(p: gpu_codec.Payload) -> dict[str, bytes]:
    if p.tensors[0].encoding != "zstd":
        return {"default": p.to_bytes()}
    return {
        name: v2.write(v2.plan(p.tensors, p.pipeline, p.metadata, wire_layouts(), data_mode=mode))
        for name, mode in (("records", v2.DATA_RECORDS), ("zstd", v2.DATA_ZSTD), ("plain", v2.DATA_PLAIN))
    }


@pytest.mark.parametrize("case", sorted(FRESH))
def test_fresh_v2_payloads_in_every_data_mode_read_the_same(case):
    kwargs, _ = FRESH[case]
    new, base = update(np.random.default_rng(sorted(FRESH).index(case)))
    p = gpu_codec.compress(new, base, metadata={"round": 2, "site": "é"}, **kwargs)
    for mode, blob in modes_of(p).items():
        assert blob[8] == 2
        header, _ = spec_reader.parse_any(blob)
        assert header["metadata"] == {"round": 2, "site": "é"} and header["pipeline"] == p.pipeline, mode
        assert_same(blob)
        assert_same(blob, base, base)


def test_a_compressed_table_and_front_coded_names():
    u = {f"blocks.{i}.mlp.fc{j}.weight": np.full(40, i + j, np.float32) for i in range(60) for j in (1, 2)}
    blob = gpu_codec.compress(u, fraction=0.1).to_bytes()
    assert blob[12] & v2.FLAG_TABLE_ZSTD
    assert list(assert_same(blob)) == list(u)


def test_the_base_fingerprint_as_the_document_defines_it():
    torch = pytest.importorskip("torch")
    new, base = update(np.random.default_rng(5))
    new["bf"], base["bf"] = (
        torch.linspace(0, 1, 700).to(torch.bfloat16) + 1,
        torch.linspace(0, 1, 700).to(torch.bfloat16),
    )
    p = gpu_codec.compress(new, base, fraction=0.1, fingerprint_base=True)
    spec_base = {k: v.view(torch.int16).numpy().view(np.uint16) if k == "bf" else v for k, v in base.items()}
    assert spec_reader.base_fingerprint(spec_base, list(new)) == p.base_fingerprint
    for version in (1, 2):
        header, _ = spec_reader.parse_any(p.to_bytes(version=version))
        assert header["base_fingerprint"] == p.base_fingerprint
