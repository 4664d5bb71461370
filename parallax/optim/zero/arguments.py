"""Accept parameters the ways torch optimizers do, plus ``(name, param)`` pairs.

Names are what make the optimizer's saved state independent of the layout: a checkpoint keyed by
``"layers.3.mlp.up.weight"`` can be loaded at any dp, tp or pp split that uses the same logical
names. Without names, a parameter is named by its position in the list given (frozen ones
included), which is stable only as long as that list is.

:func:`accept` checks everything a ZeroOptimizer is given on this rank, then agrees with the
other ranks of its stage (:mod:`parallax.optim.zero.plane`): a bad argument on one rank raises the
same error on all of them instead of leaving them in the next collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallax.context import ParallelContext
from parallax.optim.zero.plane import plane_problems


@dataclass
class ParamGroup:
    names: list[str]
    params: list[torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)  # hyperparameters of this group


def _entries(group: dict) -> list:
    params = group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, tuple) and len(params) == 2 and isinstance(params[0], str):
        return [params]  # one (name, param) pair
    return list(params)


def normalize_param_groups(params: Iterable) -> list[ParamGroup]:
    """Parameters, param-group dicts, ``(name, param)`` pairs, or groups of pairs -> groups."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters, (name, param) pairs or dicts")
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    raw = items if isinstance(items[0], dict) else [{"params": items}]
    groups: list[ParamGroup] = []
    named: bool | None = None
    index = 0
    for g in raw:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(
                "a list of param groups must hold only dicts with a 'params' entry, "
                f"got {type(g).__name__}"
            )
        group = ParamGroup([], [], {k: v for k, v in g.items() if k != "params"})
        for entry in _entries(g):
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                name, p, is_named = entry[0], entry[1], True
            elif isinstance(entry, torch.Tensor):
                name, p, is_named = str(index), entry, False
            else:
                raise TypeError(
                    f"expected a parameter or a (name, parameter) pair, got {type(entry).__name__}"
                )
            if named is not None and named != is_named:
                raise ValueError(
                    "params mixes named (name, param) pairs and bare parameters; give names "
                    "for all of them (e.g. model.named_parameters()) or for none"
                )
            named = is_named
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise ValueError(f"parameter {name!r} is not a leaf tensor")
            group.names.append(name)
            group.params.append(p)
            index += 1
        groups.append(group)
    _check_unique(groups)
    return groups


def trainable(groups: list[ParamGroup]) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """Names, tensors and group indices of the parameters with ``requires_grad``."""
    out: tuple[list, list, list] = ([], [], [])
    for gi, g in enumerate(groups):
        for name, p in zip(g.names, g.params):
            if p.requires_grad:
                out[0].append(name)
                out[1].append(p)
                out[2].append(gi)
    return out


def _check_unique(groups: list[ParamGroup]) -> None:
    seen_ids: dict[int, str] = {}
    seen_names: set[str] = set()
    for g in groups:
        for name, p in zip(g.names, g.params):
            if id(p) in seen_ids:
                raise ValueError(
                    f"parameter {name!r} is given twice (also as {seen_ids[id(p)]!r}); "
                    "each parameter may appear in only one group, once"
                )
            if name in seen_names:
                raise ValueError(f"two parameters are both named {name!r}; names must be unique")
            seen_ids[id(p)] = name
            seen_names.add(name)


def forward_order(
    params: list[torch.Tensor], names: list[str], param_order: Iterable[torch.Tensor] | None
) -> list[int] | None:
    """Indices of ``params`` in ``param_order`` (frozen and unknown parameters there ignored)."""
    if param_order is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    order = list(dict.fromkeys(index[id(p)] for p in param_order if id(p) in index))
    missing = sorted(set(range(len(params))) - set(order))
    if missing:
        raise ValueError(
            f"param_order lacks {len(missing)} trainable parameters, e.g. "
            f"{[names[i] for i in missing[:3]]}; pass every parameter, e.g. model.parameters()"
        )
    return order


@dataclass
class Accepted:
    """What a ZeroOptimizer is built from, the same layout on every rank of its plane."""

    groups: list[ParamGroup]
    names: list[str]  # the trainable parameters, in the order given
    params: list[torch.Tensor]
    group_of: list[int]  # each one's group
    group_names: list[list[str]]  # each group's trainable names
    sequence_parallel: list[bool]
    order: list[int] | None  # the forward order (see forward_order)
    device: torch.device


def accept(
    ctx: ParallelContext,
    params: Iterable,
    optimizer_class: Any,
    passes: Any,
    bucket_numel: Any,
    param_order: Iterable[torch.Tensor] | None,
) -> Accepted:
    """Check the arguments here, then agree over the stage's dp x tp plane (a collective)."""
    own: Exception | None = None
    groups, names, tensors, group_of, order = [], [], [], [], None
    try:
        _check_arguments(optimizer_class, passes, bucket_numel)
        groups = normalize_param_groups(params)
        names, tensors, group_of = trainable(groups)
        order = forward_order(tensors, names, param_order)
        devices = sorted({str(p.device) for p in tensors})
        if len(devices) > 1:
            raise ValueError(f"parameters are on several devices {devices}; move them first")
        if devices == ["meta"]:
            raise ValueError("parameters are on the meta device; materialize them first")
    except (TypeError, ValueError) as err:
        own = err
    device = tensors[0].device if tensors and own is None else ctx.device
    sp = [bool(getattr(p, "sequence_parallel", False)) for p in tensors]
    signature = [
        (n, tuple(p.shape), str(p.dtype), s, g) for n, p, s, g in zip(names, tensors, sp, group_of)
    ]
    found = plane_problems(ctx, None if own is None else str(own), device.type, signature)
    if own is not None and found == [str(own)]:  # alone in its plane: the error as raised
        raise own
    if found:
        raise (ValueError if own is None else type(own))("ZeroOptimizer: " + "; ".join(found))
    group_names = [[n for n, gi in zip(names, group_of) if gi == j] for j in range(len(groups))]
    return Accepted(groups, names, tensors, group_of, group_names, sp, order, device)


def _check_arguments(optimizer_class: Any, passes: Any, bucket_numel: Any) -> None:
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    check_passes(passes)
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive integer, got {bucket_numel!r}")


def check_passes(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {value!r}")
