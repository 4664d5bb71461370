"""A :class:`~parallax.run.TrainConfig` -> its :class:`~parallax.run.Run`, once.

:func:`resolve` checks the options (one ``ValueError`` naming every problem), finds the family
(:mod:`parallax.recipe.registry`), reads the family's own options (refusing another family's:
an option is never silently ignored), resolves ``--model`` to its config and checkpoint, fills
in what the family decides (the learning rate, its schedule and groups, LoRA's recipe) and
applies the run's options to the model config. ``--layout auto`` is the planner's, applied to
the resolved run by the command (:func:`parallax.plan.auto.choose`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from parallax.recipe.base import Recipe
from parallax.recipe.registry import find, owner_of, strip_family
from parallax.run import FULL_DEFAULTS, LORA_DEFAULTS, Run, TrainConfig
from parallax.run.option import as_given, flag, needs_problems, problems
from parallax.run.rules import type_problems


def family_defaults(cfg: TrainConfig, recipe: Recipe, name: str) -> TrainConfig:
    """``cfg`` with what it leaves to the family filled in: ``--lr`` (LoRA's rate with
    ``--finetune lora``), ``--lr-groups``, and the warm-up, schedule and clipping of full
    fine-tuning or of OpenVLA's LoRA recipe. The same for a run and its ``--dry-run``."""
    lora = cfg.finetune == "lora"
    model = recipe.model
    filled: dict[str, Any] = {}
    lr = cfg.lr
    if lr is None:
        lr = filled["lr"] = model.default_lora_lr(name) if lora else model.default_lr(name)
    if cfg.lr_groups is None:
        filled["lr_groups"] = model.default_lr_groups(name, lr)
    for key, value in (LORA_DEFAULTS if lora else FULL_DEFAULTS).items():
        if getattr(cfg, key) is None:
            filled[key] = value
    return cfg.replace(**filled) if filled else cfg


def family_options(cfg: TrainConfig, recipe: Recipe) -> Any:
    """The family's own options of ``cfg`` (its dataclass, defaults filled in), or None when it
    declares none; a ``ValueError`` for a value of another family's option or a bad one."""
    given = dict(cfg.family_values)
    declared = recipe.options
    known = set() if declared is None else {f.name for f in dataclasses.fields(declared)}
    foreign = [_foreign(k, recipe) for k in given if k not in known]
    foreign += unread_problems(cfg, recipe)
    if foreign:
        raise ValueError("; ".join(foreign))
    if declared is None:
        return None
    own = declared(**given)
    found = type_problems(own) or problems(own) + needs_problems(own, cfg)
    if found:
        raise ValueError("; ".join(found))
    return own


def unread_problems(cfg: TrainConfig, recipe: Recipe) -> list[str]:
    """The core options ``cfg`` sets away from their defaults that ``recipe``'s family does not
    read (its ``unread``): given, they would change nothing."""
    defaults = TrainConfig()
    return [
        f"{as_given(name, getattr(cfg, name))}: the {recipe.name} family does not read it "
        "(it would change nothing): drop it"
        for name in recipe.unread
        if getattr(cfg, name) != getattr(defaults, name)
    ]


def _foreign(key: str, recipe: Recipe) -> str:
    owner = owner_of(key)
    whose = f"an option of the {owner} family" if owner else "not an option of any family"
    return (
        f"{flag(key)} is {whose}; the {recipe.name} family does not read it: drop it, or pick "
        f"a model of {owner or 'a family that has it'} with --model"
    )


def resolve(
    cfg: TrainConfig,
    *,
    recipe: Recipe | None = None,
    model_config: Any | None = None,
    checkpoint: Path | None = None,
) -> Run:
    """The :class:`Run` of ``cfg``. ``recipe`` overrides the family found from ``cfg.model``;
    ``model_config`` (and ``checkpoint``) the model it resolves to."""
    if isinstance(cfg, Run):
        raise TypeError("resolve() takes a TrainConfig; this Run is resolved already")
    cfg.check()
    recipe = recipe or find(cfg.model)
    name = strip_family(cfg.model, recipe)
    own = family_options(cfg, recipe)
    if model_config is None:
        spec = recipe.model.resolve(name)
        model_config, checkpoint = spec.config, spec.checkpoint
    recipe = recipe.variant(own, model_config)
    flags = family_defaults(cfg, recipe, name)
    if flags.pad_to_multiple_of > 1 and not recipe.data.pads_text:
        raise ValueError(
            f"--pad-to-multiple-of: the {recipe.name} family's batches do not pad their text "
            "to a multiple; leave it at 1"
        )
    run = Run(
        **flags.core_options(),
        recipe=recipe,
        model_name=name,
        model_config=model_config,
        checkpoint=checkpoint,
        family_options=own,
    )
    return run.replace(model_config=recipe.model.configure(run))
