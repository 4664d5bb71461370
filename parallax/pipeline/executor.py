"""The one interpreter of pipeline schedules: ``run_schedule`` runs any schedule on this rank.

It walks this rank's lowered program (:func:`parallax.pipeline.lower`): compute actions call the
rank's :class:`~parallax.pipeline.PipelineStage` chunks, batches post their sends and receives
together (:func:`parallax.comm.post_send_recv`) and wait for them. Stages on the same rank hand
activations over locally. Gradients accumulate in the parameters' ``.grad``; no optimizer work
happens here.

Before the first message, every rank of the pipeline checks its own inputs and then agrees with
the others in one small all-reduce (which also brings up the group's communicator before the
first batched send): a wrong configuration on any rank raises the same ``ValueError`` on all of
them instead of a hang.

Two host synchronisations are optional for a caller that runs the same program step after step:
the agreement (``agree=False`` once a step has run with it) and reading each received
activation's metadata (``recv_metas`` gives the shapes when the caller knows them from the
batch; the metadata still travels, unread, so the program is the same either way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch.profiler import record_function

from parallax import comm
from parallax.context import ParallelContext
from parallax.pipeline import p2p
from parallax.pipeline.lower import Batch, Program, lower
from parallax.pipeline.schedule import Action, Schedule
from parallax.pipeline.stage import LossFn, PipelineStage
from parallax.pipeline.timeline import COMPUTE, Timeline
from parallax.pipeline.validate import rank_problem

RecvMetas = Callable[[int, int], Sequence[p2p.TensorMeta]]  # (stage, microbatch) -> metas


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _agree(problem: str | None, program_id: str, ctx: ParallelContext) -> None:
    """Raise the same ``ValueError`` on every pipeline rank if any rank has a problem or the
    ranks run different programs."""
    if comm.size(ctx.pp_group) == 1:
        if problem:
            raise ValueError(f"run_schedule: {problem}")
        return
    fp = int(program_id[:15], 16)
    flags = torch.tensor([int(problem is not None), fp, -fp], dtype=torch.int64, device=ctx.device)
    comm.all_reduce(flags, ctx.pp_group, op="max")
    bad, high, neg_low = flags.tolist()
    if not bad and high == -neg_low:
        return
    reports = comm.all_gather_object((ctx.pp_rank, problem, program_id), ctx.pp_group)
    lines = [f"pp rank {r}: {p}" for r, p, _ in reports if p]
    if not lines:
        ids = ", ".join(f"pp rank {r}: {i}" for r, _, i in reports)
        lines = [f"pipeline ranks run different schedules or placements ({ids})"]
    raise ValueError("run_schedule: " + "; ".join(lines))


class _Runner:
    """State of one step on one rank: activations and gradients waiting to be used or sent."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, PipelineStage],
        ctx: ParallelContext,
        inputs: Sequence | None,
        targets: Sequence | None,
        loss_fn: LossFn | None,
        loss_scale: float,
        timeline: Timeline | None,
        recv_metas: RecvMetas | None = None,
    ) -> None:
        self.schedule, self.stages, self.ctx = schedule, stages, ctx
        self.known_metas = recv_metas
        self.inputs, self.targets = inputs, targets
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        self.timeline = timeline
        self.rank = ctx.pp_rank
        self.fwd_in: dict[tuple[int, int], tuple] = {}  # inputs ready for F(stage, mb)
        self.grad_in: dict[tuple[int, int], tuple] = {}  # output grads ready for B(stage, mb)
        self.to_send: dict[tuple[str, int, int], tuple] = {}
        self.sent_meta: dict[tuple[int, int], list[p2p.TensorMeta]] = {}  # sizes of RECV_B
        self.recv_meta: dict[tuple[int, int], list[p2p.TensorMeta]] = {}
        self.loss = torch.zeros((), dtype=torch.float32, device=ctx.device)

    def _span(self, name: str, cat: str, **args: object):
        return self.timeline.span(name, cat, **args) if self.timeline else nullcontext()

    def _local(self, stage: int) -> bool:
        return self.schedule.rank_of(stage) == self.rank

    def _peer(self, stage: int) -> int:
        return self.ctx.pp_peer(self.schedule.rank_of(stage))

    def compute(self, a: Action) -> None:
        s, m, stage = a.stage, a.microbatch, self.stages[a.stage]
        with (
            self._span(str(a), COMPUTE, stage=s, microbatch=m),
            record_function(f"parallax.{a.kind}"),
        ):
            if a.kind == "F":
                self._forward(stage, s, m)
            elif a.kind == "B":
                self._backward(stage, s, m)
            else:
                raise NotImplementedError(f"run_schedule: {a.kind} actions ({a}) are not run yet")

    def _forward(self, stage: PipelineStage, s: int, m: int) -> None:
        if s == 0:
            args = _to_device(self.inputs[m], self.ctx.device)
        else:
            args = self.fwd_in.pop((s, m))
        if stage.is_last:
            target = _to_device(self.targets[m], self.ctx.device)
            (loss,) = stage.forward(m, args, target, self.loss_fn, self.loss_scale)
            self.loss += loss.float()
            return
        outputs = stage.forward(m, args)
        if self._local(s + 1):  # hand over on this rank, cutting the graph as a send would
            self.fwd_in[(s + 1, m)] = tuple(
                o.detach().requires_grad_(o.requires_grad) for o in outputs
            )
        else:
            self.to_send[("F", s, m)] = outputs
            self.sent_meta[(s, m)] = [p2p.TensorMeta.of(o) for o in outputs if o.requires_grad]

    def _backward(self, stage: PipelineStage, s: int, m: int) -> None:
        grads = None if stage.is_last else self.grad_in.pop((s, m))
        input_grads = stage.backward(m, grads)
        if s == 0:
            return
        if self._local(s - 1):
            self.grad_in[(s - 1, m)] = input_grads
        else:
            self.to_send[("B", s, m)] = input_grads

    def _plan(self, op: Action) -> tuple[list, list, Callable[[], None] | None]:
        """The ``(tensor, peer)`` sends and receives of one communication action, and what to do
        once they are done."""
        s, m, device = op.stage, op.microbatch, self.ctx.device
        if op.kind == "SEND_F_META":
            metas = [p2p.TensorMeta.of(o) for o in self.to_send[("F", s, m)]]
            return [(p2p.encode(metas, device, f"stage {s}"), self._peer(s + 1))], [], None
        if op.kind == "SEND_F":
            outputs = self.to_send.pop(("F", s, m))
            sends = [(o.detach().contiguous(), self._peer(s + 1)) for o in outputs]
            return sends, [], partial(self.stages[s].free_outputs, m)
        if op.kind == "SEND_B":
            grads = self.to_send.pop(("B", s, m))
            return [(g.contiguous(), self._peer(s - 1)) for g in grads], [], None
        if op.kind == "RECV_F_META":
            buf = p2p.meta_buffer(device)

            def got_meta() -> None:
                if self.known_metas is not None:  # no device-to-host read of the buffer
                    self.recv_meta[(s, m)] = list(self.known_metas(s, m))
                else:
                    self.recv_meta[(s, m)] = p2p.decode(buf)

            return [], [(buf, self._peer(s - 1))], got_meta
        if op.kind == "RECV_F":
            metas = self.recv_meta.pop((s, m))
            bufs = [meta.empty(device) for meta in metas]

            def got_activations() -> None:
                # leaves that collect the gradient to send back; integer tensors get none
                ready = tuple(b.requires_grad_(t.requires_grad) for b, t in zip(bufs, metas))
                self.fwd_in[(s, m)] = ready

            return [], [(b, self._peer(s - 1)) for b in bufs], got_activations
        if op.kind == "RECV_B":
            bufs = tuple(meta.empty(device) for meta in self.sent_meta.pop((s, m)))
            return (
                [],
                [(b, self._peer(s + 1)) for b in bufs],
                partial(self.grad_in.__setitem__, (s, m), bufs),
            )
        raise ValueError(f"run_schedule: {op} is not a communication action")

    def exchange(self, batch: Batch) -> None:
        """Post one batch, wait for all of it, then file what arrived."""
        sends, recvs, after = [], [], []
        for op in batch.ops:
            op_sends, op_recvs, then = self._plan(op)
            sends += op_sends
            recvs += op_recvs
            if then is not None:
                after.append(then)
        kinds = sorted({op.kind.split("_")[0].lower() for op in batch.ops})
        with self._span(str(batch), "+".join(kinds)):
            works = comm.post_send_recv(sends, recvs, self.ctx.pp_group)
        with self._span(str(batch), "wait"):
            for work in works:
                work.wait()
            for then in after:
                then()


