"""Saving and resuming a training run, layout-free.

A checkpoint holds the model's weights and the optimizer's state as full logical tensors (named
by global parameter names, so any dp x tp x pp can read them) plus JSON metadata: the step, the
run's flags, the model config, the data position, the lr schedule, RNG state and the layout it
was written with. Each pipeline stage's (dp 0, tp 0) rank writes its own shard; the store
publishes the step directory atomically and keeps the last K. Fused projections are stored as
their separate tensors (:mod:`parallax.train.names`), so a run resumes with them on or off.
A ``--finetune lora`` run's checkpoints hold only what trains (adapters, ``--train`` modules and
their optimizer state) and the frozen base's fingerprint, checked on resume
(:mod:`parallax.train.lora`).

A resumed run follows its own learning-rate flags from the step it resumes at (the schedule
is a pure function of the step and the flags; :mod:`parallax.train.lr_schedule` says why),
saying in one line which differ from the saved run's; a model that differs from the saved one
is refused naming both (:func:`check_same_model`).

At ``--zero 3`` the weights are sharded over dp as well: every dp rank takes part in gathering
each tensor for the writer (one tensor at a time, never a whole block), and a resume writes each
block's weights into the rank's shards (:meth:`parallax.optim.ZeroOptimizer.materialized`).
So a checkpoint is the same whatever the stage, and any stage resumes any other.

One ``--out`` holds one run (:mod:`parallax.train.outdir`, whose functions are re-exported here).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from parallax import comm
from parallax.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorSource,
    load_module,
    module_sources,
    read_agreed,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from parallax.optim.zero.state_io import FORMAT as OPTIM_FORMAT
from parallax.optim.zero.state_io import state_kinds
from parallax.recipe import registry
from parallax.tensor import logical_shape
from parallax.tensor.sharding import unshard_tensor
from parallax.train import lora
from parallax.train.lr_schedule import schedule_changes
from parallax.train.names import SeparateView, model_meta, separate_meta, split_fused
from parallax.train.outdir import (
    check_out,
    check_steps_left,
    checkpoint_root,
    clear_run,
    find_resume,
    metrics_path,
)

log = logging.getLogger(__name__)

__all__ = [
    "OPTIM_PREFIX",
    "check_out",
    "check_resumable",
    "check_same_model",
    "check_steps_left",
    "checkpoint_root",
    "clear_run",
    "find_resume",
    "follow_schedule",
    "load",
    "metrics_path",
    "save",
]

OPTIM_PREFIX = "optim."


def _optimizer_sources(trainer, write: bool) -> list[TensorSource]:
    """The optimizer's full logical tensors as sources, produced one at a time in the order
    ``state_tensors()`` yields them (a collective over dp and tp that every rank consumes)."""
    opt = trainer.optimizer
    kinds = state_kinds(opt)  # collective: the same on every rank of the stage
    stream = opt.state_tensors()

    def produce(expect: str):
        got, tensor = next(stream)
        if got != expect:
            raise RuntimeError(f"optimizer state out of order: {got} != {expect}")
        return tensor

    out = []
    for i, name in enumerate(opt.names):
        entries = [("master", ("tensor", "float32"))] + sorted(kinds.get(i, {}).items())
        for key, (kind, dtype) in entries:
            shape = () if kind == "scalar" else logical_shape(opt.params[i])
            dtype = torch.float32 if kind == "scalar" else getattr(torch, dtype)
            out.append(
                TensorSource(
                    OPTIM_PREFIX + f"{name}.{key}",
                    tuple(shape),
                    dtype,
                    lambda k=f"{name}.{key}": produce(k),
                    write=write,
                )
            )
    return out


def _merge_optim_meta(metas: list[dict]) -> dict:
    """One optimizer meta for the whole model from each pipeline stage's own."""
    merged = dict(metas[0])
    merged["keys"] = {k: v for m in metas for k, v in m["keys"].items()}
    merged["param_groups"] = [
        {**g, "params": [n for m in metas for n in m["param_groups"][j]["params"]]}
        for j, g in enumerate(metas[0]["param_groups"])
    ]
    return merged


