"""OpenVLA-OFT's own released folders, read as OFT's evaluation reads them (``shared/oft.md``).

OFT's fine-tuning writes the merged OpenVLA (the HF layout: a ``config.json`` without
parallax's ``parallax_oft`` section) and beside it ``action_head--{step}_checkpoint.pt``,
``proprio_projector--{step}_checkpoint.pt`` (``torch.save`` of plain state dicts, keys with
DDP's ``module.``), with FiLM ``vision_backbone--{step}_checkpoint.pt`` (its whole FiLM- and
PEFT-wrapped vision backbone), and ``dataset_statistics.json``. Where several steps are there,
the newest is read (and the log says so); every module must have a file of that step.

The files tell the action dimension (the head's last linear), the proprio dimension (the
projector's first linear, 0 without its file), the head's residual blocks and FiLM (its file
is there). They do not tell the chunk (OFT picks ``NUM_ACTIONS_CHUNK`` from words of its
command line, 8 for LIBERO, 25 for ALOHA, 5 for Bridge, and forks change it), the cameras (an
evaluation option) or the normalisation (q01/q99, or min/max for ALOHA): those are keyword
arguments (:data:`GIVEN`), and a given value the files contradict is refused naming both.

The FiLM file's keys are ``vision_backbone.{tower}.blocks.{i}.block.{timm name}`` for the tower,
``...blocks.{i}.scale|shift.{weight,bias}`` for FiLM's linears (parallax's ``film_scale`` and
``film_shift``), every linear of the tower wrapped by PEFT (``base_layer.weight``,
``lora_A.default.weight``, ``lora_B.default.weight``). OFT's evaluation wraps the towers again
with LoRA rank 32, alpha 16 (later versions: alpha ``min(rank, 16)``) before loading it, so a
linear computes ``base + alpha / rank * B @ A``: merged so here, in float32.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from parallax.families.openvla.oft.config import OFTConfig

log = logging.getLogger(__name__)

PT_MODULES = ("action_head", "proprio_projector", "vision_backbone")
DDP_PREFIX = "module."
GIVEN = ("chunk", "num_images", "action_dim", "proprio_dim", "film", "normalization")
NORMALIZATIONS = ("q99", "bounds")  # OFT's BOUNDS_Q99 (LIBERO, Bridge) and BOUNDS (ALOHA)
OFT_LORA_ALPHA = 16  # OFT's evaluation: LoraConfig(r=32, lora_alpha=16), later min(r, 16)
_FILM = re.compile(r"(blocks\.\d+)\.(scale|shift)\.")  # FiLM's linears on the block wrapper
_WRAPPED = re.compile(r"(blocks\.\d+)\.block\.")  # the timm block inside the wrapper
_LORA = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.\w+\.weight")


def pt_files(path: Path, module: str) -> dict[str, Path]:
    """``{step: file}`` of ``{module}--{step}_checkpoint.pt`` in ``path``."""
    head, tail = f"{module}--", "_checkpoint.pt"
    return {f.name[len(head) : -len(tail)]: f for f in sorted(path.glob(f"{head}*{tail}"))}


def _order(step: str) -> float:
    return int(step) if step.isdigit() else math.inf  # OFT's "latest" is the newest


def is_released(path: str | Path) -> bool:
    """OFT's own layout: a ``config.json`` without parallax's OFT section and OFT's module
    files beside it."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file() or not any(pt_files(path, m) for m in PT_MODULES):
        return False
    return "parallax_oft" not in json.loads(config.read_text())


def is_oft_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds an OpenVLA-OFT model: parallax's export (its config.json's
    ``parallax_oft``) or OFT's release."""
    config = Path(path) / "config.json"
    return is_released(path) or "parallax_oft" in json.loads(config.read_text())


