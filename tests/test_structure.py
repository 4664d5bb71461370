"""The package's shape, as the structure issue left it: layers that import only downward, no
circles between files, no private names taken from another module, in-function imports only
where a comment says why (an optional dependency, the compiler), families imported only when a
run asks for them, and tests that mirror the package (a test of one family under
``tests/families/<family>/``)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# lowest first: a module may import its own layer and those below it
LAYERS = [
    ("parallax.seeds", "parallax.dims", "parallax.atomic", "parallax.tomlfile", "parallax.eager"),
    ("parallax.comm",),
    ("parallax.context",),
    ("parallax.tensor", "parallax.init"),
    ("parallax.pipeline",),
    ("parallax.optim", "parallax.checkpoint"),
    ("parallax.models",),
    ("parallax.data",),
    ("parallax.run",),  # the run's vocabulary: options, their rules, TrainConfig and Run
    ("parallax.recipe",),
    ("parallax.families",),
    ("parallax.plan",),  # below the trainer, which runs --layout auto and --dry-run with it
    ("parallax.train",),
    ("parallax.report", "parallax.testing"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "parallax").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _imports(mods: dict[str, Path]):
    """``(module, target, name, line, in a function, commented)`` of every parallax import,
    type-checking-only blocks left out (they run no code)."""
    for module, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            up, inside, typing_only = node, False, False
            while up in parents:
                up = parents[up]
                inside |= isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef)
                typing_only |= isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test)
            if typing_only:
                continue
            prev = lines[node.lineno - 2] if node.lineno > 1 else ""
            commented = "#" in lines[node.lineno - 1] or "#" in prev  # here or on the line above
            if isinstance(node, ast.ImportFrom):
                if node.level or not (node.module or "").startswith("parallax"):
                    if inside:
                        yield module, None, None, node.lineno, inside, commented
                    continue
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in mods else node.module
                    yield module, target, alias.name, node.lineno, inside, commented
            else:
                for alias in node.names:
                    target = alias.name if alias.name.startswith("parallax") else None
                    yield module, target, None, node.lineno, inside, commented


def _target(name: str, mods) -> str:
    while name not in mods:
        name = name.rpartition(".")[0]
    return name


def test_the_import_graph_runs_downward_without_circles_or_private_names():
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    problems = []
    for module, target, name, line, inside, commented in _imports(mods):
        where = f"{mods[module].relative_to(ROOT)}:{line}"
        if inside and not commented:
            problems.append(f"{where}: an import inside a function without a comment saying why")
        if target is None or module == "parallax":  # the package face exports the API
            continue
        target = _target(target, mods)
        if target == module:
            continue
        graph[module].add(target)
        if name and name.startswith("_") and f"{target}.{name}" not in mods:
            problems.append(f"{where}: imports the private name {name} of {target}")
        if _layer(target) > _layer(module):
            problems.append(f"{where}: imports upward, {module} -> {target}")
    problems += [f"a circle of imports: {' -> '.join(c)}" for c in _circles(graph)]
    assert not problems, "\n".join(problems)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _loaded_after(*codes: str) -> list[set[str]]:
    """The parallax.families modules loaded after each of ``codes``, run one after the other
    in one fresh interpreter."""
    names = "','.join(m for m in sys.modules if 'families' in m)"
    probe = "import sys\n" + "".join(f"{code}\nprint('LOADED=' + {names})\n" for code in codes)
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("LOADED=")]
    assert len(lines) == len(codes), proc.stdout[-2000:]
    return [{m for m in line.removeprefix("LOADED=").split(",") if m} for line in lines]


def _declarations() -> set[str]:
    """The families' option declarations and the packages above them: what ``--help`` (which
    shows every family's flags) may import of them."""
    from parallax.recipe import registry

    out = {"parallax.families"}
    for family in registry.FAMILIES.values():
        if family.options:
            parts = family.options.split(":")[0].split(".")
            out |= {".".join(parts[:i]) for i in range(3, len(parts) + 1)}
    return out


