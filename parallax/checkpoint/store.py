"""The checkpoint directory layout: stage, commit, find, prune.

::

    out/checkpoints/
      latest                        "step_00000200\\n" (informational; written atomically)
      step_00000100/                one complete checkpoint
        shard-00000.safetensors     any number of shard files, each written by one rank
        shard-00001.safetensors
        index.json                  {"format": "parallax-checkpoint", "version": 2, "step": 100,
                                     "weight_map": {tensor name: file},
                                     "tensors": {tensor name: {"dtype": "F32", "shape": [...],
                                                 "chunks": [rows, cols], "crc32": [...]}},
                                     "files": {file: size in bytes}}
        meta.json                   {"step": 100, ...whatever the caller passed...}
      step_00000200/
      step_00000300.tmp/            a write in progress, or the remains of a crashed one
      step_00000050.deleting/       a pruned checkpoint being deleted, or what a kill left of it

A step directory is written as ``step_XXXXXXXX.tmp`` and renamed into place only when every
shard, the index and the metadata are on disk (fsynced); so any ``step_XXXXXXXX`` directory is
complete, a crash leaves only a ``.tmp`` that readers ignore, and older checkpoints are deleted
(keep-last-K) only after the new one is in place, never the one just written; a pruned one is
renamed to ``.deleting`` before its files go, so a kill midway leaves a name no reader takes
for a checkpoint (the next prune removes it). Tensors are full logical tensors named by their
global names, which is what makes a checkpoint independent of the layout that wrote it. Version
2 adds per-tile CRC-32 checksums (:mod:`parallax.checkpoint.checksum`); version 1 checkpoints
(no checksums) still load, unverified.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from parallax.atomic import atomic_write_text, fsync_dir, fsync_file, publish_dir
from parallax.checkpoint.checksum import DEFAULT_CHUNKING, Chunking
from parallax.checkpoint.stream import (
    DTYPES,
    CheckpointError,
    TensorSource,
    drain,
    iter_sources,
    write_safetensors,
)

log = logging.getLogger(__name__)

FORMAT = "parallax-checkpoint"
VERSION = 2  # 2: per-tile checksums in the index; 1 (none) still reads
INDEX, META, LATEST = "index.json", "meta.json", "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")
STAGING_RE = re.compile(r"^step_(\d{8,})\.tmp$")
OLD_RE = re.compile(r"^\.step_\d{8,}\.old-[0-9a-f]+$")  # see parallax.atomic.publish_dir
DELETING = ".deleting"
# {"file": str, "size": int, "tensors": {name: {"dtype", "shape", "chunks", "crc32"}}}
ShardInfo = dict[str, Any]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def staging_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}.tmp"


def begin_checkpoint(root: str | Path, step: int) -> Path:
    """Create an empty staging directory for ``step`` (on one rank, before any shard is
    written); the remains of an earlier crashed write of the same step are removed."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
    stage = staging_dir(root, step)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    return stage


def write_shard(
    stage: str | Path,
    file: str,
    tensors: Iterable[TensorSource] | dict[str, Any],
    chunking: Chunking = DEFAULT_CHUNKING,
) -> ShardInfo | None:
    """Write one shard file into the staging directory (any rank); return its description
    (with each tensor's checksums) for :func:`commit_checkpoint`, or ``None`` when every
    source is ``write=False`` (their producers still run, in order). One full tensor is in
    memory at a time."""
    if "/" in file or "\\" in file or not file.endswith(".safetensors"):
        raise CheckpointError(f"shard file {file!r} must be a plain name ending in .safetensors")
    srcs = iter_sources(tensors)
    written = [s for s in srcs if s.write]
    if not written:
        for k, src in enumerate(srcs):
            try:
                src.produce()
            except Exception:
                drain(srcs[k + 1 :])
                raise
        return None
    sums: dict[str, dict[str, Any]] = {}
    size = write_safetensors(Path(stage) / file, srcs, checksums=sums, chunking=chunking)
    return {
        "file": file,
        "size": size,
        "tensors": {
            s.name: {"dtype": DTYPES[s.dtype], "shape": list(s.shape), **sums[s.name]}
            for s in written
        },
    }


