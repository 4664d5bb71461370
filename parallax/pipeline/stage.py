"""PipelineStage: one chunk of a model, run forward and backward one microbatch at a time.

The stage keeps, per microbatch in flight, only what its backward needs: the received inputs
whose gradients go back to the previous stage and the outputs whose gradients come from the next
one. Once the outputs have been sent, their values are no longer needed (only their autograd
history), so :meth:`PipelineStage.free_outputs` releases them where that is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallax.context import ParallelContext
from parallax.pipeline.p2p import as_tensors

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class _InFlight:
    inputs: tuple[torch.Tensor, ...]  # inputs that send a gradient back
    outputs: tuple[torch.Tensor, ...]  # outputs that receive a gradient (the scaled loss if last)
    freed: bool = False


def _engine_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward`` without its shape check, which freed outputs would fail (the
    graph keeps the original shapes)."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(tensors),
        grad_tensors=tuple(grads),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _reaches(start: object, target: object) -> bool:
    """Whether autograd node ``target`` is ``start`` or one of its ancestors."""
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if node is target:
            return True
        seen.add(id(node))
        stack.extend(fn for fn, _ in node.next_functions)
    return False


class PipelineStage:
    """One chunk of a model at virtual stage ``stage_index`` of ``num_stages``.

    ``module``'s forward takes the previous stage's tensors as positional arguments (the first
    stage takes the microbatch: a tuple, a dict passed as keyword arguments, or one tensor) and
    returns a tensor or a tuple of tensors. The last stage's output goes to
    ``loss_fn(output, target)``, which must return a scalar.
    """

    def __init__(
        self, module: nn.Module, stage_index: int, num_stages: int, ctx: ParallelContext
    ) -> None:
        pp = ctx.pp_size
        if num_stages < 1 or num_stages % pp != 0:
            raise ValueError(
                f"PipelineStage: {num_stages} stages cannot be spread over pp={pp} ranks; use "
                f"pp x chunks per rank stages ({pp}, {2 * pp}, ...)"
            )
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} outside [0, {num_stages})")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.ctx = ctx
        self._in_flight: dict[int, _InFlight] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

    def forward(
        self,
        microbatch: int,
        args: Any,
        target: Any = None,
        loss_fn: LossFn | None = None,
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, ...]:
        """Run one microbatch; return the outputs to send, or ``(scaled loss,)`` (detached) on the
        last stage. ``args`` is the received tuple, or the microbatch on the first stage."""
        if microbatch in self._in_flight:
            raise RuntimeError(f"{self}: forward of microbatch {microbatch} ran twice")
        if isinstance(args, dict):
            out = self.module(**args)
        elif isinstance(args, tuple | list):
            out = self.module(*args)
        else:
            out = self.module(args)
        inputs = args if isinstance(args, tuple) and not self.is_first else ()
        grad_inputs = tuple(x for x in inputs if x.requires_grad)
        if self.is_last:
            if loss_fn is None:
                raise ValueError(f"{self}: the last stage needs a loss_fn")
            loss = loss_fn(out, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"{self}: loss_fn must return a scalar tensor, got {loss!r}")
            scaled = loss.reshape(()) * loss_scale
            self._in_flight[microbatch] = _InFlight(grad_inputs, (scaled,))
            return (scaled.detach(),)
        outputs = as_tensors(out, f"{self}")
        grad_outputs = tuple(o for o in outputs if o.requires_grad)
        self._in_flight[microbatch] = _InFlight(grad_inputs, grad_outputs)
        return outputs

    def free_outputs(self, microbatch: int) -> None:
        """Release the values of outputs already sent, keeping their autograd history.

        Skipped for an output that is a view, an input passed through, or (with several
        outputs) part of another output's history, whose backward may still read its value.
        An output saved by its own autograd node stays correct: the node holds its own reference.
        """
        saved = self._in_flight[microbatch]
        inputs = {x.untyped_storage().data_ptr() for x in saved.inputs}
        for out in saved.outputs:
            if out.grad_fn is None or out._base is not None or out.numel() == 0:
                continue
            if out.untyped_storage().data_ptr() in inputs:
                continue
            others = [o for o in saved.outputs if o is not out]
            if any(_reaches(o.grad_fn, out.grad_fn) for o in others):
                continue
            out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            saved.freed = True

    def backward(
        self, microbatch: int, grads: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Backward of one microbatch given the gradients of the outputs that need one (none on
        the last stage); return the gradients of the inputs that need one, in order."""
        saved = self._in_flight.pop(microbatch)
        grads = tuple(grads or ())
        if self.is_last:
            saved.outputs[0].backward()
        elif len(grads) != len(saved.outputs):
            raise ValueError(
                f"{self}: microbatch {microbatch} has {len(saved.outputs)} outputs that need a "
                f"gradient but received {len(grads)} gradients"
            )
        elif saved.outputs:
            _engine_backward(saved.outputs, grads)
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in saved.inputs)

    def clear(self) -> None:
        """Drop every microbatch in flight (after an error, so the next step starts clean)."""
        self._in_flight.clear()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
