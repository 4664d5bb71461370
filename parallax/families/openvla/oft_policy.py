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

import dataclasses
import fnmatch
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from parallax.checkpoint import Checkpoint, latest_checkpoint, load_module
from parallax.context import ParallelContext
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.models.stages import partition
from parallax.recipe import registry
from parallax.tensor.lora_apply import apply_lora, is_adapter_name

# the run's flags this needs, and their defaults when an old checkpoint lacks them
FLAGS = {
    "model": "tiny", "seed": 0, "finetune": "full", "lora_rank": 32, "lora_alpha": 16.0,
    "lora_dropout": 0.0, "lora_targets": "all-linear", "train": None, "action_head": "l1",
}  # fmt: skip


def load_policy(
    path: str | Path, ctx: ParallelContext | None = None, dtype: torch.dtype = torch.float32
) -> OpenVLA:
    """The :class:`~parallax.families.openvla.OpenVLA` of a checkpoint or export (module doc)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return OpenVLA.from_pretrained(path, ctx, dtype=dtype)
    return _from_training_checkpoint(path, ctx or ParallelContext.local(), dtype)


def _checkpoint_dir(path: Path) -> tuple[Path, Path]:
    """``(the checkpoint's step directory, the run's --out)``."""
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


def _from_training_checkpoint(path: Path, ctx: ParallelContext, dtype: torch.dtype) -> OpenVLA:
    step_dir, out = _checkpoint_dir(path)
    ckpt = Checkpoint(step_dir)
    run = SimpleNamespace(**{k: ckpt.meta["config"].get(k, v) for k, v in FLAGS.items()})
    run.checkpointing, run.logits = False, "labelled"
    recipe = registry.recipe(ckpt.meta.get("family", "openvla"))
    # separate q/k/v and gate/up: the names the checkpoint stores
    config = OpenVLAConfig.from_dict(ckpt.meta["model_config"])
    config = config.with_options(fused_projections=False)
    family, sep, rest = run.model.partition(":")
    base = recipe.resolve(rest if sep and family == recipe.name else run.model).checkpoint
    blocks = range(len(recipe.blocks(config)))
    if ctx.pp_size > 1:
        blocks = partition([b.cost for b in recipe.blocks(config)], ctx.pp_size)[ctx.pp_rank]
    model = recipe.build(
        config, blocks, ctx, cfg=run, dtype=dtype, device=ctx.device, checkpoint=base
    )
    only = None
    if run.finetune == "lora":  # the adapters as the run put them, the base as it built it
        apply_lora(
            model, run.lora_targets, rank=run.lora_rank, alpha=run.lora_alpha,
            dropout=run.lora_dropout, seed=run.seed, exclude=recipe.lora_exclude,
        )  # fmt: skip
        globs = [*(run.train.split(",") if run.train else ()), *recipe.fully_trained(run)]
        _train_whole(model, globs)
        only = {n for n, p in model.named_parameters() if p.requires_grad}.__contains__
    load_module(model, ckpt, only=only)
    stats = out / "dataset_statistics.json"
    if stats.is_file():
        model.config = dataclasses.replace(model.config, norm_stats=json.loads(stats.read_text()))
    return model.eval()


def _train_whole(model: OpenVLA, globs: list[str]) -> None:
    """Mark the parameters of the modules ``globs`` select (the module or any module above
    it, whole or as a dotted tail: ``--train``'s rule) as trained: what the checkpoint holds."""

    def hit(owner: str) -> bool:
        return any(
            fnmatch.fnmatchcase(owner, g) or fnmatch.fnmatchcase(owner, "*." + g) for g in globs
        )

    for name, p in model.named_parameters():
        parts = name.split(".")
        owners = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if not is_adapter_name(name) and any(hit(o) for o in owners):
            p.requires_grad_(True)
