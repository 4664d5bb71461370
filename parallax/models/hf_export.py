"""Write a model (all pipeline stages, all tp shards) as a Hugging Face checkpoint.

The names come from the model's ``checkpoint_layout()``, which each family gives
(:class:`parallax.families.openvla.checkpoint.OpenVLATensors`, LLaVA-NeXT's layouts): an
object with ``tensors(name, logical_shape)`` (the checkpoint tensors whose dim-0
concatenation, viewed to the parameter's shape, is the parameter), ``unused()`` (checkpoint-only
tensors, written from ``model.hf_unused``) and ``expected()`` (every parameter tensor).

Each stage's (dp 0, tp 0) rank writes that stage's own shard files, gathering one parameter at a
time over tp and streaming it to disk, so no writer ever holds more than one full tensor; the
file plan (which tensor goes to which file) is computed identically on every rank from the
stages' tensor lists. Rank 0 then writes the index and config.json.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from parallax import comm
from parallax.models.hf_io import INDEX, SINGLE
from parallax.models.safetensors_io import (
    Group,
    parse_size,
    stream_file,
    write_bytes_atomic,
    write_json_atomic,
)
from parallax.tensor import logical_shape, unshard_tensor
from parallax.tensor.lora_apply import base_parameters, merged_value

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
AUX_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "configuration_prismatic.py",
    "modeling_prismatic.py",
    "processing_prismatic.py",
    "chat_template.json",
)


def _layout(model):
    """The model's checkpoint names (``checkpoint_layout()``: see the module docstring)."""
    make = getattr(model, "checkpoint_layout", None)
    if make is None:
        raise TypeError(f"{type(model).__name__} has no checkpoint_layout(): no HF layout to write")
    return make()


def plan_files(
    stage_groups: list[list[list]], max_bytes: int, itemsize: int
) -> list[tuple[int, list]]:
    """Files as ``(stage, [group, ...])``; a group (one parameter's tensors) never straddles
    files, and no file holds two stages' tensors."""
    files = []
    for stage, groups in enumerate(stage_groups):
        current, size = [], 0
        for group in groups:
            nbytes = sum(itemsize * math.prod(shape) for _, shape in group)
            if current and size + nbytes > max_bytes:
                files.append((stage, current))
                current, size = [], 0
            current.append(group)
            size += nbytes
        if current:
            files.append((stage, current))
    return files


