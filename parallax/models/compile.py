"""``torch.compile`` of repeated blocks (ViT blocks, decoder layers), one module at a time.

Compiling each block's forward rather than the whole model keeps the graphs small and shared by
every layer of the same shape, and leaves activation checkpointing, pipeline cuts and the
optimizer in eager code. Tensor-parallel collectives inside a block run eagerly
(:mod:`parallax.tensor.functional` hides them from the compiler), so a tp block compiles as the
pieces between them. Sequence lengths vary: with ``dynamic=None`` (the default) a second length
recompiles once with a dynamic sequence dimension and later lengths reuse it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def compile_modules(modules: Iterable[nn.Module], **options) -> int:
    """Compile each module's forward in place (``module.compile(**options)``): calls through the
    module, checkpointed ones included, run the compiled code. Returns how many."""
    modules = list(modules)
    _allow_recompiles(len(modules))
    for module in modules:
        module.compile(**options)
    return len(modules)


def _allow_recompiles(count: int) -> None:
    """Before torch 2.5 the compiler guarded on each module object, so every layer compiled
    anew: let that many compilations happen instead of falling back to eager after 8."""
    if torch.__version__ >= "2.5":
        return  # parameters are graph inputs: one compilation serves every layer
    import torch._dynamo.config as config

    if not config.inline_inbuilt_nn_modules:
        config.cache_size_limit = max(config.cache_size_limit, 2 * count + 8)
