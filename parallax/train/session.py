"""One training session on this rank: open the data, build the trainer, resume, run the steps,
checkpoint, evaluate and export (what :func:`parallax.train.cli.run` does between taking the
lock of ``--out`` and giving it back).

Refused before training (:class:`UserError`, exit status 2): an ``--out`` that holds another run
(without ``--resume`` or ``--overwrite``), a ``--resume`` with no steps left, a checkpoint whose
checksums fail on any rank. A step whose loss or gradient norm is not finite stops the run
(:class:`UserError` naming the step; every rank sees the same reduced values) before any later
checkpoint is written, so the latest stays the last good one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallax import comm
from parallax.checkpoint import CheckpointError
from parallax.context import ParallelContext
from parallax.data import write_statistics
from parallax.data.episodes import STATISTICS
from parallax.data.prefetch import Serialized
from parallax.run import Run
from parallax.train import checkpoints, lora, sinks
from parallax.train.agreement import UserError, agree
from parallax.train.evaluate import EvalDataError, Evaluator
from parallax.train.failures import Preempted, Preemption
from parallax.train.memory_limit import out_of_memory_message
from parallax.train.monitor import Monitor, NonFiniteError, offload_fields, truncate_metrics
from parallax.train.step_batches import StepBatches
from parallax.train.trainer import InputError, Trainer

log = logging.getLogger("parallax.train")


@dataclass
class Session:
    """What a session holds between its steps."""

    run: Run
    ctx: ParallelContext
    out: Path
    data: Any
    loader: Any
    trainer: Trainer
    builder: Any
    evaluator: Evaluator | None
    start: int  # the step it resumed after (0: fresh)
    saved: int | None  # the latest checkpoint's step
    monitor: Monitor | None = None
    batches: StepBatches | None = None  # the steps' batches, made --prefetch steps ahead


def train(run: Run, ctx: ParallelContext, stop_after: int | None, preemption: Preemption):
    """Train as ``run`` says on this rank; returns the last step's metrics. ``stop_after`` ends
    this invocation after that many steps (after saving a checkpoint), as a preemption would: a
    later ``--resume`` carries on with the same schedule."""
    s = open_session(run, ctx)
    s.monitor = _monitor(s)
    preemption.armed, preempted = True, False
    try:
        s.batches = StepBatches(s.loader, s.builder, s.trainer, s.start, run.steps, run.prefetch)
        preempted = _steps(s, stop_after, preemption)
        s.monitor.flush()  # the last step, before any export
    except NonFiniteError as err:
        raise UserError(_non_finite_message(err, s.saved, s.out)) from None
    finally:
        s.monitor.close()
        if s.batches is not None:
            s.batches.close()  # the prefetch thread, then the loader's worker processes
        elif hasattr(s.loader, "close"):
            s.loader.close()
    if preempted:
        raise Preempted(s.saved)
    if run.export_hf:
        export_hf(s.trainer, s.out / "hf", getattr(s.data, "statistics", None))
    return s.monitor.last


def open_session(run: Run, ctx: ParallelContext) -> Session:
    """The data, the loader, the trainer and the collator, every rank agreeing on each; the
    checkpoint resumed from (if any) loaded; ``--out`` prepared."""
    data_side = run.recipe.data
    data = open_data(ctx, run)
    loader = agree(ctx, "--data and batch sizes", lambda: data_side.loader(data, run, ctx))
    ckpt = agree(ctx, "--resume", lambda: _find_resume(run) if run.resume else None)
    trainer = agree(ctx, "building the model", lambda: Trainer(run, ctx))
    # the prefetch thread and the evaluation both collate: one call at a time
    builder = agree(ctx, "data and model", lambda: Serialized(data_side.collator(run, data)))
    evaluator = None
    if run.eval_interval:
        evaluator = agree(
            ctx,
            "--eval-data",
            lambda: Evaluator(
                trainer, data_side.eval_dataset(run.eval_data, run), builder, Path(run.out)
            ),
        )
    s = Session(run, ctx, Path(run.out), data, loader, trainer, builder, evaluator, 0, None)
    if ckpt is not None:
        agree(ctx, f"checkpoint {ckpt.path}", lambda: checkpoints.check_resumable(ckpt, trainer))
        s.start = s.saved = agree(ctx, "--resume", lambda: checkpoints.load(trainer, ckpt, loader))
        where = ckpt.meta.get("layout")
        log.info("resumed from %s at step %d (written at %s)", ckpt.path, s.start, where)
    elif run.resume:
        log.info("--resume: no checkpoint in %s yet, starting from scratch", s.out)
    _prepare_out(s)
    return s


def _prepare_out(s: Session) -> None:
    """Rank 0 makes ``--out``: metrics cut back to the resumed step (or removed), the data's
    statistics written (what ``predict_action`` un-normalises by)."""
    if s.ctx.rank == 0:
        if s.run.overwrite:
            checkpoints.clear_run(s.out)
        s.out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            if s.start:
                truncate_metrics(s.out / name, s.start)
            elif (s.out / name).exists():
                (s.out / name).unlink()
        statistics = getattr(s.data, "statistics", None)
        if statistics:
            write_statistics(s.out / STATISTICS, statistics)
    comm.barrier(s.ctx.world_group)


def _monitor(s: Session) -> Monitor:
    ctx, run = s.ctx, s.run
    layout = {"tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size, "world_size": ctx.world_size}
    return Monitor(
        s.out,
        rank=ctx.rank,
        world=ctx.world_size,
        device=ctx.device,
        log_interval=run.log_interval,
        total_steps=run.steps,
        objective=run.recipe.objective,
        sinks=agree(
            ctx,
            "--log-to",
            lambda: sinks.open_sinks(run, s.out, layout, s.start) if ctx.rank == 0 else [],
        ),
    )


def _steps(s: Session, stop_after: int | None, preemption: Preemption) -> bool:
    """Run the steps after ``s.start``; whether a SIGTERM stopped them (after a checkpoint)."""
    run = s.run
    for step in range(s.start + 1, run.steps + 1):
        output = _one_step(s, step, preemption)
        preemption.agreed = output.stop  # every rank saves after this step
        preempted = output.stop and step < run.steps
        stopping = preempted or (stop_after is not None and step - s.start >= stop_after)
        if s.evaluator is not None:
            try:  # its batches are agreed on like the step's
                evaluated = s.evaluator.maybe_run(step, last=step == run.steps)
            except EvalDataError as err:
                raise UserError(str(err)) from None
            if evaluated:
                s.monitor.log_eval(evaluated)
        periodic = run.save_interval and (step % run.save_interval == 0 or step == run.steps)
        if periodic or stopping:
            s.monitor.flush()  # every step since the last checkpoint is finite
            _save(s, step)
            if preempted:  # a later SIGTERM says so and leaves
                preemption.saved = step
        if stopping:
            return preempted
    return False


def _one_step(s: Session, step: int, preemption: Preemption):
    """One optimizer step on this rank's next microbatches, recorded by the monitor."""
    batch = s.batches.next()  # made ahead with --prefetch; waited_s: what the step waited
    microbatches = batch.microbatches
    try:  # every rank agrees on the batches before the step's first collective
        output = s.trainer.train_step(
            microbatches,
            problem=batch.problem,
            data_wait_s=batch.waited_s,
            stop=preemption.stop_asked(),
            staged=batch.staged,
        )
    except InputError as err:
        more = f" (and {len(err.found) - 1} more)" if len(err.found) > 1 else ""
        raise UserError(f"the batch of step {step}: {err.found[0]}{more}") from None
    except torch.OutOfMemoryError as err:
        raise UserError(out_of_memory_message(s.run, step, err)) from None
    if step == s.start + 1:  # the offload's host buffers and moments exist from now on
        s.monitor.offload = offload_fields(s.trainer.optimizer)
    dp = s.ctx.dp_size
    tokens = s.trainer.tokens(microbatches) * dp
    flops = s.trainer.model_flops(microbatches) * dp  # what this step computes
    s.monitor.record(step, output, tokens, flops, data_wait_s=output.data_wait_s)
    return output


