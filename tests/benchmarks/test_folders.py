"""benchmarks/ is grouped by question, and stands on its own: nothing in it imports tests/."""

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FOLDERS = (
    "layers",
    "pipeline",
    "zero",
    "openvla",
    "llava",
    "siglip",
    "lora",
    "data",
    "plan",
    "tools",
)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_every_script_sits_in_a_question_folder_and_imports_no_tests():
    scripts = sorted(BENCHMARKS.rglob("*.py"))
    assert {p.relative_to(BENCHMARKS).parts[0] for p in scripts} <= {*FOLDERS, "__init__.py"}
    for folder in FOLDERS:
        assert (BENCHMARKS / folder / "__init__.py").is_file(), folder
    for path in scripts:
        bad = [m for m in _imports(path) if m == "tests" or m.startswith("tests.")]
        assert not bad, f"{path.relative_to(BENCHMARKS)} imports {bad}"
