"""``--dry-run``: the plan of a run, computed without processes, data or weights.

It checks the layout, the batch sizes and the schedule exactly as a real run would, then builds
each pipeline rank's chunks on the ``meta`` device (shapes only) to count parameters per rank,
and estimates memory per rank: weights, gradients, ZeRO-1 optimizer state, and activations
(Megatron's ``s*b*h*34`` bytes per layer at 16-bit, times the microbatches a rank holds at the
schedule's peak: an estimate, not a measurement).
"""

from __future__ import annotations

import os

import torch
from rich.console import Console
from rich.table import Table

from parallax.context import ParallelContext
from parallax.data.workers import auto_workers
from parallax.dims import ParallelDims
from parallax.pipeline import format_schedule, simulate, split
from parallax.pipeline.simulate import peak_activations
from parallax.recipe.protocol import whole_model
from parallax.train import groups, lora
from parallax.train.config import TrainConfig
from parallax.train.run import Run, resolve
from parallax.train.steps import make_schedule, num_microbatches

GIB = 2**30


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def _dims(cfg: TrainConfig) -> ParallelDims:
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        return ParallelDims.from_world(int(world), tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    return ParallelDims(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp or 1)


def rank_plan(cfg: Run, dims: ParallelDims, pp_rank: int) -> dict:
    """Blocks, parameters and memory of one (dp 0, tp 0) rank of pipeline rank ``pp_rank``."""
    recipe, config = cfg.recipe, cfg.model_config
    recipe.check_layout(config, cfg, dims)
    blocks = recipe.blocks(config)
    ranges = split([b.cost for b in blocks], dims.pp, cfg.chunks, pin_first=recipe.pin_first)
    m = num_microbatches(cfg, dims.dp)
    schedule = make_schedule(cfg.schedule, dims.pp, m, cfg.chunks)
    ctx = ParallelContext(dims=dims, rank=dims.rank(pp_rank, 0, 0), device=torch.device("meta"))
    mine = [r for s, r in enumerate(ranges) if schedule.rank_of(s) == pp_rank]
    if pp_rank == 0 and lora.enabled(cfg):  # the globs, as a run checks them
        lora.check_globs(whole_model(recipe, config, cfg), cfg, recipe)
    params = trainable = adapters = 0
    weight_bytes = grad_bytes = optim = 0.0
    by_group = [0] * len(groups.group_labels(cfg))
    wbytes = 2 if cfg.precision == "bf16" else 4
    dtype = torch.bfloat16 if wbytes == 2 else torch.float32
    # ZeroOptimizer with AdamW: fp32 master and moments over dp (fp32 weights, such as LoRA
    # adapters, are their own masters), and an fp32 gradient slice only where overlap may
    # reduce during backward; frozen weights have none of it
    per16 = 12 + (4 if dims.dp > 1 and cfg.overlap_grad_reduce else 0)
    for r in mine:
        chunk = recipe.build(config, r, ctx, cfg=cfg, dtype=dtype, device="meta", checkpoint=None)
        report = lora.prepare(chunk, cfg, recipe)
        adapters += report.adapters if report is not None else 0
        groups.apply_freeze([chunk], cfg, recipe)
        params += sum(p.numel() for p in chunk.parameters())
        weight_bytes += sum(p.numel() * p.element_size() for p in chunk.parameters())
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        trainable += sum(p.numel() for _, p in named)
        grad_bytes += sum(p.numel() * p.element_size() for _, p in named)
        optim += sum(p.numel() * (8 if p.element_size() == 4 else per16) for _, p in named)
        for i, g in enumerate(groups.param_groups(named, cfg)):
            by_group[i] += sum(p.numel() for _, p in g["params"])
    names = [blocks[i].name for r in mine for i in r]
    optim /= dims.dp
    in_flight = peak_activations(schedule)[pp_rank]
    act = 0.0
    if cfg.checkpointing is not True:  # recomputed blocks keep only their input
        kept = names
        if cfg.checkpointing == "text":  # VLM estimates count the decoder layers alone (a
            kept = [n for n in names if not n.startswith("llm.")]  # dual encoder's: an upper bound)
        per = recipe.activation_bytes(config, kept, cfg.micro_batch_size, dims.tp)
        act = per * in_flight * (wbytes / 2)
    return {
        "blocks": names,
        "params": params,
        "trainable": trainable,
        "adapters": adapters,
        "groups": by_group,
        "weights_gib": weight_bytes / GIB,
        "grads_gib": grad_bytes / GIB,
        "optimizer_gib": optim / GIB,
        "activations_gib": act / GIB,
        "schedule": schedule,
    }


def _blocks_text(names: list[str]) -> str:
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


def _groups_table(cfg: Run, plans: list[dict]):
    """Trainable parameters per optimizer group (peak lr) and pipeline rank, and what the
    freeze flags leave untrained."""

    rates = [lr for _, lr in groups.parse_lr_groups(cfg.lr_groups)] + [cfg.lr]
    table = Table(title="optimizer groups (trainable parameters per rank of each pp rank)")
    table.add_column("group (first matching glob)")
    table.add_column("peak lr")
    for p in range(len(plans)):
        table.add_column(f"pp {p}")
    for i, label in enumerate(groups.group_labels(cfg)):
        table.add_row(label, f"{rates[i // 2]:g}", *(f"{pl['groups'][i]:,}" for pl in plans))
    frozen = [pl["params"] - pl["trainable"] for pl in plans]
    table.add_row(
        f"frozen ({', '.join(groups.freeze_globs(cfg, cfg.recipe)) or '-'})",
        "-",
        *(f"{f:,}" for f in frozen),
    )
    return table


def print_plan(cfg: TrainConfig | Run, file=None) -> None:
    """Print (to ``file``, default stdout) the layout, the blocks of each stage, parameters and
    memory per rank, and the schedule table; raises ``ValueError`` for anything a real run
    would refuse."""
    cfg = resolve(cfg)
    dims = _dims(cfg)
    plans = [rank_plan(cfg, dims, p) for p in range(dims.pp)]
    schedule = plans[0]["schedule"]
    console = Console(file=file, width=max(160, Console().width))
    note = launch_note(cfg, dims)
    if note:
        console.print(note, highlight=False)
    m = num_microbatches(cfg, dims.dp)
    console.print(
        f"[bold]parallax plan[/bold]: model {cfg.model}, {dims} = {dims.world_size} "
        f"rank{'s' if dims.world_size > 1 else ''}; "
        f"global batch {cfg.global_batch_size} = {dims.dp} dp x {m} microbatches x "
        f"{cfg.micro_batch_size}; precision {cfg.precision}; schedule {cfg.schedule}",
        highlight=False,
    )
    table = Table(title="per rank (every tp and dp rank of a pipeline rank alike)")
    for col in (
        "pp rank",
        "blocks",
        "params",
        "trainable",
        "weights",
        "grads",
        "optimizer",
        "activations (est.)",
        "total (est.)",
    ):
        table.add_column(col)
    for p, plan in enumerate(plans):
        total = sum(
            plan[k] for k in ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib")
        )
        table.add_row(
            str(p),
            _blocks_text(plan["blocks"]),
            f"{plan['params']:,}",
            f"{plan['trainable']:,}",
            _size(plan["weights_gib"]),
            _size(plan["grads_gib"]),
            _size(plan["optimizer_gib"]),
            _size(plan["activations_gib"]),
            _size(total),
        )
    console.print(table)
    if lora.enabled(cfg):
        counts = ", ".join(f"{pl['adapters']:,}" for pl in plans)
        console.print(
            f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} dropout={cfg.lora_dropout:g} on "
            f"{cfg.lora_targets}; fully trained: {cfg.train or '-'}; adapter parameters per rank "
            f"of each pp rank: {counts}; "
            "the frozen base has no gradients, masters or optimizer state",
            highlight=False,
        )
    console.print(_groups_table(cfg, plans))
    sim = simulate(schedule, 1.0, 2.0)
    console.print(format_schedule(schedule), highlight=False)
    console.print(
        f"simulated bubble (backward = 2 x forward): {sim.bubble_fraction:.3f}", highlight=False
    )
    console.print(data_note(cfg), highlight=False)


def data_note(cfg: TrainConfig) -> str:
    """What the run reads and how (not opened by a dry run), and where its data wait shows."""

    wait = "metrics.jsonl's data_wait_s is the seconds each step waited for its batch"
    if cfg.data == "synthetic":
        return f"data synthetic: the family's built-in task, made in the training process; {wait}"
    data = cfg.data if isinstance(cfg.data, str) else f"{len(cfg.data)} [[data]] datasets"
    workers = auto_workers() if cfg.workers is None else cfg.workers
    return (
        f"data {data}: robot datasets stream through {workers} decoding worker(s) per rank "
        f"(--workers), augmentation {'off' if cfg.augment is False else 'on'} for them "
        f"(--augment); {wait}"
    )
