"""Freezing and learning-rate groups, named once for every recipe by globs of global names.

``--freeze GLOB,...`` stops training every parameter whose global name matches a glob (or an
alias the family defines, such as ``vision``); ``--lr-groups`` gives matching parameters their
own peak learning rate (``"vision_tower.*=2e-6,*=2e-5"``, a TOML file of ``glob = lr`` pairs, or a
``[lr_groups]`` table in ``--config``). The first matching glob decides; parameters that match
none get ``--lr``. A fused projection (``qkv_proj``, ``gate_up_proj``) matches when its own name
or every separate tensor it stands for matches; matching only some of them is an error, since
one weight cannot be half frozen (build with ``--no-fused-projections`` for that).

Frozen parameters have ``requires_grad=False`` before the optimizer is built, so ZeRO-1 gives
them no gradient buffer, no master copy, no optimizer state and no reduction, and autograd runs
no weight-gradient matmul for them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from torch import nn

from parallax.models.hf_io import fused_parts
from parallax.run.config import TrainConfig
from parallax.run.values import load_toml_table


def split_globs(value: str | Sequence[str] | None) -> list[str]:
    """``"a.*,b.*"`` or a list -> the globs, stripped, empty ones dropped."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [g.strip() for g in items if str(g).strip()]


def freeze_globs(cfg: TrainConfig, aliases: Mapping[str, Sequence[str]]) -> list[str]:
    """The globs ``--freeze`` and ``--freeze-vision`` stand for, the family's ``aliases``
    expanded."""
    globs = split_globs(cfg.freeze)
    if cfg.freeze_vision:
        globs.append("vision")
    out: list[str] = []
    for g in globs:
        out += list(aliases.get(g, (g,)))
    return out


def _matches(name: str, glob: str) -> bool | None:
    """True / False, or None when the glob matches some but not all parts of a fused name."""
    if fnmatch.fnmatchcase(name, glob):
        return True
    parts = [fnmatch.fnmatchcase(p, glob) for p in fused_parts(name)]
    if len(parts) > 1 and any(parts):
        return True if all(parts) else None
    return False


def _first_match(name: str, globs: Sequence[str]) -> int | None:
    for i, glob in enumerate(globs):
        hit = _matches(name, glob)
        if hit is None:
            raise ValueError(
                f"{glob!r} matches only some of the projections fused into {name} "
                f"({', '.join(fused_parts(name))}); run with --no-fused-projections to treat "
                "them separately"
            )
        if hit:
            return i
    return None


def frozen_matcher(cfg: TrainConfig, aliases: Mapping[str, Sequence[str]]) -> Callable[[str], bool]:
    """A predicate on global names: frozen by this run's flags."""
    globs = freeze_globs(cfg, aliases)
    return lambda name: _first_match(name, globs) is not None


def apply_freeze(
    modules: Iterable[nn.Module], cfg: TrainConfig, aliases: Mapping[str, Sequence[str]]
) -> int:
    """Set ``requires_grad=False`` on every parameter the flags freeze; returns how many
    elements this rank froze."""
    frozen, count = frozen_matcher(cfg, aliases), 0
    for module in modules:
        for name, p in module.named_parameters():
            if frozen(name):
                p.requires_grad_(False)
                count += p.numel()
    return count


def check_freeze_globs(
    cfg: TrainConfig, aliases: Mapping[str, Sequence[str]], names: Iterable[str]
) -> None:
    """Every ``--freeze`` glob must match some parameter of the whole model (a typo would
    otherwise train what the user meant to freeze)."""
    names = list(names)
    for glob in freeze_globs(cfg, aliases):
        if not any(_matches(n, glob) for n in names):
            raise ValueError(f"--freeze {glob!r} matches no parameter of the model")


def parse_lr_groups(value) -> list[tuple[str, float]]:
    """``--lr-groups`` as ``[(glob, lr), ...]`` in the order given: a dict (TOML table), a
    ``glob=lr,...`` string, or the path of a TOML file holding such a table."""
    if not value:
        return []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str) and value.endswith(".toml"):
        items = list(load_toml_table(Path(value), "--lr-groups").items())
    elif isinstance(value, str):
        items = []
        for part in split_globs(value):
            glob, sep, lr = part.rpartition("=")
            if not sep or not glob.strip():
                raise ValueError(f"--lr-groups: {part!r} is not GLOB=LR")
            items.append((glob.strip(), lr))
    else:
        raise ValueError(f"--lr-groups must be GLOB=LR,... or a TOML table, got {value!r}")
    out = []
    for glob, lr in items:
        try:
            rate = float(lr)
        except (TypeError, ValueError):
            raise ValueError(
                f"--lr-groups: the learning rate of {glob!r} is not a number: {lr!r}"
            ) from None
        if rate < 0 or isinstance(lr, bool):
            raise ValueError(f"--lr-groups: the learning rate of {glob!r} must be >= 0, got {lr!r}")
        out.append((str(glob), rate))
    return out


def check_lr_group_globs(cfg: TrainConfig, names: Iterable[str]) -> None:
    """Every ``--lr-groups`` glob must match some parameter of the whole model (adapters
    included), as ``--freeze`` globs must: a typo would silently train at ``--lr``."""
    names = list(names)
    for glob, _ in parse_lr_groups(cfg.lr_groups):
        if not any(_matches(n, glob) for n in names):
            raise ValueError(f"--lr-groups {glob!r} matches no parameter of the model")


def param_groups(named: Sequence[tuple[str, nn.Parameter]], cfg: TrainConfig) -> list[dict]:
    """ZeRO-1 parameter groups of the trainable ``named`` parameters: one per (lr group, decay),
    in a fixed order (so every rank of every layout builds the same groups, empty ones
    included: checkpoints index groups by position). Weight decay applies to matrices only."""
    lr_groups = parse_lr_groups(cfg.lr_groups)
    rates = [lr for _, lr in lr_groups] + [cfg.lr]
    globs = [g for g, _ in lr_groups]
    buckets: list[list] = [[] for _ in range(2 * len(rates))]
    for name, p in named:
        i = _first_match(name, globs)
        i = len(rates) - 1 if i is None else i
        buckets[2 * i + (0 if p.dim() >= 2 else 1)].append((name, p))
    groups = []
    for i, rate in enumerate(rates):
        groups.append({"params": buckets[2 * i], "lr": rate})
        groups.append({"params": buckets[2 * i + 1], "lr": rate, "weight_decay": 0.0})
    return groups


def group_labels(cfg: TrainConfig) -> list[str]:
    """A label per group of :func:`param_groups`, for ``--dry-run``."""
    globs = [g for g, _ in parse_lr_groups(cfg.lr_groups)] + ["*"]
    return [f"{g} {kind}" for g in globs for kind in ("(decay)", "(no decay)")]
