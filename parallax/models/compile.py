"""``torch.compile`` of repeated blocks (ViT blocks, decoder layers), one module at a time.

Compiling each block's forward rather than the whole model keeps the graphs small and shared by
every layer of the same shape, and leaves activation checkpointing, pipeline cuts and the
optimizer in eager code. Tensor-parallel collectives inside a block run eagerly
(:mod:`parallax.tensor.functional` hides them from the compiler), so a tp block compiles as the
pieces between them. Sequence lengths vary: with ``dynamic=None`` (the default) a second length
recompiles once with a dynamic sequence dimension and later lengths reuse it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from parallax.eager import arm
from parallax.tensor.layers import resolve_tp


def compile_modules(modules: Iterable[nn.Module], **options) -> int:
    """Compile each module's forward in place (``module.compile(**options)``): calls through the
    module, checkpointed ones included, run the compiled code. Returns how many."""
    modules = list(modules)
    arm()  # parallax's collectives and hooks run eagerly in what compiles
    _allow_recompiles(len(modules))
    for module in modules:
        module.compile(**options)
    return len(modules)


def memory_budget(budget: float) -> contextlib.AbstractContextManager:
    """While open, graphs that compile keep at most ``budget`` of their saved activations
    (``torch._functorch.config.activation_memory_budget``): below 1 the partitioner recomputes
    the cheapest of the others in the backward (element-wise work, then attention, then
    matmuls). LoRA is where this pays: its compiled decoder layer keeps each norm's output,
    the SwiGLU product and a second copy of the attention output for the adapters' weight
    gradients, all cheap to recompute from what is saved anyway (OpenVLA-7B LoRA on one H200
    at 0.7: a fifth off the peak at the same speed). Scoped, not process-wide: the budget is
    read when a graph compiles, which ``parallax.train`` does inside the steps it runs under
    this.
    """
    if budget >= 1.0:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config  # the compiler's, loaded when used

    if not hasattr(functorch_config, "activation_memory_budget"):
        raise RuntimeError(
            f"an activation memory budget ({budget}) needs a torch whose compiler has one "
            f"(torch._functorch.config.activation_memory_budget); this is {torch.__version__}"
        )
    return functorch_config.patch(activation_memory_budget=budget)


CHECKPOINT_SCOPES = ("all", "vision", "text")


def checkpoint_parts(enabled: bool | str) -> tuple[bool, bool]:
    """``(vision, text)``: which parts of a model recompute their blocks for an
    ``activation_checkpointing`` value: ``False``, ``True`` (= ``"all"``), or a scope,
    ``"vision"`` (the vision towers only) or ``"text"`` (the language model, or a dual
    encoder's text tower). Why a scope: under LoRA the vision towers of OpenVLA-7B hold about a
    quarter of the step's activations for a tenth of its FLOPs, so recomputing them alone buys
    the most memory per second spent."""
    if isinstance(enabled, bool):
        return enabled, enabled
    if enabled not in CHECKPOINT_SCOPES:
        raise ValueError(
            f"activation checkpointing scope {enabled!r}: expected one of "
            f"{', '.join(CHECKPOINT_SCOPES)}"
        )
    return enabled != "text", enabled != "vision"


class CheckpointedBlocks:
    """The ``activation_checkpointing`` switch of a module that runs a stack of blocks.

    Each block (a ``checkpointed`` flag in its forward) recomputes itself inside its forward
    where :func:`traced_recompute` allows; otherwise the owner checkpoints each call of a block
    from outside (``self._checkpoint_outside``). The owner provides ``_blocks()`` and sets
    ``self._traced_recompute`` before the switch is first set."""

    _traced_recompute = True

    def _blocks(self) -> Iterable[nn.Module]:
        raise NotImplementedError

    @property
    def activation_checkpointing(self) -> bool:
        """Whether each block recomputes itself in the backward (non-reentrant)."""
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        self._checkpointing = bool(enabled)
        inside = self._checkpointing and self._traced_recompute
        self._checkpoint_outside = self._checkpointing and not inside
        for block in self._blocks():
            block.checkpointed = inside


def traced_recompute(ctx) -> bool:
    """Whether a block's activation checkpointing goes inside its forward.

    There a compiled block traces the recomputation into its own backward graph (which CUDA
    graphs can replay), as torchtitan does. A block with tensor-parallel collectives compiles as
    several graphs with eager collectives between them, and the compiler cannot trace a
    recomputation across those breaks (it would run the whole block eagerly), so at tp > 1 the
    model checkpoints each compiled block from outside, calling it again in the backward."""
    return resolve_tp(ctx)[2] == 1


def _allow_recompiles(count: int) -> None:
    """Let the compiler recompile more often than its default 8 times per function before it
    falls back to eager. With tp, each collective breaks the graph and the layer forwards it
    sits in (a row-parallel linear, say) compile as functions of their own, once per shape they
    meet (a ViT's and a Llama's). Before torch 2.5 the compiler also guarded on each module
    object, so every layer compiled anew."""
    import torch._dynamo.config as config  # the compiler's, loaded when used

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    need = 64 if torch.__version__ >= "2.5" else 2 * count + 64
    setattr(config, name, max(getattr(config, name), need))
