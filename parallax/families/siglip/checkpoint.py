"""Read and write the Hugging Face ``SiglipModel`` / ``CLIPModel`` checkpoint layouts.

:func:`hf_sources` names, for each parallax parameter, the checkpoint tensors it is made of:
one tensor, reshaped where the layouts differ (``pos_embed (1, N, w)`` is
``position_embedding.weight (N, w)``; CLIP's ``class_embedding`` and ``logit_scale`` have fewer
dims), or the three ``q_proj | k_proj | v_proj`` tensors stacked into the fused ``qkv`` weight.
The MAP head keeps the names of its ``nn.MultiheadAttention`` (``in_proj_weight``...).

Loading checks the whole checkpoint's names and shapes from the file headers on every rank (a
bad checkpoint fails identically everywhere, before any collective), then each rank reads only
its tp slice of each tensor (``safe_open(...).get_slice``). Saving gathers one parameter at a
time over tp and streams it to disk from rank 0.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import torch
from torch import nn

from parallax import comm
from parallax.families.siglip.config import SiglipConfig
from parallax.models.hf_export import finish_checkpoint, index_of, plan_files, shard_names
from parallax.models.hf_io import CheckpointReader, fit_problems, read_param
from parallax.models.meta import materialize
from parallax.models.safetensors_io import Group, parse_size, stream_file
from parallax.tensor import logical_shape, unshard_tensor

log = logging.getLogger(__name__)

IGNORED = re.compile(r".*position_ids$")  # buffers some older checkpoints persisted
AUX_FILES = (
    "spiece.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
)
_BLOCK = [
    ("norm1.", "layer_norm1."),
    ("norm2.", "layer_norm2."),
    ("attn.proj.", "self_attn.out_proj."),
    ("mlp.fc1.", "mlp.fc1."),
    ("mlp.fc2.", "mlp.fc2."),
]


def _block(name: str, prefix: str) -> str:
    for ours, theirs in _BLOCK:
        if name.startswith(ours):
            return prefix + theirs + name[len(ours) :]
    raise KeyError(name)


def _one(name: str, family: str) -> str:
    """The checkpoint name of a parameter that is one tensor."""
    clip = family == "clip"
    fixed = {
        "vision.trunk.patch_embed.proj.weight": "vision_model.embeddings.patch_embedding.weight",
        "vision.trunk.patch_embed.proj.bias": "vision_model.embeddings.patch_embedding.bias",
        "vision.trunk.pos_embed": "vision_model.embeddings.position_embedding.weight",
        "vision.trunk.cls_token": "vision_model.embeddings.class_embedding",
        "text.token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "text.position_embedding": "text_model.embeddings.position_embedding.weight",
        "vision.head.weight": "visual_projection.weight",
        "text.head.weight": "text_projection.weight" if clip else "text_model.head.weight",
        "text.head.bias": "text_model.head.bias",
        "logit_scale": "logit_scale",
        "logit_bias": "logit_bias",
    }
    if name in fixed:
        return fixed[name]
    for ours, theirs in (
        ("vision.trunk.norm_pre.", "vision_model.pre_layrnorm."),
        ("vision.trunk.norm.", "vision_model.post_layernorm."),
        ("vision.post_layernorm.", "vision_model.post_layernorm."),
        ("vision.head.", "vision_model.head."),
        ("text.final_layer_norm.", "text_model.final_layer_norm."),
    ):
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    m = re.fullmatch(r"(vision\.trunk|text)\.blocks\.(\d+)\.(.*)", name)
    if m:
        tower = "vision_model" if m.group(1) == "vision.trunk" else "text_model"
        return _block(m.group(3), f"{tower}.encoder.layers.{m.group(2)}.")
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def _hf_shape(name: str, shape: tuple[int, ...], family: str) -> tuple[int, ...]:
    if name.endswith(("pos_embed", "cls_token")):
        return tuple(shape[-2:]) if name.endswith("pos_embed") else (shape[-1],)
    if name == "logit_scale" and family == "clip":
        return ()
    return tuple(shape)


def hf_sources(name: str, shape: tuple[int, ...], family: str) -> list[tuple[str, tuple]]:
    """``[(checkpoint name, shape), ...]`` whose row-wise concatenation is parameter ``name``
    of logical ``shape`` (after a reshape to ``shape``)."""
    m = re.fullmatch(r"(vision\.trunk|text)\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)", name)
    if m:
        tower = "vision_model" if m.group(1) == "vision.trunk" else "text_model"
        base = f"{tower}.encoder.layers.{m.group(2)}.self_attn"
        rows = (shape[0] // 3, *shape[1:])
        return [(f"{base}.{p}_proj.{m.group(3)}", rows) for p in "qkv"]
    return [(_one(name, family), _hf_shape(name, shape, family))]


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a whole ``model`` (built on meta, tp 1) reads, with its shape."""
    out = {}
    for name, p in model.named_parameters():
        out.update(hf_sources(name, tuple(p.shape), model.config.family))
    return out


