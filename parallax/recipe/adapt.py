"""A chunk built and adapted as the run does, in one place: the Trainer's stages, the whole model
on the meta device (``--dry-run``, the run's checks) and the planner's per-block counts all
call :func:`build_chunk`.

Adapting is ``--finetune lora`` (adapters on every targeted linear of the recipe's chunk,
:func:`~parallax.tensor.lora_apply.apply_lora`, named after the checkpoint's modules through
``model.checkpoint_layout()`` where the model has one, initialised layout-free from ``--seed``;
the base frozen; ``--train`` globs and the recipe's own new modules trained whole, PEFT's
``modules_to_save``) and then ``--freeze``. It happens before the optimizer is built, so ZeRO
sees only what trains: no gradient buffers, fp32 masters or AdamW state for the base, and
autograd runs no weight-gradient matmul for it. The globs are checked once on the whole model
built on the meta device (no collective), so a typo fails on every rank alike.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.recipe.base import Recipe
from parallax.run import Run
from parallax.run import param_groups as groups
from parallax.tensor.lora_apply import (
    LoRAReport,
    apply_lora,
    is_adapter_name,
    matches_target,
    reset_lora,
    target_patterns,
)
from parallax.tensor.quant import QuantReport, quantize_base

log = logging.getLogger(__name__)


def lora_enabled(run: Run) -> bool:
    return run.finetune == "lora"


def build_chunk(
    run: Run,
    blocks: range,
    ctx: ParallelContext,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    checkpoint: Path | None,
) -> tuple[nn.Module, LoRAReport | None]:
    """The recipe's chunk of ``blocks`` with the run's adapters and frozen parameters, and its
    LoRA report (None for full fine-tuning); with ``--quantize-base``, its frozen linears
    quantized (:func:`quantize_chunk`)."""
    quantizing = run.quantize_base is not None
    # A checkpoint is read on the host and reaches the device quantized, layer by layer; a
    # seed's init is drawn where it runs (a host draw of 7B normals takes minutes).
    home = "cpu" if quantizing and checkpoint is not None and str(device) != "meta" else device
    chunk = run.recipe.model.build(
        run, blocks, ctx, dtype=dtype, device=home, checkpoint=checkpoint
    )
    report = add_adapters(chunk, run, run.recipe)
    groups.apply_freeze([chunk], run, run.recipe.model.freeze_aliases)
    if quantizing:
        quantize_chunk(chunk, run, device, moved=torch.device(home) != torch.device(device))
    return chunk, report


def quantize_chunk(chunk: nn.Module, run: Run, device, *, moved: bool) -> QuantReport:
    """``--quantize-base``: the chunk's frozen linears quantized on ``device`` one at a time
    (the output head left alone), then the rest of the chunk moved there; adapters built on the
    host are drawn again on the device, so they equal an unquantized run's."""
    report = quantize_base(chunk, run.quantize_base, device, run.recipe.model.lora_exclude)
    if moved:
        chunk.to(device)
        if lora_enabled(run):
            reset_lora(chunk, run.seed)
    chunk.quant_report = report
    if torch.device(device).type == "meta":
        return report
    log.info(
        "--quantize-base %s: %d linears, %.2f GiB freed on this rank",
        report.kind,
        report.layers,
        report.freed / 2**30,
    )
    return report


def whole_model(
    run: Run, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, LoRAReport | None]:
    """The whole model on the meta device at tp = 1, as the run adapts it (every global name and
    shape, no memory and no collective: the same on every rank), and its LoRA report; the
    run's globs (``--freeze``, ``--lora-targets``, ``--train``, ``--lr-groups``) are checked
    against it."""
    blocks = range(len(run.recipe.model.blocks(run.model_config)))
    local = ParallelContext.local(device="meta")
    whole = run.recipe.model.build(run, blocks, local, dtype=dtype, device="meta", checkpoint=None)
    names = [n for n, _ in whole.named_parameters()]
    aliases = run.recipe.model.freeze_aliases
    groups.check_freeze_globs(run, aliases, names)
    report = add_adapters(whole, run, run.recipe)
    if report is not None:
        _check_lora_globs(whole, run, report)
    groups.apply_freeze([whole], run, aliases)
    if run.quantize_base is not None:
        quantize_chunk(whole, run, "meta", moved=False)
    if run.lr_groups:  # against every name that can train, adapters included
        groups.check_lr_group_globs(run, [n for n, _ in whole.named_parameters()])
    return whole, report


def add_adapters(chunk: nn.Module, run: Run, recipe: Recipe) -> LoRAReport | None:
    """Adapters on ``chunk`` and its base frozen, ``--train`` modules (and the recipe's own new
    modules) trainable again, before ``--freeze``; ``None`` for full fine-tuning."""
    if not lora_enabled(run):
        return None
    report = apply_lora(
        chunk,
        run.lora_targets,
        rank=run.lora_rank,
        alpha=run.lora_alpha,
        dropout=run.lora_dropout,
        seed=run.seed,  # on the meta device the adapters stay shapes only
        exclude=recipe.model.lora_exclude,
    )
    if run.train:
        train_modules(chunk, run.train)
    fully_trained = recipe.model.fully_trained(run)
    if fully_trained:  # the recipe's own new modules (OpenVLA-OFT's head): trained whole
        train_modules(chunk, ",".join(fully_trained))
    report.trainable = sum(p.numel() for p in chunk.parameters() if p.requires_grad)
    report.frozen = sum(p.numel() for p in chunk.parameters() if not p.requires_grad)
    return report


def train_modules(model: nn.Module, patterns: str) -> list[str]:
    """Make every base parameter of the modules ``patterns`` selects train again, PEFT's
    ``modules_to_save``: a glob matches a parameter's name or any module above it, whole or as
    a dotted tail (``projector`` trains ``projector.fc1.weight``, ``*norm`` every norm).
    Returns the names made trainable."""
    globs = target_patterns(patterns) or ()
    out = []
    for name, p in model.named_parameters():
        if not is_adapter_name(name) and owned_by(name, globs):
            p.requires_grad_(True)
            out.append(name)
    return out


def owned_by(name: str, globs) -> bool:
    """Whether a glob matches the parameter ``name`` or a module above it (``--train``'s rule)."""
    parts = name.split(".")
    owners = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(matches_target(g, o) for g in globs for o in owners)


def _check_lora_globs(whole: nn.Module, run: Run, report: LoRAReport) -> None:
    """Every ``--lora-targets`` and ``--train`` glob must select something (a typo would train
    the wrong thing), and something must train."""
    if report.unmatched:
        raise ValueError(
            f"--lora-targets {', '.join(report.unmatched)} match no linear layer of the model "
            "(module names of parallax or of the HF checkpoint, whole or as a dotted tail)"
        )
    if not report.adapted:
        raise ValueError(f"--lora-targets {run.lora_targets}: no linear layer to adapt")
    for glob in target_patterns(run.train) if run.train else ():
        if not train_modules(whole, glob):  # already trainable: this only finds the names
            raise ValueError(f"--train {glob!r} matches no module or parameter of the model")


def describe(report: LoRAReport | None, run: Run) -> str:
    """One line for logs and ``--dry-run``."""
    if report is None:
        return "full fine-tuning"
    return (
        f"LoRA r={run.lora_rank} alpha={run.lora_alpha:g} dropout={run.lora_dropout:g} on "
        f"{len(report.target_modules)} modules ({run.lora_targets}); "
        f"{report.adapters:,} adapter parameters, {report.trainable:,} trainable, "
        f"{report.frozen:,} frozen; fully trained: {run.train or '-'}"
    )