def save(trainer, step: int, loader, extra_meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of step ``step`` (collective: every rank calls it)."""
    ctx, run = trainer.ctx, trainer.run
    trainer.optimizer.wait_params()  # the weights as updated, not mid-all-gather
    optim_meta = trainer.optimizer.state_meta()  # collective
    stage_metas = comm.all_gather_object(optim_meta, ctx.pp_group)
    writer = ctx.dp_rank == 0 and ctx.tp_rank == 0
    only = _trained_only(trainer)
    sources = _model_sources(trainer, writer, only)
    sources += _optimizer_sources(trainer, writer)
    sources = split_fused(sources)  # the separate tensors of fused projections
    meta = {
        "step": step,
        "config": run.to_dict(),
        "family": trainer.recipe.name,
        "model_config": trainer.model_config.to_dict(),
        "layout": {"tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size},
        "data": loader.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "optimizer": separate_meta(_merge_optim_meta(stage_metas)),
        "rng": rng_state(),
        **({"lora": lora.checkpoint_meta(trainer)} if only is not None else {}),
        **(extra_meta or {}),
    }
    return save_checkpoint(
        checkpoint_root(run.out),
        step,
        sources,
        meta,
        group=ctx.world_group,
        keep_last=run.keep_last,
    )


def _model_sources(trainer, write: bool, only) -> list[TensorSource]:
    """The weights as full logical tensors. tp peers of other dp ranks hold the same weights
    and sit out, except at ZeRO-3, where each dp rank holds a part of each (a collective)."""
    ctx, opt = trainer.ctx, trainer.optimizer
    if opt.stage < 3:
        if ctx.dp_rank != 0:
            return []
        return [
            src
            for chunk in trainer.chunks
            for src in module_sources(chunk, ctx.tp_group, write=write, only=only)
        ]

    def produce(p) -> torch.Tensor:
        local = opt.weight(p)  # (this tp rank's shape), gathered over dp
        info = getattr(p, "tp_shard", None)
        return local if info is None else unshard_tensor(local, info, ctx.tp_group)

    return [
        TensorSource(name, logical_shape(p), p.dtype, lambda p=p: produce(p), write=write)
        for chunk in trainer.chunks
        for name, p in chunk.named_parameters()
        if only is None or only(name)
    ]


def _load_weights(trainer, view: SeparateView, only) -> None:
    """Every weight this run reads from the checkpoint into the model (no collective)."""
    opt = trainer.optimizer
    if opt.stage < 3:
        for chunk in trainer.chunks:
            load_module(chunk, view, only=only)
        return
    for unit in opt.units:  # one block at a time, into this rank's shards
        names = set(unit.names)
        with opt.materialized(unit.index):
            load_module(
                trainer.chunks[unit.chunk],
                view,
                only=lambda n, names=names: n in names and (only is None or only(n)),
            )


def _trained_only(trainer):
    """For a LoRA run, the predicate of the parameters its checkpoints hold (what trains: the
    frozen base is rebuilt from the seed or the model checkpoint, and its fingerprint checked);
    ``None`` (every parameter) for full fine-tuning."""
    if trainer.base_identity is None:
        return None
    trained = {
        n for chunk in trainer.chunks for n, p in chunk.named_parameters() if p.requires_grad
    }
    return trained.__contains__


def check_resumable(ckpt: Checkpoint, trainer) -> None:
    """Every tensor this rank will read must be there, before any state is touched."""
    family = ckpt.meta.get("family", registry.FIRST)  # before recipes: the first family
    if family != trainer.recipe.name:
        raise CheckpointError(
            f"{ckpt.path} was written by a {family} run; this run trains {trainer.recipe.name}"
        )
    saved = ckpt.meta.get("config") or {}
    problem = trainer.recipe.model.resume_problem(trainer.run, saved)
    if problem:
        raise CheckpointError(problem)
    problem = lora.check_resume(ckpt.meta, trainer, ckpt.path)
    if problem:
        raise CheckpointError(problem)
    only = _trained_only(trainer) or (lambda name: True)
    params = [(n, p) for chunk in trainer.chunks for n, p in chunk.named_parameters() if only(n)]
    check_same_model(ckpt, trainer, params)
    names = [n for n, _ in params]
    meta = ckpt.meta.get("optimizer")
    if not meta or meta.get("format") != OPTIM_FORMAT:
        raise CheckpointError(f"{ckpt.path}: meta.json has no {OPTIM_FORMAT} optimizer state")
    meta = model_meta(meta, trainer.optimizer.names)
    keys = [
        OPTIM_PREFIX + f"{n}.{k}" for n in trainer.optimizer.names for k in meta["keys"].get(n, [])
    ]
    SeparateView(ckpt).require(names + keys)


def check_same_model(ckpt: Checkpoint, trainer, params: list[tuple[str, torch.Tensor]]) -> None:
    """The model this run builds is the one the checkpoint saved: every parameter is there
    with its shape. Otherwise one message naming both models (``--model`` of the run that
    wrote it and of this one), not a list of missing tensors."""
    view = SeparateView(ckpt)
    missing = [n for n, _ in params if n not in view]
    differ = [
        (n, view.shape(n), logical_shape(p))
        for n, p in params
        if n not in missing and tuple(view.shape(n)) != logical_shape(p)
    ]
    if not missing and not differ:
        return
    saved = (ckpt.meta.get("config") or {}).get("model", "unknown")
    if missing:
        detail = f"{len(missing)} of this model's tensors are not in it, e.g. {missing[0]}"
    else:
        name, was, now = differ[0]
        detail = (
            f"{len(differ)} tensors have other shapes, e.g. {name}: {list(was)} saved, "
            f"{list(now)} here"
        )
    raise CheckpointError(
        "the model differs from the one saved: the checkpoint was written by a run of --model "
        f"{saved} and this run builds --model {trainer.run.model} ({detail}); resume with "
        f"--model {saved}, or start afresh with another --out"
    )


def load(trainer, ckpt: Checkpoint, loader) -> int:
    """Restore weights, optimizer, lr schedule, data position and RNG; returns the step.

    Each rank reads (and verifies the checksums of) only what it holds; the ranks then agree,
    so damage any rank finds raises the same :class:`CheckpointError` on every rank."""
    step = read_agreed(trainer.ctx.world_group, lambda: _load(trainer, ckpt, loader))
    for line in schedule_changes(ckpt.meta.get("config") or {}, trainer.run, step):
        log.info(line)
    return step


def follow_schedule(trainer, step: int, weight_decay: list[float]) -> None:
    """Set every group's lr to this run's schedule at ``step`` (what the step after it trains
    with) and its weight decay to this run's, over what the loaded optimizer state holds:
    the schedule is a pure function of the step and the flags
    (:mod:`parallax.train.lr_schedule`)."""
    sched = trainer.scheduler
    sched.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, base, lr, decay in zip(
        trainer.optimizer.param_groups, sched.base_lrs, lrs, weight_decay
    ):
        group.update(lr=lr, initial_lr=base, weight_decay=decay)
    sched._last_lr = lrs


def _load(trainer, ckpt: Checkpoint, loader) -> int:
    view = SeparateView(ckpt)
    _load_weights(trainer, view, _trained_only(trainer))
    meta = ckpt.meta
    decay = [g["weight_decay"] for g in trainer.optimizer.param_groups]  # this run's
    try:  # the optimizer's own checks (shapes, groups) are this rank's alone: agree on them too
        trainer.optimizer.load_state_tensors(
            model_meta(meta["optimizer"], trainer.optimizer.names),
            lambda key: view.get(OPTIM_PREFIX + key),
        )
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path}: optimizer state: {err}") from err
    follow_schedule(trainer, int(meta["step"]), decay)  # not the saved scheduler's state
    loader.load_state_dict(meta["data"])
    set_rng_state(meta["rng"])
    return int(meta["step"])
