"""Saving one checkpoint from many ranks, each writing the tensors it holds, without hangs.

``save_checkpoint`` is :func:`begin_checkpoint` on the group's rank 0, :func:`write_shard` on
every rank that writes, and :func:`commit_checkpoint` on rank 0, separated by three agreement
points (``all_gather_object`` of an error message or ``None``) instead of bare barriers: when
any rank fails, every rank raises the same :class:`CheckpointError` naming it, nobody waits for
a peer that will never arrive, the staging directory is removed, and no complete checkpoint is
touched. The checkpoint directory must be on a filesystem every rank of the group sees.

A full tensor often has to be gathered from tp or dp shards first, a collective the peers
join. Those peers list the same source with ``TensorSource(..., write=False)``: every rank
calls its producers in list order, so the gathers line up, and only the writer stores it.

Reading is the mirror image: each rank reads (and verifies) only what it needs, so damage may
be seen by some ranks only; :func:`read_agreed` runs a rank's reads and then one agreement
point, so every rank raises the same error or none does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from parallax import comm
from parallax.checkpoint.checksum import DEFAULT_CHUNKING, Chunking
from parallax.checkpoint.store import (
    ShardInfo,
    begin_checkpoint,
    commit_checkpoint,
    staging_dir,
    step_dir,
    write_shard,
)
from parallax.checkpoint.stream import CheckpointError, TensorSource, iter_sources

Group = comm.Group
T = TypeVar("T")


def _agree(error: str | None, group: Group, step: int, phase: str) -> None:
    errors = comm.all_gather_object(error, group)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"saving checkpoint step {step} failed while {phase}: {detail}")


def _check_meta(meta: dict[str, Any] | None) -> None:
    try:
        json.dumps(meta or {})
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"meta must hold JSON values only ({err})") from None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: Iterable[TensorSource] | dict[str, torch.Tensor],
    meta: dict[str, Any] | None = None,
    *,
    group: Group = None,
    keep_last: int | None = None,
    chunking: Chunking = DEFAULT_CHUNKING,
) -> Path:
    """Save ``step`` under ``root`` from every rank of ``group`` (``None``: this process only).

    Each rank passes the full logical tensors it is responsible for (sources, or a dict of
    in-memory tensors; every name written by exactly one rank), plus ``write=False`` sources
    for the gathers it only helps with. ``meta`` (JSON values) is taken from the group's
    rank 0. ``chunking`` sets the checksum tiles. Returns the published step directory on
    every rank.
    """
    rank = comm.rank(group)
    stage = staging_dir(root, step)
    error = None
    if rank == 0:
        try:
            _check_meta(meta)
            begin_checkpoint(root, step)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = _describe(err)
    _agree(error, group, step, f"preparing {stage}")

    info: ShardInfo | None = None
    error = None
    try:
        info = write_shard(stage, f"shard-{rank:05d}.safetensors", iter_sources(tensors), chunking)
    except Exception as err:  # noqa: BLE001
        error = _describe(err)
    shards = comm.all_gather_object((info, error), group)
    failed = [(r, e) for r, (_, e) in enumerate(shards) if e]
    if failed:
        if rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"saving checkpoint step {step} failed while writing: {detail}")

    error = None
    if rank == 0:
        try:
            commit_checkpoint(root, step, [s for s, _ in shards], meta, keep_last)
        except Exception as err:  # noqa: BLE001
            shutil.rmtree(stage, ignore_errors=True)
            error = _describe(err)
    _agree(error, group, step, "committing")
    return step_dir(root, step)


def read_agreed(group: Group, fn: Callable[[], T]) -> T:
    """Run ``fn`` (this rank's reads from a checkpoint) on every rank of ``group``, then agree:
    if it raised :class:`CheckpointError` on any rank, every rank raises one same
    ``CheckpointError`` carrying each distinct message and the ranks that saw it. ``fn`` must
    not run collectives (a failing rank skips the rest of them)."""
    error, value = None, None
    try:
        value = fn()
    except CheckpointError as err:
        error = str(err)
    errors = comm.all_gather_object(error, group)
    seen: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            seen.setdefault(e, []).append(r)
    if seen:
        raise CheckpointError(
            "; ".join(
                (f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}") + f": {e}"
                for e, rs in seen.items()
            )
        )
    return value
