"""LeRobot's pi0 / pi0.5 policy folder: ``config.json`` + ``model.safetensors`` (``shared/pi0.md``).

Key names: the SigLIP tower, the projector and the Gemma prefix model under
``model.paligemma_with_expert.paligemma.model.``, the expert under
``model.paligemma_with_expert.gemma_expert.model.``, the heads under ``model.``. parallax's
fused SigLIP ``qkv`` is LeRobot's ``q_proj``, ``k_proj``, ``v_proj`` stacked by rows; its
``pos_embed`` (1, n, w) is ``position_embedding.weight`` (n, w).

``config.json`` names only the Gemma variants, so widths and depths are read from the tensors'
shapes (a small checkpoint with the same names loads as itself): Gemma's head width from the
one key/value head's ``k_proj``, its query heads from ``q_proj``. SigLIP's head count is not in
any shape: it is read from the safetensors metadata (``vision_heads``, which parallax writes),
else taken as So400m's head width of 72. Each tp rank reads only its slices. The two
``lm_head`` tensors LeRobot saves never reach the actions: the prefix's is the tied embedding
(written from it), the expert's is copied from the folder the model was read from (zeros for a
model that was not read from one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from parallax.atomic import atomic_write_json
from parallax.families.pi0.config import GemmaConfig, Pi0Config
from parallax.families.pi0.model import Pi0Model
from parallax.families.pi0.processors import read_statistics, write_processors
from parallax.models.hf_io import CheckpointReader, read_param
from parallax.models.safetensors_io import SafetensorsWriter
from parallax.models.stage_export import stage_rows, to_first_stage
from parallax.models.vit_config import ViTConfig
from parallax.tensor import logical_shape, resolve_tp, unshard_tensor
from parallax.tensor.lora_apply import base_parameters, merged_value

P = "model.paligemma_with_expert."
VISION = P + "paligemma.model.vision_tower.vision_model."
LANGUAGE = P + "paligemma.model.language_model."
EXPERT = P + "gemma_expert.model."
PREFIX_HEAD, EXPERT_HEAD = P + "paligemma.lm_head.weight", P + "gemma_expert.lm_head.weight"
SO400M_HEAD_WIDTH = 72
TOWER = {"patch_embed.proj": "embeddings.patch_embedding", "norm": "post_layernorm"}
BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.proj": "self_attn.out_proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def _vision_keys(rest: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    if rest == "pos_embed":
        return [(VISION + "embeddings.position_embedding.weight", shape[1:])]
    owner, leaf = rest.rsplit(".", 1)
    if not owner.startswith("blocks."):
        return [(f"{VISION}{TOWER[owner]}.{leaf}", shape)]
    _, i, part = owner.split(".", 2)
    base = f"{VISION}encoder.layers.{i}."
    if part == "attn.qkv":
        rows = (shape[0] // 3, *shape[1:])
        return [(f"{base}self_attn.{x}_proj.{leaf}", rows) for x in "qkv"]
    return [(f"{base}{BLOCK[part]}.{leaf}", shape)]


def lerobot_keys(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors ``(key, shape)`` parameter ``name`` (logical ``shape``) is."""
    if name.startswith("vision."):
        return _vision_keys(name.removeprefix("vision."), shape)
    if name.startswith("projector."):
        return [(P + "paligemma.model.multi_modal_projector.linear." + name[10:], shape)]
    if name.startswith("layers."):
        _, i, stream, rest = name.split(".", 3)
        return [(f"{LANGUAGE if stream == 'prefix' else EXPERT}layers.{i}.{rest}", shape)]
    if name.startswith(("embed_tokens.", "norm.")):
        return [(LANGUAGE + name, shape)]
    if name.startswith("expert_norm."):
        return [(EXPERT + "norm." + name.removeprefix("expert_norm."), shape)]
    return [("model." + name, shape)]  # the suffix heads


