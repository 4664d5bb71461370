"""Layout-free optimizer state: full logical tensors keyed by parameter name, streamed.

Keys are ``"<parameter name>.<state>"``: ``.master`` for the fp32 master weight, then the
wrapped optimizer's own state names (AdamW: ``.exp_avg``, ``.exp_avg_sq``, ``.step``; SGD with
momentum: ``.momentum_buffer``). Per-element state is the full logical tensor (gathered over dp,
unsharded over tp), shaped like the logical parameter; scalar state (``step``) is a 0-d float32
tensor. A parameter that has never been stepped has only ``.master``.

The meta (JSON-able) holds the format tag, the optimizer's class name, the param groups (their
hyperparameters and member names) and, per parameter name, the list of its state names. Metas
of several pipeline stages merge by the union of ``"keys"`` and the concatenation of each
group's ``"params"``.

Saving gathers one tensor at a time (every rank of the dp and tp group takes part, in the same
order; only the ranks that write need keep it). Loading makes no collective: each rank pulls
the full tensors it needs through ``get(key)`` and keeps its slice. :class:`StateIO` does it
for one ZeroOptimizer, from the parts it reads (its parameters, pieces and wrapped optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.plane import plane_gather
from parallax.tensor.sharding import logical_shape, shard_tensor, unshard_tensor

FORMAT = "parallax.zero/1"

Kinds = dict[str, tuple[str, str]]  # state name -> ("elem" | "scalar", dtype)

# how this run steps (its device, --offload), not what it learned: kept from this optimizer
KERNEL_OPTIONS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _fetch(get: Callable[[str], torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``get(key)``, checked: a 0-d tensor (scalar state) or one of the logical ``shape``."""
    try:
        value = get(key)
    except KeyError:
        raise ValueError(f"the optimizer checkpoint has no tensor {key!r}") from None
    if (value.dim() > 0 or key.endswith(".master")) and tuple(value.shape) != shape:
        raise ValueError(
            f"optimizer checkpoint tensor {key!r} has shape {tuple(value.shape)}, "
            f"expected the logical shape {shape}"
        )
    return value


def _kind(key: str, value: torch.Tensor, piece: torch.Tensor, name: str) -> str:
    """``"scalar"`` or ``"elem"``: how state ``key`` of parameter ``name`` is saved."""
    if not isinstance(value, torch.Tensor):
        raise NotImplementedError(
            f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; "
            "only tensor state can be saved"
        )
    if value.dim() == 0:
        return "scalar"
    if value.shape == piece.shape:
        return "elem"
    raise NotImplementedError(
        f"optimizer state {key!r} of {name!r} has shape "
        f"{tuple(value.shape)}, neither per-element {tuple(piece.shape)} nor scalar"
    )


