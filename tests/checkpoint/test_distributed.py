"""Two gloo ranks write different shards of one step; a reader gets every tensor; failures on one
rank reach every rank as the same CheckpointError, without hanging."""

import json
from pathlib import Path

import torch

from parallax import comm
from parallax.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorSource,
    latest_checkpoint,
    save_checkpoint,
)
from parallax.testing import context, run_ranks

FULL_W = torch.arange(24.0).reshape(4, 6)
FULL_B = -torch.arange(6.0)


def _sources(rank, group, fail_on=None, duplicate=False):
    half_w, half_b = FULL_W.chunk(2, 0)[rank], FULL_B.chunk(2)[rank]  # what a tp rank holds
    own = torch.full((rank + 2, 3), float(rank))

    def local():
        if rank == fail_on:  # e.g. a full disk; the gathers after it must still line up
            raise OSError("disk full")
        return own

    return [
        TensorSource(f"stage{rank}.weight", tuple(own.shape), own.dtype, local),
        TensorSource(
            "tp.weight",
            (4, 6),
            torch.float32,
            lambda: comm.all_gather(half_w, group, dim=0),
            write=rank == 0,
        ),
        TensorSource(
            "tp.bias", (6,), torch.float32, lambda: comm.all_gather(half_b, group), write=rank == 1
        ),
        TensorSource.of(
            f"stage{rank}.weight.exp_avg", torch.full((2,), rank + 0.5).to(torch.bfloat16)
        ),
    ] + ([TensorSource.of("dup", torch.zeros(1))] if duplicate else [])


def _save_on_two_ranks(root):
    ctx = context(dp=2)
    group, rank = ctx.world_group, ctx.rank
    path = save_checkpoint(
        root, 10, _sources(rank, group), {"layout": {"dp": 2}}, group=group, keep_last=2
    )
    ckpt = Checkpoint(path)
    values = {name: ckpt.get(name) for name in ckpt.names()}
    mine = ckpt.shard("tp.weight", dim=0, rank=rank, world=2)  # re-shard on read
    errors = []
    for kwargs in ({"fail_on": 1}, {"duplicate": True}):
        try:
            save_checkpoint(root, 20, _sources(rank, group, **kwargs), group=group)
        except CheckpointError as err:
            errors.append(str(err))
    comm.barrier(group)
    leftovers = sorted(p.name for p in Path(root).iterdir())
    return str(path), values, torch.equal(mine, FULL_W.chunk(2, 0)[rank]), errors, leftovers


def test_two_ranks_write_one_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_on_two_ranks, 2, root)
    expected = {
        "stage0.weight": torch.zeros(2, 3),
        "stage1.weight": torch.ones(3, 3),
        "tp.weight": FULL_W,
        "tp.bias": FULL_B,
        "stage0.weight.exp_avg": torch.full((2,), 0.5).to(torch.bfloat16),
        "stage1.weight.exp_avg": torch.full((2,), 1.5).to(torch.bfloat16),
    }
    for path, values, resharded, errors, leftovers in results:
        assert path == str(latest_checkpoint(root))
        assert values.keys() == expected.keys()
        for name, value in expected.items():
            assert values[name].dtype == value.dtype and torch.equal(values[name], value), name
        assert resharded
        assert "failed while writing: rank 1: OSError: disk full" in errors[0]
        assert "'dup' written twice" in errors[1]
        assert leftovers == ["latest", "step_00000010"]  # failed steps left nothing behind
    index = json.loads((Path(results[0][0]) / "index.json").read_text())
    assert index["weight_map"]["tp.weight"] == "shard-00000.safetensors"
    assert index["weight_map"]["tp.bias"] == "shard-00001.safetensors"
    assert json.loads((Path(results[0][0]) / "meta.json").read_text()) == {
        "layout": {"dp": 2},
        "step": 10,
    }