def _depth(shapes, prefix: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(found) + 1 if found else 0


def _gemma(shapes, base: str, vocab: int) -> GemmaConfig:
    layer = f"{base}layers.0."
    head_dim = shapes[layer + "self_attn.k_proj.weight"][0]  # one key/value head
    return GemmaConfig(
        width=shapes[layer + "mlp.down_proj.weight"][0],
        depth=_depth(shapes, base + "layers."),
        heads=shapes[layer + "self_attn.q_proj.weight"][0] // head_dim,
        head_dim=head_dim,
        mlp_hidden=shapes[layer + "mlp.gate_proj.weight"][0],
        vocab_size=vocab,
    )


def _vision(shapes, heads: int | None) -> ViTConfig:
    w, _, patch, _ = shapes[VISION + "embeddings.patch_embedding.weight"]
    n = shapes[VISION + "embeddings.position_embedding.weight"][0]
    return ViTConfig(
        image_size=round(n**0.5) * patch,
        patch_size=patch,
        width=w,
        depth=_depth(shapes, VISION + "encoder.layers."),
        num_heads=heads or w // SO400M_HEAD_WIDTH,
        mlp_hidden=shapes[VISION + "encoder.layers.0.mlp.fc1.weight"][0],
        class_token=False,
        final_norm=True,
        act="gelu_tanh",
        pool="none",
    )


def config_from_folder(path: str | Path) -> Pi0Config:
    """The config of a LeRobot policy folder (module doc)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.get("type") not in ("pi0", "pi05"):
        raise ValueError(f"{path}/config.json: type {raw.get('type')!r} is not pi0 or pi05")
    reader = CheckpointReader(path)
    shapes = reader.shapes()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        heads = (f.metadata() or {}).get("vision_heads")
    cameras = [k for k, v in raw.get("input_features", {}).items() if v.get("type") == "VISUAL"]
    return Pi0Config(
        variant=raw["type"],
        vision=_vision(shapes, int(heads) if heads else None),
        prefix=_gemma(shapes, LANGUAGE, shapes[LANGUAGE + "embed_tokens.weight"][0]),
        expert=_gemma(shapes, EXPERT, 0),
        chunk=int(raw["chunk_size"]),
        max_action_dim=shapes["model.action_in_proj.weight"][1],
        max_state_dim=int(raw.get("max_state_dim", 32)),
        num_cameras=max(1, len(cameras) + int(raw.get("empty_cameras", 0))),
        text_length=int(raw.get("tokenizer_max_length", 48)),
        num_steps=int(raw.get("num_inference_steps", 10)),
        source=str(path),
        lerobot=raw,
    )


@torch.no_grad()
def load_model(path, ctx=None, *, blocks=None, dtype=torch.float32, device=None) -> Pi0Model:
    """A :class:`Pi0Model` (whole, or the chunk of ``blocks``) from a LeRobot policy folder,
    each tp rank reading its slices."""
    config = config_from_folder(path)
    model = Pi0Model(config, ctx, blocks=blocks, dtype=dtype, device=device)
    reader = CheckpointReader(path)
    present = reader.shapes()
    for name, p in model.named_parameters():
        sources = lerobot_keys(name, logical_shape(p))
        for key, shape in sources:
            if present.get(key) != shape:
                raise ValueError(f"{path}: {key} has shape {present.get(key)}, expected {shape}")
        value = read_param(reader, sources, getattr(p, "tp_shard", None))
        p.copy_(value.reshape(p.shape))
    model.statistics = read_statistics(path)  # the processor files' (None: none there)
    return model


def lerobot_config(config: Pi0Config, statistics: dict | None = None) -> dict:
    """``config.json`` of a policy folder: the one it was read from with the sizes updated, or
    a minimal one LeRobot's config reader takes; with the ``statistics`` the run normalised by
    (a ``norm_stats`` entry), the state and action features take the data's widths."""
    raw = dict(config.lerobot or {})
    raw.update(
        type=config.variant,
        chunk_size=config.chunk,
        max_state_dim=config.max_state_dim,
        max_action_dim=config.max_action_dim,
        tokenizer_max_length=config.text_length,
        num_inference_steps=config.num_steps,
    )
    raw.setdefault("paligemma_variant", "gemma_2b")
    raw.setdefault("action_expert_variant", "gemma_300m")
    raw.setdefault("n_action_steps", config.chunk)
    size = config.vision.image_size
    raw.setdefault("image_resolution", [size, size])
    raw.setdefault(
        "input_features",
        {
            f"observation.images.camera{i}": {"type": "VISUAL", "shape": [3, size, size]}
            for i in range(config.num_cameras)
        },
    )
    if statistics is not None:
        return _data_features(raw, statistics)
    return raw


FEATURES = {"proprio": ("observation.state", "STATE"), "action": ("action", "ACTION")}


def _data_features(raw: dict, statistics: dict) -> dict:
    """``raw`` with ``observation.state`` and ``action`` shaped as the data the statistics
    describe (a fine-tune on other data changes them)."""
    inputs = dict(raw.get("input_features") or {})
    outputs = dict(raw.get("output_features") or {})
    widths = {k: len(next(iter(v.values()))) for k, v in statistics.items() if k in FEATURES}
    for what, width in widths.items():
        key, kind = FEATURES[what]
        where = inputs if kind == "STATE" else outputs
        where[key] = {"type": kind, "shape": [width]}
    return {**raw, "input_features": inputs, "output_features": outputs}


@torch.no_grad()
def save_policy(model: Pi0Model, path: str | Path, ctx=None, dtype=None, statistics=None) -> None:
    """Write ``model`` as a LeRobot policy folder: a whole model, or under a pipeline every
    stage's chunk (collective over the tp and pp groups; rank 0 writes, the later stages'
    tensors reaching it one at a time: :mod:`parallax.models.stage_export`), LoRA adapters
    merged (``W + (alpha/r) B A`` in fp32, rounded once to the parameter's dtype); each tensor
    in ``dtype`` or its parameter's. The file is the one a single process writes.
    ``statistics`` (a ``norm_stats`` entry; default the model's own, read with it) go into
    LeRobot's processor files (:mod:`.processors`)."""
    path = Path(path)
    stats = getattr(model, "statistics", None) if statistics is None else statistics
    group, tp_rank, _ = resolve_tp(ctx)
    writing = tp_rank == 0 and (ctx is None or getattr(ctx, "rank", 0) == 0)
    params = list(base_parameters(model))  # LoRA adapters are merged in, in fp32
    rows = [
        (k, s, dtype or p.dtype) for n, p in params for k, s in lerobot_keys(n, logical_shape(p))
    ]
    stages = stage_rows(rows, ctx)  # every stage's, in stage order
    config = model.config
    writer, kept = None, {}
    if writing:
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path / "config.json", lerobot_config(config, stats))
        if stats is not None:
            write_processors(path, config, stats)
        embed = dict(params)["embed_tokens.weight"]
        head = dtype or embed.dtype
        extras = [(PREFIX_HEAD, tuple(logical_shape(embed)), head)]
        extras.append((EXPERT_HEAD, (config.prefix.vocab_size, config.expert.width), head))
        meta = {"format": "pt", "vision_heads": str(config.vision.num_heads)}
        writer = SafetensorsWriter(path / "model.safetensors", sum(stages, []) + extras, meta)
    device = next(model.parameters()).device
    try:
        tensors = _merged_tensors(model, params, group, rows, kept if writing else None)
        for key, t in to_first_stage(tensors, ctx, stages, device):
            if writer is not None:
                writer.write(key, t)
        if writer is not None:
            writer.write(PREFIX_HEAD, kept["embed"].to(head))
            writer.write(EXPERT_HEAD, _expert_head(config, extras[1][1], head))
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


