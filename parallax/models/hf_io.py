"""Reading Hugging Face safetensors checkpoints, whatever the family: the single-file or
sharded layout, tensors read by name and by tp slice, and the fit of a checkpoint to a model.

Fused projections (``qkv_proj``, ``gate_up_proj``) are parallax's own: a checkpoint keeps the
separate tensors (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``), and
:func:`hf_names` says which ones make up a parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_FUSED = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
    ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
}


def fused_parts(name: str) -> list[str]:
    """The separate checkpoint names that (fused) parameter ``name`` stands for, in block order
    (``[name]`` for an ordinary parameter). ``name`` may carry a prefix or suffix."""
    for fused, parts in _FUSED.items():
        if fused in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


def hf_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors ``(name, shape)`` that make up parameter ``name`` (row blocks)."""
    parts = fused_parts(name)
    if len(parts) == 1:
        return [(name, tuple(shape))]
    rows = shape[0] // len(parts)
    return [(p, (rows, *shape[1:])) for p in parts]


@dataclass
class LoadStats:
    """What a rank read: ``bytes_read`` counts the parameter slices, ``unused_bytes`` the
    checkpoint-only tensors rank 0 keeps for saving."""

    bytes_read: int = 0
    tensors_read: int = 0
    unused_bytes: int = 0
    files_opened: int = 0
    seconds: float = 0.0


class CheckpointReader:
    """Lazy access to the tensors of a single-file or sharded safetensors checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            index = json.loads((self.path / INDEX).read_text())
            self.weight_map: dict[str, str] = dict(index["weight_map"])
        elif (self.path / SINGLE).is_file():
            names = self._open(SINGLE).keys()  # noqa: SIM118 - a safetensors handle
            self.weight_map = dict.fromkeys(names, SINGLE)
        else:
            raise FileNotFoundError(f"no {SINGLE} or {INDEX} in checkpoint directory {self.path}")
        self._handles: dict = {}
        self.stats = LoadStats()

    def _open(self, file: str):
        if not (self.path / file).is_file():
            raise ValueError(f"checkpoint shard {self.path / file} is missing")
        try:
            return safe_open(str(self.path / file), framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own error type
            raise ValueError(
                f"cannot read checkpoint shard {self.path / file}: {err} (truncated or corrupt?)"
            ) from err

    def handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._open(file)
            self.stats.files_opened += 1
        return self._handles[file]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor, from the headers; opens (and so validates) every shard."""
        out = {}
        for file in sorted(set(self.weight_map.values())):
            h = self.handle(file)
            present = set(h.keys())
            for name in (n for n, f in self.weight_map.items() if f == file):
                if name in present:
                    out[name] = tuple(h.get_slice(name).get_shape())
        return out

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None):
        """Rows ``start:stop`` of ``name`` along ``dim`` (0 or 1); the whole tensor by default."""
        sl = self.handle(self.weight_map[name]).get_slice(name)
        if stop is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:stop]
        else:
            t = sl[:, start:stop]
        self.stats.bytes_read += t.numel() * t.element_size()
        self.stats.tensors_read += 1
        return t


def read_param(reader: CheckpointReader, sources, info) -> torch.Tensor:
    """This rank's piece of the logical tensor ``cat(sources)`` along the shard dim."""
    if info is None:
        parts = [reader.read(n) for n, _ in sources]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]
    d = info.dim
    pieces, offset, bounds = [], 0, []
    for name, shape in sources:
        bounds.append((name, offset, offset + shape[d]))
        offset += shape[d]
    for start, stop in info.ranges():
        for name, lo, hi in bounds:
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                pieces.append(reader.read(name, d, a - lo, b - lo))
        if stop > offset:  # tp padding of the vocabulary: zero rows
            shape = list(sources[0][1])
            shape[d] = stop - max(start, offset)
            pieces.append(torch.zeros(shape, dtype=pieces[0].dtype if pieces else torch.float32))
    return torch.cat(pieces, d) if len(pieces) > 1 else pieces[0]


def fit_problems(
    present: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    unused: Iterable[str] = (),
    ignored: Callable[[str], object] = lambda name: False,
) -> list[str]:
    """What keeps a checkpoint's tensors (``present``: name -> shape) from filling a model that
    reads ``expected``: the missing, the mis-shaped and the unexpected (neither expected, nor
    ``unused`` by the model, nor ``ignored``), each list cut at 8 names."""
    unused = set(unused)
    missing = [n for n in expected if n not in present]
    wrong = [(n, s, present[n]) for n, s in expected.items() if n in present and present[n] != s]
    unexpected = [n for n in present if n not in expected and n not in unused and not ignored(n)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors: " + ", ".join(missing[:8]))
    for n, want, got in wrong[:8]:
        problems.append(f"{n} has shape {list(got)}, expected {list(want)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors: " + ", ".join(unexpected[:8]))
    return problems
