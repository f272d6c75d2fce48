"""The package's layers point down only: adapters -> engine -> codecs -> backends -> kernels / twins."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gpu_codec"

# Rank of each module group: a module may import only groups of a lower or equal rank.
BOTTOM = {"constants", "errors", "dtypes", "format"}  # format: the container, which codecs register into
RANK = {"bottom": 0, "cpu_fallback": 1, "kernels": 1, "xp": 1, "backends": 2, "codecs": 3, "core": 4, "adapters": 5}
CORE = {
    "engine",
    "encode",
    "decode",
    "payload",
    "aggregate",
    "arrays",
    "collector",
    "error_feedback",
    "pending",
    "schedules",
    "synthetic",
}
ADAPTERS = {"clara", "openfl", "fl4health", "flower", "nvflare", "adapt", "cli", "testing", "__init__"}


def _group(mod: str) -> str:
    parts = mod.split(".")
    assert parts[0] == "gpu_codec", mod
    if len(parts) == 1:
        return "adapters"
    head = parts[1]
    if head in BOTTOM:
        return "bottom"
    if head in ("backends", "codecs", "cpu_fallback", "kernels", "xp"):
        return head
    if head in CORE:
        return "core"
    assert head in ADAPTERS, f"unknown module {mod}"
    return "adapters"


def _files() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        out[".".join(("gpu_codec", *rel.parts))] = p
    for p in (ROOT / "cpu_fallback").glob("*.py"):
        out[f"gpu_codec.cpu_fallback.{p.stem}"] = p
    return out


def _imports(mod: str, path: Path) -> set[str]:
    """Every gpu_codec module ``mod`` imports, at top level or inside functions."""
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpu_codec")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("gpu_codec"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in _files()}
    return found


def test_layers_point_down():
    bad = []
    for mod, path in _files().items():
        if mod.endswith(("__main__",)):
            continue
        g = RANK[_group(mod)]
        for imp in _imports(mod, path):
            if imp == "gpu_codec":
                continue
            if RANK[_group(imp)] > g:
                bad.append(f"{mod} imports {imp}")
    assert bad == []


def test_cpu_backend_and_kernel_wrappers_stay_apart():
    files = _files()
    cpu_imports = _imports("gpu_codec.backends.cpu", files["gpu_codec.backends.cpu"])
    assert not cpu_imports & {f"gpu_codec.backends.{m}" for m in ("gpu", "kernels", "emulated")}
    for m in ("gpu_codec.backends.kernels", "gpu_codec.backends.gpu", "gpu_codec.backends.emulated"):
        assert not {i for i in _imports(m, files[m]) if "cpu_fallback" in i}, m


def test_codecs_reach_kernels_only_through_the_backend():
    files = _files()
    for m, p in files.items():
        if m.startswith("gpu_codec.codecs."):
            imps = _imports(m, p)
            assert not {i for i in imps if i.startswith("gpu_codec.backends.") and i != "gpu_codec.backends.base"}, m
            assert not {i for i in imps if "cpu_fallback.quantize" in i or "cpu_fallback.select" in i}, m


def test_index_rule_lives_in_one_place():
    hits = [p for p in [*PKG.rglob("*.py"), *(ROOT / "cpu_fallback").glob("*.py")] if "1 << 32)" in p.read_text()]
    assert [p.name for p in hits] == ["constants.py"]


def _edges(mod: str, path: Path, files: dict[str, Path]) -> set[str]:
    """The modules ``mod`` imports, at top level or inside functions: ``from pkg import sub`` counts as importing
    the submodule ``sub`` alone, any other name as importing ``pkg`` (its ``__init__``)."""
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in files}
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in files else base)
    return {m for m in found if m in files and m not in (mod, "gpu_codec")}


def test_no_import_cycles():
    """No module reaches itself through the imports of others (lazy imports inside functions count too)."""
    files = {m.removesuffix(".__init__"): p for m, p in _files().items()}
    graph = {m: _edges(m, p, files) for m, p in files.items()}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(path[path.index(n) :] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_twins_import_nothing_above_them():
    """The NumPy twins of the kernels (cpu_fallback/) take their numbers and rules from gpu_codec.constants alone,
    as the kernels take them as -D flags (and raise the package's errors), and the array code every backend runs
    from gpu_codec.xp, beside them: nothing of the format, the codecs or the backends; and that array code imports no
    twin."""
    bad = []
    for mod, path in _files().items():
        if mod.startswith("gpu_codec.cpu_fallback."):
            bad += [f"{mod} imports {i}" for i in _imports(mod, path) if not i.startswith("gpu_codec.cpu_fallback")]
    allowed = (" imports gpu_codec.constants", " imports gpu_codec.errors", " imports gpu_codec.xp")
    bad = [b for b in bad if not b.endswith(allowed) and " imports gpu_codec.xp." not in b]
    assert bad == []
    for mod, path in _files().items():  # the array code stands beside the twins, not on them
        if mod.startswith("gpu_codec.xp."):
            assert not any(i.startswith("gpu_codec.cpu_fallback") for i in _imports(mod, path)), mod
