"""A payload cut short anywhere is reported as truncated (PayloadTruncatedError: shorter than its header or
tensor table declares), in every format version and data mode, instead of only as a checksum mismatch; damage
that keeps the length is still a checksum mismatch."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import gpu_codec
from gpu_codec import PayloadChecksumError, PayloadLayoutError, PayloadTruncatedError, Quantize, RiceIndices, Zstd
from gpu_codec.codecs import wire_layouts
from gpu_codec.format import v2

from .common import use_backend

GOLDEN = sorted((pathlib.Path(__file__).parent / "golden").glob("*.bin"))


def update(n: int = 300) -> dict:
    rng = np.random.default_rng(1)
    return {"a": rng.standard_normal(n).astype(np.float32), "b": rng.standard_normal((7, 5)), "c.w": np.ones(9)}


def fresh() -> dict[str, bytes]:
    u = update()
    with use_backend("cpu"):
        p = gpu_codec.compress(u, fraction=0.1, metadata={"round": 7})
        z = gpu_codec.compress(u, fraction=0.1, pipeline=[Quantize("float16"), RiceIndices(), Zstd()])
        d = gpu_codec.compress(update(20_000), fraction=None, pipeline=[Zstd()])
        modes = {
            f"v2_{name}": v2.write(v2.plan(z.tensors, z.pipeline, {}, wire_layouts(), data_mode=mode))
            for name, mode in (("records", v2.DATA_RECORDS), ("zstd", v2.DATA_ZSTD), ("plain", v2.DATA_PLAIN))
        }
        big = gpu_codec.compress({f"layer{i}.weight": np.ones(30, np.float32) * i for i in range(200)}, fraction=0.1)
        return {
            "v1": p.to_bytes(version=1),
            "v2": p.to_bytes(),
            "v1_zstd": z.to_bytes(version=1),
            "v2_dense_zstd": d.to_bytes(),
            "v2_compressed_table": big.to_bytes(),
            **modes,
        }


CASES = {**fresh(), **{f"golden/{p.name}": p.read_bytes() for p in GOLDEN}}


def test_the_cases_cover_every_data_mode_and_a_compressed_table():
    modes = {gpu_codec.format.unpack(b, wire_layouts())[0].get("data") for b in CASES.values()}
    assert modes == {None, "records", "zstd", "plain"}  # None: version 1
    assert CASES["v2_compressed_table"][12] & v2.FLAG_TABLE_ZSTD


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_cut_is_reported_as_truncated(name):
    blob = CASES[name]
    gpu_codec.decompress(blob)
    step = max(1, len(blob) // 400)  # the large golden: about 400 cuts, the last bytes all
    cuts = sorted({*range(1, len(blob), step), *range(max(1, len(blob) - 40), len(blob))})
    for k in cuts:
        with pytest.raises(PayloadTruncatedError, match=r"shorter|truncated") as e:
            gpu_codec.decompress(blob[:k])
        assert isinstance(e.value, PayloadLayoutError)


@pytest.mark.parametrize("name", ["v1", "v2", "v2_zstd", "v2_records"])
def test_damage_that_keeps_the_length_is_a_checksum_mismatch(name):
    blob = bytearray(CASES[name])
    blob[len(blob) // 2] ^= 0x40
    with pytest.raises(PayloadChecksumError):
        gpu_codec.decompress(bytes(blob))
    with pytest.raises(PayloadChecksumError):  # longer than declared: not a cut, corrupt
        gpu_codec.decompress(CASES[name] + b"\0\0")
