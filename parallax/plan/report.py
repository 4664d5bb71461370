"""What the planner prints: the best layouts as a table, why each loses to the first, the
command of the first, and why nothing fits when nothing does."""

from __future__ import annotations

import shlex

from rich.table import Table

from parallax.plan.choice import Candidate, simplicity
from parallax.plan.memory import GIB
from parallax.plan.search import Result


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def why_slower(c: Candidate, first: Candidate) -> str:
    """The causes of ``c``'s extra time over ``first`` (the two largest), or what else
    separates them."""
    if c is first:
        return "fastest"
    extra = c.time.seconds - first.time.seconds
    mine, theirs = c.time.parts(), first.time.parts()
    deltas = sorted(((mine[k] - theirs[k], k) for k in mine), reverse=True)
    floor = max(0.01 * first.time.seconds, 1e-4)
    causes = [f"+{_seconds(d)} {k}" for d, k in deltas[:2] if d > floor]
    if extra <= floor or not causes:
        return _tie(c, first)
    return ", ".join(causes)


def _tie(c: Candidate, first: Candidate) -> str:
    """Why a layout as fast as the first is not first: more involved, or (the first is more
    involved but fits a smaller cap, where more memory must not choose slower) more memory."""
    if simplicity(c.layout) > simplicity(first.layout):
        return "as fast (a more involved layout)"
    if c.gpu > first.gpu:
        return "as fast (needs more GPU memory)"
    return "as fast"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def layouts_table(result: Result) -> Table:
    table = Table(title="the fastest layouts that fit (predicted)")
    for col in (
        "#",
        "layout",
        "GiB/GPU (peak, needed)",
        "host GiB/node",
        "step s",
        "samples/s",
        "bubble",
        "against the first",
    ):
        table.add_column(col)
    first = result.ranked[0]
    for i, c in enumerate(result.ranked, 1):
        peak = max(r.gpu for r in c.memory)
        table.add_row(
            str(i),
            c.layout.describe(),
            f"{gib(peak)}, {gib(c.gpu)}",
            gib(c.host),
            f"{c.time.seconds:.3f}",
            f"{c.samples_per_s:.1f}",
            f"{c.time.bubble:.0%}" if c.layout.pp > 1 else "-",
            why_slower(c, first),
        )
    return table


def command(train_argv: list[str], best: Candidate, nodes: int, per_node: int) -> str:
    """The one-line ``torchrun`` command of ``best``: the run's own flags, then the layout's."""
    given = set(train_argv)
    layout = [a for a in _pairs(best.layout.argv()) if a[0] not in given]
    args = [*train_argv, *(x for pair in layout for x in pair)]
    if nodes > 1:
        head = (
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            "--rdzv-endpoint FIRST_NODE:29500"
        )
    else:
        head = f"torchrun --nproc-per-node {per_node}"
    return f"{head} -m parallax.train {shlex.join(args)}"


def _pairs(argv: list[str]) -> list[tuple[str, ...]]:
    """``["--tp", "2", "--no-x"]`` -> ``[("--tp", "2"), ("--no-x",)]``."""
    out: list[tuple[str, ...]] = []
    for a in argv:
        if a.startswith("--"):
            out.append((a,))
        else:
            out[-1] = (*out[-1], a)
    return out


def nothing_fits(result: Result, world: int, lora: bool = False, split: bool = True) -> str:
    """Why no layout fits, with the nearest ones and what would help (``lora``: the run
    trains adapters already; ``split``: its offloaded masters are split already)."""
    if not result.closest:
        reasons = "; ".join(f"{n} layouts: {p}" for p, n in result.problems.items())
        return f"no layout of {world} GPUs is valid for this run ({reasons or 'none searched'})"
    c = result.closest[0]
    gpu_short = c.gpu > result.usable_gpu
    host_short = c.host > result.usable_host
    lines = [
        f"nothing fits: of {result.searched} layouts of {world} GPUs, the nearest, "
        f"{c.layout.describe()}, needs {gib(c.gpu)} GiB a GPU (usable: "
        f"{gib(result.usable_gpu)}) and {gib(c.host)} GiB of host memory a node (usable: "
        f"{gib(result.usable_host)})."
    ]
    helps = []
    if gpu_short:
        helps.append("more GPUs (a larger world shards more)")
        helps.append("GPUs with more memory")
        if not lora:
            helps.append("--finetune lora")
    if host_short:
        helps.append("more host memory per node (--host-memory), or nodes with fewer GPUs each")
        if c.layout.offload and not split:
            helps.append("--host-masters split (2 bytes a parameter less, a slower host step)")
    lines.append("What would help: " + "; ".join(helps) + ".")
    return " ".join(lines)
