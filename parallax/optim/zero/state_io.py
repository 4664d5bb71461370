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
the full tensors it needs through ``get(key)`` and keeps its slice. :class:`StateMethods` is
ZeroOptimizer's public face of all this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from parallax import comm
from parallax.optim.zero.plane import plane_gather
from parallax.tensor.sharding import logical_shape, shard_tensor, unshard_tensor

Zero = Any  # a parallax.optim.ZeroOptimizer: the class is built from this module

FORMAT = "parallax.zero/1"

Kinds = dict[str, tuple[str, str]]  # state name -> ("elem" | "scalar", dtype)


def _local_kinds(opt: Zero) -> dict[int, Kinds]:
    out: dict[int, Kinds] = {}
    for i, pieces in enumerate(opt.flat.pieces_of):
        for _, t in pieces:
            for key, value in opt.inner.state.get(t, {}).items():
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise NotImplementedError(
                        f"optimizer state {key!r} of {opt.names[i]!r} is a {type(value).__name__}; "
                        "only tensor state can be saved"
                    )
                if value.dim() == 0:
                    kind = "scalar"
                elif value.shape == t.shape:
                    kind = "elem"
                else:
                    raise NotImplementedError(
                        f"optimizer state {key!r} of {opt.names[i]!r} has shape "
                        f"{tuple(value.shape)}, neither per-element {tuple(t.shape)} nor scalar"
                    )
                out.setdefault(i, {})[key] = (kind, str(value.dtype).removeprefix("torch."))
    return out


def state_kinds(opt: Zero) -> dict[int, Kinds]:
    """Per parameter index, the state its owners hold, agreed over dp and tp (collective).
    State that cannot be saved, on any rank of the plane, raises on all of them."""
    try:
        local, problem = _local_kinds(opt), None
    except NotImplementedError as err:
        local, problem = {}, str(err)
    reports = [
        r for column in plane_gather(opt.ctx, (opt.ctx.rank, problem, local)) for r in column
    ]
    found = [f"rank {r}: {p}" if len(reports) > 1 else p for r, p, _ in reports if p]
    if found:
        raise NotImplementedError("; ".join(found))
    merged: dict[int, Kinds] = {}
    for _, _, other in reports:
        for i, kinds in other.items():
            merged.setdefault(i, {}).update(kinds)
    return merged


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


# how this run steps (its device, --offload), not what it learned: kept from this optimizer
KERNEL_OPTIONS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def state_meta(opt: Zero) -> dict[str, Any]:
    kinds = state_kinds(opt)
    groups = [
        {**{k: _jsonable(v) for k, v in g.items() if k != "params"}, "params": list(names)}
        for g, names in zip(opt.inner.param_groups, opt._group_names)
    ]
    keys = {name: ["master", *sorted(kinds.get(i, {}))] for i, name in enumerate(opt.names)}
    return {
        "format": FORMAT,
        "optimizer": type(opt.inner).__name__,
        "param_groups": groups,
        "keys": keys,
    }


def _full(opt: Zero, i: int, source: Callable[[torch.Tensor], torch.Tensor], dtype):
    """The full logical tensor of one per-element state of parameter ``i`` (collective)."""
    p = opt.params[i]
    flat = torch.zeros(p.numel(), dtype=dtype, device=opt.device)  # (numel on this tp rank,)
    for pc, t in opt.flat.pieces_of[i]:
        flat[pc.start : pc.start + pc.numel] = source(t)
    comm.all_reduce(flat, opt.ctx.dp_group)  # each element is owned by exactly one dp rank
    info = getattr(p, "tp_shard", None)
    local = flat.view(p.shape)
    return local if info is None else unshard_tensor(local, info, opt.ctx.tp_group)


def _scalar(opt: Zero, i: int, key: str) -> torch.Tensor:
    value = torch.full((), -math.inf, dtype=torch.float64, device=opt.device)
    for _, t in opt.flat.pieces_of[i]:
        held = opt.inner.state.get(t, {}).get(key)
        if held is not None:
            value = torch.maximum(value, held.detach().to(value))
    comm.all_reduce(value, opt.ctx.dp_group, op="max")  # from whichever rank owns a piece
    return value.float()


def state_tensors(opt: Zero) -> Iterator[tuple[str, torch.Tensor]]:
    kinds, state = state_kinds(opt), opt.inner.state
    for i, name in enumerate(opt.names):
        yield f"{name}.master", _full(opt, i, lambda t: t, torch.float32)
        for key, (kind, dtype) in sorted(kinds.get(i, {}).items()):
            if kind == "scalar":
                yield f"{name}.{key}", _scalar(opt, i, key)
            else:
                yield (
                    f"{name}.{key}",
                    _full(opt, i, lambda t, k=key: state[t][k], getattr(torch, dtype)),
                )


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


