"""``--finetune lora`` in the Trainer, for any recipe whose model uses parallax's parallel linears.

Each chunk the recipe builds gets adapters (:func:`~parallax.tensor.lora_apply.apply_lora`,
named after the checkpoint's modules through ``model.checkpoint_layout()`` where the model has
one, initialised layout-free from ``--seed``) and a frozen base; ``--train`` globs make whole
modules train again (PEFT's ``modules_to_save``). All of it happens before the optimizer is
built, so ZeRO-1 sees only what trains: no gradient buffers, fp32 masters or AdamW state for the
base, and autograd runs no weight-gradient matmul for it. The globs are checked once on the whole
model built on the meta device (no collective), so a typo fails on every rank alike.

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
from parallax.tensor.fingerprint import Fingerprint, base_fingerprint, fingerprint_mismatches
from parallax.tensor.lora_apply import (
    LoRAReport,
    apply_lora,
    is_adapter_name,
    matches_target,
    target_patterns,
)

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"


def enabled(cfg) -> bool:
    return cfg.finetune == "lora"


def prepare(chunk: nn.Module, cfg, recipe) -> LoRAReport | None:
    """Adapters on ``chunk`` and its base frozen, ``--train`` modules trainable again (before
    ``--freeze``, which the Trainer applies next); ``None`` for full fine-tuning."""
    if not enabled(cfg):
        return None
    report = apply_lora(
        chunk,
        cfg.lora_targets,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        seed=cfg.seed,  # on the meta device the adapters stay shapes only
        exclude=recipe.lora_exclude,
    )
    if cfg.train:
        train_modules(chunk, cfg.train)
    fully_trained = recipe.fully_trained(cfg)
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
        parts = name.split(".")
        owners = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if not is_adapter_name(name) and any(matches_target(g, o) for g in globs for o in owners):
            p.requires_grad_(True)
            out.append(name)
    return out


def check_globs(whole: nn.Module, cfg, recipe) -> LoRAReport | None:
    """Adapt the ``whole`` model (meta, tp = 1) as the run will: every ``--lora-targets`` and
    ``--train`` glob must select something (a typo would train the wrong thing), and something
    must train. Returns the whole model's report (adapters, the modules never built)."""
    report = prepare(whole, cfg, recipe)
    if report is None:
        return None
    if report.unmatched:
        raise ValueError(
            f"--lora-targets {', '.join(report.unmatched)} match no linear layer of the model "
            "(module names of parallax or of the HF checkpoint, whole or as a dotted tail)"
        )
    if not report.adapted:
        raise ValueError(f"--lora-targets {cfg.lora_targets}: no linear layer to adapt")
    for glob in target_patterns(cfg.train) if cfg.train else ():
        if not train_modules(whole, glob):  # already trainable: this only finds the names
            raise ValueError(f"--train {glob!r} matches no module or parameter of the model")
    return report


def load_init(chunks: Sequence[nn.Module], cfg, ctx) -> None:
    """Fill the adapters (and any ``modules_to_save`` tensors) from ``--lora-init``
    (collective; one chunk per rank, which the config checks)."""

    if not cfg.lora_init:
        return
    for chunk in chunks:
        result = load_adapter(chunk, cfg.lora_init, ctx=ctx)
        if ctx.rank == 0:
            log.info(
                "--lora-init: loaded %s (%d trained tensors, %d of modules never built ignored)",
                cfg.lora_init,
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
    cfg = trainer.cfg
    return {
        "rank": cfg.lora_rank,
        "alpha": cfg.lora_alpha,
        "dropout": cfg.lora_dropout,
        "targets": cfg.lora_targets,
        "train": cfg.train,
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
    cfg = trainer.cfg
    for key, mine in (("rank", cfg.lora_rank), ("alpha", cfg.lora_alpha)):
        if float(saved[key]) != float(mine):
            return f"{path} has LoRA {key} {saved[key]:g}; this run asks for {mine:g}"
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
    globs = trainer.recipe.fully_trained(trainer.cfg)

    def apart(name: str) -> bool:
        parts = name.split(".")
        owners = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(matches_target(g, o) for g in globs for o in owners)

    return apart


def describe(report: LoRAReport | None, cfg) -> str:
    """One line for logs and ``--dry-run``."""
    if report is None:
        return "full fine-tuning"
    return (
        f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} dropout={cfg.lora_dropout:g} on "
        f"{len(report.target_modules)} modules ({cfg.lora_targets}); "
        f"{report.adapters:,} adapter parameters, {report.trainable:,} trainable, "
        f"{report.frozen:,} frozen; fully trained: {cfg.train or '-'}"
    )
