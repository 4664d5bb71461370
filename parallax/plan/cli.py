"""``python -m parallax.plan``: the fastest layout of a run that fits the GPUs given.

Every option of ``parallax.train`` is taken as it is (the model, ``--finetune``, the batch,
the data, ``--precision``: bf16 unless given); those that a layout sets (``--tp``, ``--zero``,
``--micro-batch-size``...) constrain the search when given. The planner's own options say what
the machine is. ``python -m parallax.plan calibrate --out FILE`` measures a profile
(:mod:`parallax.plan.calibrate`).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from parallax.plan import calibrate
from parallax.plan.layout import LAYOUT_OPTIONS
from parallax.plan.machine import LINKS, Machine, target
from parallax.plan.report import command, layouts_table, nothing_fits
from parallax.plan.search import MARGIN, Result, search
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.recipe.flags import parse_args, train_parser

INTERCONNECTS = ("nvlink", "pcie", "pcie-no-p2p")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallax.plan",
        description="The fastest dp x tp x pp x ZeRO layout of a parallax.train run that fits "
        "the GPUs given, predicted; any parallax.train flag may follow.",
    )
    p.add_argument("--gpus", type=int, help="GPUs in all (default: --nodes x --gpus-per-node)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: --gpus, at most 8)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of each GPU")
    p.add_argument("--host-memory", type=float, metavar="GIB", help="host memory of each node")
    p.add_argument("--interconnect", choices=INTERCONNECTS, help="how a node's GPUs talk")
    p.add_argument("--machine", metavar="FILE", help="a profile from 'calibrate --out FILE'")
    p.add_argument("--margin", type=float, default=MARGIN, help="share of memory kept free")
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    return p


def _world(args: argparse.Namespace) -> tuple[int, int, int]:
    """(world, nodes, GPUs per node) from --gpus / --nodes / --gpus-per-node."""
    nodes, per_node = args.nodes, args.gpus_per_node
    if per_node is None:
        if args.gpus is None:
            per_node = 1
        elif nodes > 1:
            per_node = args.gpus // nodes
        else:
            per_node = min(args.gpus, 8)
    if args.gpus is not None:
        nodes = max(args.gpus // max(per_node, 1), 1)
    world = nodes * per_node
    if (args.gpus is not None and world != args.gpus) or min(nodes, per_node) < 1:
        raise ValueError(
            f"--gpus {args.gpus} is not a whole number of nodes of {per_node} GPUs; give "
            "--gpus N (nodes of 8) or --nodes A --gpus-per-node B"
        )
    return world, nodes, per_node


def given_options(train_argv: list[str]) -> set[str]:
    """The parallax.train options ``train_argv`` sets."""
    known, _ = train_parser().parse_known_args(train_argv)
    return {k for k, v in vars(known).items() if v is not None}


def plan(argv: list[str], console: Console) -> tuple[Result, str | None]:
    """Search and print; returns the result and the command of the first layout."""
    args, train_argv = parser().parse_known_args(argv)
    world, nodes, per_node = _world(args)
    if "precision" not in given_options(train_argv):
        train_argv = [*train_argv, "--precision", "bf16"]
    given = given_options(train_argv)
    cfg = parse_args(train_argv)
    run = resolve(cfg)
    fixed = {k: getattr(cfg, k) for k in LAYOUT_OPTIONS if k in given}
    machine = target(
        gpus_per_node=per_node,
        nodes=nodes,
        gpu_memory_gib=args.gpu_memory,
        host_memory_gib=args.host_memory,
        interconnect=args.interconnect,
        machine_file=args.machine,
    )
    limit = cfg.gpu_memory_limit
    if limit is not None and limit < machine.gpu_memory_gib:  # a cap without the CUDA context
        machine = machine.with_(gpu_memory_gib=limit, cuda_context_gib=0.0)
    model = Workload(run)
    result = search(model, machine, world, fixed, top=args.top, margin=args.margin)
    console.print(_header(run, model, machine, world, nodes, args.margin), highlight=False)
    if not result.ranked:
        console.print(nothing_fits(result, world, run.finetune == "lora"), highlight=False)
        return result, None
    console.print(f"searched {result.searched} layouts, {result.fitting} fit", highlight=False)
    console.print(layouts_table(result))
    line = command(train_argv, result.ranked[0], nodes, per_node)
    console.print(line, highlight=False, soft_wrap=True)
    return result, line


def _header(run, model: Workload, machine: Machine, world: int, nodes: int, margin: float) -> str:
    link = next((k for k, v in LINKS.items() if v == machine.intra), "measured")
    kind = "measured" if machine.measured else "a shipped default, not measured"
    mode = "LoRA" if run.finetune == "lora" else "full fine-tuning"
    return (
        f"[bold]parallax plan[/bold]: {run.model} ({model.total_params / 1e9:.2f}B parameters, "
        f"{mode}, {run.precision}), global batch {run.global_batch_size} on {world} GPU(s), "
        f"{nodes} node(s) of {machine.gpus_per_node}; profile {machine.name} ({kind}): "
        f"{machine.gpu_memory_gib:g} GiB a GPU, {machine.host_memory_gib:g} GiB of host "
        f"memory a node, {link} between GPUs; {margin:.0%} of each kept free"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        return calibrate.main(argv[1:])
    console = Console(width=max(160, Console().width))
    try:
        result, _ = plan(argv, console)
    except ValueError as err:
        console.print(f"parallax.plan: {err}", highlight=False)
        return 2
    return 0 if result.ranked else 1
