"""The suffix: the tokens the action expert reads, and how the flow-matching time enters.

pi0: one state token ``state_proj(state)``, then the ``H`` action tokens
``mlp_out(silu(mlp_in(concat(action_in_proj(x_t), temb(t)))))``; block flags 1, 1, 0, ...
pi0.5: the ``H`` action tokens ``action_in_proj(x_t)`` alone (flags 1, 0, ...; the state is in
the prompt) and the time as the adaptive norms' conditioning
``silu(time_mlp_out(silu(time_mlp_in(temb(t)))))``. The heads are small and replicated on
every tp rank (LeRobot's names: ``action_in_proj``, ``action_out_proj``, ``state_proj``,
``action_time_mlp_{in,out}``, ``time_mlp_{in,out}``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallax.families.pi0.config import Pi0Config

MIN_PERIOD, MAX_PERIOD = 4e-3, 4.0


def time_embedding(t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``temb(t)`` (b, width): sin then cos of ``2 pi t / p`` for ``width / 2`` periods spaced
    geometrically from 4e-3 to 4, computed in float64."""
    if width % 2:
        raise ValueError(f"the time embedding's width {width} must be even")
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = MIN_PERIOD * (MAX_PERIOD / MIN_PERIOD) ** fraction  # (w/2,)
    angle = (2 * math.pi / period)[None] * t.double()[:, None]  # (b, w/2)
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(dtype)  # (b, w)


def add_input_heads(model: nn.Module, config: Pi0Config, device=None, dtype=None) -> None:
    """Give ``model`` the variant's heads that make the suffix (LeRobot's names, at its top
    level; ``action_out_proj`` is the model's last block's)."""
    w, a = config.expert.width, config.max_action_dim
    kw = dict(device=device, dtype=dtype)
    model.action_in_proj = nn.Linear(a, w, **kw)
    if config.pi05:
        model.time_mlp_in = nn.Linear(w, w, **kw)
        model.time_mlp_out = nn.Linear(w, w, **kw)
    else:
        model.state_proj = nn.Linear(config.max_state_dim, w, **kw)
        model.action_time_mlp_in = nn.Linear(2 * w, w, **kw)
        model.action_time_mlp_out = nn.Linear(w, w, **kw)


def suffix_flags(config: Pi0Config, device=None) -> torch.Tensor:
    """Block flags of the suffix ``(S,)``: pi0 1 (state), 1, 0, ...; pi0.5 1, 0, ..."""
    flags = torch.zeros(config.suffix_length, dtype=torch.long, device=device)
    flags[: 1 if config.pi05 else 2] = 1
    return flags


def embed_suffix(model: nn.Module, state, x_t: torch.Tensor, t: torch.Tensor):
    """``(tokens (b, S, w_e), cond (b, w_e) | None)`` of noisy actions ``x_t`` (b, H, A) at
    times ``t`` (b,); ``state`` (b, Ds) for pi0 (None for pi0.5)."""
    config = model.config
    dtype = model.action_in_proj.weight.dtype
    temb = time_embedding(t, config.expert.width, dtype)  # (b, w_e)
    actions = model.action_in_proj(x_t.to(dtype))  # (b, H, w_e)
    if config.pi05:
        cond = F.silu(model.time_mlp_out(F.silu(model.time_mlp_in(temb))))  # (b, w_e)
        return actions, cond
    if state is None:
        raise ValueError("pi0's suffix starts with the state token: give the state")
    mixed = torch.cat([actions, temb[:, None].expand_as(actions)], dim=-1)  # (b, H, 2 w_e)
    actions = model.action_time_mlp_out(F.silu(model.action_time_mlp_in(mixed)))  # (b, H, w_e)
    token = model.state_proj(state.to(dtype))[:, None]  # (b, 1, w_e)
    return torch.cat([token, actions], dim=1), None  # (b, 1 + H, w_e)
