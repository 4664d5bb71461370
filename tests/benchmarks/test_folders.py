"""benchmarks/ is grouped by question, one axis: the part of parallax a question is about (a
whole training step against its peers is ``step/``, one script per workload). No file repeats
its folder's name, no two files import each other (round about either), and nothing in it
imports tests/ (it stands on its own)."""

import ast
from pathlib import Path

from tests.test_structure import _circles

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FOLDERS = ("layers", "pipeline", "zero", "checkpoint", "plan", "data", "step", "tools")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, type-checking-only and in-function imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(BENCHMARKS.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_every_script_sits_in_a_question_folder_and_imports_no_tests():
    scripts = sorted(BENCHMARKS.rglob("*.py"))
    assert {p.relative_to(BENCHMARKS).parts[0] for p in scripts} <= {*FOLDERS, "__init__.py"}
    for folder in FOLDERS:
        assert (BENCHMARKS / folder / "__init__.py").is_file(), folder
    for path in scripts:
        bad = [m for m in _imports(path) if m == "tests" or m.startswith("tests.")]
        assert not bad, f"{path.relative_to(BENCHMARKS)} imports {bad}"


def test_no_file_repeats_its_folders_name():
    stutter = [
        str(p.relative_to(BENCHMARKS))
        for p in sorted(BENCHMARKS.rglob("*"))
        if p.is_file() and p.parent != BENCHMARKS and p.parent.name in p.stem.split("_")
    ]
    assert not stutter, f"name them without their folder's name: {stutter}"


def test_no_circle_of_imports():
    scripts = {_module(p): p for p in sorted(BENCHMARKS.rglob("*.py"))}
    graph = {m: set() for m in scripts}
    for module, path in scripts.items():
        for name in _imports(path):
            while name and name not in scripts:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    assert not _circles(graph), _circles(graph)