def test_families_are_imported_only_when_asked_for():
    helped, planned = _loaded_after(
        "from parallax.train import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "main(['--dry-run', '--model', 'siglip-tiny'])",
    )
    declared = _declarations()
    assert helped <= declared, f"--help imported {sorted(helped - declared)}"
    # a run of one family (which imports the family's package) loads no other family's code
    others = {m.split(".")[2] for m in planned - declared if m.count(".") >= 2}
    assert others == {"siglip"}, planned


def test_a_family_imports_no_other_family():
    """Importing one family's recipe (what a run of it imports) loads no module of another
    family, data modules included (each family's own formats live in its package)."""
    probe = (
        "import sys\nimport parallax.families.siglip.recipe\n"
        "print(','.join(m for m in sys.modules if 'openvla' in m or 'llava' in m))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", proc.stdout


FAMILIES = sorted(p.parent.name for p in (ROOT / "parallax" / "families").glob("*/__init__.py"))
# tests of something else than the package, which keep their own place whatever they import
ELSEWHERE = {
    "tests/benchmarks": "the benchmarks' tests mirror benchmarks/",
    "tests/test_readme.py": "runs the code blocks of README.md and docs/",
}


def _families_imported(path: Path) -> set[str]:
    """The families that ``path`` imports itself (``parallax.families.<name>...``), anywhere in
    the file (in a function too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["parallax", "families"] and len(parts) > 2 and parts[2] in FAMILIES:
                found.add(parts[2])
    return found


def _data_folder(path: Path) -> bool:
    """Under a folder of fixtures or data files (not a test package such as tests/data/)."""
    folders = path.relative_to(ROOT / "tests").parents
    return any(
        d.name in ("fixtures", "data") and not (ROOT / "tests" / d / "__init__.py").is_file()
        for d in folders
    )


def test_a_test_that_imports_one_family_lives_under_it():
    """Tests mirror the package: a test module (or helper) that imports exactly one family lives
    under ``tests/families/<that family>/``; one that imports several families or none stays
    with the part of parallax it tests."""
    assert FAMILIES, "no family packages found under parallax/families/"
    misplaced = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if _data_folder(path) or any(rel == e or rel.startswith(e + "/") for e in ELSEWHERE):
            continue
        families = _families_imported(path)
        if len(families) != 1:
            continue
        (family,) = families
        home = ROOT / "tests" / "families" / family
        if not path.is_relative_to(home):
            misplaced.append(
                f"{rel} imports only parallax.families.{family}: move it under "
                f"tests/families/{family}/"
            )
    assert not misplaced, "\n".join(misplaced)


# the files every family package holds, so that a reader finds the same thing at the same name
SKELETON = (
    "__init__.py",
    "config.py",
    "model.py",
    "checkpoint.py",
    "data.py",
    "batches.py",
    "objective.py",
    "sides.py",
    "recipe.py",
    "estimate.py",
    "flops.py",
    "predict.py",
)


def test_every_family_holds_the_skeleton_files():
    """Every folder under ``parallax/families/`` holds the skeleton files (it may hold more)."""
    folders = [p for p in (ROOT / "parallax" / "families").iterdir() if p.is_dir()]
    folders = sorted(p for p in folders if p.name != "__pycache__")
    assert folders, "no family packages found under parallax/families/"
    missing = []
    for folder in folders:
        lacks = [f for f in SKELETON if not (folder / f).is_file()]
        if lacks:
            missing.append(f"parallax/families/{folder.name}/ lacks {', '.join(lacks)}")
    assert not missing, "\n".join(missing)


def _top_level_names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_a_family_exports_names_its_modules_define():
    """Every module an ``EXPORTS`` entry of a family's ``__init__`` names is a module of the
    package that defines (or imports) those names, read from the source: no family code is
    imported."""
    wrong = []
    for family in FAMILIES:
        package = ROOT / "parallax" / "families" / family
        tree = ast.parse((package / "__init__.py").read_text())
        exports = next(
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "EXPORTS" for t in n.targets)
        )
        for module, names in exports.items():
            path = package.joinpath(*module.split(".")).with_suffix(".py")
            defined = _top_level_names(path) if path.is_file() else set()
            wrong += [
                f"parallax.families.{family}: {n} is not in {module}"
                for n in names
                if n not in defined
            ]
    assert not wrong, "\n".join(wrong)