def run_schedule(
    schedule: Schedule | Program,
    stages: PipelineStage | Sequence[PipelineStage],
    ctx: ParallelContext,
    inputs: Sequence | None = None,
    targets: Sequence | None = None,
    loss_fn: LossFn | None = None,
    loss_scale: float | None = None,
    timeline: Timeline | None = None,
    *,
    agree: bool = True,
    recv_metas: RecvMetas | None = None,
) -> torch.Tensor:
    """Run one pipelined forward and backward of every microbatch on this rank.

    ``stages`` are this rank's chunks (several with interleaving). ``inputs[m]`` is microbatch
    ``m`` for the first stage (a tuple of tensors, a dict of keyword arguments or a tensor),
    ``targets[m]`` its target for ``loss_fn(output, target)`` on the last stage; other ranks may
    pass ``None``. Each microbatch's loss is multiplied once by ``loss_scale`` (default
    ``1 / num_microbatches``) before its backward. Returns the sum of the scaled losses, a
    float32 scalar broadcast from the last stage to every rank of the pipeline.

    ``schedule`` may be a lowered :class:`~parallax.pipeline.Program` (e.g.
    ``lower(schedule, forward_time, backward_time)`` with measured costs); every rank must pass
    the same one.

    ``agree=False`` skips the cross-rank agreement (a collective and a host sync): only for a
    caller that already ran this program with it and checks its inputs identically on every
    rank. ``recv_metas(stage, microbatch)`` returns the :class:`~parallax.pipeline.p2p.TensorMeta`
    list that ``stage`` receives for ``microbatch`` (what the previous stage sends); it must be
    exact, on every rank that receives.
    """
    stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
    program = _checked_program(schedule, stages, ctx, inputs, targets, loss_fn, agree)
    schedule = program.schedule
    scale = 1.0 / schedule.num_microbatches if loss_scale is None else float(loss_scale)
    by_index = {stage.stage_index: stage for stage in stages}
    runner = _Runner(schedule, by_index, ctx, inputs, targets, loss_fn, scale, timeline, recv_metas)
    if timeline is not None:
        timeline.begin_step(ctx)
    try:
        for item in program.ranks[ctx.pp_rank]:
            if isinstance(item, Batch):
                runner.exchange(item)
            else:
                runner.compute(item)
    except BaseException:
        for stage in stages:
            stage.clear()
        raise
    if timeline is not None:
        timeline.end_step()
    loss = runner.loss
    if comm.size(ctx.pp_group) > 1:
        last = ctx.pp_peer(schedule.rank_of(schedule.num_stages - 1))
        comm.broadcast(loss, src=last, group=ctx.pp_group)
    return loss


def _checked_program(
    schedule: Schedule | Program,
    stages: list[PipelineStage],
    ctx: ParallelContext,
    inputs: Sequence | None,
    targets: Sequence | None,
    loss_fn: LossFn | None,
    agree: bool,
) -> Program:
    """The lowered program, once this rank's arguments are checked and (with ``agree``) every
    rank agreed that theirs are too and that they run the same program."""
    program = schedule if isinstance(schedule, Program) else None
    if program is not None:
        schedule = program.schedule
    problem = rank_problem(schedule, stages, ctx, inputs, targets, loss_fn)
    if problem is None and program is None:
        program = lower(schedule)
    if agree:
        _agree(problem, program.fingerprint if program else "0" * 16, ctx)
    elif problem is not None:  # the caller vouched for every rank: fail here, without peers
        raise ValueError(f"run_schedule: {problem}")
    return program
