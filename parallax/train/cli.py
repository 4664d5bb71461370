"""``torchrun -m parallax.train``: parse flags, build, train, log, checkpoint, resume.

Every failure that a user can cause (a bad layout, batch sizes that do not divide, a missing
dataset, a corrupt or partial checkpoint) ends with one clear message (rank 0's) and exit status
2 on every rank, before training starts and without touching existing checkpoints. Ranks agree
on such errors before any collective that depends on them, so none is left waiting. A peer that
dies or hangs mid-run ends the others' collectives within ``--timeout`` seconds: they exit with
status 1 and say so once each; ``torchrun --max-restarts N ... --resume`` then carries on from
the last checkpoint. :mod:`parallax.train.failures` says who says what.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from parallax import comm
from parallax.checkpoint import CheckpointError
from parallax.context import DEFAULT_TIMEOUT_S, ParallelContext, init_parallel
from parallax.data import DatasetError, write_statistics
from parallax.data.episodes import STATISTICS
from parallax.dims import ParallelDims
from parallax.recipe import registry
from parallax.train import lora, state
from parallax.train.config import TrainConfig, parse_args
from parallax.train.evaluate import EvalDataError, Evaluator
from parallax.train.failures import Ending, is_comm_failure, sigterm_held
from parallax.train.memory_limit import out_of_memory_message
from parallax.train.monitor import Monitor, NonFiniteError, truncate_metrics
from parallax.train.trainer import InputError, Trainer

log = logging.getLogger("parallax.train")
T = TypeVar("T")

USER_ERRORS = (ValueError, CheckpointError, DatasetError, FileNotFoundError)


class UserError(Exception):
    """A problem with the run's inputs, agreed on by every rank."""