def released_files(path: str | Path) -> dict[str, Path]:
    """The newest step's OFT files ``{module: file}``, ``{}`` where there are none; refuses a
    folder whose projector or backbone files have no action head of their step."""
    path = Path(path)
    steps = {m: pt_files(path, m) for m in PT_MODULES}
    if not any(steps.values()):
        return {}
    heads = steps["action_head"]
    if not heads:
        others = [f.name for files in steps.values() for f in files.values()]
        raise FileNotFoundError(
            f"{path}: expected the action head (OFT's action_head--{{step}}_checkpoint.pt or "
            f"parallax's action_head.safetensors) beside {', '.join(others)}; refusing to start "
            "the head from random values"
        )
    step = max(heads, key=_order)
    if len(heads) > 1:
        log.info("%s: OFT checkpoints of steps %s; reading the newest, %s", path, list(heads), step)
    out = {"action_head": heads[step]}
    for module in PT_MODULES[1:]:
        if steps[module] and step not in steps[module]:
            found = [f.name for f in steps[module].values()]
            raise FileNotFoundError(
                f"{path}: expected {module}--{step}_checkpoint.pt beside "
                f"action_head--{step}_checkpoint.pt; found {found}"
            )
        if steps[module]:
            out[module] = steps[module][step]
    return out


