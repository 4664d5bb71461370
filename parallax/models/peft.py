"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

Keys are ``base_model.model.`` + the checkpoint's module name + ``.lora_A.weight`` ``(r, in)`` or
``.lora_B.weight`` ``(out, r)``; a fused parallax layer with several adapters is written as the
checkpoint's separate modules (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``), timm's
fused ``qkv`` as one. Fully trained modules (PEFT's ``modules_to_save``) are written as
``base_model.model.`` + their checkpoint tensor names. A PEFT user loads the directory onto the
model class that reads the base checkpoint.

Writing is collective: every rank calls :func:`save_adapter`. Each stage's (dp 0) ranks gather
one tensor at a time over tp; the stage's tp rank 0 sends it to global rank 0, which streams the
one file (safetensors' header first, then tensor by tensor), so no rank holds more than one full
tensor. Rank 0 writes into a temporary directory and renames it into place when complete; every
rank returns or raises the same error. Reading is :mod:`parallax.models.peft_load`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from parallax import comm
from parallax.atomic import atomic_write_json, fsync_dir, publish_dir, temp_sibling
from parallax.models.safetensors_io import SafetensorsWriter
from parallax.tensor import logical_shape, unshard_tensor
from parallax.tensor.lora_apply import is_adapter_name, lora_layers

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
NOTES = "parallax_adapter.json"
PREFIX = "base_model.model."
Pieces = list[tuple[str, tuple[int, ...]]]  # (file key, shape): dim-0 blocks of one parameter


def tensor_names(model: nn.Module):
    """``names(param, logical_shape) -> [(checkpoint name, shape), ...]`` of the model's
    checkpoint (its own parameter names when it has no ``checkpoint_layout``)."""
    make = getattr(model, "checkpoint_layout", None)
    if make is None:
        return lambda name, shape: [(name, tuple(shape))]
    return make().tensors


def adapter_pieces(model: nn.Module, trained: Iterable[str] | None = None) -> dict[str, Pieces]:
    """This rank's exported parameters -> their pieces in the file: every adapter A and B, and
    those of the ``trained`` parameters this rank holds (default: every parameter that trains
    and is not an adapter). Names of other pipeline stages' parameters are skipped here."""
    params = dict(model.named_parameters())
    out: dict[str, Pieces] = {}
    for mname, layer in lora_layers(model):
        r, g = layer.lora_rank, layer.lora_groups
        out_rows = layer.out_features // g
        out[f"{mname}.lora_A"] = [
            (f"{PREFIX}{n}.lora_A.weight", (r, layer.in_features)) for n in layer.lora_names
        ]
        out[f"{mname}.lora_B"] = [
            (f"{PREFIX}{n}.lora_B.weight", (out_rows, r)) for n in layer.lora_names
        ]
    if trained is None:
        trained = [n for n, p in params.items() if p.requires_grad and not is_adapter_name(n)]
    names = tensor_names(model)
    for name in trained:
        if is_adapter_name(name):
            raise ValueError(f"{name} is an adapter, not a base parameter to save whole")
        if name not in params:
            continue  # another stage's (save_adapter checks that some stage holds it)
        pieces = names(name, logical_shape(params[name]))
        out[name] = [(PREFIX + n, tuple(s)) for n, s in pieces]
    return out


def lora_hyperparameters(model: nn.Module) -> tuple[int, float, float] | None:
    """``(r, alpha, dropout)`` shared by every adapter of this rank; ``None`` without adapters."""
    seen = {(m.lora_rank, m.lora_alpha, m.lora_dropout) for _, m in lora_layers(model)}
    if len(seen) > 1:
        raise ValueError(f"adapters with different (r, alpha, dropout): {sorted(seen)}")
    return seen.pop() if seen else None


def adapter_config(
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    *,
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
    modules_to_save: list[str] | None = None,
    init_lora_weights: bool | str = "gaussian",
) -> dict:
    """PEFT's ``LoraConfig`` fields for these adapters. ``target_modules`` are full module
    names: PEFT matches a name equal to one exactly, so it builds adapters exactly where these
    are (a suffix such as ``proj`` would also catch modules parallax never builds)."""
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
        "init_lora_weights": init_lora_weights,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
        "revision": None,
    }


def _stage_plan(model, ctx, trained) -> tuple[list, tuple, str | None]:
    """Every rank's view of the whole file: ``[(stage, param, pieces, shape, dtype)]`` in stage
    order, the hyperparameters, and one error message (the same on every rank) or ``None``."""
    coords = (0, 0, 0) if ctx is None else ctx.dims.coords(ctx.rank)
    params = dict(model.named_parameters())
    trained = None if trained is None else list(trained)
    try:
        pieces, error = adapter_pieces(model, trained), None
        mine = [(n, ps, logical_shape(params[n]), str(params[n].dtype)) for n, ps in pieces.items()]
        hyper = lora_hyperparameters(model)
    except ValueError as err:
        mine, hyper, error = [], None, str(err)
    world = None if ctx is None else ctx.world_group
    gathered = comm.all_gather_object((coords, mine, hyper, error), world)
    errors = sorted({e for *_, e in gathered if e})
    if errors:
        return [], (), "; ".join(errors)
    stages = {c[0]: (m, h) for c, m, h, _ in gathered if c[1] == 0 and c[2] == 0}
    hypers = {h for _, h in stages.values() if h is not None}
    plan = [(stage, *entry) for stage in sorted(stages) for entry in stages[stage][0]]
    keys = {k for entry in plan for k, _ in entry[2]}
    if len(hypers) != 1:
        problem = (
            "no adapters" if not hypers else f"stages disagree on (r, alpha, dropout) {hypers}"
        )
        return [], (), f"save_adapter: {problem}"
    if len(keys) != sum(len(e[2]) for e in plan):
        return [], (), "save_adapter: two stages hold the same adapter (overlapping stages?)"
    held = {entry[1] for entry in plan}
    lost = sorted(set(trained or ()) - held)
    if lost:
        return [], (), f"save_adapter: no stage holds the trained parameters {lost[:5]}"
    return plan, hypers.pop(), None


def _agree(error: str | None, world) -> None:
    errors = [e for e in comm.all_gather_object(error, world) if e]
    if errors:
        raise RuntimeError(f"save_adapter failed: {errors[0]}")


def save_adapter(
    model: nn.Module,
    path: str | Path,
    *,
    ctx=None,
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
    trained: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    notes: dict | None = None,
) -> None:
    """Write the model's adapters (all stages, all tp shards) to directory ``path`` in PEFT's
    format; collective. ``trained``: base parameters also written (``modules_to_save``; default:
    every trainable non-adapter parameter). ``dtype``: of the written tensors (default: as held,
    fp32 for adapters). ``base_model_name_or_path`` defaults to the checkpoint the model came
    from. ``notes`` (e.g. the LoRA report's ``skipped`` modules) go to ``parallax_adapter.json``.
    """
    ctx = ctx if ctx is not None else getattr(model, "ctx", None)
    path = Path(path)
    world = None if ctx is None else ctx.world_group
    rank = 0 if ctx is None else ctx.rank
    plan, hyper, error = _stage_plan(model, ctx, trained)
    if error:
        raise ValueError(error)
    params = dict(model.named_parameters())
    tmp, writer, failure = None, None, None
    if rank == 0:
        try:
            tmp = temp_sibling(path)
            tmp.mkdir(parents=True)
            entries = [(k, s, dtype or _DTYPES[d]) for _, _, ps, _, d in plan for k, s in ps]
            writer = SafetensorsWriter(tmp / ADAPTER_WEIGHTS, entries)
        except OSError as err:
            failure = f"rank 0 could not start writing {path}: {err}"
    for stage, name, pieces, shape, dt in plan:
        full = full_on_rank0(params, name, stage, shape, dtype or _DTYPES[dt], ctx)
        if writer is not None and failure is None:
            try:
                for (key, piece), t in zip(pieces, full.split(pieces[0][1][0], dim=0)):
                    writer.write(key, t.reshape(piece).to(dtype or t.dtype))
            except (OSError, RuntimeError) as err:
                failure = f"writing {name}: {err}"
        full = None  # one tensor at a time
    if rank == 0:
        if failure is None:
            try:
                writer.close()
                config = _config(model, plan, hyper, base_model_name_or_path, task_type)
                atomic_write_json(tmp / ADAPTER_CONFIG, config)
                atomic_write_json(tmp / NOTES, _notes(notes))
                fsync_dir(tmp)
                publish_dir(tmp, path)
                log.info("saved %d adapter tensors to %s", len(writer.order), path)
            except OSError as err:
                failure = f"finishing {path}: {err}"
        if failure is not None:
            if writer is not None:
                writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(failure, world)


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def full_on_rank0(
    params: dict, name: str, stage: int, shape, dtype: torch.dtype, ctx
) -> torch.Tensor | None:
    """The full logical tensor of parameter ``name`` (held by pipeline ``stage``) on global
    rank 0, in ``dtype`` (gathered over tp by the stage's dp-0 ranks, sent from its tp rank 0);
    ``None`` elsewhere. Collective over the stage's tp group and rank 0."""
    if ctx is None or ctx.world_size == 1:
        return params[name].detach().to(dtype)
    pp, dp, tp = ctx.dims.coords(ctx.rank)
    if pp == stage and dp == 0:
        info = getattr(params[name], "tp_shard", None)
        p = params[name].detach()
        full = (p if info is None else unshard_tensor(p, info, ctx.tp_group)).to(dtype)
        if tp == 0 and ctx.rank != 0:
            comm.batch_send_recv([(full.contiguous(), 0)], [], ctx.world_group)
        return full if ctx.rank == 0 else None
    if ctx.rank == 0:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
        comm.batch_send_recv([], [(buf, ctx.dims.rank(stage, 0, 0))], ctx.world_group)
        return buf
    return None


def _config(model, plan, hyper, base: str | None, task_type: str | None) -> dict:
    r, alpha, dropout = hyper
    targets, saved = set(), set()
    for _, name, pieces, _, _ in plan:
        keys = [k[len(PREFIX) :] for k, _ in pieces]
        if is_adapter_name(name):
            targets.update(k.rsplit(".", 2)[0] for k in keys)  # drop .lora_A.weight
        else:
            saved.update(k.rpartition(".")[0] for k in keys)  # the tensor's module
    if base is None:
        base = getattr(getattr(model, "config", None), "source", None)
    return adapter_config(
        r,
        alpha,
        dropout,
        sorted(targets),
        base_model_name_or_path=None if base is None else str(base),
        task_type=task_type,
        modules_to_save=sorted(saved) or None,
    )


def _notes(notes: dict | None) -> dict:
    out = {
        "written_by": "parallax",
        "adapters": "A ~ N(0, 1/r) from the seed and the module name, B = 0 (PEFT's gaussian)",
        "merge": "a merged export adds (alpha/r) B A to each weight in fp32, rounded once",
    }
    out.update(notes or {})
    return out
