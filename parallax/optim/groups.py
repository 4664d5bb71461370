"""Accept parameters the ways torch optimizers do, plus ``(name, param)`` pairs.

Names are what make the optimizer's saved state independent of the layout: a checkpoint keyed by
``"layers.3.mlp.up.weight"`` can be loaded at any dp, tp or pp split that uses the same logical
names. Without names, a parameter is named by its position in the list given (frozen ones
included), which is stable only as long as that list is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallax import comm
from parallax.context import ParallelContext


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


def check_agreement(ctx: ParallelContext, signature: list[tuple]) -> None:
    """Every dp (and tp) rank must build the same buffers, or collectives would not match."""
    for axis, group in (("dp", ctx.dp_group), ("tp", ctx.tp_group)):
        if comm.size(group) == 1:
            continue
        signatures = comm.all_gather_object(signature, group)
        for r, other in enumerate(signatures):
            if other == signatures[0]:
                continue
            diff = next((i for i, (a, b) in enumerate(zip(signatures[0], other)) if a != b), None)
            what = (
                f"{len(signatures[0])} vs {len(other)} trainable parameters"
                if diff is None
                else f"parameter #{diff}: {signatures[0][diff]} on {axis} rank 0 vs "
                f"{other[diff]} on {axis} rank {r}"
            )
            raise ValueError(
                f"ZeroOptimizer: {axis} ranks disagree on the trainable parameters ({what}); every "
                f"{axis} rank must pass the same names, shapes, dtypes, requires_grad and groups "
                "(name, shape, dtype, sequence_parallel, group)"
            )
