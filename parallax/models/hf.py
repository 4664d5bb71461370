"""Read and write the Hugging Face OpenVLA checkpoint layout (safetensors, bf16, sharded).

Parameter names are the checkpoint names, except fused projections: ``qkv_proj`` is stored as
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` as ``gate_proj``/``up_proj``. Loading: every
rank checks the whole checkpoint's names and shapes from the file headers (so a bad checkpoint
fails identically everywhere, before any collective), then reads only its own stage's tensors
and only its tp slice of each (``safe_open(...).get_slice``), so no rank ever holds the full
model. Tensors the model never uses (the towers' final ``norm``, SigLIP's ``attn_pool``, blocks
after the feature layer) are skipped on purpose; rank 0 keeps them to write them back.

Saving is in :mod:`parallax.models.hf_save`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from parallax.models.config import OpenVLAConfig
from parallax.models.meta import materialize
from parallax.models.vit import checkpoint_only_tensors
from parallax.tensor import logical_shape

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


def expected_tensors(config: OpenVLAConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the whole model reads, with its shape (built on meta, tp=1)."""
    from parallax.models.openvla import OpenVLA

    model = OpenVLA(config, None, device="meta")
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
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


def _read_param(reader: CheckpointReader, sources, info) -> torch.Tensor:
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


def validate_checkpoint(reader: CheckpointReader, config: OpenVLAConfig) -> dict:
    """Raise one ``ValueError`` naming every missing, mis-shaped or unexpected tensor."""
    present = reader.shapes()
    problems = fit_problems(present, expected_tensors(config), unused_tensors(config))
    if problems:
        raise ValueError(f"checkpoint {reader.path} does not fit the model: " + "; ".join(problems))
    return present


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
    **model_kwargs,
):
    """Build ``cls(config, ctx, blocks=...)`` on meta and fill it from the checkpoint at ``path``.

    The result's ``load_stats`` tells what this rank read. ``model_kwargs`` go to the model
    (``activation_checkpointing``, ``freeze_vision``).
    """
    t0 = time.perf_counter()
    config = config or OpenVLAConfig.from_pretrained(path)
    if fused_projections:
        config = config.with_options(fused_projections=True)
    reader = CheckpointReader(path)
    present = validate_checkpoint(reader, config)
    model = cls(config, ctx, blocks=blocks, dtype=dtype, device="meta", **model_kwargs)
    if device is None:
        device = ctx.device if ctx is not None else torch.device("cpu")
    materialize(model, device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            sources = hf_names(name, logical_shape(param))
            param.copy_(_read_param(reader, sources, getattr(param, "tp_shard", None)))
    if model.has_vision and (ctx is None or ctx.rank == 0):
        before = reader.stats.bytes_read
        model.hf_unused = {n: reader.read(n) for n in unused_tensors(config) if n in present}
        reader.stats.unused_bytes = reader.stats.bytes_read - before
        reader.stats.bytes_read = before
    reader.stats.seconds = time.perf_counter() - t0
    model.load_stats = reader.stats
    return model
