"""``python -m parallax.plan``: the fastest layout of a run that fits the GPUs given.

Every option of ``parallax.train`` is taken as it is (the model, ``--finetune``, the batch,
the data, ``--precision``: bf16 unless given); those that a layout sets (``--tp``, ``--zero``,
``--micro-batch-size``...) constrain the search when given. On a GPU the profile is this card's
own (:mod:`parallax.plan.device`), its memory ``--gpu-memory-limit`` or ``--gpu-memory`` when
given; the note under the header says which profile and why. The planner's own options say what
the machine is (:mod:`parallax.plan.options`: checked as the trainer checks its own, before any
model is built). ``python -m parallax.plan calibrate --out FILE`` measures a profile
(:mod:`parallax.plan.calibrate`). Status: 0 a layout fits, 1 none fits, 2 a bad input (one
message on stderr, naming it).
"""

from __future__ import annotations

import sys

from rich.console import Console

from parallax.plan import calibrate
from parallax.plan.device import Detect, Device, base_profile
from parallax.plan.device import detect as detect_device
from parallax.plan.host_fallback import search_run
from parallax.plan.layout import LAYOUT_OPTIONS
from parallax.plan.machine import DEFAULTS, LINKS, Machine, target
from parallax.plan.options import PlanOptions, parse_plan, world
from parallax.plan.report import command, layouts_table, nothing_fits
from parallax.plan.ruled_out import ruled_out
from parallax.plan.search import Result
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.recipe.flags import option_classes, parse_args, train_parser
from parallax.run import command_line as cl


def machine_of(
    opts: PlanOptions, nodes: int, per_node: int, device: Device | None
) -> tuple[Machine, str]:
    """The profile to plan for and a note saying which and why (and how to name another):
    ``--machine``'s, else this GPU's own (:mod:`parallax.plan.device`), else the shipped
    default nearest ``--gpu-memory`` (its memory ``--gpu-memory``, else the profile's, else this
    GPU's)."""
    gib = opts.gpu_memory
    if gib is None and opts.machine is None and device is not None:
        gib = device.memory_gib
    base = base_profile(opts.machine, device)
    machine = target(
        gpus_per_node=per_node,
        nodes=nodes,
        gpu_memory_gib=gib,
        host_memory_gib=opts.host_memory,
        interconnect=opts.interconnect,
        machine_file=opts.machine,
        profile=base.machine,
    )
    if base.why:
        return machine, f"profile {machine.name}: {base.why}"
    if gib is None:
        return machine, (
            f"no GPU here and no --gpu-memory: planning for the {machine.name} profile, "
            f"{machine.gpu_memory_gib:g} GiB a GPU; name another with --gpu-memory GIB (24: an "
            "RTX 4090, 80: an H100) or --machine FILE|NAME (a profile python -m parallax.plan "
            f"calibrate measured, or a shipped card: {', '.join(DEFAULTS)})"
        )
    return machine, (
        f"no GPU here: planning for the shipped default nearest --gpu-memory {gib:g} GiB, "
        f"{machine.name}; name a card with --machine ({', '.join(DEFAULTS)}, or a profile file)"
    )


def given_options(train_argv: list[str]) -> set[str]:
    """The parallax.train options ``train_argv`` sets (its ``--config`` file's among them); a
    ``ValueError`` for a flag that is neither the planner's nor parallax.train's."""
    values, unknown = cl.parse_known(train_argv, option_classes(), train_parser())
    if unknown:
        raise ValueError(
            f"unrecognized arguments: {' '.join(unknown)} (neither the planner's flags, "
            "parallax.plan --help, nor parallax.train's, parallax.train --help)"
        )
    return set(values)


def plan(
    argv: list[str], console: Console, detect: Detect = detect_device
) -> tuple[Result, str | None]:
    """Search and print; returns the result and the command of the first layout. Every flag
    and the ``--machine`` profile are checked before the model is built; ``detect`` finds this
    machine's GPU (tests pretend to have one)."""
    opts, train_argv = parse_plan(argv)
    gpus, nodes, per_node = world(opts)
    given = given_options(train_argv)
    machine, note = machine_of(opts, nodes, per_node, detect(0))
    if "precision" not in given:
        train_argv = [*train_argv, "--precision", "bf16"]
    cfg = parse_args(train_argv)
    run = resolve(cfg)
    fixed = {k: getattr(cfg, k) for k in LAYOUT_OPTIONS if k in given}
    limit = cfg.gpu_memory_limit
    if limit is not None and limit < machine.gpu_memory_gib:  # a cap without the CUDA context
        machine = machine.with_(gpu_memory_gib=limit, cuda_context_gib=0.0)
        note += f"; --gpu-memory-limit {limit:g} GiB as its memory"
    run, model, result, split = search_run(
        run, machine, gpus, fixed, top=opts.top, margin=opts.margin
    )
    if split:  # (the command says so)
        train_argv = [*train_argv, "--host-masters", "split"]
        note += f"; {split}"
    if why := ruled_out(result, model, gpus, per_node, fixed):
        raise ValueError(why)
    console.print(_header(run, model, machine, gpus, nodes, opts.margin), highlight=False)
    console.print(note, highlight=False)
    if not result.ranked:
        lora, split = run.finetune == "lora", run.host_masters_split
        console.print(nothing_fits(result, gpus, lora, split), highlight=False)
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
        print(f"parallax.plan: error: {err}", file=sys.stderr)
        return 2
    return 0 if result.ranked else 1
