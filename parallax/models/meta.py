"""Build big models on the meta device, then give them real storage without losing metadata.

``nn.Module.to_empty`` replaces parameters by new objects and drops the attributes parallax
hangs on them (``tp_shard``, ``sequence_parallel``); :func:`materialize` keeps them. Building on
meta first means a 7B model is never initialised twice (once by the layers' own
``reset_parameters``, once by the checkpoint or the layout-free init).
"""

from __future__ import annotations

import torch
from torch import nn

_KEEP = ("tp_shard", "sequence_parallel")


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give every meta parameter and buffer uninitialised storage on ``device``, in place.

    Values are garbage afterwards: load a checkpoint or call ``init_parameters`` next.
    """
    device = torch.device(device)
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = nn.Parameter(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
            for attr in _KEEP:
                if hasattr(param, attr):
                    setattr(new, attr, getattr(param, attr))
            mod._parameters[name] = new
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.empty_like(buf, device=device)
    return module