def agree(ctx: ParallelContext, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails with a user error on any rank, raise that error's
    message on all of them (so no rank walks into a collective its peers never reach)."""
    error, value = None, None
    try:
        value = fn()
    except USER_ERRORS as err:
        error = f"{what}: {err}"
    errors = [e for e in comm.all_gather_object(error, ctx.world_group) if e]
    if errors:
        raise UserError(errors[0])
    return value


def run(cfg: TrainConfig, ctx: ParallelContext, stop_after: int | None = None) -> dict[str, float]:
    """Train as ``cfg`` says on this rank; returns the last step's metrics.

    Refused before training (:class:`UserError`, exit status 2): an ``--out`` that holds
    another run (without ``--resume`` or ``--overwrite``), a ``--resume`` with no steps left,
    a checkpoint whose checksums fail on any rank. A step whose loss or gradient norm is not
    finite stops the run (:class:`UserError` naming the step; every rank sees the same reduced
    values) before any later checkpoint is written, so the latest stays the last good one.

    ``stop_after`` ends this invocation after that many steps (after saving a checkpoint), as a
    preemption would: a later ``--resume`` carries on with the same schedule.
    """
    out = Path(cfg.out)
    agree(ctx, "--out", lambda: state.check_out(out, cfg.resume, cfg.overwrite))
    recipe, spec = agree(ctx, "--model", lambda: registry.resolve(cfg.model))
    model_config, checkpoint_dir = spec.config, spec.checkpoint
    data = open_data(ctx, recipe, cfg)
    loader = agree(ctx, "batch sizes", lambda: recipe.loader(data, cfg, ctx))
    ckpt = agree(ctx, "--resume", lambda: _find_resume(cfg) if cfg.resume else None)
    trainer = agree(
        ctx,
        "building the model",
        lambda: Trainer(cfg, ctx, model_config, checkpoint_dir, recipe=recipe),
    )
    builder = agree(
        ctx,
        "data and model",
        lambda: recipe.collator(trainer.model_config, data, checkpoint_dir),
    )
    evaluator = None
    if cfg.eval_interval:
        evaluator = agree(
            ctx,
            "--eval-data",
            lambda: Evaluator(
                trainer, recipe.eval_dataset(cfg.eval_data, cfg), builder, Path(cfg.out)
            ),
        )
    start = 0
    if ckpt is not None:
        agree(ctx, f"checkpoint {ckpt.path}", lambda: state.check_resumable(ckpt, trainer))
        start = agree(ctx, "--resume", lambda: state.load(trainer, ckpt, loader))
        log.info(
            "resumed from %s at step %d (written at %s)", ckpt.path, start, ckpt.meta.get("layout")
        )
    elif cfg.resume:
        log.info("--resume: no checkpoint in %s yet, starting from scratch", out)
    if ctx.rank == 0:
        if cfg.overwrite:
            state.clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            if start:
                truncate_metrics(out / name, start)
            elif (out / name).exists():
                (out / name).unlink()
        statistics = getattr(data, "statistics", None)
        if statistics:  # OpenVLA's dataset_statistics.json: what predict_action un-normalises by
            write_statistics(out / STATISTICS, statistics)
    comm.barrier(ctx.world_group)

    monitor = Monitor(
        out,
        rank=ctx.rank,
        world=ctx.world_size,
        device=ctx.device,
        log_interval=cfg.log_interval,
        total_steps=cfg.steps,
        recipe=recipe,
    )
    saved = start if ckpt is not None else None
    try:
        for step in range(start + 1, cfg.steps + 1):
            began = time.perf_counter()
            microbatches, problem = next_microbatches(loader, builder)
            waited = time.perf_counter() - began  # what the step waited for its batch
            try:  # every rank agrees on the batches before the step's first collective
                output = trainer.train_step(microbatches, problem=problem, data_wait_s=waited)
            except InputError as err:
                more = f" (and {len(err.found) - 1} more)" if len(err.found) > 1 else ""
                raise UserError(f"the batch of step {step}: {err.found[0]}{more}") from None
            except torch.OutOfMemoryError as err:
                raise UserError(out_of_memory_message(cfg, step, err)) from None
            tokens = trainer.tokens(microbatches) * ctx.dp_size
            flops = trainer.model_flops(microbatches) * ctx.dp_size  # what this step computes
            monitor.record(step, output, tokens, flops, data_wait_s=output.data_wait_s)
            stopping = stop_after is not None and step - start >= stop_after
            if evaluator is not None:
                try:  # its batches are agreed on like the step's
                    evaluator.maybe_run(step, last=step == cfg.steps)
                except EvalDataError as err:
                    raise UserError(str(err)) from None
            periodic = cfg.save_interval and (step % cfg.save_interval == 0 or step == cfg.steps)
            if periodic or stopping:
                monitor.flush()  # every step since the last checkpoint is finite
                state.save(trainer, step, loader, {"metrics": monitor.last})
                saved = step
            if stopping:
                break
        monitor.flush()  # the last step, before any export
    except NonFiniteError as err:
        raise UserError(_non_finite_message(err, saved, out)) from None
    finally:
        monitor.close()
        if hasattr(loader, "close"):
            loader.close()  # its worker processes
    if cfg.export_hf:
        export_hf(trainer, out / "hf", getattr(data, "statistics", None))
    return monitor.last


def open_data(ctx: ParallelContext, recipe, cfg: TrainConfig):
    """The recipe's dataset on every rank: rank 0 opens it first (scanning robot data and
    writing its index), then the others (reading that index). An error on any rank, such as
    bad data found by the scan, is raised on all of them."""
    data = agree(ctx, "--data", lambda: recipe.dataset(cfg.data, cfg) if ctx.rank == 0 else None)
    if ctx.world_size == 1:
        return data
    return agree(ctx, "--data", lambda: data if ctx.rank == 0 else recipe.dataset(cfg.data, cfg))


def next_microbatches(loader, builder) -> tuple[list, str | None]:
    """This rank's microbatches of the next step, or ``([], message)`` when its data is bad
    (the trainer then makes every rank agree on it before the step runs)."""
    try:
        return [builder(samples) for samples in loader.next_batch()], None
    except USER_ERRORS as err:
        return [], str(err)


def _find_resume(cfg: TrainConfig):
    ckpt = state.find_resume(cfg.out)
    if ckpt is not None:
        state.check_steps_left(ckpt, cfg.steps)
    return ckpt


def _non_finite_message(err: NonFiniteError, saved: int | None, out: Path) -> str:
    if saved is None:
        kept = "no checkpoint was written"
    else:
        path = state.checkpoint_root(out) / f"step_{saved:08d}"
        kept = f"the latest checkpoint, {path}, is the last good one"
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
        trainer.recipe.export(trainer.chunks[0], path, statistics)  # merged, each its slice
        if trainer.base_identity is not None:
            lora.export_adapter(trainer, path / lora.ADAPTER_DIR, trainer.lora_report)
    if trainer.ctx.rank == 0:
        log.info("exported the Hugging Face checkpoint to %s", path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m parallax.train`` and ``parallax-train``. What each rank says
    and which exit status it gives when the run cannot go on: :mod:`parallax.train.failures`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ending = Ending(int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1))
    signal.signal(signal.SIGTERM, ending.on_sigterm)
    cfg = ctx = None
    try:
        # what every rank checks alike, rank 0 says; a launcher's SIGTERM (a peer that already
        # failed on the same check) waits until it has been said
        with sigterm_held():
            try:
                cfg = parse_args(argv)
                if cfg.dry_run:
                    from parallax.train.plan import print_plan

                    print_plan(cfg, file=None if ending.rank == 0 else io.StringIO())
                    return ending.end(0)
                ParallelDims.from_world(ending.world, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
            except ValueError as err:
                return ending.user_error(err, agreed=True)
        ctx = init_parallel(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, timeout=cfg.timeout)
        if ctx.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        run(cfg, ctx)
        return ending.end(0)
    except UserError as err:
        return ending.user_error(err, agreed=True)
    except USER_ERRORS as err:
        return ending.user_error(err, agreed=False)
    except KeyboardInterrupt:
        return ending.interrupted()
    except Exception as err:
        if is_comm_failure(err):
            return ending.peer_failed(err, cfg.timeout if cfg else DEFAULT_TIMEOUT_S)
        return ending.crashed(traceback.format_exc())  # a bug: say where
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group cannot always be torn down
                dist.destroy_process_group()
        ending.hold_on()
