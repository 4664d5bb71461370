"""The README and docs/ run as written: every Python block, and every shell command a CPU can run.

Each file's blocks run in order in a scratch directory of its own (so a command may use what an
earlier block of the same file wrote), with the repository's ``examples/`` linked in and
``benchmarks/`` copied (so their results files stay untouched). A comment line right before a
block's fence steers it: ``<!-- test: ranks=N -->`` runs a Python block under torchrun with N
processes (one process otherwise); ``<!-- test: dry-run -->`` plans every training command of a
shell block instead of running it; ``<!-- test: setup=NAME -->`` first makes what the block
names as the user's own input (see ``SETUPS``); ``<!-- test: file=NAME -->`` writes the block
(a TOML config, say) to NAME for later blocks to use. Blocks that run nothing (a layout, the
CI's own install and test steps) are checked to be just that, and not collected as runs.

Python commands (``python -m ...``, ``python script.py`` and torchrun's standalone form) run as
processes forked from one warm interpreter (``tests/warm.py``: the same argv, directory and
environment, torchrun's for each rank, without paying torch's import for each); anything else
runs as a plain subprocess.

Shell commands: setting up the environment (``python -m venv``, activating it, ``pip
install``) and ``pytest`` are the CI's own steps and are not repeated; downloads (``hf``) need
the network, and the ``setup=`` option makes a local stand-in for what they fetch; a benchmark
without ``--smoke`` needs GPUs (each such line has its ``--smoke`` twin); a training command runs
with ``--steps 2`` appended (the full runs' numbers in the docs are measured, not tested), or
with ``--dry-run`` where it names GPU work (bf16, a 7B preset, several nodes); so does the
pipeline example, which takes ``--steps`` too (its 60 steps print a falling loss, checked nowhere).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import warm

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- test: (.*) -->$")
GPU_WORDS = ("--precision bf16", "openvla-7b", "vicuna-7b", "siglip-large", "--nnodes")
TIMEOUT_S = 300
TRAINERS = ("parallax.train", "examples/custom_recipe.py")  # entry points that take its flags
STEPPED = ("examples/pipeline_custom_model.py",)  # scripts with a --steps of their own


def blocks(text: str) -> list[tuple[int, str, str, dict[str, str]]]:
    """(line, language, code, marker options) of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, body = i, []
        i += 1
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        opts = {}
        if mark := MARK.match(prev.strip()):
            for part in mark.group(1).split(";"):
                key, _, value = part.strip().partition("=")
                opts[key] = value
        out.append((start + 1, m.group(1), "\n".join(body), opts))
        i += 1
    return out


def commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    cmds = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            cmds.append(shlex.join(words))
    return cmds


def _torchrun(nproc: int | None = None) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run + ([f"--nproc-per-node={nproc}"] if nproc else [])


SETUP_WORDS = ("pip", "pytest", "ruff", ".", "source", "hf", "huggingface-cli")


def plan(cmd: str, dry_run: bool) -> list[str] | None:
    """The argv that runs ``cmd`` here, or None where it is not run (see the module doc)."""
    words = shlex.split(cmd)
    if words[0] in SETUP_WORDS or words[1:3] == ["-m", "venv"]:
        return None
    if any(w.startswith("benchmarks.") for w in words) and "--smoke" not in words:
        return None  # a GPU benchmark: its --smoke twin runs
    if trainer := next((w for w in words if w in TRAINERS), None):
        args = words[words.index(trainer) + 1 :]
        if dry_run or any(w in cmd for w in GPU_WORDS):
            entry = ["-m", trainer] if trainer == "parallax.train" else [trainer]
            return [sys.executable, *entry, *args, "--dry-run"]
        words = [*words, "--steps", "2"]
    elif any(w in STEPPED for w in words):
        words = [*words, "--steps", "2"]
    if words[0] == "torchrun":
        rdzv = any(w.startswith("--rdzv") for w in words)
        return _torchrun() + words[1:] if not rdzv else [sys.executable, "-m", *words]
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    return words


def _episodes(work: Path) -> None:
    """``my_episodes/``: the folder layout the converter documents, two short episodes."""
    rng = np.random.default_rng(0)
    for e in range(2):
        ep = work / "my_episodes" / f"ep{e}"
        ep.mkdir(parents=True, exist_ok=True)
        (ep / "instruction.txt").write_text("pick up the red block")
        np.save(ep / "images.npy", rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8))
        np.save(ep / "actions.npy", rng.uniform(-1, 1, (5, 7)).astype(np.float32))


def _checkpoint(work: Path, path: str) -> None:
    """An OpenVLA checkpoint in the Hugging Face layout at ``path`` (the tiny preset; made in
    this process: it is the user's input, not a command of the docs)."""
    from parallax.families.openvla import OpenVLA, OpenVLAConfig

    OpenVLA(OpenVLAConfig.preset("tiny"), seed=0).save_pretrained(work / path)


