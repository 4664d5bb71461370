"""A step's inputs on this rank's device: what the first stage takes, what the last stage's loss
needs, or a ``"step"`` objective's model inputs.

:class:`Stager` makes them from the host microbatches. In the training thread (``ahead=False``,
``--prefetch 0`` and direct ``Trainer.train_step`` calls) it copies them on the current stream,
as the step always did. Ahead of the step (``ahead=True``, in the prefetch thread of
:mod:`parallax.train.step_batches`) on a GPU it pins each tensor and copies it on a side CUDA
stream, recording an event after the copies; :meth:`Staged.ready`, called by the step in the
training thread, makes the step's stream wait for that event and records the tensors as used on
that stream, so the caching allocator does not hand their memory out while the step still reads
it. On a CPU both ways are the host tensors themselves.

Only the ranks that use them get device copies: the first stage's inputs on the rank holding
stage 0, the targets on the rank holding the last stage (every pipeline rank still builds the
same host microbatches: the step's checks, unit count and received shapes read them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parallax.recipe import Microbatch

Copy = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Staged:
    """A step's device inputs (see the module doc); ``None`` where this rank needs none."""

    inputs: list[tuple] | None = None  # per microbatch, the first stage's inputs
    targets: list[Any] | None = None  # per microbatch, the last stage's loss targets
    microbatches: list[Microbatch] | None = None  # a "step" objective: inputs on the device
    event: Any = None  # torch.cuda.Event after the side stream's copies
    device: torch.device | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)  # the side stream's copies

    def ready(self) -> None:
        """Before the step uses them, in its thread: its stream waits for the copies, which
        are recorded as used on it (their memory is freed only after the step's kernels)."""
        if self.event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in self.tensors:
            t.record_stream(stream)
        self.event, self.tensors = None, []


class Stager:
    """Makes a trainer's :class:`Staged` inputs (see the module doc); one per trainer."""

    def __init__(self, trainer) -> None:
        self.run, self.recipe, self.device = trainer.run, trainer.recipe, trainer.ctx.device
        held = set(trainer.schedule.stages_of(trainer.ctx.pp_rank))
        self.first = 0 in held
        self.last = trainer.schedule.num_stages - 1 in held
        self._stream = None  # the side stream, made at the first copy ahead

    def __call__(self, microbatches: list[Microbatch], ahead: bool = False) -> Staged:
        """The device inputs of these host microbatches; ``ahead``: copied on a side stream
        (on a GPU) for a later step, see :meth:`Staged.ready`."""
        if not (ahead and self.device.type == "cuda"):
            return self._stage(microbatches, self._copy)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        copies: list[torch.Tensor] = []

        def pinned_copy(x: torch.Tensor) -> torch.Tensor:
            if x.device == self.device:  # made there already (perhaps on this stream): recorded
                copies.append(x)
                return x
            host = x if x.is_pinned() else x.pin_memory()  # a true async copy needs pinned memory
            out = host.to(self.device, non_blocking=True)
            copies.append(out)
            return out

        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            staged = self._stage(microbatches, pinned_copy)
            staged.event = torch.cuda.Event()
            staged.event.record(self._stream)
        staged.device, staged.tensors = self.device, copies
        return staged

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=True)

    def _stage(self, microbatches: list[Microbatch], copy: Copy) -> Staged:
        data, objective = self.recipe.data, self.recipe.objective
        if objective.kind == "step":  # the model inputs (input_keys) on the device
            keys = data.input_keys
            return Staged(microbatches=[_with_keys(mb, keys, copy) for mb in microbatches])
        staged = Staged()
        if self.first:
            staged.inputs = [tuple(copy(x) for x in data.stage_inputs(mb)) for mb in microbatches]
        else:  # never read off the first stage: the host tensors, not copied
            staged.inputs = [tuple(data.stage_inputs(mb)) for mb in microbatches]
        if self.last:
            targets = [objective.loss_target(self.run, mb) for mb in microbatches]
            staged.targets = [_tree(t, copy) for t in targets]
        return staged


def _with_keys(mb: Microbatch, keys: tuple[str, ...], copy: Copy) -> Microbatch:
    """``mb`` with its tensors under ``keys`` copied (the rest stays on the host)."""
    out = dict(mb)
    for k in keys:
        if isinstance(out.get(k), torch.Tensor):
            out[k] = copy(out[k])
    return out


def _tree(value: Any, copy: Copy) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) copied."""
    if isinstance(value, torch.Tensor):
        return copy(value)
    if isinstance(value, tuple | list):
        return type(value)(_tree(v, copy) for v in value)
    if isinstance(value, dict):
        return {k: _tree(v, copy) for k, v in value.items()}
    return value
