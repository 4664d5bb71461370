"""The units ZeRO-3 gathers: a model chunk's blocks, found from its modules alone.

A *block unit* is each module held in an ``nn.ModuleList`` or ``nn.ModuleDict`` (decoder layers,
ViT blocks) and each compiled module (``module.compile()``), with all its parameters: gathered
for its forward, released after. Every other module with parameters of its own (embeddings,
norms, the head, a projector, a tower's position embeddings) is a unit of those parameters
alone, around its own forward. The chunk's own parameters (a dual encoder's ``logit_scale``)
are read outside any forward (by the loss), so their unit is gathered from its first use until
the optimizer step (``keep``). Units come in the modules' registration order, which is about the
forward order; the order that matters for prefetching is recorded from the forward itself.

Every parameter must be read inside the forward of the module that holds it (or of a unit above
it), and each parameter may sit in one unit only (a tied weight is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from parallax.optim.zero.torch_contract import is_compiled

if TYPE_CHECKING:
    from parallax.optim.zero.stage import ZeroStage

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass
class Unit:
    index: int
    module: nn.Module
    chunk: int  # which of the modules handed to the optimizer it belongs to
    names: list[str]  # the parameters' names in their chunk (the global names, for a Trainer)
    params: list[nn.Parameter]
    block: bool  # a block (all its parameters) rather than a module's own parameters
    keep: bool  # the chunk's own parameters: kept from first use until the step


def find_units(modules: Sequence[nn.Module]) -> list[Unit]:
    """Every unit of ``modules`` (see the module docstring), in registration order: a pure walk
    of the module trees, which the planner also counts a model's units with. A weight shared by
    two modules is in both units (:func:`shared_weight` says so; ZeRO-3 refuses it)."""
    units: list[Unit] = []

    def add(module: nn.Module, chunk: int, prefix: str, block: bool, keep: bool) -> None:
        named = list(module.named_parameters(prefix=prefix, recurse=block))
        if named:
            names, params = [n for n, _ in named], [p for _, p in named]
            units.append(Unit(len(units), module, chunk, names, params, block, keep))

    def visit(module: nn.Module, chunk: int, prefix: str, root: bool, held: bool) -> None:
        if not root and (held or is_compiled(module)) and _has_params(module):
            add(module, chunk, prefix, block=True, keep=False)
            return
        add(module, chunk, prefix, block=False, keep=root)
        for name, child in module.named_children():
            child_prefix = f"{prefix}.{name}" if prefix else name
            visit(child, chunk, child_prefix, False, isinstance(module, CONTAINERS))

    for c, module in enumerate(modules):
        visit(module, c, "", True, False)
    return units


def shared_weight(units: Sequence[Unit]) -> str | None:
    """Why ZeRO-3 cannot shard ``units``: a weight two of them hold (tied embeddings), or None."""
    owner: dict[int, str] = {}
    for u in units:
        for name, p in zip(u.names, u.params):
            if id(p) in owner:
                return (
                    f"ZeRO-3: parameter {name!r} is also {owner[id(p)]!r}: a weight shared "
                    "between two modules (tied embeddings) is not supported; untie it or use "
                    "--zero 2"
                )
            owner[id(p)] = name
    return None


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def unit_of_params(units: Sequence[Unit]) -> dict[int, int]:
    """``id(param) -> unit index``."""
    return {id(p): u.index for u in units for p in u.params}


def check_trainable(units: Sequence[Unit], trainable: Sequence[torch.Tensor]) -> str | None:
    """Why ``trainable`` (the optimizer's parameters) do not match the units' parameters that
    require a gradient, or None."""
    given = {id(p) for p in trainable}
    where = unit_of_params(units)
    outside = sum(1 for p in trainable if id(p) not in where)
    if outside:
        return (
            f"ZeRO-3: {outside} of the optimizer's parameters are not in the modules it was "
            "given; pass every module whose parameters it trains"
        )
    missed = [n for u in units for n, p in zip(u.names, u.params) if p.requires_grad]
    missed = [n for n, p in zip(missed, _trainable(units)) if id(p) not in given]
    if missed:
        return (
            f"ZeRO-3: parameters {missed[:3]} require a gradient but are not given to the "
            "optimizer; freeze them (requires_grad=False) or pass them"
        )
    return None


def _trainable(units: Sequence[Unit]) -> list[torch.Tensor]:
    return [p for u in units for p in u.params if p.requires_grad]


def parameter_units(
    stage: ZeroStage, modules: list[nn.Module], params: Sequence[torch.Tensor]
) -> tuple[list[Unit], list[int] | None]:
    """The units (stage 3) and each trainable parameter's unit, the group of parameters its
    buckets hold and reduce together: its block at stage 3, its chunk at stage 2 (``None``: one
    unit, stage 1 or no modules)."""
    if stage.shards_weights:
        units = find_units(modules)
        problem = shared_weight(units) or check_trainable(units, params)
        if problem:
            raise ValueError(problem)
        where = unit_of_params(units)
        return units, [where[id(p)] for p in params]
    if stage.reduces_each_pass and modules:
        chunk = {id(p): c for c, m in enumerate(modules) for p in m.parameters()}
        missing = sum(1 for p in params if id(p) not in chunk)
        if missing:
            raise ValueError(
                f"ZeRO-{stage}: {missing} of the optimizer's parameters are not in the modules "
                "given"
            )
        return [], [chunk[id(p)] for p in params]
    return [], None


def grouped_order(order: list[int] | None, unit_of: list[int] | None, n: int) -> list[int] | None:
    """The forward order with each unit's parameters together, units in their own order."""
    if unit_of is None:
        return order
    base = list(range(n)) if order is None else order
    rank = {i: k for k, i in enumerate(base)}
    return sorted(range(n), key=lambda i: (unit_of[i], rank[i]))