def validate_checkpoint(reader: CheckpointReader, model: nn.Module) -> None:
    """Raise one ``ValueError`` naming every missing, mis-shaped or unexpected tensor for the
    whole ``model`` (on meta)."""
    config = model.config
    problems = fit_problems(reader.shapes(), expected_tensors(model), ignored=IGNORED.match)
    if problems:
        raise ValueError(
            f"checkpoint {reader.path} does not fit the {config.family} model of its "
            "config.json: " + "; ".join(problems)
        )


def load_pretrained(
    cls,
    path: str | Path,
    ctx=None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    config: SiglipConfig | None = None,
    **model_kwargs,
):
    """Build ``cls(config, ctx)`` on meta and fill it with this rank's slice of each tensor."""
    t0 = time.perf_counter()
    config = config or SiglipConfig.from_pretrained(path)
    reader = CheckpointReader(path)
    validate_checkpoint(reader, cls(config, None, device="meta"))
    model = cls(config, ctx, dtype=dtype, device="meta", **model_kwargs)
    materialize(model, device or (ctx.device if ctx is not None else "cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            sources = hf_sources(name, logical_shape(param), config.family)
            if sources[0][1] == ():  # CLIP's 0-d logit_scale: safetensors cannot slice it
                piece = reader.handle(reader.weight_map[sources[0][0]]).get_tensor(sources[0][0])
            else:
                piece = read_param(reader, sources, getattr(param, "tp_shard", None))
            param.copy_(piece.reshape(param.shape))
    reader.stats.seconds = time.perf_counter() - t0
    model.load_stats = reader.stats
    return model


def save_pretrained(
    model, path: str | Path, *, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
) -> None:
    """Write ``model`` as a Hugging Face checkpoint (collective: call on every rank).

    The dp-rank-0 tp group gathers one parameter at a time and rank 0 streams it into
    safetensors shards; rank 0 then writes the index, config.json and the tokenizer files of
    the checkpoint the model came from. ``dtype``: the parameters' own by default.
    """
    ctx, config = model.ctx, model.config
    path = Path(path)
    rank, dp_rank = (0, 0) if ctx is None else (ctx.rank, ctx.dp_rank)
    world, tp_group = (None, None) if ctx is None else (ctx.world_group, ctx.tp_group)
    params = list(model.named_parameters())
    dtype = dtype or params[0][1].dtype
    groups = [hf_sources(n, logical_shape(p), config.family) for n, p in params]
    itemsize = torch.empty((), dtype=dtype).element_size()
    files = [g for _, g in plan_files([groups], parse_size(max_shard_size), itemsize)]
    names = shard_names(len(files))
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dp_rank == 0:
        by_first = {g[0][0]: p for (_, p), g in zip(params, groups)}

        def parts_of(group: Group) -> list[torch.Tensor]:
            param = by_first[group[0][0]]
            info = getattr(param, "tp_shard", None)
            p = param.detach()
            full = p if info is None else unshard_tensor(p, info, tp_group)
            return full.chunk(len(group)) if len(group) > 1 else [full]

        for file_groups, file_name in zip(files, names):
            stream_file(path / file_name, file_groups, parts_of, dtype, rank == 0)
    comm.barrier(world)
    if rank == 0:
        tensors = sum(len(g) for f in files for g in f)
        finish_checkpoint(path, config, names, index_of(files, names, itemsize), AUX_FILES, tensors)
    comm.barrier(world)
