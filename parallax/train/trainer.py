"""The composition: one model, split over pp, sharded over tp, trained with ZeRO 1-3 over dp.

:class:`Trainer` builds this rank's model chunks through the model family's recipe
(:mod:`parallax.recipe`), the pipeline schedule, the optimizer (with the run's parameter groups
and frozen parameters, :mod:`parallax.run.param_groups`) and the learning-rate schedule from a
resolved :class:`~parallax.run.Run`, and runs one optimizer step per
:meth:`Trainer.train_step` without waiting for the device: the one agreement of a step (every
rank's inputs are well-formed) is a small all-reduce over the host group.

For a ``"tokens"`` recipe the loss follows the global batch: each microbatch contributes ``sum of
unit losses / units in the global batch`` (counted by the Trainer over dp), so the loss and the
update are the same at every layout. A ``"step"`` recipe runs the step's forwards and backwards
itself (pp = 1). Pass labels on the host (as the loaders do): what the loss needs is read from
them without a device synchronisation. The step's device inputs come from
:mod:`parallax.train.staging`: made ahead by the session's prefetch thread, or by the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from parallax import comm
from parallax.context import ParallelContext
from parallax.models.compile import memory_budget
from parallax.pipeline import TensorMeta, Timeline, lower, make_schedule, run_schedule, split
from parallax.pipeline.forward import run_forward
from parallax.recipe import Microbatch
from parallax.recipe.adapt import lora_enabled, whole_model
from parallax.run import Run
from parallax.tensor.sharding import unshard_tensor
from parallax.train import batch_checks, lora
from parallax.train.batch_checks import InputError
from parallax.train.build import build_stages, compile_options
from parallax.train.lr_schedule import lr_lambda
from parallax.train.memory_limit import apply_gpu_memory_limit
from parallax.train.optimizer import build_optimizer
from parallax.train.staging import Staged, Stager

__all__ = ["InputError", "Staged", "StepOutput", "Trainer"]


@dataclass
class StepOutput:
    """What one step returns, as tensors (read them only at log steps: no host sync)."""

    loss: torch.Tensor  # global mean loss
    grad_norm: torch.Tensor
    metrics: torch.Tensor  # [loss sum, *recipe.metric_sums] over the global batch, every rank
    lr: float
    data_wait_s: float = 0.0  # the slowest rank's wait for its batch (as train_step was told)
    stop: bool = False  # some rank was asked to stop (SIGTERM): every rank saves after this step


class Trainer:
    """This rank's share of the model, the schedule and the optimizer; see the module doc."""

    def __init__(self, run: Run, ctx: ParallelContext, compile_options: dict | None = None) -> None:
        """``run``: the resolved run (:func:`parallax.recipe.resolve`); ``compile_options`` go to
        ``torch.compile`` when ``run.compile``."""
        if not isinstance(run, Run):
            raise TypeError(
                f"Trainer takes a resolved Run (parallax.recipe.resolve(config)), not "
                f"{type(run).__name__}"
            )
        self.run, self.ctx, self.recipe = run, ctx, run.recipe
        self.model_config = run.model_config
        apply_gpu_memory_limit(run, ctx)
        self.recipe.model.check_layout(run, ctx.dims)
        self.dtype = torch.bfloat16 if run.precision == "bf16" else torch.float32
        self.num_microbatches = run.num_microbatches(ctx.dp_size)
        # the schedule first: it validates pp, microbatches and chunks before anything is built
        self.schedule = make_schedule(run.schedule, ctx.pp_size, self.num_microbatches, run.chunks)
        self.program = lower(self.schedule)
        self.stager = Stager(self)  # this rank's device inputs of a step (staging.py)
        blocks = self.recipe.model.blocks(self.model_config)
        self.block_names = [b.name for b in blocks]
        pin = self.recipe.model.pin_first
        self.ranges = split([b.cost for b in blocks], ctx.pp_size, run.chunks, pin_first=pin)
        # the whole model (meta: shapes only) as this run adapts it: adapters, frozen parameters
        self.whole, self.lora_report = whole_model(run, self.dtype)
        self.chunks, self.stages = build_stages(self, compile_options)
        self.base_identity = None  # the frozen base's fingerprint, for LoRA checkpoints
        if lora_enabled(run):
            lora.load_init(self.chunks, run, ctx)
            self.base_identity = lora.base_identity(self.chunks, ctx)
        self.optimizer = build_optimizer(self)
        if run.overlap_param_gather and ctx.dp_size > 1 and run.zero < 3:
            self.optimizer.overlap_param_gather(*self.chunks)
        if run.offload == "optimizer":  # the host's step under the next forward, where it can
            self.optimizer.overlap_host_step(*self.chunks)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(run))
        self._metrics: list[torch.Tensor] = []
        self._units: torch.Tensor | None = None
        self._units_work = None  # the unit count's all-reduce, waited for where it is used
        self._agreed = False  # the pipeline ranks agreed on the program once

    # -- building ----------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        """Every global parameter name of the whole model (built on the meta device: the same
        on every rank, no collective), adapters included."""
        return [n for n, _ in self.whole.named_parameters()]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their global (layout-free) names, with their current
        values (the last step's deferred all-gathers are waited for)."""
        self.optimizer.wait_params()
        return self._named_parameters()

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of this rank's chunks as ``(global name, full logical tensor)``, one
        at a time (at ``--zero 3`` the parameters hold no values between uses: read them
        here). Collective over dp and tp: every rank of the stage consumes it all."""
        for name, p in self._named_parameters():
            local = self.optimizer.weight(p)  # (this tp rank's shape)
            info = getattr(p, "tp_shard", None)
            yield name, local if info is None else unshard_tensor(local, info, self.ctx.tp_group)

    def _compile_options(self, given: dict | None) -> dict:
        """``torch.compile`` options: those given, and with ``cuda_graphs`` reduce-overhead."""
        return compile_options(self.run, given)

    # -- one step ----------------------------------------------------------------------------
    def _loss_fn(self, out: Any, target: Any) -> torch.Tensor:
        """This microbatch's loss sum over the global batch's unit count, times dp (ZeRO
        averages gradients over dp); metrics are kept on the side."""
        ce, sums = self.recipe.objective.loss(self.chunks[-1], out, target, self.ctx, self.run)
        self._metrics.append(torch.cat([ce.detach().float().reshape(1), sums.float()]))
        return ce * (self.ctx.dp_size / self._units_ready())

    def _global_units(self, microbatches: list[Microbatch]) -> torch.Tensor:
        """Supervised units of the global batch (a collective over dp, left in flight: see
        :meth:`_units_ready`); counted on the host."""
        count = sum(int(self.recipe.objective.loss_units(mb)) for mb in microbatches)
        total = torch.full((), float(count), device=self.ctx.device)  # a fill, not a copy
        self._units_work = comm.all_reduce_async(total, self.ctx.dp_group)
        return total

    def _units_ready(self) -> torch.Tensor:
        """The global unit count, once its all-reduce is done. It is waited for at its first
        use, not when launched: the all-reduce queues behind the previous step's parameter
        all-gathers, and waiting at launch would hold the whole forward back for them. At least
        1 (a batch without labels has loss 0); the clamp is idempotent."""
        comm.wait(self._units_work)
        self._units_work = None
        return self._units.clamp_(min=1.0)

    def _recv_metas(self, microbatches: list[Microbatch]):
        """What every later stage receives, from the batch's host shapes (the same on every
        pipeline rank)."""
        metas = [self.recipe.data.stage_metas(self.run, mb, self.dtype) for mb in microbatches]

        def of(stage: int, m: int) -> list[TensorMeta]:
            return metas[m]

        return of

    def train_step(
        self,
        microbatches: list[Microbatch],
        timeline: Timeline | None = None,
        problem: str | None = None,
        data_wait_s: float = 0.0,
        stop: bool = False,
        staged: Staged | None = None,
    ) -> StepOutput:
        """One optimizer step over this dp rank's microbatches (dicts of host tensors, as the
        recipe's collator makes them). A ``problem`` (this rank could not make its batch: bad
        data) ends the step on every rank before anything runs: :class:`InputError`.
        ``data_wait_s``: how long this rank waited for the batch; the output carries the
        largest wait over the ranks (the inputs' agreement reduces it, no extra collective).
        ``stop``: this rank was asked to stop; the output says whether any rank was (the same
        agreement), so that every rank saves after the same step. ``staged``: these
        microbatches' device inputs, made ahead (``self.stager(microbatches, ahead=True)``);
        without them the step copies its inputs itself."""
        slowest, stopping = batch_checks.check(self, microbatches, problem, data_wait_s, stop)
        staged = staged or self.stager(microbatches)
        staged.ready()  # this stream waits for copies made ahead on a side stream
        if self.run.cuda_graphs:  # last step's graph outputs are dead: replay on the fast path
            torch.compiler.cudagraph_mark_step_begin()
        with memory_budget(self.run.activation_memory_budget):  # blocks compile in the step
            output = self._train_step(microbatches, staged, timeline, slowest)
        output.stop = stopping
        return output

    def _train_step(self, microbatches, staged: Staged, timeline, slowest: float) -> StepOutput:
        self.optimizer.zero_grad()
        if self.recipe.objective.kind == "step":
            with record_function("parallax.forward_backward"):
                loss, metrics = self.recipe.objective.forward_backward(
                    self.chunks, staged.microbatches, self.ctx, self.run
                )
        else:
            self._run_pipeline(microbatches, staged, timeline)
            with record_function("parallax.grad_norm"):
                # before step(): a collective queued after step()'s deferred gathers would wait
                metrics = self._reduce_metrics()
            loss = None
        with record_function("parallax.grad_norm"):
            if self.run.grad_clip > 0:
                grad_norm = self.optimizer.clip_grad_norm_(self.run.grad_clip)
            else:
                grad_norm = self.optimizer.grad_norm()
        lr = self.optimizer.param_groups[-1]["lr"]  # the default group ("*")
        with record_function("parallax.optimizer"):
            self.optimizer.step()
        self.scheduler.step()
        if loss is None:
            loss = metrics[0] / self._units_ready()  # the global batch's mean unit loss
        return StepOutput(loss, grad_norm.detach(), metrics, lr, data_wait_s=slowest)

    def _run_pipeline(self, microbatches: list[Microbatch], staged: Staged, timeline) -> None:
        self._units = self._global_units(microbatches)
        self._metrics = []
        syncs = self.run.pipeline_syncs
        # the phases are named for profiles (benchmarks/step/openvla_profile.py); free otherwise
        with record_function("parallax.schedule"):
            run_schedule(
                self.program,
                self.stages,
                self.ctx,
                inputs=staged.inputs,
                targets=staged.targets,
                loss_fn=self._loss_fn,
                loss_scale=1.0,
                timeline=timeline,
                agree=syncs or not self._agreed,
                recv_metas=None
                if syncs or self.ctx.pp_size == 1
                else self._recv_metas(microbatches),
            )
        self._agreed = True

    def _reduce_metrics(self) -> torch.Tensor:
        """Loss and metric sums over the global batch, on every rank (from the last stage)."""
        if self._metrics:
            local = torch.stack(self._metrics).sum(0)
        else:
            local = torch.zeros(1 + len(self.recipe.objective.metric_sums), device=self.ctx.device)
        comm.all_reduce(local, self.ctx.dp_group)
        if self.ctx.pp_size > 1:
            last = self.ctx.pp_peer(self.schedule.rank_of(self.schedule.num_stages - 1))
            comm.broadcast(local, src=last, group=self.ctx.pp_group)
        return local

    # -- evaluation and reporting --------------------------------------------------------------
    @torch.no_grad()
    def eval_step(self, microbatches: list[Microbatch], problem: str | None = None) -> torch.Tensor:
        """Loss and metric sums of these microbatches, forward only (collective: every rank
        passes its dp share of the same evaluation batch). The inputs are agreed on first, as
        in :meth:`train_step`: a ``problem`` on one rank is :class:`InputError` on all."""
        batch_checks.check(self, microbatches, problem)
        self.optimizer.wait_params()
        objective = self.recipe.objective
        if objective.kind == "step":
            return objective.evaluate_step(self.chunks, microbatches, self.ctx, self.run)

        def last(out: Any, m: int) -> torch.Tensor:
            target = _to(objective.loss_target(self.run, microbatches[m]), self.ctx.device)
            ce, sums = objective.loss(self.chunks[-1], out, target, self.ctx, self.run)
            return torch.cat([ce.float().reshape(1), sums.float()])

        self._metrics = run_forward(
            self.schedule,
            {st.stage_index: st.module for st in self.stages},
            self.ctx,
            self.stager(microbatches).inputs,
            last,
            self._recv_metas(microbatches),
        )
        sums = self._reduce_metrics()
        sampled = objective.sampled_sums(self.chunks, microbatches, self.ctx, self.run)
        if sampled is None:
            return sums
        sampled = sampled.to(sums.device, torch.float64)
        comm.all_reduce(sampled, self.ctx.dp_group)
        return torch.cat([sums.double(), sampled])

    def model_flops(self, microbatches: list[Microbatch]) -> float:
        """Model FLOPs of one step over these microbatches (the recipe's formula)."""
        return self.recipe.model.flops(self.run, microbatches, self.whole)

    def tokens(self, microbatches: list[Microbatch]) -> int:
        """Tokens these microbatches process (image and text)."""
        return self.recipe.model.tokens(self.run, microbatches)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value