def commit_checkpoint(
    root: str | Path,
    step: int,
    shards: Iterable[ShardInfo | None],
    meta: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write the index and metadata, then publish the staging directory as ``step_XXXXXXXX``,
    update ``latest`` and prune to ``keep_last``, this step among them (one rank, after every
    shard)."""
    root, stage = Path(root), staging_dir(root, step)
    meta_text = json.dumps({**(meta or {}), "step": step}, indent=2, sort_keys=True)
    weight_map: dict[str, str] = {}
    tensors: dict[str, Any] = {}
    files: dict[str, int] = {}
    for shard in shards:
        if not shard:
            continue
        files[shard["file"]] = shard["size"]
        actual = (stage / shard["file"]).stat().st_size if (stage / shard["file"]).is_file() else -1
        if actual != shard["size"]:
            raise CheckpointError(
                f"{stage / shard['file']}: expected {shard['size']} bytes, found {actual} "
                "(missing or incomplete; is the checkpoint directory on a shared filesystem?)"
            )
        for name, info in shard["tensors"].items():
            if name in weight_map:
                raise CheckpointError(
                    f"tensor {name!r} written twice ({weight_map[name]} and {shard['file']}); "
                    "exactly one rank must write each tensor"
                )
            weight_map[name], tensors[name] = shard["file"], info
    index = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "weight_map": dict(sorted(weight_map.items())),
        "tensors": dict(sorted(tensors.items())),
        "files": dict(sorted(files.items())),
    }
    for name, text in ((INDEX, json.dumps(index, indent=1)), (META, meta_text)):
        (stage / name).write_text(text + "\n")
        fsync_file(stage / name)
    fsync_dir(stage)
    final = step_dir(root, step)
    publish_dir(stage, final)
    atomic_write_text(root / LATEST, final.name + "\n")
    if keep_last:
        prune_checkpoints(root, keep_last, protect=step)
    log.info("saved checkpoint %s (%d tensors in %d files)", final, len(weight_map), len(files))
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete step directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_RE.match(p.name)) and (p / INDEX).is_file() and (p / META).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest published checkpoint under ``root``, or ``None`` when there is none.

    Staging directories of crashed writes are ignored: they were never published. A published
    step directory is returned even when files have since gone missing, so that opening it
    (:class:`~parallax.checkpoint.Checkpoint`) reports the damage instead of a run silently
    falling back to an older step and later overwriting the damaged one. ``root`` that exists
    but is not a directory is an error."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()
    ]
    return max(found)[1] if found else None


def prune_checkpoints(root: str | Path, keep_last: int, protect: int | None = None) -> None:
    """Delete all but ``keep_last`` complete checkpoints: the newest by step, with step
    ``protect`` (the one just written) always among them. Also remove staging directories
    older than the newest checkpoint, replaced copies and half-deleted checkpoints (all left
    by crashed writes or kills)."""
    root = Path(root)
    found = list_checkpoints(root)
    keep = found[-keep_last:] if keep_last > 0 else []
    mine = step_dir(root, protect) if protect is not None else None
    if mine in found and mine not in keep:
        others = [p for p in found if p != mine]
        keep = [mine, *others[max(0, len(others) - keep_last + 1) :]] if keep_last > 1 else [mine]
        log.warning(
            "%s holds checkpoints newer than step %d, the one just written: they are from "
            "another run (kept: %s)",
            root,
            protect,
            ", ".join(p.name for p in keep),
        )
    for old in found:
        if old not in keep:
            discard(old)
    if found:
        newest = int(STEP_RE.match(found[-1].name).group(1))
        for p in root.iterdir():
            m = STAGING_RE.match(p.name)
            if (m and int(m.group(1)) < newest) or OLD_RE.match(p.name):
                shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.endswith(DELETING):
            shutil.rmtree(p, ignore_errors=True)


def discard(path: str | Path) -> None:
    """Delete a checkpoint directory by renaming it to ``<name>.deleting`` first: a kill in
    the middle leaves a name that no reader takes for a checkpoint, removed by the next
    :func:`prune_checkpoints`, instead of a half-deleted ``step_XXXXXXXX``."""
    path = Path(path)
    doomed = path.with_name(path.name + DELETING)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_checkpoints(root: str | Path) -> None:
    """Remove every checkpoint under ``root`` (and ``latest``, staging and leftover
    directories): what ``--overwrite`` does to an old run. Published ones go through
    :func:`discard`, so a kill midway never leaves something that looks resumable."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if STEP_RE.match(p.name) and p.is_dir():
            discard(p)
        elif p.name == LATEST:
            p.unlink()
        elif p.is_dir() and (
            STAGING_RE.match(p.name) or OLD_RE.match(p.name) or p.name.endswith(DELETING)
        ):
            shutil.rmtree(p, ignore_errors=True)
