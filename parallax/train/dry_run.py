"""``--dry-run``: the plan of a run, computed without processes, data or weights.

It checks the layout, the batch sizes and the schedule exactly as a real run would, then prints
each pipeline rank's blocks, parameters and memory from the planner's memory model
(:mod:`parallax.plan.memory`, one code path with ``python -m parallax.plan``): weights,
gradients and optimizer state at the run's ZeRO stage, ZeRO-3's gathered units, activations
at the schedule's peak, the backward's workspace and buffers, what a card needs with the
allocator's reserve and the CUDA context, and host memory with offload (by what it holds, and
against the floor of 12 bytes a trainable parameter). Under a memory cap
(``--gpu-memory-limit`` or ``--gpu-memory``) it says whether the layout fits, and which options
would make it fit.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from parallax.data.workers import auto_workers
from parallax.dims import ParallelDims
from parallax.optim.zero.stage import HOST_FLOOR_BYTES
from parallax.pipeline import format_schedule, make_schedule, simulate
from parallax.plan.advice import fit_advice
from parallax.plan.layout import Layout
from parallax.plan.machine import target
from parallax.plan.memory import GIB, RankMemory, plan_memory
from parallax.plan.workload import Workload
from parallax.recipe.adapt import lora_enabled, whole_model
from parallax.run import Run, TrainConfig
from parallax.run import param_groups as groups


def _size(nbytes: float) -> str:
    gib = nbytes / GIB
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def _dims(cfg: TrainConfig) -> ParallelDims:
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        return ParallelDims.from_world(int(world), tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    return ParallelDims(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp or 1)


def check_run(run: Run, dims: ParallelDims):
    """Everything a run checks before it builds: the family's layout rules, the batch sizes,
    the schedule and (LoRA) the globs against the whole model; returns the schedule."""
    run.recipe.model.check_layout(run, dims)
    m = run.num_microbatches(dims.dp)
    schedule = make_schedule(run.schedule, dims.pp, m, run.chunks)
    if lora_enabled(run):
        whole_model(run)  # checks the globs
    return schedule


def memory_plan(run: Run, dims: ParallelDims) -> list[RankMemory]:
    """Every pipeline rank's memory at ``dims`` (the run checked first, as a run would)."""
    check_run(run, dims)
    return plan_memory(Workload(run), Layout.of(run, dims.dp), run.overlap_grad_reduce)


def _blocks_text(names: tuple[str, ...]) -> str:
    llm = [int(n.split(".")[1]) for n in names if n.startswith("llm.")]
    parts = [n for n in names if not n.startswith("llm.")]
    if llm:
        parts.insert(1 if "vision" in parts else 0, f"llm.{min(llm)}..{max(llm)}")
    return ", ".join(parts)


def launch_note(cfg: TrainConfig, dims: ParallelDims) -> str | None:
    """Outside torchrun, which world the plan is for and how to plan for another."""
    if "WORLD_SIZE" in os.environ:
        return None
    if dims.world_size == 1:
        return (
            "not under torchrun: planning for one process; pass --dp N (with --tp and --pp) "
            "to plan for N x tp x pp processes, or add --dry-run to the torchrun command"
        )
    return (
        f"not under torchrun: planning for the {dims.world_size} processes of --tp {dims.tp} "
        f"--pp {dims.pp} --dp {dims.dp}"
    )


def _groups_table(run: Run, plans: list[RankMemory]) -> Table:
    """Trainable parameters per optimizer group (peak lr) and pipeline rank, and what the
    freeze flags leave untrained."""
    rates = [lr for _, lr in groups.parse_lr_groups(run.lr_groups)] + [run.lr]
    table = Table(title="optimizer groups (trainable parameters per rank of each pp rank)")
    table.add_column("group (first matching glob)")
    table.add_column("peak lr")
    for p in range(len(plans)):
        table.add_column(f"pp {p}")
    for i, label in enumerate(groups.group_labels(run)):
        table.add_row(label, f"{rates[i // 2]:g}", *(f"{pl.groups[i]:,}" for pl in plans))
    table.add_row(
        f"frozen ({', '.join(groups.freeze_globs(run, run.recipe.model.freeze_aliases)) or '-'})",
        "-",
        *(f"{pl.params - pl.trainable:,}" for pl in plans),
    )
    return table


COLUMNS = (
    "pp rank",
    "blocks",
    "params",
    "trainable",
    "weights",
    "grads",
    "optimizer",
    "gathered",
    "activations",
    "workspace, buffers",
    "peak",
    "card needs",
    "host",
)


def memory_table(plans: list[RankMemory], machine, title: str) -> Table:
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for r in plans:
        table.add_row(
            str(r.pp_rank),
            _blocks_text(r.blocks),
            f"{r.params:,}",
            f"{r.trainable:,}",
            _size(r.weights),
            _size(r.gradients),
            _size(r.optimizer),
            _size(r.gathered),
            _size(r.activations),
            _size(r.workspace + r.buffers),
            _size(r.gpu),
            _size(r.needed(machine)),
            _size(r.host),
        )
    return table