SETUPS = {"episodes": _episodes, "checkpoint": _checkpoint}


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One scratch directory per file, made when its first block runs."""
    made: dict[str, Path] = {}

    def get(doc: str) -> Path:
        if doc not in made:
            work = made[doc] = tmp_path_factory.mktemp(doc.replace("/", "-").replace(".", "-"))
            (work / "examples").symlink_to(ROOT / "examples")
            # a copy, not a link: a benchmark run appends to its RESULTS.md, which must stay
            skip = shutil.ignore_patterns("__pycache__", "profiles")
            shutil.copytree(ROOT / "benchmarks", work / "benchmarks", ignore=skip)
        return made[doc]

    return get


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [(_name(d), *b) for d in DOCS for b in blocks(d.read_text())]
README_BLOCKS = [b[1:] for b in BLOCKS if b[0] == "README.md"]
RESULT_FILES = ("RESULTS.md", "results.jsonl")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


RESULTS_BEFORE = {f: _digest(ROOT / "benchmarks" / f) for f in RESULT_FILES}


def test_the_readme_has_blocks_of_both_kinds():
    kinds = {lang for _, lang, _, _ in README_BLOCKS}
    assert {"python", "bash"} <= kinds, kinds
    assert "ranks=2" in {k + "=" + v for *_, _, _, o in BLOCKS for k, v in o.items()}


def test_commands_are_planned_as_the_module_doc_says():
    assert plan("pip install -e '.[test]'", False) is None
    assert plan("python3 -m venv .venv && . .venv/bin/activate", False) is None
    assert plan("hf download openvla/openvla-7b --local-dir ckpt", False) is None
    assert plan("torchrun --nproc-per-node 2 -m benchmarks.step.openvla", False) is None
    got = plan("torchrun --nproc-per-node 2 -m parallax.train --out a", False)
    assert got[-4:] == ["--out", "a", "--steps", "2"] and "--standalone" in got
    got = plan("torchrun --nproc-per-node 8 -m parallax.train --precision bf16", False)
    assert got == [sys.executable, "-m", "parallax.train", "--precision", "bf16", "--dry-run"]
    got = plan("torchrun --nproc-per-node 2 examples/pipeline_custom_model.py --pp 2", False)
    assert got[-4:] == ["--pp", "2", "--steps", "2"], got
    assert commands("a \\\n  b  # c\n# d\ne") == ["a b", "e"]


def runs(line: int, lang: str, code: str, opts: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(what, argv) of everything a block runs here; empty for a block that runs nothing."""
    if "file" in opts:
        return []  # written for later blocks, not run
    if lang == "python":
        ranks = int(opts.get("ranks", "1"))
        script = f"readme_line{line}.py"  # written into the scratch directory
        argv = _torchrun(ranks) + [script] if ranks > 1 else [sys.executable, script]
        return [(f"python block at line {line}", argv)]
    if lang != "bash":
        return []
    planned = [(c, plan(c, "dry-run" in opts)) for c in commands(code)]
    return [(c, argv) for c, argv in planned if argv is not None]


RUNNABLE = [b for b in BLOCKS if runs(*b[1:])]
IN_ORDER = [b for b in BLOCKS if runs(*b[1:]) or "file" in b[4]]  # with the files they write


def test_the_blocks_that_run_nothing_only_show_files_or_install():
    """Blocks left out of ``test_block_runs``: layouts (text, TOML) and the CI's own steps."""
    for doc, line, lang, code, opts in BLOCKS:
        if not runs(line, lang, code, opts) and "file" not in opts:
            assert lang not in ("python", "bash") or all(
                plan(c, False) is None for c in commands(code)
            ), f"{doc} line {line} runs nothing"
    assert len(RUNNABLE) >= 20, len(RUNNABLE)


@pytest.mark.parametrize(
    "doc,line,lang,code,opts",
    IN_ORDER,
    ids=[f"{b[0].removesuffix('.md')}-line{b[1]}-{b[2]}" for b in IN_ORDER],
)
def test_block_runs(workdirs, warm_server, doc, line, lang, code, opts):
    work = workdirs(doc)
    if "file" in opts:  # a file later blocks use: written in file order, as a reader would
        (work / opts["file"]).write_text(code + "\n")
        return
    for setup in filter(None, opts.get("setup", "").split(",")):
        name, _, arg = setup.partition(":")
        SETUPS[name](work, *([arg] if arg else []))
    if lang == "python":
        (work / f"readme_line{line}.py").write_text(code + "\n")
    for what, argv in runs(line, lang, code, opts):
        if planned := warm.plan(argv):
            code, out = warm_server.run(planned, work, warm.command_env(), TIMEOUT_S)
        else:
            proc = subprocess.run(
                argv,
                cwd=work,
                env=warm.command_env(),
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            code, out = proc.returncode, proc.stdout[-2000:] + "\n" + proc.stderr
        assert code == 0, f"{doc} line {line}: {what} (exit {code})\n{out[-6000:]}"


def test_the_readme_is_short_and_links_every_doc():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in text, f"README.md does not link docs/{doc.name}"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_relative_links_name_files_that_exist():
    for doc in DOCS:
        for target, _ in LINK.findall(doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{_name(doc)}: no such file {target}"


def test_install_lines_install_this_checkout():
    """`pip install parallax` is an unrelated PyPI project: install from the checkout."""
    wrong = re.compile(r"pip install[^\n`]*?(?<![\w.-])['\"]?parallax(\[|['\"\s]|$)")
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            assert not wrong.search(line), f"{_name(doc)} line {n}: {line}"


def test_the_runs_left_the_repository_results_alone():
    """Runs after the blocks (pytest keeps file order): the benchmarks wrote into the copy."""
    assert {f: _digest(ROOT / "benchmarks" / f) for f in RESULT_FILES} == RESULTS_BEFORE
