"""Training checkpoints name tensors as Hugging Face does, whether projections are fused or not.

A run with fused projections holds q/k/v as one ``qkv_proj`` weight and gate/up as one
``gate_up_proj`` (:class:`~parallax.models.LlamaConfig`). Its checkpoints still store the
separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` tensors (weights,
fp32 masters and AdamW moments alike: row blocks of the fused tensor), so a run resumes with
either setting, at any layout, and older checkpoints load unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from parallax.checkpoint import Checkpoint, TensorSource
from parallax.models.hf_io import fused_parts


def split_fused(sources: list[TensorSource]) -> list[TensorSource]:
    """Each source of a fused tensor becomes one source per separate tensor (its row blocks;
    a scalar, such as AdamW's step, is repeated). The full tensor is produced once, by the
    first part, in the order the stream runs producers."""
    out: list[TensorSource] = []
    for src in sources:
        names = fused_parts(src.name)
        if len(names) == 1:
            out.append(src)
            continue
        k, blocks = len(names), []

        def produce(i: int, src: TensorSource = src, blocks: list = blocks, k: int = k):
            if i == 0:
                full = src.produce()
                blocks[:] = [full] * k if full.dim() == 0 else list(full.chunk(k))
            block, blocks[i] = blocks[i], None  # freed as soon as it is written
            return block

        shape = src.shape[:0] if not src.shape else (src.shape[0] // k, *src.shape[1:])
        out += [
            replace(src, name=name, shape=tuple(shape), produce=lambda i=i, f=produce: f(i))
            for i, name in enumerate(names)
        ]
    return out


class SeparateView:
    """A checkpoint read through this model's parameter names: a fused name is the
    concatenation of the separate tensors the checkpoint stores (or the fused tensor itself,
    if it was stored so). Offers what :func:`parallax.checkpoint.load_module` uses."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def _parts(self, name: str) -> list[str]:
        return [name] if name in self.ckpt else fused_parts(name)

    def __contains__(self, name: str) -> bool:
        """Whether every tensor that ``name`` stands for is stored."""
        return all(part in self.ckpt for part in self._parts(name))

    def require(self, names: Iterable[str]) -> None:
        self.ckpt.require(part for name in names for part in self._parts(name))

    def shape(self, name: str) -> tuple[int, ...]:
        shapes = [tuple(self.ckpt.shape(p)) for p in self._parts(name)]
        if len(shapes) == 1 or not shapes[0]:
            return shapes[0]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def get(self, name: str, index=None) -> torch.Tensor:
        parts = self._parts(name)
        if len(parts) == 1:
            return self.ckpt.get(parts[0], index)
        values = [self.ckpt.get(p) for p in parts]
        if values[0].dim() == 0:
            return values[0]  # a scalar: the same for every part
        full = torch.cat(values)  # (k * rows, ...)
        return full if index is None else full[index]


def separate_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """An optimizer meta (``keys`` and group ``params`` by parameter name) under the separate
    names."""
    out = dict(meta)
    out["keys"] = {p: v for n, v in meta["keys"].items() for p in fused_parts(n)}
    out["param_groups"] = [
        {**g, "params": [p for n in g["params"] for p in fused_parts(n)]}
        for g in meta["param_groups"]
    ]
    return out


def model_meta(meta: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """A saved optimizer meta with entries added for this model's fused ``names`` (taken from
    their first separate part), so it reads as if saved by this model."""
    out = dict(meta)
    keys = dict(meta["keys"])
    alias = {}
    for name in names:
        first = fused_parts(name)[0]
        if name not in keys and first != name and first in keys:
            keys[name] = keys[first]
            alias[first] = name
    out["keys"] = keys
    out["param_groups"] = [
        {**g, "params": [*g["params"], *(alias[p] for p in g["params"] if p in alias)]}
        for g in meta["param_groups"]
    ]
    return out