def _merged_tensors(model, params, group, rows, kept: dict | None):
    """This chunk's checkpoint tensors ``(key, tensor)`` in ``rows``' order and dtypes, each
    parameter merged with its adapter and gathered over tp; ``kept["embed"]``: the whole
    embedding (the prefix's ``lm_head``), where ``kept`` is given."""
    dtype_of = {k: d for k, _, d in rows}
    for name, p in params:
        value, info = merged_value(model, name, p), getattr(p, "tp_shard", None)
        full = value if info is None else unshard_tensor(value, info, group)  # over tp
        if name == "embed_tokens.weight" and kept is not None:
            kept["embed"] = full
        parts = lerobot_keys(name, tuple(full.shape))
        pieces = full.split([s[0] for _, s in parts]) if len(parts) > 1 else [full]
        for (key, shape), t in zip(parts, pieces):
            yield key, t.reshape(shape).to(dtype_of[key])


def _expert_head(config: Pi0Config, shape, dtype) -> torch.Tensor:
    """The expert's unused ``lm_head``: from the folder the model was read from, else zeros."""
    source = Path(config.source) if config.source else None
    if source is not None and (source / "model.safetensors").is_file():
        reader = CheckpointReader(source)
        if EXPERT_HEAD in reader.weight_map:
            return reader.read(EXPERT_HEAD).to(dtype)
    return torch.zeros(shape, dtype=dtype)