class StateIO:
    """The state of one ZeroOptimizer as full logical tensors (see the module docstring).

    ``names``/``params``: its trainable parameters, ``group_names`` each group's names,
    ``flat`` the pieces this rank owns, ``inner`` the wrapped optimizer (its ``state`` and groups
    read at each call: loading replaces them); collectives over ``ctx``'s dp x tp plane."""

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        group_names: Sequence[Sequence[str]],
        flat: FlatBuffers,
        inner: torch.optim.Optimizer,
        ctx: ParallelContext,
        device: torch.device,
    ) -> None:
        self.names, self.params, self.group_names = names, params, group_names
        self.flat, self.inner, self.ctx, self.device = flat, inner, ctx, device

    def _local_kinds(self) -> dict[int, Kinds]:
        out: dict[int, Kinds] = {}
        for i, pieces in enumerate(self.flat.pieces_of):
            for _, t in pieces:
                for key, value in self.inner.state.get(t, {}).items():
                    if value is None:
                        continue
                    kind = _kind(key, value, t, self.names[i])
                    out.setdefault(i, {})[key] = (kind, str(value.dtype).removeprefix("torch."))
        return out

    def kinds(self) -> dict[int, Kinds]:
        """Per parameter index, the state its owners hold, agreed over dp and tp (collective).
        State that cannot be saved, on any rank of the plane, raises on all of them."""
        try:
            local, problem = self._local_kinds(), None
        except NotImplementedError as err:
            local, problem = {}, str(err)
        plane = plane_gather(self.ctx, (self.ctx.rank, problem, local))
        reports = [r for column in plane for r in column]
        found = [f"rank {r}: {p}" if len(reports) > 1 else p for r, p, _ in reports if p]
        if found:
            raise NotImplementedError("; ".join(found))
        merged: dict[int, Kinds] = {}
        for _, _, other in reports:
            for i, kinds in other.items():
                merged.setdefault(i, {}).update(kinds)
        return merged

    def meta(self) -> dict[str, Any]:
        kinds = self.kinds()
        groups = [
            {**{k: _jsonable(v) for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(self.inner.param_groups, self.group_names)
        ]
        keys = {name: ["master", *sorted(kinds.get(i, {}))] for i, name in enumerate(self.names)}
        return {
            "format": FORMAT,
            "optimizer": type(self.inner).__name__,
            "param_groups": groups,
            "keys": keys,
        }

    def _full(self, i: int, source: Callable[..., torch.Tensor], dtype):
        """The full logical tensor of one per-element state of parameter ``i`` (collective)."""
        p = self.params[i]
        flat = torch.zeros(p.numel(), dtype=dtype, device=self.device)  # (numel on this tp rank,)
        for pc, t in self.flat.pieces_of[i]:
            flat[pc.start : pc.start + pc.numel] = source(pc, t)
        comm.all_reduce(flat, self.ctx.dp_group)  # each element is owned by exactly one dp rank
        info = getattr(p, "tp_shard", None)
        local = flat.view(p.shape)
        return local if info is None else unshard_tensor(local, info, self.ctx.tp_group)

    def _scalar(self, i: int, key: str) -> torch.Tensor:
        value = torch.full((), -math.inf, dtype=torch.float64, device=self.device)
        for _, t in self.flat.pieces_of[i]:
            held = self.inner.state.get(t, {}).get(key)
            if held is not None:
                value = torch.maximum(value, held.detach().to(value))
        comm.all_reduce(value, self.ctx.dp_group, op="max")  # from whichever rank owns a piece
        return value.float()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        kinds, state = self.kinds(), self.inner.state
        for i, name in enumerate(self.names):
            yield f"{name}.master", self._full(i, self.flat.master_values, torch.float32)
            for key, (kind, dtype) in sorted(kinds.get(i, {}).items()):
                if kind == "scalar":
                    yield f"{name}.{key}", self._scalar(i, key)
                else:
                    yield (
                        f"{name}.{key}",
                        self._full(i, lambda _, t, k=key: state[t][k], getattr(torch, dtype)),
                    )

    def _check_meta(self, meta: dict[str, Any]) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} optimizer state (format {meta.get('format')!r})")
        missing = [n for n in self.names if n not in meta["keys"]]
        if missing:
            raise ValueError(
                f"the optimizer checkpoint has no state for {len(missing)} of {len(self.names)} "
                f"parameters, e.g. {missing[:3]}"
            )
        saved = meta["param_groups"]
        if len(saved) != len(self.group_names):
            raise ValueError(
                f"the optimizer checkpoint has {len(saved)} param groups, this optimizer "
                f"{len(self.group_names)}; build the groups the same way"
            )
        for j, (g, names) in enumerate(zip(saved, self.group_names)):
            moved = sorted(set(names) - set(g["params"]))
            if moved:
                raise ValueError(
                    f"parameters {moved[:3]} are in param group {j} here but not saved so"
                )

    @torch.no_grad()
    def load(self, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
        self._check_meta(meta)
        inner = self.inner
        inner.state.clear()  # the new slices replace the old ones, not add to them
        index = {id(t): k for k, t in enumerate(t for g in inner.param_groups for t in g["params"])}
        new_state: dict[int, dict[str, torch.Tensor]] = {}
        for i, name in enumerate(self.names):
            shape = logical_shape(self.params[i])
            for key in meta["keys"][name]:
                # the fetched tensor is an argument only: it is freed before the next one comes
                self._load_one(i, key, _fetch(get, f"{name}.{key}", shape), index, new_state)
        groups = inner.state_dict()["param_groups"]
        for g, saved in zip(groups, meta["param_groups"]):
            for k, v in saved.items():
                if k != "params" and k not in KERNEL_OPTIONS:
                    g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        inner.load_state_dict({"state": new_state, "param_groups": groups})

    def _load_one(
        self,
        i: int,
        key: str,
        full: torch.Tensor,
        index: dict[int, int],
        new_state: dict[int, dict[str, torch.Tensor]],
    ) -> None:
        """Keep this rank's slices of one full tensor: master into the model and the masters,
        optimizer state into ``new_state`` (keyed as the wrapped optimizer numbers its tensors)."""
        pieces = self.flat.pieces_of[i]
        if full.dim() == 0:  # scalar state, e.g. step: the same for every piece
            for _, t in pieces:
                new_state.setdefault(index[id(t)], {})[key] = full.detach().clone()
            return
        p, info = self.params[i], getattr(self.params[i], "tp_shard", None)
        local = full.to(self.device)
        local = local if info is None else shard_tensor(local, info)  # (this tp rank's shape)
        sharded = self.flat.store is not None  # ZeRO-3: the model holds this rank's shard only
        if key == "master" and not sharded:
            p.data.copy_(local)  # fp32 -> the model's dtype
        flat = local.reshape(-1)
        for pc, t in pieces:
            part = flat[pc.start : pc.start + pc.numel]
            if key == "master":
                self.flat.set_master(pc, t, part)
                if sharded:  # fp32 -> the model's dtype, in the shard
                    shard = self.flat.own_param(pc.bucket)
                    shard[pc.chunk_offset : pc.chunk_offset + pc.numel].copy_(part)
            else:
                new_state.setdefault(index[id(t)], {})[key] = part.clone()


class HasStateIO(Protocol):
    state_io: StateIO


def state_kinds(opt: HasStateIO) -> dict[int, Kinds]:
    """The state kinds of a ZeroOptimizer's parameters (:meth:`StateIO.kinds`; collective), for
    the checkpoint code that names each saved tensor before it streams them."""
    return opt.state_io.kinds()
