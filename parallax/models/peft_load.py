"""Load a PEFT LoRA adapter directory onto a model that :func:`apply_lora` has prepared.

Every rank checks the adapter's config and the file's names and shapes (header only) against
the whole model (every stage's expected keys are gathered first), so a wrong adapter fails with
one message on every rank before anything is read; then each rank reads only its own slice of
each tensor. Adapters of modules parallax never builds (an adapter trained with PEFT on the
full towers has them for the unused last blocks and SigLIP's attention pool) are ignored and
named in the result. Load before building the optimizer (or call its
``reload_master_weights()`` afterwards).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from parallax import comm
from parallax.models.hf_io import CheckpointReader, LoadStats
from parallax.models.hf_io import read_param as _read_param
from parallax.models.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX,
    adapter_pieces,
    lora_hyperparameters,
    tensor_names,
)
from parallax.tensor import logical_shape
from parallax.tensor.lora_apply import is_adapter_name, unbuilt_linears

log = logging.getLogger(__name__)
_UNSUPPORTED = {"use_rslora": True, "use_dora": True, "fan_in_fan_out": True}


class _AdapterReader(CheckpointReader):
    """:class:`CheckpointReader`'s sliced reads over the one adapter file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / ADAPTER_WEIGHTS).is_file():
            raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in adapter directory {self.path}")
        self.weight_map = {}
        self._handles: dict = {}
        self.stats = LoadStats()
        names = self.handle(ADAPTER_WEIGHTS).keys()  # noqa: SIM118 - a safetensors handle
        self.weight_map = dict.fromkeys(names, ADAPTER_WEIGHTS)


def read_adapter_config(path: str | Path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA directory, checked for what parallax supports
    (plain LoRA: no rsLoRA, DoRA, per-module ranks or transposed weights)."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in adapter directory {path}")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    bad = [k for k, v in _UNSUPPORTED.items() if config.get(k) == v]
    bad += [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config['bias']!r}")
    if bad:
        raise ValueError(f"{file}: unsupported LoRA options {bad}")
    return config


def _expected(model: nn.Module) -> tuple[dict, dict]:
    """This rank's adapter keys -> (param, pieces), and its base parameters' keys -> pieces."""
    adapters = adapter_pieces(model, trained=[])
    names, base = tensor_names(model), {}
    for name, p in model.named_parameters():
        if not is_adapter_name(name):
            base[name] = [(PREFIX + n, tuple(s)) for n, s in names(name, logical_shape(p))]
    return adapters, base


def _check(model, config, path, present: dict, ctx) -> tuple[dict, list[str], list[str]]:
    """The tensors this rank loads, the trained modules found, the ignored keys; raises the
    same ``ValueError`` on every rank when anything does not fit."""
    problems = []
    hyper = lora_hyperparameters(model)
    if hyper is None:
        problems.append("the model has no adapters: call apply_lora first")
    elif (hyper[0], hyper[1]) != (config.get("r"), config.get("lora_alpha")):
        problems.append(
            f"the adapter has r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; "
            f"the model's adapters r={hyper[0]}, alpha={hyper[1]}"
        )
    adapters, base = _expected(model)
    load = {}
    for param, pieces in adapters.items():
        load[param] = pieces
        for key, shape in pieces:
            if key not in present:
                problems.append(f"missing {key}")
            elif tuple(present[key]) != tuple(shape):
                problems.append(f"{key} has shape {list(present[key])}, expected {list(shape)}")
    trained = [p for p, pieces in base.items() if all(k in present for k, _ in pieces)]
    for param in trained:
        load[param] = base[param]
        for key, shape in base[param]:
            if tuple(present[key]) != tuple(shape):
                problems.append(f"{key} has shape {list(present[key])}, expected {list(shape)}")
    mine = {k for pieces in load.values() for k, _ in pieces}
    world = None if ctx is None else ctx.world_group
    gathered = comm.all_gather_object((sorted(mine), problems), world)
    known = {k for keys, _ in gathered for k in keys}
    unbuilt = tuple(f"{PREFIX}{m}.lora_" for m in unbuilt_linears(model))
    ignored = sorted(k for k in present if k not in known and k.startswith(unbuilt))
    unknown = sorted(k for k in present if k not in known and not k.startswith(unbuilt))
    problems = [p for _, ps in gathered for p in ps]
    if unknown:
        problems.append(f"{len(unknown)} keys match nothing in the model: {unknown[:5]}")
    if problems:
        raise ValueError(f"adapter {path} does not fit the model: " + "; ".join(problems[:8]))
    return load, trained, ignored


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path, *, ctx=None) -> dict:
    """Fill the model's adapters (and any ``modules_to_save`` tensors the file holds) from the
    PEFT directory ``path``; collective (one agreement over the world). Each rank reads its own
    slice. Returns ``{"config", "trained", "ignored"}``: the adapter's config, the base
    parameters loaded from it, and the keys of modules the model never builds."""
    ctx = ctx if ctx is not None else getattr(model, "ctx", None)
    config = read_adapter_config(path)
    reader = _AdapterReader(path)
    present = reader.shapes()
    load, trained, ignored = _check(model, config, path, present, ctx)
    params = dict(model.named_parameters())
    for name, pieces in load.items():
        p = params[name]
        p.copy_(_read_param(reader, pieces, getattr(p, "tp_shard", None)).reshape(p.shape))
    if ignored:
        log.info("adapter %s: ignored %d tensors of modules never built", path, len(ignored))
    return {"config": config, "trained": trained, "ignored": ignored}
