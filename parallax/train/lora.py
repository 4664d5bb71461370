"""``--finetune lora`` in the Trainer, once the chunks are built with their adapters
(:mod:`parallax.recipe.adapt`): ``--lora-init``, the checkpoints' LoRA section and the PEFT
export.

What a LoRA checkpoint holds is what trains (adapters, ``--train`` modules and their optimizer
state) and the base's identity: :func:`~parallax.tensor.fingerprint.base_fingerprint` of the
frozen weights, layout-free, so a resume at another layout rebuilds the same base (from the seed
or the checkpoint it read) and a resume onto another base is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from parallax.models.peft import save_adapter
from parallax.models.peft_load import load_adapter
from parallax.recipe.adapt import owned_by
from parallax.run import Run
from parallax.tensor.fingerprint import Fingerprint, base_fingerprint, fingerprint_mismatches
from parallax.tensor.lora_apply import LoRAReport, is_adapter_name

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"


def load_init(chunks: Sequence[nn.Module], run: Run, ctx) -> None:
    """Fill the adapters (and any ``modules_to_save`` tensors) from ``--lora-init``
    (collective; one chunk per rank, which the config checks)."""

    if not run.lora_init:
        return
    for chunk in chunks:
        result = load_adapter(chunk, run.lora_init, ctx=ctx)
        if ctx.rank == 0:
            log.info(
                "--lora-init: loaded %s (%d trained tensors, %d of modules never built ignored)",
                run.lora_init,
                len(result["trained"]),
                len(result["ignored"]),
            )


def base_identity(chunks: Sequence[nn.Module], ctx) -> Fingerprint:
    """The fingerprint of every frozen parameter of the whole model (collective)."""
    out: Fingerprint = {}
    for chunk in chunks:
        out.update(base_fingerprint(chunk, ctx))
    return dict(sorted(out.items()))


def checkpoint_meta(trainer) -> dict:
    """What a LoRA checkpoint's meta.json says about the adapters and the base."""
    run = trainer.run
    return {
        "rank": run.lora_rank,
        "alpha": run.lora_alpha,
        "dropout": run.lora_dropout,
        "targets": run.lora_targets,
        "train": run.train,
        "quantize_base": run.quantize_base,
        "base": trainer.base_identity,
    }


def check_resume(meta: dict, trainer, path: Path) -> str | None:
    """Why this run cannot resume the checkpoint at ``path`` (meta ``meta``), or ``None``."""
    saved = meta.get("lora")
    if saved is None and trainer.base_identity is None:
        return None
    if saved is None:
        return (
            f"{path} was written by a full fine-tuning run; --finetune lora cannot resume it "
            "(export it with --export-hf and start a LoRA run with --model OUT/hf)"
        )
    if trainer.base_identity is None:
        return f"{path} holds LoRA adapters only: resume it with --finetune lora"
    run = trainer.run
    for key, mine in (("rank", run.lora_rank), ("alpha", run.lora_alpha)):
        if float(saved[key]) != float(mine):
            return f"{path} has LoRA {key} {saved[key]:g}; this run asks for {mine:g}"
    kind = saved.get("quantize_base")
    if kind != run.quantize_base:
        given = f"--quantize-base {kind}" if kind else "no --quantize-base"
        return (
            f"{path} grew its adapters on a base held {kind or 'unquantized'}; this run asks for "
            f"{run.quantize_base or 'an unquantized base'}: resume with {given}"
        )
    bad = fingerprint_mismatches(saved["base"], trainer.base_identity)
    if bad:
        return (
            f"{path} was trained on a different base model: {len(bad)} frozen tensors differ "
            f"(e.g. {', '.join(bad[:3])}); resume with the --model, --seed and --precision "
            "(and --train) that the run started with"
        )
    return None


def export_adapter(trainer, path: Path, report: LoRAReport | None) -> None:
    """The adapters (and ``--train`` modules) alone in PEFT's format (collective)."""

    notes = {}
    if report is not None:
        notes["not_adapted"] = {
            "modules": list(report.skipped),
            "why": "the model never builds them (the towers' blocks after the feature layer, "
            "SigLIP's attention pool): no adapter, and a PEFT run on the full towers has them",
        }
    chunk, apart = trainer.chunks[0], recipe_modules(trainer)
    trained = [
        n
        for n, p in chunk.named_parameters()
        if p.requires_grad and not is_adapter_name(n) and not apart(n)
    ]
    save_adapter(chunk, path, ctx=trainer.ctx, notes=notes, trained=trained)


def recipe_modules(trainer):
    """A predicate on parameter names: the recipe's fully trained modules
    (``Recipe.fully_trained``), which its export writes apart from the PEFT adapter."""
    globs = trainer.recipe.model.fully_trained(trainer.run)
    return lambda name: owned_by(name, globs)
