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

from parallax.context import ParallelContext
from parallax.dims import ParallelDims
from parallax.models import OpenVLA
from parallax.pipeline import format_schedule, simulate, split
from parallax.pipeline.simulate import peak_activations
from parallax.train.config import TrainConfig
from parallax.train.trainer import make_schedule, num_microbatches, resolve_model_config

GIB = 2**30


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def _dims(cfg: TrainConfig) -> ParallelDims:
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        return ParallelDims.from_world(int(world), tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    return ParallelDims(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp or 1)


def rank_plan(cfg: TrainConfig, dims: ParallelDims, pp_rank: int) -> dict:
    """Blocks, parameters and memory of one (dp 0, tp 0) rank of pipeline rank ``pp_rank``."""
    config, _ = resolve_model_config(cfg.model)
    blocks = OpenVLA.stage_blocks(config)
    ranges = split([b.cost for b in blocks], dims.pp, cfg.chunks, pin_first=1)
    m = num_microbatches(cfg, dims.dp)
    schedule = make_schedule(cfg.schedule, dims.pp, m, cfg.chunks)
    ctx = ParallelContext(dims=dims, rank=dims.rank(pp_rank, 0, 0), device=torch.device("meta"))
    mine = [r for s, r in enumerate(ranges) if schedule.rank_of(s) == pp_rank]
    params = trainable = 0
    layers = 0
    for r in mine:
        chunk = OpenVLA(config, ctx, blocks=r, device="meta", freeze_vision=cfg.freeze_vision)
        params += sum(p.numel() for p in chunk.parameters())
        trainable += sum(p.numel() for p in chunk.parameters() if p.requires_grad)
        layers += sum(1 for i in r if blocks[i].name.startswith("llm."))
    wbytes = 2 if cfg.precision == "bf16" else 4
    # ZeroOptimizer with AdamW: fp32 master and moments over dp (fp32 weights are their own
    # masters), and an fp32 gradient slice only where overlap may reduce during backward
    per = 12 + (4 if dims.dp > 1 and cfg.overlap_grad_reduce else 0) if wbytes == 2 else 8
    optim = trainable * per / dims.dp
    seq = config.num_patches + 48  # patches + a typical prompt and action
    h = config.text.hidden_size
    in_flight = peak_activations(schedule)[pp_rank]
    act = (
        0.0
        if cfg.activation_checkpointing
        else 34.0 * seq * cfg.micro_batch_size * h * (layers / dims.tp) * in_flight * (wbytes / 2)
    )
    return {
        "blocks": [blocks[i].name for r in mine for i in r],
        "params": params,
        "trainable": trainable,
        "weights_gib": params * wbytes / GIB,
        "grads_gib": trainable * wbytes / GIB,
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


def print_plan(cfg: TrainConfig, file=None) -> None:
    """Print (to ``file``, default stdout) the layout, the blocks of each stage, parameters and
    memory per rank, and the schedule table; raises ``ValueError`` for anything a real run
    would refuse."""
    from rich.console import Console
    from rich.table import Table

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
    sim = simulate(schedule, 1.0, 2.0)
    console.print(format_schedule(schedule), highlight=False)
    console.print(
        f"simulated bubble (backward = 2 x forward): {sim.bubble_fraction:.3f}", highlight=False
    )