def host_note(plans: list[RankMemory]) -> str | None:
    """With offload, the host bytes of the rank that needs most, by what they hold, against
    the floor of 12 bytes a trainable parameter (its fp32 master and AdamW's moments): the
    memory model's terms, which are the optimizer's (:mod:`parallax.plan.memory`)."""
    r = max(plans, key=lambda r: r.host)
    if r.host_ratio is None:
        return None
    parts = ", ".join(f"{name} {_size(b)}" for name, b in r.host_parts)
    return (
        f"host memory of the optimizer offload (pp rank {r.pp_rank}, each of its tp and dp "
        f"ranks): {_size(r.host)} ({parts}) for {r.offloaded:,.0f} offloaded trainable "
        f"parameters: {r.host / r.offloaded:.2f} B a parameter, {r.host_ratio:.2f}x the floor "
        f"of {HOST_FLOOR_BYTES} B (fp32 master and AdamW's moments, {_size(r.host_floor)})"
        + (
            f"; the gradient sums of {r.kept:,.0f} of them on the GPU (--gpu-accumulation)"
            if r.kept
            else ""
        )
    )


def _memory_words(run: Run) -> str:
    layout = Layout.of(run, 1)
    words = [f"zero {layout.zero}"]
    if layout.offload:
        words.append(f"optimizer offloaded ({layout.offload:.0%} of it)")
    if layout.checkpointing:
        scope = layout.checkpointing if isinstance(layout.checkpointing, str) else "all"
        words.append(f"activation checkpointing ({scope})")
    return ", ".join(words)


def _base_notes(cfg: Run, plans) -> list[str]:
    """The lines that say what LoRA and a quantized base hold per rank (none when unused)."""
    lines = []
    if lora_enabled(cfg):
        counts = ", ".join(f"{pl.adapters:,}" for pl in plans)
        lines.append(
            f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} dropout={cfg.lora_dropout:g} on "
            f"{cfg.lora_targets}; fully trained: {cfg.train or '-'}; adapter parameters per rank "
            f"of each pp rank: {counts}; "
            "the frozen base has no gradients, masters or optimizer state"
        )
    if cfg.quantize_base:
        held = ", ".join(f"{pl.quantized / 2**30:.2f} GiB" for pl in plans)
        lines.append(
            f"--quantize-base {cfg.quantize_base}: the frozen linears (all but the output head) "
            f"held quantized, per rank of each pp rank: {held} (in weights; whole on every dp "
            "rank at any ZeRO stage)"
        )
    return lines


def print_plan(cfg: Run, file=None) -> None:
    """Print (to ``file``, default stdout) the layout, the blocks and memory of each pipeline
    rank of the resolved run ``cfg``, whether it fits a memory cap, and the schedule table;
    raises ``ValueError`` for anything a real run would refuse."""
    dims = _dims(cfg)
    schedule = check_run(cfg, dims)
    model = Workload(cfg)
    plans = plan_memory(model, Layout.of(cfg, dims.dp), cfg.overlap_grad_reduce)
    machine = target(
        gpus_per_node=min(dims.world_size, 8),
        gpu_memory_gib=getattr(cfg, "gpu_memory", None),
        machine_file=getattr(cfg, "machine", None),
    )
    console = Console(file=file, width=max(160, Console().width))
    note = launch_note(cfg, dims)
    if note:
        console.print(note, highlight=False)
    m = cfg.num_microbatches(dims.dp)
    console.print(
        f"[bold]parallax plan[/bold]: model {cfg.model}, {dims} = {dims.world_size} "
        f"rank{'s' if dims.world_size > 1 else ''}; "
        f"global batch {cfg.global_batch_size} = {dims.dp} dp x {m} microbatches x "
        f"{cfg.micro_batch_size}; precision {cfg.precision}{' (FP8 linears)' if cfg.fp8 else ''}; "
        f"schedule {cfg.schedule}; "
        f"{_memory_words(cfg)}",
        highlight=False,
    )
    title = (
        "memory per rank, predicted (every tp and dp rank of a pipeline rank alike; the card "
        f"needs the peak plus {machine.allocator_reserve:.0%} allocator reserve and "
        f"{machine.cuda_context_gib:g} GiB CUDA context)"
    )
    console.print(memory_table(plans, machine, title))
    if note := host_note(plans):
        console.print(note, highlight=False)
    advice = fit_advice(model, cfg, dims, plans, machine)
    if advice:
        console.print(advice, highlight=False)
    for line in _base_notes(cfg, plans):
        console.print(line, highlight=False)
    console.print(_groups_table(cfg, plans))
    sim = simulate(schedule, 1.0, 2.0)
    console.print(format_schedule(schedule), highlight=False)
    console.print(
        f"simulated bubble (backward = 2 x forward): {sim.bubble_fraction:.3f}", highlight=False
    )
    console.print(data_note(cfg), highlight=False)


def data_note(cfg: TrainConfig) -> str:
    """What the run reads and how (not opened by a dry run), and where its data wait shows."""

    ahead = (
        f"each step's batch made {cfg.prefetch} step(s) ahead in a thread (--prefetch)"
        if cfg.prefetch
        else "each step's batch made between steps (--prefetch 0)"
    )
    wait = f"{ahead}; metrics.jsonl's data_wait_s is the seconds each step waited for it"
    if cfg.data == "synthetic":
        return f"data synthetic: the family's built-in task, made in the training process; {wait}"
    data = cfg.data if isinstance(cfg.data, str) else f"{len(cfg.data)} [[data]] datasets"
    workers = auto_workers() if cfg.workers is None else cfg.workers
    return (
        f"data {data}: robot datasets stream through {workers} decoding worker(s) per rank "
        f"(--workers), augmentation {'off' if cfg.augment is False else 'on'} for them "
        f"(--augment); {wait}"
    )
