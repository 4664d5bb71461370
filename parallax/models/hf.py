"""Read and write the Hugging Face OpenVLA checkpoint layout (safetensors, bf16, sharded).

Parameter names are the checkpoint names, except fused projections: ``qkv_proj`` is stored as
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` as ``gate_proj``/``up_proj``. Loading: every
rank checks the whole checkpoint's names and shapes from the file headers (so a bad checkpoint
fails identically everywhere, before any collective), then reads only its own stage's tensors
and only its tp slice of each (``safe_open(...).get_slice``), so no rank ever holds the full
model. Tensors the model never uses (the towers' final ``norm``, SigLIP's ``attn_pool``, blocks
after the feature layer) are skipped on purpose; rank 0 keeps them to write them back.

Saving: each pipeline stage writes its own shard files, gathering one parameter at a time over
tp and streaming it into the file; rank 0 then writes the index and config.json.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from parallax import comm
from parallax.models.config import OpenVLAConfig
from parallax.models.meta import materialize
from parallax.models.safetensors_io import (
    SafetensorsWriter,
    parse_size,
    write_bytes_atomic,
    write_json_atomic,
)
from parallax.models.vit import checkpoint_only_tensors
from parallax.tensor import logical_shape, unshard_tensor

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_FUSED = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
    ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
}
AUX_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "configuration_prismatic.py",
    "modeling_prismatic.py",
    "processing_prismatic.py",
)


def hf_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors ``(name, shape)`` that make up parameter ``name`` (row blocks)."""
    for fused, parts in _FUSED.items():
        if fused in name:
            rows = shape[0] // len(parts)
            return [(name.replace(fused, p), (rows, *shape[1:])) for p in parts]
    return [(name, tuple(shape))]


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


def validate_checkpoint(reader: CheckpointReader, config: OpenVLAConfig) -> dict:
    """Raise one ``ValueError`` naming every missing, mis-shaped or unexpected tensor."""
    present = reader.shapes()
    expected, unused = expected_tensors(config), unused_tensors(config)
    missing = [n for n in expected if n not in present]
    wrong = [(n, s, present[n]) for n, s in expected.items() if n in present and present[n] != s]
    unexpected = [n for n in present if n not in expected and n not in unused]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors: " + ", ".join(missing[:8]))
    for n, want, got in wrong[:8]:
        problems.append(f"{n} has shape {list(got)}, expected {list(want)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors: " + ", ".join(unexpected[:8]))
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


# ---------------------------------------------------------------------------------- saving


