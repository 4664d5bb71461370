"""One training run, resolved once: the options, the family's defaults and the model.

:func:`resolve` turns a checked :class:`~parallax.train.config.TrainConfig` into a frozen
:class:`Run`: it finds the family (:mod:`parallax.recipe.registry`), resolves ``--model`` to its
config and checkpoint, fills in what the family decides (the learning rate, its schedule and
groups, LoRA's recipe) and applies the run's options to the model config. The CLI does this once
and passes the Run down to the Trainer, the recipe, checkpoints and ``--dry-run``; nothing
edits it later. With ``--layout auto`` the layout options come from the planner here
(:mod:`parallax.plan.auto`), for the world torchrun started. A Run reads like the config it
holds (``run.lr``, ``run.seed``), with the defaults filled in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.plan import auto
from parallax.recipe import registry
from parallax.recipe.protocol import Recipe
from parallax.train.config import FULL_DEFAULTS, LORA_DEFAULTS, TrainConfig


@dataclass(frozen=True)
class Run:
    """The resolved run: ``flags`` with every family default filled in, the family's recipe,
    the model's config (after the run's options) and the checkpoint it starts from."""

    flags: TrainConfig
    recipe: Recipe
    model_name: str  # --model without its FAMILY: prefix
    model_config: Any
    checkpoint: Path | None = None

    def __getattr__(self, name: str) -> Any:
        """The options, as the config has them (``run.lr``, ``run.micro_batch_size``)."""
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.flags, name)

    @property
    def family(self) -> str:
        return self.recipe.name

    def to_dict(self) -> dict[str, Any]:
        """The options as saved in checkpoints (the filled-in defaults included)."""
        return self.flags.to_dict()

    def replace(self, **options: Any) -> Run:
        """A copy with other option values (the model stays as resolved; the run is frozen)."""
        return dataclasses.replace(self, flags=self.flags.replace(**options))


def family_defaults(cfg: TrainConfig, recipe: Recipe, name: str) -> TrainConfig:
    """``cfg`` with what it leaves to the family filled in: ``--lr`` (LoRA's rate with
    ``--finetune lora``), ``--lr-groups``, and the warm-up, schedule and clipping of full
    fine-tuning or of OpenVLA's LoRA recipe. The same for a run and its ``--dry-run``."""
    lora = cfg.finetune == "lora"
    filled: dict[str, Any] = {}
    lr = cfg.lr
    if lr is None:
        lr = filled["lr"] = recipe.default_lora_lr(name) if lora else recipe.default_lr(name)
    if cfg.lr_groups is None:
        filled["lr_groups"] = recipe.default_lr_groups(name, lr)
    for key, value in (LORA_DEFAULTS if lora else FULL_DEFAULTS).items():
        if getattr(cfg, key) is None:
            filled[key] = value
    return cfg.replace(**filled) if filled else cfg


def resolve(
    cfg: TrainConfig,
    *,
    recipe: Recipe | None = None,
    model_config: Any | None = None,
    checkpoint: Path | None = None,
) -> Run:
    """The :class:`Run` of ``cfg`` (checked first: one ``ValueError`` naming every problem).
    ``recipe`` overrides the family found from ``cfg.model``; ``model_config`` (and
    ``checkpoint``) the model it resolves to."""
    if isinstance(cfg, Run):
        return cfg
    cfg.check()
    recipe = recipe or registry.find(cfg.model)
    name = registry.strip_family(cfg.model, recipe)
    if model_config is None:
        spec = recipe.resolve(name)
        model_config, checkpoint = spec.config, spec.checkpoint
    flags = family_defaults(cfg, recipe, name)
    if flags.layout == "auto":  # the planner's layout for this world, on every rank alike
        as_given = Run(flags, recipe, name, recipe.configure(model_config, flags), checkpoint)
        flags = auto.choose(as_given)
    if flags.pad_to_multiple_of > 1 and not recipe.pads_text:
        raise ValueError(
            f"--pad-to-multiple-of: the {recipe.name} family's batches do not pad their text "
            "to a multiple; leave it at 1"
        )
    configured = recipe.configure(model_config, flags)
    return Run(flags, recipe, name, configured, checkpoint)
