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
there, those of the newest step, with ``torch.load(weights_only=True)``: no pickle is ever
run; OFT's FiLM file, the whole backbone, gives the towers too: :mod:`.released`) and keeps
this rank's tp slice. A checkpoint that is an OFT one must hold every module the model has (a
missing file is refused, naming it); only a plain OpenVLA starting an OFT run starts them from
the layout-free init.
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
from parallax.families.openvla.oft.released import (
    DDP_PREFIX,
    load_state,
    released_files,
    vision_backbone_tensors,
)
from parallax.init import init_parameters
from parallax.models.peft import full_on_rank0
from parallax.tensor import logical_shape, shard_tensor

log = logging.getLogger(__name__)

FILES = ("action_head", "proprio_projector", "film")
OFT_PT = ("action_head", "proprio_projector")  # what OFT's loader reads from .pt files


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
    """Every OFT tensor found in ``path``, under parallax's names: each module's safetensors,
    else OFT's ``.pt`` file of the newest step (:mod:`.released`; FiLM's is the whole vision
    backbone, so the towers' tensors come with it)."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    pending = [m for m in FILES if not (path / f"{m}.safetensors").is_file()]
    pt = released_files(path) if pending else {}
    for module in FILES:
        file = path / f"{module}.safetensors"
        if file.is_file():
            with safe_open(str(file), framework="pt") as f:
                out.update({parallax_name(module, k): f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        elif module == "film" and "vision_backbone" in pt:
            out.update(vision_backbone_tensors(pt["vision_backbone"]))
        elif module in pt:
            out.update(_pt_tensors(module, pt[module]))
    return out


def _pt_tensors(module: str, file: Path) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in load_state(file).items():
        try:
            out[parallax_name(module, key)] = value
        except (IndexError, ValueError):
            raise ValueError(f"{file}: {key!r} is no key of OFT's {module}") from None
    return out


@torch.no_grad()
def load_oft_modules(
    model, path: str | Path, seed: int = 0, *, required: bool = False, unused=()
) -> list[str]:
    """Fill this rank's OFT parameters (its tp slices) from the files in ``path``, and its
    towers too where OFT's FiLM backbone file holds them; returns the names read.

    ``required`` (the checkpoint is an OFT one): a module without its file is refused, naming
    the file expected; else (a plain OpenVLA starting an OFT run) what no file holds starts
    from ``seed``'s layout-free init. ``unused``: checkpoint tensors the model skips."""
    path = Path(path)
    whole = _whole_shapes(model)
    found = read_oft_files(path)
    _check(path, found, whole, set(unused), required)
    params = dict(model.named_parameters())
    mine = {n: p for n, p in params.items() if is_oft_name(n) and n not in found}
    if mine:  # not required, nothing on disk: the layout-free init
        init = model.default_init_fn()
        for owner in dict.fromkeys(n.rpartition(".")[0] for n in mine):
            init_parameters(model.get_submodule(owner), seed, init, prefix=owner)
    read = [n for n in params if n in found]
    for name in read:
        info = getattr(params[name], "tp_shard", None)
        full = found[name]
        params[name].copy_(full if info is None else shard_tensor(full, info))
    return read


def _check(path: Path, found: dict, whole: dict, unused: set, required: bool) -> None:
    """The same refusals on every rank (whole-model names): tensors the model lacks or of
    another shape, a module partly there, and with ``required`` a module not there at all."""
    film_of_unused = {
        n for n in found if ".film_" in n and n.split(".film_")[0] + ".norm1.weight" in unused
    }
    unexpected = sorted(set(found) - set(whole) - unused - film_of_unused)
    if unexpected:
        raise ValueError(f"{path}: OFT tensors the model does not have: {unexpected[:5]}")
    for name, shape in whole.items():
        if name in found and tuple(found[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {list(found[name].shape)}, the model {list(shape)}"
            )
    groups: dict[str, list[str]] = {}
    towers = any(n.startswith("vision_backbone.") and not is_oft_name(n) for n in found)
    for name in whole:
        if is_oft_name(name) or (towers and name.startswith("vision_backbone.")):
            groups.setdefault(oft_key(name)[0] if is_oft_name(name) else "film", []).append(name)
    for module, names in groups.items():
        missing = [n for n in names if n not in found]
        if missing and len(missing) < len(names):
            raise ValueError(f"{path}: {_expected(module, missing, len(names))}")
        if missing and required:
            raise FileNotFoundError(f"{path}: {_expected(module, missing, len(names))}")


def _expected(module: str, missing: list[str], total: int) -> str:
    files = {
        "action_head": "action_head.safetensors or action_head--{step}_checkpoint.pt",
        "proprio_projector": "proprio_projector.safetensors or "
        "proprio_projector--{step}_checkpoint.pt",
        "film": "film.safetensors or vision_backbone--{step}_checkpoint.pt",
    }[module]
    if len(missing) == total:
        return f"expected {files} (the model's {module}); found neither, refusing random values"
    return f"{files} lacks {len(missing)} of the {module}'s {total} tensors: {missing[:3]}"


def _whole_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model and its full shape (built on meta)."""
    whole = type(model)(model.config, None, device="meta")
    return {n: tuple(p.shape) for n, p in whole.named_parameters()}
