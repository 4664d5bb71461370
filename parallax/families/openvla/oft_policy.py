"""An OpenVLA-OFT policy from what a run wrote: a parallax training checkpoint or an export.

- A **training checkpoint** (``OUT`` or ``OUT/checkpoints/step_N``) holds layout-free tensors
  and the run's flags and model config: the model is rebuilt as the run built it (the base
  from ``--model``: a preset's seeded init or the checkpoint it read; LoRA adapters as the
  run put them), then every tensor the checkpoint holds is read (a LoRA run's: the adapters
  and the fully trained modules). The statistics come from ``OUT/dataset_statistics.json``.
- An **export** (``OUT/hf``: :mod:`.oft_export`) is read by :meth:`OpenVLA.from_pretrained`
  (its ``config.json`` names the OFT options; the head, projector and FiLM files beside it).

Either loads at any tp and pp (``ctx``): each rank reads only its stage's tensors, sliced.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallax.context import ParallelContext


def load_policy(
    path: str | Path, ctx: ParallelContext | None = None, dtype: torch.dtype = torch.float32
):
    """The :class:`~parallax.families.openvla.OpenVLA` of a checkpoint or export (module doc)."""
    from parallax.families.openvla.model import OpenVLA

    path = Path(path)
    if (path / "config.json").is_file():
        return OpenVLA.from_pretrained(path, ctx, dtype=dtype)
    return _from_training_checkpoint(path, ctx, dtype)


def _checkpoint_dir(path: Path) -> tuple[Path, Path]:
    """``(the checkpoint's step directory, the run's --out)``."""
    from parallax.checkpoint import latest_checkpoint

    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"{path}/checkpoints holds no complete checkpoint")
        return latest, path
    if (path / "meta.json").is_file():
        return path, path.parent.parent
    raise FileNotFoundError(
        f"{path} is neither an export (config.json), a run's --out (checkpoints/) nor a "
        "checkpoint directory (meta.json)"
    )


def _from_training_checkpoint(path: Path, ctx, dtype: torch.dtype):
    from parallax.checkpoint import Checkpoint, load_module
    from parallax.families.openvla.config import OpenVLAConfig
    from parallax.recipe import registry
    from parallax.train import lora
    from parallax.train.config import TrainConfig
    from parallax.train.names import SeparateView

    step_dir, out = _checkpoint_dir(path)
    ckpt = Checkpoint(step_dir)
    meta = ckpt.meta
    cfg = TrainConfig(
        **{k: v for k, v in meta["config"].items() if k in TrainConfig.__annotations__}
    )
    recipe = registry.recipe(meta.get("family", "openvla"))
    config = OpenVLAConfig.from_dict(meta["model_config"])
    family, sep, rest = cfg.model.partition(":")
    spec = recipe.resolve(rest if sep and family == recipe.name else cfg.model)
    ctx = ctx or ParallelContext.local()
    blocks = range(len(recipe.blocks(config)))
    if ctx.pp_size > 1:
        from parallax.models.stages import partition

        blocks = partition([b.cost for b in recipe.blocks(config)], ctx.pp_size)[ctx.pp_rank]
    cfg.activation_checkpointing = False
    model = recipe.build(
        config, blocks, ctx, cfg=cfg, dtype=dtype, device=ctx.device, checkpoint=spec.checkpoint
    )
    only = None
    if lora.enabled(cfg):
        lora.prepare(model, cfg, recipe)
        only = {n for n, p in model.named_parameters() if p.requires_grad}.__contains__
    load_module(model, SeparateView(ckpt), only=only)
    stats = out / "dataset_statistics.json"
    if stats.is_file():
        import dataclasses

        model.config = dataclasses.replace(model.config, norm_stats=json.loads(stats.read_text()))
    model.eval()
    return model
