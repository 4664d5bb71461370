"""OpenVLA-OFT's new modules: the L1 regression head and the proprio projector, and their names
in OFT's own checkpoint files.

The head is OFT's ``L1RegressionActionHead`` (``shared/oft.md``): the final-norm hidden states
of the ``action_dim`` positions of one chunk step, concatenated, go through an MLP-ResNet,
``LayerNorm(D h) -> Linear(D h -> H) -> ReLU -> blocks x [LayerNorm, Linear(H -> H), ReLU,
+ residual] -> LayerNorm -> Linear(H -> D)`` with ``H`` the language model's width (151 M
parameters for Llama-2-7B and 7-dim actions). Under tp the first linear, the 28,672-wide
(``D x h``) one that holds most of them, is column-parallel with its output gathered; the rest
is replicated. The projector is ``Linear(proprio_dim -> h) -> GELU -> Linear(h -> h)``,
replicated. Both are plain modules here (no adapters: ``--finetune lora`` trains them whole).
The layout-free init (:func:`oft_init`) draws them as ``torch.nn.Linear`` initialises itself,
as OFT's are: uniform in ``+-1/sqrt(fan_in)``, LayerNorms at one and zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallax.tensor import ColumnParallelLinear

# parallax parameter name (below ``action_head.``) -> OFT's key (below its module)
HEAD_KEYS = {
    "norm_in": "model.layer_norm1",
    "proj_in": "model.fc1",
    "norm_out": "model.layer_norm2",
    "proj_out": "model.fc2",
}
OFT_MODULES = ("action_head", "proprio_projector")
FILM_LINEARS = ("film_scale", "film_shift")
LORA_EXCLUDE = ("proj_in", *FILM_LINEARS)  # the column-parallel linears trained whole


class ResidualBlock(nn.Module):
    """``x + relu(linear(norm(x)))`` (OFT's ``MLPResNetBlock``, pre-norm)."""

    def __init__(self, dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.linear = nn.Linear(dim, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.linear(self.norm(x)))  # (n, H)


class L1ActionHead(nn.Module):
    """Hidden states of one chunk step ``(n, D h)`` -> its action ``(n, D)`` (module doc)."""

    def __init__(
        self, hidden: int, action_dim: int, ctx=None, blocks: int = 2, device=None, dtype=None
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        width = action_dim * hidden
        self.action_dim, self.hidden = action_dim, hidden
        self.norm_in = nn.LayerNorm(width, **kw)
        self.proj_in = ColumnParallelLinear(width, hidden, True, True, ctx=ctx, **kw)
        self.blocks = nn.ModuleList([ResidualBlock(hidden, **kw) for _ in range(blocks)])
        self.norm_out = nn.LayerNorm(hidden, **kw)
        self.proj_out = nn.Linear(hidden, action_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.proj_in(self.norm_in(x)))  # (n, H), gathered over tp
        for block in self.blocks:
            x = block(x)
        return self.proj_out(self.norm_out(x))  # (n, D)


class ProprioProjector(nn.Module):
    """The robot state ``(b, proprio_dim)`` -> one token ``(b, h)``: ``fc2(gelu(fc1(x)))``."""

    def __init__(self, proprio_dim: int, hidden: int, device=None, dtype=None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (b, h)


def is_oft_name(name: str) -> bool:
    """Whether a global parameter name belongs to a module OFT adds (not in OpenVLA's HF
    checkpoint): the head, the proprio projector, the FiLM linears."""
    first = name.split(".", 1)[0]
    return first in OFT_MODULES or any(f".{f}." in name for f in FILM_LINEARS)


def oft_key(name: str) -> tuple[str, str]:
    """A global parameter name -> ``(OFT module, its key in OFT's state dict)``:
    ``action_head.blocks.0.linear.weight`` -> ``("action_head",
    "model.mlp_resnet_blocks.0.ffn.1.weight")``; FiLM keeps the parallax name."""
    module, _, rest = name.partition(".")
    if module == "proprio_projector":
        return module, rest
    if module != "action_head":
        return "film", name
    owner, _, leaf = rest.rpartition(".")
    if owner.startswith("blocks."):
        _, i, part = owner.split(".")
        return module, f"model.mlp_resnet_blocks.{i}.ffn.{0 if part == 'norm' else 1}.{leaf}"
    return module, f"{HEAD_KEYS[owner]}.{leaf}"


def parallax_name(module: str, key: str) -> str:
    """Inverse of :func:`oft_key`."""
    if module == "film":
        return key
    if module == "proprio_projector":
        return f"{module}.{key}"
    owner, _, leaf = key.rpartition(".")
    parts = owner.split(".")
    if parts[1] == "mlp_resnet_blocks":
        return f"action_head.blocks.{parts[2]}.{'norm' if parts[4] == '0' else 'linear'}.{leaf}"
    back = {v: k for k, v in HEAD_KEYS.items()}
    if owner not in back:
        raise ValueError(f"{key!r} is no key of OFT's L1 action head")
    return f"action_head.{back[owner]}.{leaf}"


def oft_init_fn(hidden: int, action_dim: int, proprio_dim: int):
    """Layout-free values of the OFT modules' parameters (module doc) for a language model of
    width ``hidden``: ``nn.Linear``'s own uniform init of weights and biases (the bound from
    the module's input width), ones and zeros for LayerNorms."""
    fan_ins = {
        "proj_in": action_dim * hidden,
        "linear": hidden,
        "proj_out": hidden,
        "fc1": proprio_dim,
        "fc2": hidden,
        "film_scale": hidden,
        "film_shift": hidden,
    }

    def init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
        owner = name.rpartition(".")[0]
        leaf_module = owner.rpartition(".")[2]
        if leaf_module.startswith("norm"):
            return (torch.ones if name.endswith("weight") else torch.zeros)(shape, device=device)
        bound = 1.0 / math.sqrt(fan_ins[leaf_module])
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=gen)

    return init
