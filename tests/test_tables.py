"""The number tables in the docs are the ones ``benchmarks/tables.py`` generates from ``benchmarks/results/``."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tables():
    name = "gpu_codec_benchmarks_tables"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "tables.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_docs_agree_with_the_committed_results():
    t = tables()
    assert t.stale() == [], "run: python benchmarks/tables.py"


def test_every_doc_keeps_its_generated_regions():
    t = tables()
    want = {
        "README.md": [
            "headline",
            "nvflare",
            "zoo_gpu",
            "gpu_against_latest",
            "gpu_against_views",
            "gpu_against",
            "gpu_against_shared",
            "gpu_against_wrap",
            "collector_gpu",
            "collector_cpu",
            "topk",
            "traffic",
            "layout",
            "server",
            "convergence",
            "pipelines",
        ],
        "examples/nvflare/README.md": ["nvflare"],
        "examples/flower/README.md": ["flower"],
    }
    for doc, names in want.items():
        assert t.regions((ROOT / doc).read_text(encoding="utf-8")) == names, doc


def test_a_changed_figure_is_caught():
    t = tables()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    figure = t.headline().split("zstd ")[1].split("×")[0]  # the fp16 ratio as the results give it
    edited = text.replace(f"zstd {figure}× fewer", "zstd 110× fewer", 1)
    assert edited != text and t.render(edited) == text


def test_an_empty_region_is_filled():
    t = tables()
    text = "a\n<!-- tables:gpu_against -->\n<!-- /tables:gpu_against -->\nb"
    got = t.render(text)
    assert got.startswith("a\n<!-- tables:gpu_against -->\n") and got.endswith("\n<!-- /tables:gpu_against -->\nb")
    assert t.gpu_against() in got and t.render(got) == got