def _plan(stage_groups: list[list[list]], max_bytes: int, itemsize: int) -> list[tuple[int, list]]:
    """Files as ``(stage, [group, ...])``; a group (one parameter's tensors) never straddles
    files, and no file holds two stages' tensors."""
    files = []
    for stage, groups in enumerate(stage_groups):
        current, size = [], 0
        for group in groups:
            nbytes = sum(itemsize * _numel(shape) for _, shape in group)
            if current and size + nbytes > max_bytes:
                files.append((stage, current))
                current, size = [], 0
            current.append(group)
            size += nbytes
        if current:
            files.append((stage, current))
    return files


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _file_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def save_pretrained(
    model,
    path: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write ``model`` (all stages, all tp shards) as a Hugging Face OpenVLA checkpoint.

    Collective: call on every rank. Each stage's (dp 0, tp 0) rank writes that stage's shard
    files while its tp peers help gather; rank 0 writes the index, config.json (with
    norm_stats), dataset_statistics.json and copies the tokenizer and processor files of the
    checkpoint the model came from. A writer holds one full parameter at a time.
    """
    ctx, config = model.ctx, model.config
    path = Path(path)
    rank = 0 if ctx is None else ctx.rank
    pp_rank, dp_rank, tp_rank = (0, 0, 0) if ctx is None else ctx.dims.coords(ctx.rank)
    world = None if ctx is None else ctx.world_group
    tp_group = None if ctx is None else ctx.tp_group
    itemsize = torch.empty((), dtype=dtype).element_size()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    comm.barrier(world)

    params = dict(model.named_parameters())
    groups = [hf_names(n, logical_shape(p)) for n, p in params.items()]
    unused = unused_tensors(config) if model.has_vision else {}
    groups += [[(n, s)] for n, s in unused.items()]
    gathered = comm.all_gather_object((pp_rank, dp_rank, tp_rank, groups), world)
    by_stage = {pp: g for pp, dp, tp, g in gathered if dp == 0 and tp == 0}
    _check_complete(by_stage, config)  # same verdict on every rank, before anything is written
    files = _plan([by_stage[s] for s in sorted(by_stage)], parse_size(max_shard_size), itemsize)
    names = [_file_name(i, len(files)) for i in range(len(files))]

    if dp_rank == 0:
        owners = {group[0][0]: name for name, group in zip(params, groups)}
        for (stage, file_groups), file_name in zip(files, names):
            if stage != pp_rank:
                continue
            entries = [(n, s, dtype) for g in file_groups for n, s in g]
            writer = SafetensorsWriter(path / file_name, entries) if tp_rank == 0 else None
            try:
                for group in file_groups:
                    first = group[0][0]
                    if first in owners:  # a parameter: gather over tp (every tp rank joins)
                        param = params[owners[first]]
                        info = getattr(param, "tp_shard", None)
                        p = param.detach()
                        full = p if info is None else unshard_tensor(p, info, tp_group)
                        parts = full.split(group[0][1][0], dim=0) if len(group) > 1 else [full]
                    elif writer is not None:
                        parts = [_unused_value(model, first, group[0][1])]
                    else:
                        continue
                    if writer is not None:
                        for (n, _), t in zip(group, parts):
                            writer.write(n, t.to(dtype))
                    full = parts = None  # hold one parameter at a time
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            if writer is not None:
                writer.close()
    comm.barrier(world)
    if rank == 0:
        _write_metadata(model, path, files, names, itemsize)
    comm.barrier(world)


def _check_complete(by_stage: dict, config: OpenVLAConfig) -> None:
    names = [n for s in sorted(by_stage) for g in by_stage[s] for n, _ in g]
    want = {**expected_tensors(config), **unused_tensors(config)}
    counts = Counter(names)
    missing = [n for n in want if n not in counts]
    twice = sorted(n for n, c in counts.items() if c > 1)
    if missing or twice:
        raise ValueError(
            "save_pretrained: the pipeline stages do not hold the whole model exactly once "
            f"({len(missing)} tensors missing, e.g. {missing[:3]}; held twice: {twice[:3]}); "
            "build the stages from contiguous block ranges that cover every block"
        )


def _unused_value(model, name: str, shape) -> torch.Tensor:
    """The checkpoint-only tensor as loaded, or a neutral value for a model built from scratch
    (ones for norm weights, zeros otherwise): the model never reads it."""
    if name in model.hf_unused:
        return model.hf_unused[name]
    if re.search(r"norm\d?\.weight$", name):
        return torch.ones(shape)
    return torch.zeros(shape)


def _write_metadata(model, path: Path, files, names, itemsize: int) -> None:
    config = model.config
    if len(files) > 1:
        weight_map, total = {}, 0
        for (_, groups), file_name in zip(files, names):
            for n, shape in (e for g in groups for e in g):
                weight_map[n] = file_name
                total += itemsize * _numel(shape)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json_atomic(path / INDEX, index)
    for stale in path.iterdir():  # shards of an earlier save with another shard count
        if (_SHARD_RE.match(stale.name) and stale.name not in names) or (
            stale.name == INDEX and len(files) == 1
        ):
            stale.unlink()
    write_json_atomic(path / "config.json", config.to_dict())
    if config.norm_stats:
        write_json_atomic(path / "dataset_statistics.json", config.norm_stats)
    if config.source and Path(config.source).resolve() != path.resolve():
        for aux in AUX_FILES:
            src = Path(config.source) / aux
            if src.is_file():
                write_bytes_atomic(path / aux, src.read_bytes())
    log.info(
        "saved %d tensors in %d files to %s",
        sum(len(g) for _, gs in files for g in gs),
        len(files),
        path,
    )
