"""Read and write the Hugging Face OpenVLA checkpoint layout (safetensors, bf16, sharded).

Parameter names are the checkpoint names, except fused projections: ``qkv_proj`` is stored as
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` as ``gate_proj``/``up_proj``. Loading: every
rank checks the whole checkpoint's names and shapes from the file headers (so a bad checkpoint
fails identically everywhere, before any collective), then reads only its own stage's tensors
and only its tp slice of each (``safe_open(...).get_slice``), so no rank ever holds the full
model. Tensors the model never uses (the towers' final ``norm``, SigLIP's ``attn_pool``, blocks
after the feature layer) are skipped on purpose; rank 0 keeps them to write them back.

Saving is in :mod:`parallax.models.hf_export`; the generic reading in
:mod:`parallax.models.hf_io`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.oft.export import load_oft_modules
from parallax.families.openvla.oft.head import is_oft_name
from parallax.families.openvla.oft.released import (
    check_given,
    is_oft_checkpoint,
    is_released,
    released_config,
)
from parallax.models.hf_io import CheckpointReader, fit_problems, hf_names, read_param
from parallax.models.meta import materialize
from parallax.models.vit import checkpoint_only_tensors
from parallax.tensor import logical_shape


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a whole ``model`` (built on meta, tp=1) reads, with its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        if not is_oft_name(name):  # OFT's modules live in files of their own (oft/export.py)
            out.update(hf_names(name, tuple(p.shape)))
    return out


def unused_tensors(config: OpenVLAConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors the model skips (and writes back for tools that load strictly)."""
    out = {}
    for prefix, cfg in zip(
        ("vision_backbone.featurizer.", "vision_backbone.fused_featurizer."), config.vision
    ):
        out.update({prefix + k: v for k, v in checkpoint_only_tensors(cfg).items()})
    return out


def validate_checkpoint(reader: CheckpointReader, model: nn.Module) -> dict:
    """Raise one ``ValueError`` naming every missing, mis-shaped or unexpected tensor for the
    whole ``model`` (on meta)."""
    present = reader.shapes()
    problems = fit_problems(present, expected_tensors(model), unused_tensors(model.config))
    if problems:
        raise ValueError(f"checkpoint {reader.path} does not fit the model: " + "; ".join(problems))
    return present


class OpenVLATensors:
    """OpenVLA's checkpoint names: what :func:`parallax.models.hf_export.save_pretrained` writes."""

    def __init__(self, config: OpenVLAConfig, cls: type[nn.Module]) -> None:
        self.config, self.cls = config, cls  # the model class, to list its parameters

    def tensors(self, name: str, shape) -> list:
        """The checkpoint tensors of a parameter; none for OFT's modules (written apart)."""
        return [] if is_oft_name(name) else hf_names(name, shape)

    def unused(self) -> dict:
        return unused_tensors(self.config)

    def expected(self) -> dict:
        return expected_tensors(self.cls(self.config, None, device="meta"))


def load_pretrained(
    cls,
    path: str | Path,
    ctx=None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    blocks: range | None = None,
    device: torch.device | str | None = None,
    fused_projections: bool = False,
    config: OpenVLAConfig | None = None,
    seed: int = 0,
    oft: Mapping | None = None,
    **model_kwargs,
):
    """Build ``cls(config, ctx, blocks=...)`` on meta and fill it from the checkpoint at ``path``.

    The result's ``load_stats`` tells what this rank read. ``model_kwargs`` go to the model
    (``activation_checkpointing``, ``freeze_vision``). An OpenVLA-OFT checkpoint, parallax's
    export (``parallax_oft`` in config.json) or OFT's own release (:mod:`.oft.released`: its
    options from the files and ``oft``, e.g. ``{"chunk": 8, "num_images": 2}``), reads its
    head, projector and FiLM from their files and refuses a missing one; only a plain OpenVLA
    checkpoint read with an OFT ``config`` (an OFT run's start) starts them from ``seed``'s
    layout-free init (:mod:`.oft.export`). ``oft`` the checkpoint contradicts is refused.
    """
    t0 = time.perf_counter()
    config = _checkpoint_config(path, config, oft or {})
    if fused_projections:
        config = config.with_options(fused_projections=True)
    reader = CheckpointReader(path)
    present = validate_checkpoint(reader, cls(config, None, device="meta"))
    model = cls(config, ctx, blocks=blocks, dtype=dtype, device="meta", **model_kwargs)
    if device is None:
        device = ctx.device if ctx is not None else torch.device("cpu")
    materialize(model, device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_oft_name(name):
                continue
            sources = hf_names(name, logical_shape(param))
            param.copy_(read_param(reader, sources, getattr(param, "tp_shard", None)))
    if config.oft is not None:
        required = is_oft_checkpoint(path)
        load_oft_modules(model, path, seed, required=required, unused=unused_tensors(config))
    if model.has_vision and (ctx is None or ctx.rank == 0):
        before = reader.stats.bytes_read
        model.hf_unused = {n: reader.read(n) for n in unused_tensors(config) if n in present}
        reader.stats.unused_bytes = reader.stats.bytes_read - before
        reader.stats.bytes_read = before
    reader.stats.seconds = time.perf_counter() - t0
    model.load_stats = reader.stats
    return model


def _checkpoint_config(path, config: OpenVLAConfig | None, oft: Mapping) -> OpenVLAConfig:
    """``config``, else the checkpoint's (OFT's release: with the options its files and
    ``oft`` give); OFT options ``oft`` that it contradicts are refused."""
    if config is None and is_released(path):
        saved = OpenVLAConfig.from_pretrained(path)
        return released_config(path, saved, oft, saved.text.hidden_size)
    config = config or OpenVLAConfig.from_pretrained(path)
    check_given(config, oft, path)
    return config