def _check_meta(opt: Zero, meta: dict[str, Any]) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} optimizer state (format {meta.get('format')!r})")
    missing = [n for n in opt.names if n not in meta["keys"]]
    if missing:
        raise ValueError(
            f"the optimizer checkpoint has no state for {len(missing)} of {len(opt.names)} "
            f"parameters, e.g. {missing[:3]}"
        )
    saved = meta["param_groups"]
    if len(saved) != len(opt._group_names):
        raise ValueError(
            f"the optimizer checkpoint has {len(saved)} param groups, this optimizer "
            f"{len(opt._group_names)}; build the groups the same way"
        )
    for j, (g, names) in enumerate(zip(saved, opt._group_names)):
        moved = sorted(set(names) - set(g["params"]))
        if moved:
            raise ValueError(f"parameters {moved[:3]} are in param group {j} here but not saved so")


@torch.no_grad()
def load_state_tensors(opt: Zero, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
    _check_meta(opt, meta)
    opt.inner.state.clear()  # the new slices replace the old ones, not add to them
    index = {id(t): k for k, t in enumerate(t for g in opt.inner.param_groups for t in g["params"])}
    new_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(opt.names):
        for key in meta["keys"][name]:
            # the fetched tensor is an argument only: it is freed before the next one comes
            _load_one(
                opt,
                i,
                key,
                _fetch(get, f"{name}.{key}", logical_shape(opt.params[i])),
                index,
                new_state,
            )
    groups = opt.inner.state_dict()["param_groups"]
    for g, saved in zip(groups, meta["param_groups"]):
        for k, v in saved.items():
            if k != "params" and k not in KERNEL_OPTIONS:
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    opt.inner.load_state_dict({"state": new_state, "param_groups": groups})


def _load_one(
    opt: Zero,
    i: int,
    key: str,
    full: torch.Tensor,
    index: dict[int, int],
    new_state: dict[int, dict[str, torch.Tensor]],
) -> None:
    """Keep this rank's slices of one full tensor: master into the model and the masters,
    optimizer state into ``new_state`` (keyed as the wrapped optimizer numbers its tensors)."""
    if full.dim() == 0:  # scalar state, e.g. step: the same for every piece
        for _, t in opt.flat.pieces_of[i]:
            new_state.setdefault(index[id(t)], {})[key] = full.detach().clone()
        return
    p, info = opt.params[i], getattr(opt.params[i], "tp_shard", None)
    local = full.to(opt.device)
    local = local if info is None else shard_tensor(local, info)  # (this tp rank's shape)
    sharded = opt.flat.store is not None  # ZeRO-3: the model holds this rank's shard only
    if key == "master" and not sharded:
        p.data.copy_(local)  # fp32 -> the model's dtype
    flat = local.reshape(-1)
    for pc, t in opt.flat.pieces_of[i]:
        part = flat[pc.start : pc.start + pc.numel]
        if key == "master":
            t.copy_(part)
            if sharded:  # fp32 -> the model's dtype, in the shard
                shard = opt.flat.own_param(pc.bucket)
                shard[pc.chunk_offset : pc.chunk_offset + pc.numel].copy_(part)
        else:
            new_state.setdefault(index[id(t)], {})[key] = part.clone()


class StateMethods:
    """ZeroOptimizer's state methods: full logical tensors, loadable at any dp and tp size."""

    def state_meta(self) -> dict[str, Any]:
        """JSON-able description of the state: hyperparameters and, per parameter name, the
        state keys that :meth:`state_tensors` yields. Collective: call on every rank."""
        self.wait_params()
        return state_meta(self)

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``("<name>.<state>", full logical tensor)`` one at a time (see
        :mod:`parallax.optim.zero.state_io`). Collective: every rank must consume it all."""
        self.wait_params()
        return state_tensors(self)

    def load_state_tensors(self, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
        """Load from ``meta`` and ``get(key) -> full tensor``, one tensor at a time, at any
        dp and tp size. Also writes the masters into the model. No collective: a caller whose
        ranks may fail differently (a rank-local read error) agrees on the outcome itself."""
        self.wait_params()
        load_state_tensors(self, meta, get)

    def state_dict(self) -> dict[str, Any]:
        """``{"meta": state_meta(), "tensors": {key: full tensor on CPU}}``; for big models use
        :meth:`state_tensors`, which never holds more than one full tensor. The hooks of
        ``register_state_dict_pre_hook`` / ``_post_hook`` run around it."""

        def make() -> dict[str, Any]:
            meta = self.state_meta()
            return {"meta": meta, "tensors": {k: v.cpu() for k, v in self.state_tensors()}}

        return self._with_state_dict_hooks(make)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._with_load_hooks(
            state_dict, lambda sd: self.load_state_tensors(sd["meta"], sd["tensors"].__getitem__)
        )
