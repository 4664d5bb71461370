"""OpenVLA-OFT's modules on disk, beside an exported (or any) OpenVLA checkpoint.

An OFT export is the Hugging Face OpenVLA layout (the merged model; with LoRA the PEFT adapter
in ``adapter/``), ``config.json`` with a ``parallax_oft`` entry (chunk, action and state
sizes, cameras, FiLM), ``dataset_statistics.json`` (actions and proprio), and OFT's modules:

- ``action_head.safetensors``, ``proprio_projector.safetensors``: the tensors under the keys
  OFT's modules have (``model.fc1.weight``, ``model.mlp_resnet_blocks.0.ffn.1.weight``,
  ``fc1.weight``...), and ``film.safetensors`` (the FiLM linears under parallax's names,
  ``vision_backbone.featurizer.blocks.0.film_scale.weight``...);
- ``action_head--{step}_checkpoint.pt``, ``proprio_projector--{step}_checkpoint.pt``: the same
  tensors as OFT's fine-tuning script writes them, ``torch.save`` of a plain dict of tensors
  whose keys carry the DDP prefix ``module.`` (OFT's loader strips it and reads the file with
  ``weights_only=True``). OFT saves FiLM as the whole PEFT-wrapped vision backbone's state
  dict, LoRA internals included; that file is not written (``film.safetensors`` holds it).

Writing is collective: each stage's dp-0 ranks gather an OFT tensor over tp, the stage's tp
rank 0 sends it to global rank 0, which writes every file atomically. Reading
(:func:`load_oft_modules`) takes the safetensors (or, where only OFT's ``.pt`` files are
there, those, with ``torch.load(weights_only=True)``: no pickle is ever run) and keeps this
rank's tp slice; what no file holds starts from the layout-free init.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from parallax import comm
from parallax.atomic import atomic_write_bytes
from parallax.families.openvla.oft.head import is_oft_name, oft_key, parallax_name
from parallax.init import init_parameters
from parallax.models.peft import full_on_rank0
from parallax.tensor import logical_shape, shard_tensor

log = logging.getLogger(__name__)

FILES = ("action_head", "proprio_projector", "film")
OFT_PT = ("action_head", "proprio_projector")  # what OFT's loader reads from .pt files
DDP_PREFIX = "module."


def _plan(model, ctx) -> list[tuple[int, str, tuple[int, ...], torch.dtype]]:
    """Every stage's OFT parameters ``(stage, name, shape, dtype)``, the same on every rank."""
    mine = [
        (n, tuple(logical_shape(p)), p.dtype) for n, p in model.named_parameters() if is_oft_name(n)
    ]
    if ctx is None or ctx.world_size == 1:
        return [(0, n, s, d) for n, s, d in mine]
    coords = ctx.dims.coords(ctx.rank)
    gathered = comm.all_gather_object((coords, mine), ctx.world_group)
    out = []
    for (pp, dp, tp), entries in sorted(gathered, key=lambda e: e[0]):
        if dp == 0 and tp == 0:
            out += [(pp, n, s, d) for n, s, d in entries]
    return out


def save_oft_modules(model, path: str | Path, step: int | None = None) -> None:
    """Write the OFT files of the module doc into ``path`` (collective; rank 0 writes).
    ``step`` names OFT's ``.pt`` files (``latest`` without one, as OFT's own option does)."""
    ctx = model.ctx
    path = Path(path)
    params = dict(model.named_parameters())
    tensors: dict[str, dict[str, torch.Tensor]] = {f: {} for f in FILES}
    for stage, name, shape, dtype in _plan(model, ctx):
        full = full_on_rank0(params, name, stage, shape, dtype, ctx)  # dtype: its own
        if full is not None:
            module, key = oft_key(name)
            tensors[module][key] = full.cpu().contiguous()
    if ctx is None or ctx.rank == 0:
        _write(path, tensors, "latest" if step is None else str(step))
    if ctx is not None:
        comm.barrier(ctx.world_group)


def _write(path: Path, tensors: dict[str, dict[str, torch.Tensor]], step: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for module, values in tensors.items():
        if not values:
            continue
        atomic_write_bytes(path / f"{module}.safetensors", safetensors_bytes(values))
        if module not in OFT_PT:
            continue
        for stale in path.glob(f"{module}--*checkpoint.pt"):
            stale.unlink()  # OFT's loader wants exactly one file per module
        buffer = io.BytesIO()
        torch.save({DDP_PREFIX + k: v for k, v in values.items()}, buffer)
        atomic_write_bytes(path / f"{module}--{step}_checkpoint.pt", buffer.getvalue())
    log.info(
        "saved OpenVLA-OFT's modules (%s) to %s",
        ", ".join(k for k, v in tensors.items() if v),
        path,
    )


def read_oft_files(path: str | Path) -> dict[str, torch.Tensor]:
    """Every OFT tensor found in ``path``, under parallax's names (module doc)."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    for module in FILES:
        file = path / f"{module}.safetensors"
        if file.is_file():
            with safe_open(str(file), framework="pt") as f:
                out.update({parallax_name(module, k): f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
            continue
        found = sorted(path.glob(f"{module}--*checkpoint.pt")) if module in OFT_PT else []
        if len(found) > 1:
            raise ValueError(f"{path}: several {module} checkpoints {[p.name for p in found]}")
        if found:
            state = torch.load(found[0], map_location="cpu", weights_only=True)
            for k, v in state.items():
                key = k[len(DDP_PREFIX) :] if k.startswith(DDP_PREFIX) else k
                out[parallax_name(module, key)] = v
    return out


@torch.no_grad()
def load_oft_modules(model, path: str | Path, seed: int = 0) -> list[str]:
    """Fill this rank's OFT parameters from the files in ``path`` (its tp slices), the rest
    from ``seed``'s layout-free init; returns the names read from files."""
    mine = {n: p for n, p in model.named_parameters() if is_oft_name(n)}
    if not mine:
        return []
    init = model.default_init_fn()
    for owner in dict.fromkeys(n.rpartition(".")[0] for n in mine):  # the layout-free init
        init_parameters(model.get_submodule(owner), seed, init, prefix=owner)
    found = read_oft_files(path)
    unexpected = sorted(set(found) - set(_all_oft_names(model)))
    if unexpected:
        raise ValueError(f"{path}: OFT tensors the model does not have: {unexpected[:5]}")
    read = []
    for name, p in mine.items():
        if name not in found:
            continue
        full = found[name]
        if tuple(full.shape) != tuple(logical_shape(p)):
            raise ValueError(
                f"{path}: {name} has shape {list(full.shape)}, the model {list(logical_shape(p))}"
            )
        info = getattr(p, "tp_shard", None)
        p.copy_(full if info is None else shard_tensor(full, info))
        read.append(name)
    return read


def _all_oft_names(model) -> list[str]:
    """The OFT parameter names of the whole model (built on meta, whatever this rank holds)."""
    whole = type(model)(model.config, None, device="meta")
    return [n for n, _ in whole.named_parameters() if is_oft_name(n)]