def _save(s: Session, step: int) -> None:
    """A checkpoint of ``step``; a failed save (a full disk) is an error every rank agrees on
    (one message, rank 0's), and the latest checkpoint stays as it was."""
    try:
        # the position after this step's batch, not the loader's (it runs ahead)
        checkpoints.save(s.trainer, step, s.batches, {"metrics": s.monitor.last})
    except CheckpointError as err:
        raise UserError(f"{err} ({_kept(s.saved, s.out)})") from None
    s.saved = step


def _kept(saved: int | None, out: Path) -> str:
    if saved is None:
        return "no checkpoint was written"
    path = checkpoints.checkpoint_root(out) / f"step_{saved:08d}"
    return f"the latest checkpoint, {path}, is the last good one"


def open_data(ctx: ParallelContext, run: Run):
    """The recipe's dataset on every rank: rank 0 opens it first (scanning robot data and
    writing its index), then the others (reading that index). An error on any rank, such as
    bad data found by the scan, is raised on all of them."""
    side = run.recipe.data
    data = agree(ctx, "--data", lambda: side.dataset(run.data, run) if ctx.rank == 0 else None)
    if ctx.world_size == 1:
        return data
    return agree(ctx, "--data", lambda: data if ctx.rank == 0 else side.dataset(run.data, run))


def _find_resume(run: Run):
    ckpt = checkpoints.find_resume(run.out)
    if ckpt is not None:
        checkpoints.check_steps_left(ckpt, run.steps)
    return ckpt


def _non_finite_message(err: NonFiniteError, saved: int | None, out: Path) -> str:
    kept = _kept(saved, out)
    return (
        f"step {err.step}: the loss is {err.loss} and the gradient norm {err.grad_norm}, not "
        f"finite: stopped without saving ({kept}). Training diverged (try a lower --lr) or "
        "the data holds non-finite values"
    )


def export_hf(trainer: Trainer, path: Path, statistics: dict | None = None) -> None:
    """Write the trained weights in the family's Hugging Face layout (collective), with the
    training data's statistics where the family keeps them (``Recipe.export``). A LoRA run
    writes the merged model there (each rank adds ``(alpha/r) B A`` to its own slices in fp32,
    from the weights in memory) and the adapter alone in PEFT's format to ``path/adapter``."""
    if len(trainer.chunks) != 1:
        raise UserError("--export-hf needs one model chunk per pipeline rank (not interleaved)")
    with trainer.optimizer.gathered():  # the weights as updated (whole at --zero 3)
        model = trainer.recipe.model
        model.export(trainer.run, trainer.chunks[0], path, statistics)  # merged, each its slice
        if trainer.base_identity is not None:
            lora.export_adapter(trainer, path / lora.ADAPTER_DIR, trainer.lora_report)
    if trainer.ctx.rank == 0:
        log.info("exported the Hugging Face checkpoint to %s", path)
