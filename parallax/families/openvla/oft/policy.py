"""An OpenVLA-OFT policy from what a run wrote: a parallax training checkpoint or an export.

- A **training checkpoint** (``OUT`` or ``OUT/checkpoints/step_N``) holds layout-free tensors
  and the run's flags and model config: the model is rebuilt as the run built it (the base
  from ``--model``: a preset's seeded init or the checkpoint it read; LoRA adapters as the
  run put them), then every tensor the checkpoint holds is read (a LoRA run's: the adapters
  and the fully trained modules). The statistics come from ``OUT/dataset_statistics.json``.
- An **export** (``OUT/hf``: :mod:`.export`) is read by :meth:`OpenVLA.from_pretrained`
  (its ``config.json`` names the OFT options; the head, projector and FiLM files beside it).
- **OFT's own release** (a ``config.json`` without parallax's OFT section, beside
  ``action_head--{step}_checkpoint.pt`` and the rest: :mod:`.released`) likewise, its options
  from the files' shapes and from the keyword arguments where the files cannot tell.

A head, projector or FiLM file an OFT checkpoint lacks is refused, naming it: never a random
head.

Either loads at any tp and pp (``ctx``): each rank reads only its stage's tensors, sliced.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from parallax.checkpoint import Checkpoint, latest_checkpoint, load_module
from parallax.context import ParallelContext
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.oft.released import check_given
from parallax.models.stages import partition
from parallax.recipe import registry, resolve
from parallax.recipe.adapt import build_chunk
from parallax.run import Run, TrainConfig

# the run's flags this needs, and their defaults when an old checkpoint lacks them
FLAGS = {
    "model": "tiny", "seed": 0, "finetune": "full", "lora_rank": 32, "lora_alpha": 16.0,
    "lora_dropout": 0.0, "lora_targets": "all-linear", "train": None, "freeze": None,
    "freeze_vision": False, "pad_to_multiple_of": 1, "action_head": "l1", "action_chunk": None,
    "film": False, "quantize_base": None,
}  # fmt: skip
# load_policy's keywords, in its order: OFT's options its release files cannot tell, or checks
RELEASE_OPTIONS = ("chunk", "num_images", "action_dim", "proprio_dim", "film", "normalization")


def load_policy(
    path: str | Path,
    ctx: ParallelContext | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    chunk: int | None = None,
    num_images: int | None = None,
    action_dim: int | None = None,
    proprio_dim: int | None = None,
    film: bool | None = None,
    normalization: str | None = None,
) -> OpenVLA:
    """The :class:`~parallax.families.openvla.OpenVLA` of a checkpoint, an export or OFT's own
    release (module doc). The keyword arguments are OFT's options: what OFT's files cannot tell
    (``chunk``, ``num_images``; ``normalization`` ``"q99"``, the default, or ``"bounds"``
    for OFT's min/max, ALOHA's), or checks (any option a checkpoint contradicts is refused)."""
    path = Path(path)
    named = zip(RELEASE_OPTIONS, (chunk, num_images, action_dim, proprio_dim, film, normalization))
    given = {k: v for k, v in named if v is not None}
    if (path / "config.json").is_file():
        return OpenVLA.from_pretrained(path, ctx, dtype=dtype, oft=given)
    model = _from_training_checkpoint(path, ctx or ParallelContext.local(), dtype)
    check_given(model.config, given, path)
    return model


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
    run = _saved_run(ckpt, out)
    config = run.model_config
    blocks = range(len(run.recipe.model.blocks(config)))
    if ctx.pp_size > 1:
        costs = [b.cost for b in run.recipe.model.blocks(config)]
        blocks = partition(costs, ctx.pp_size)[ctx.pp_rank]
    # the base as the run built it (a preset's seeded init or the checkpoint it read), adapted
    # as the run adapted it: what trained is what the checkpoint holds
    model, report = build_chunk(
        run, blocks, ctx, dtype=dtype, device=ctx.device, checkpoint=run.checkpoint
    )
    only = None
    if report is not None:
        only = {n for n, p in model.named_parameters() if p.requires_grad}.__contains__
    load_module(model, ckpt, only=only)
    stats = out / "dataset_statistics.json"
    if stats.is_file():
        model.config = dataclasses.replace(model.config, norm_stats=json.loads(stats.read_text()))
    return model.eval()


def _saved_run(ckpt: Checkpoint, out: Path) -> Run:
    """The run that wrote ``ckpt``, resolved again from its saved flags and model config: the
    separate q/k/v and gate/up the checkpoint stores, no recomputation, the head on the
    labelled rows."""
    saved = {k: ckpt.meta["config"].get(k, v) for k, v in FLAGS.items()}
    cfg = TrainConfig.of(**saved, out=str(out), logits="labelled", fused_projections=False)
    recipe = registry.recipe(ckpt.meta.get("family", "openvla"))
    name = registry.strip_family(cfg.model, recipe)
    base = recipe.model.resolve(name).checkpoint
    config = OpenVLAConfig.from_dict(ckpt.meta["model_config"])
    return resolve(cfg, recipe=recipe, model_config=config, checkpoint=base)