def shard_names(n: int) -> list[str]:
    """The safetensors file names of a checkpoint in ``n`` files, as transformers names them."""
    return [SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def index_of(files: list[list[Group]], names: list[str], itemsize: int) -> dict:
    """The index of a sharded checkpoint: each tensor's file, in file order, and the size."""
    weight_map = {n: name for groups, name in zip(files, names) for g in groups for n, _ in g}
    total = sum(itemsize * math.prod(shape) for groups in files for g in groups for _, shape in g)
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def save_pretrained(
    model,
    path: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write ``model`` (all stages, all tp shards) as a Hugging Face OpenVLA checkpoint.

    Collective: call on every rank. Each stage's (dp 0, tp 0) rank writes that stage's shard
    files while its tp peers help gather; rank 0 writes the index, config.json (with
    norm_stats), dataset_statistics.json and copies the tokenizer and processor files of the
    checkpoint the model came from. A writer holds one full parameter at a time. A model
    with LoRA adapters is written merged: each rank adds ``(alpha/r) B A`` to its own slice of
    each adapted weight in fp32 (rounded once, to ``dtype``), with no reload of the base.
    """
    ctx = model.ctx
    path = Path(path)
    rank = 0 if ctx is None else ctx.rank
    pp_rank, dp_rank, tp_rank = (0, 0, 0) if ctx is None else ctx.dims.coords(ctx.rank)
    world = None if ctx is None else ctx.world_group
    tp_group = None if ctx is None else ctx.tp_group
    itemsize = torch.empty((), dtype=dtype).element_size()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    comm.barrier(world)

    layout = _layout(model)
    params, groups = _rank_groups(model, layout)
    gathered = comm.all_gather_object((pp_rank, dp_rank, tp_rank, groups), world)
    by_stage = {pp: g for pp, dp, tp, g in gathered if dp == 0 and tp == 0}
    _check_complete(by_stage, layout)  # same verdict on every rank, before anything is written
    files = plan_files(
        [by_stage[s] for s in sorted(by_stage)], parse_size(max_shard_size), itemsize
    )
    names = shard_names(len(files))

    if dp_rank == 0:
        owners = {group[0][0]: name for name, group in zip(params, groups)}

        def parts_of(group: Group) -> list[torch.Tensor] | None:
            first = group[0][0]
            if first in owners:  # a parameter: gather over tp (every tp rank joins)
                param = params[owners[first]]
                info = getattr(param, "tp_shard", None)
                p = merged_value(model, owners[first], param)  # fp32 if adapted
                full = p if info is None else unshard_tensor(p, info, tp_group)
                return full.split(group[0][1][0], dim=0) if len(group) > 1 else [full]
            return [_unused_value(model, first, group[0][1])] if tp_rank == 0 else None

        for (stage, file_groups), file_name in zip(files, names):
            if stage == pp_rank:
                stream_file(path / file_name, file_groups, parts_of, dtype, tp_rank == 0)
    comm.barrier(world)
    if rank == 0:
        index = index_of([groups for _, groups in files], names, itemsize)
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        tensors = sum(len(g) for _, groups in files for g in groups)
        finish_checkpoint(path, model.config, names, index, AUX_FILES, tensors)
    comm.barrier(world)


def _rank_groups(model, layout) -> tuple[dict[str, torch.nn.Parameter], list[Group]]:
    """This rank's parameters that the layout stores, and the tensor groups of the checkpoint
    they become (then, with the vision towers, the checkpoint's unused tensors, one each)."""
    params = dict(base_parameters(model))  # LoRA adapters are merged in, not written
    groups = [layout.tensors(n, logical_shape(p)) for n, p in params.items()]
    # a parameter the layout stores nowhere (a module the family writes apart) is left out
    params = {n: p for (n, p), g in zip(params.items(), groups) if g}
    groups = [g for g in groups if g]
    unused = layout.unused() if model.has_vision else {}
    groups += [[(n, s)] for n, s in unused.items()]
    return params, groups


def _check_complete(by_stage: dict, layout) -> None:
    names = [n for s in sorted(by_stage) for g in by_stage[s] for n, _ in g]
    want = {**layout.expected(), **layout.unused()}
    counts = Counter(names)
    missing = [n for n in want if n not in counts]
    twice = sorted(n for n, c in counts.items() if c > 1)
    if missing or twice:
        raise ValueError(
            "save_pretrained: the pipeline stages do not hold the whole model exactly once "
            f"({len(missing)} tensors missing, e.g. {missing[:3]}; held twice: {twice[:3]}); "
            "build the stages from contiguous block ranges that cover every block"
        )


def _unused_value(model, name: str, shape) -> torch.Tensor:
    """The checkpoint-only tensor as loaded, or a neutral value for a model built from scratch
    (ones for norm weights, zeros otherwise): the model never reads it."""
    if name in model.hf_unused:
        return model.hf_unused[name]
    if re.search(r"norm\d?\.weight$", name):
        return torch.ones(shape)
    return torch.zeros(shape)


def finish_checkpoint(
    path: Path, config, names: list[str], index: dict, aux_files: Sequence[str], tensors: int
) -> None:
    """Rank 0's last writes once the shards ``names`` are on disk: the ``index`` (when there
    are several), no shards left of an earlier save with another count, config.json (and
    OpenVLA's statistics), and the tokenizer and processor files of the source checkpoint."""
    if len(names) > 1:
        write_json_atomic(path / INDEX, index)
    for stale in path.iterdir():  # shards of an earlier save with another shard count
        if (_SHARD_RE.match(stale.name) and stale.name not in names) or (
            stale.name == INDEX and len(names) == 1
        ):
            stale.unlink()
    write_json_atomic(path / "config.json", config.to_dict())
    if getattr(config, "norm_stats", None):
        write_json_atomic(path / "dataset_statistics.json", config.norm_stats)
    if config.source and Path(config.source).resolve() != path.resolve():
        for aux in aux_files:
            src = Path(config.source) / aux
            if src.is_file():
                write_bytes_atomic(path / aux, src.read_bytes())
    log.info("saved %d tensors in %d files to %s", tensors, len(names), path)