def load_state(file: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """An OFT ``.pt`` state dict without DDP's prefix (``weights_only``: no pickle runs)."""
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise ValueError(f"{file}: expected a state dict of tensors (OFT's torch.save of one)")
    return {k.removeprefix(DDP_PREFIX): v for k, v in state.items()}


def vision_backbone_tensors(file: Path) -> dict[str, torch.Tensor]:
    """OFT's FiLM backbone file under parallax's names (``vision_backbone.featurizer...``),
    PEFT's LoRA merged as OFT's evaluation applies it (module doc)."""
    plain: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_state(file).items():
        name = _WRAPPED.sub(r"\1.", _FILM.sub(r"\1.film_\2.", key.removeprefix("vision_backbone.")))
        match = _LORA.fullmatch(name)
        if match:
            lora.setdefault(match["module"], {})[match["part"]] = value
        else:
            plain["vision_backbone." + name.replace(".base_layer.", ".")] = value
    for module, parts in lora.items():
        weight = f"vision_backbone.{module}.weight"
        if set(parts) != {"A", "B"} or weight not in plain:
            raise ValueError(f"{file}: {module} has LoRA {sorted(parts)} but not A, B and its base")
        a, b = parts["A"].float(), parts["B"].float()  # (r, in), (out, r)
        alpha = min(a.shape[0], OFT_LORA_ALPHA)
        plain[weight] = plain[weight].float() + alpha / a.shape[0] * (b @ a)  # (out, in)
    if lora:
        log.info("%s: merged PEFT's LoRA into %d tower linears (alpha %d)", file, len(lora), alpha)
    return plain


def released_config(path: str | Path, saved, given: Mapping, hidden: int):
    """``saved`` (the folder's :class:`~..config.OpenVLAConfig`) with the OFT options the files
    and ``given`` tell (module doc) and ``dataset_statistics.json``'s statistics."""
    path = Path(path)
    check_keys(given)
    files = released_files(path)
    found = _from_files(files, hidden)
    for key, value in found.items():
        if key in given and given[key] != value:
            raise ValueError(f"{key}={given[key]!r} given, but {_says(path, files, key, value)}")
    missing = [k for k in ("chunk", "num_images") if k not in given]
    if missing:
        raise ValueError(
            f"{path}: OFT's files do not tell the {' or the '.join(missing)}; pass "
            f"{', '.join(f'{k}=' for k in missing)} to load_policy (OpenVLA.from_pretrained: "
            "oft={...}); OFT's chunks: 8 for LIBERO, 25 for ALOHA, 5 for Bridge, forks differ; "
            "its cameras: 2 for LIBERO, 3 for ALOHA"
        )
    oft = OFTConfig(chunk=given["chunk"], num_images=given["num_images"], **found)
    normalization = given.get("normalization", "q99")
    stats = _statistics(path, saved.norm_stats, oft, normalization)
    log.info(
        "%s: OpenVLA-OFT as OFT released it (%s): %s, %s normalisation",
        path,
        ", ".join(f.name for f in files.values()),
        oft,
        normalization,
    )
    return dataclasses.replace(saved, oft=oft, norm_stats=stats)


def _from_files(files: Mapping[str, Path], hidden: int) -> dict:
    """What the files' shapes tell: action and proprio sizes, the head's blocks, FiLM."""
    head = load_state(files["action_head"], mmap=True)
    try:
        action_dim = head["model.fc2.weight"].shape[0]
        width = head["model.fc1.weight"].shape[1]
    except KeyError as err:
        raise ValueError(f"{files['action_head']}: no {err} (not OFT's L1 action head)") from None
    if width != action_dim * hidden:
        raise ValueError(
            f"{files['action_head']}: a head reading {width} features, the language model's "
            f"{hidden}-wide hidden states give {action_dim} x {hidden} for {action_dim}-dim actions"
        )
    blocks = {k.split(".")[2] for k in head if k.startswith("model.mlp_resnet_blocks.")}
    proprio_dim = 0
    if "proprio_projector" in files:
        proprio_dim = load_state(files["proprio_projector"], mmap=True)["fc1.weight"].shape[1]
    film = "vision_backbone" in files
    return dict(action_dim=action_dim, proprio_dim=proprio_dim, film=film, head_blocks=len(blocks))


def _says(path: Path, files: Mapping[str, Path], key: str, value) -> str:
    if key == "action_dim":
        return f"{files['action_head'].name} is a head for {value}-dim actions"
    if key == "proprio_dim" and "proprio_projector" in files:
        return f"{files['proprio_projector'].name} projects {value}-dim states"
    if key == "proprio_dim":
        return f"{path} has no proprio_projector--{{step}}_checkpoint.pt (no state token)"
    if key == "film" and value:
        return f"{path} has {files['vision_backbone'].name} (FiLM's backbone)"
    if key == "film":
        return f"{path} has no vision_backbone--{{step}}_checkpoint.pt (FiLM's backbone)"
    return f"the files say {key} {value}"


def _statistics(path: Path, fallback: dict, oft: OFTConfig, normalization: str) -> dict:
    """``dataset_statistics.json`` (as OFT's evaluation reads it; else config.json's
    ``norm_stats``), checked against the head and the projector; with ``bounds`` the min/max
    take the q01/q99's place, so parallax's q01/q99 formulas become OFT's BOUNDS."""
    file = path / "dataset_statistics.json"
    if not file.is_file():
        log.warning("%s: no dataset_statistics.json; config.json's norm_stats are used", path)
        return fallback
    stats = json.loads(file.read_text())
    for name, entry in stats.items():
        for key, dim in (("action", oft.action_dim), ("proprio", oft.proprio_dim)):
            if key == "proprio" and not dim:
                continue
            got = len(entry.get(key, {}).get("q01", []))
            if got != dim:
                raise ValueError(
                    f"{file}: {name!r} has {got}-dim {key} statistics, the model's "
                    f"{'head' if key == 'action' else 'projector'} takes {dim}"
                )
            if normalization == "bounds":
                if "min" not in entry[key] or "max" not in entry[key]:
                    raise ValueError(f"{file}: {name!r} has no {key} min/max for 'bounds'")
                entry[key] = {**entry[key], "q01": entry[key]["min"], "q99": entry[key]["max"]}
    return stats


def check_keys(given: Mapping) -> None:
    unknown = sorted(set(given) - set(GIVEN))
    if unknown:
        raise ValueError(f"unknown OFT options {unknown}; known: {list(GIVEN)}")
    if given.get("normalization", "q99") not in NORMALIZATIONS:
        raise ValueError(f"normalization={given['normalization']!r}: one of {NORMALIZATIONS}")


def check_given(config, given: Mapping, source) -> None:
    """Refuse OFT options ``given`` that ``config`` (a parallax checkpoint's) contradicts,
    naming both; ``config`` without OFT options refuses any."""
    check_keys(given)
    if not given:
        return
    if config.oft is None:
        raise FileNotFoundError(
            f"{', '.join(f'{k}=' for k in given)} given, but {source} holds no OpenVLA-OFT "
            "model: no parallax_oft section in its config.json and no "
            "action_head--{step}_checkpoint.pt beside it"
        )
    for key, value in given.items():
        have = "q99" if key == "normalization" else getattr(config.oft, key)
        if value != have:
            raise ValueError(f"{key}={value!r} given, but {source} says {key} {have!r}")
