"""Checksums: damaged tensor bytes are named, slices verify only their tiles, old ones load."""

import itertools
import json
import logging
import math

import pytest
import torch

from parallax.checkpoint import (
    Checkpoint,
    CheckpointError,
    Chunking,
    read_agreed,
    read_header,
    save_checkpoint,
)
from parallax.checkpoint.checksum import tile_bounds, tile_count, tiles_touched
from parallax.testing import run_ranks

# (64, 256) float32 in tiles of 8 rows x 32 columns: 8 x 8 tiles of 1 KiB each
SMALL = Chunking(bytes=1024, columns=32)
TILE = 8 * 32 * 4


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 256, generator=g),
        "b": torch.randn(10, generator=g),
        "half": torch.randn(12, 6, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.0),
    }


def _corrupt(path, name, at, nbytes=4):
    """Overwrite ``nbytes`` inside tensor ``name``'s data, ``at`` bytes into it."""
    shard = path / "shard-00000.safetensors"
    begin, end = read_header(shard)[name]["data_offsets"]
    start = shard.stat().st_size - max(h["data_offsets"][1] for h in read_header(shard).values())
    assert begin + at + nbytes <= end
    raw = bytearray(shard.read_bytes())
    pos = start + begin + at
    raw[pos : pos + nbytes] = bytes(255 - b for b in raw[pos : pos + nbytes])
    shard.write_bytes(bytes(raw))


def test_damaged_data_is_refused_naming_file_and_tensor(tmp_path):
    path = save_checkpoint(tmp_path / "c", 1, _tensors())
    _corrupt(path, "w", at=5000)
    ckpt = Checkpoint(path)  # the header is intact: opening succeeds
    assert torch.equal(ckpt.get("b"), _tensors()["b"])
    with pytest.raises(CheckpointError, match=r"shard-00000\.safetensors: tensor 'w' is corrupt"):
        ckpt.get("w")


def test_slices_verify_only_the_tiles_they_read(tmp_path):
    full = _tensors()["w"]
    path = save_checkpoint(tmp_path / "c", 1, _tensors(), chunking=SMALL)
    ckpt = Checkpoint(path)
    assert torch.equal(ckpt.shard("w", dim=0, rank=1, world=4), full[16:32])
    assert ckpt.bytes_verified == 2 * 8 * TILE  # 2 tile rows of 8 tiles: a quarter
    ckpt.shard("w", dim=0, rank=1, world=4)
    assert ckpt.bytes_verified == 16 * TILE  # each tile is checked once
    ckpt = Checkpoint(path)
    assert torch.equal(ckpt.shard("w", dim=1, rank=1, world=4), full[:, 64:128])
    assert ckpt.bytes_verified == 8 * 2 * TILE  # 2 tile columns of 8 tiles: a quarter
    ckpt.get("w")
    assert ckpt.bytes_verified == full.numel() * 4

    _corrupt(path, "w", at=0)  # the first tile: rows 0:8, columns 0:32
    ckpt = Checkpoint(path)
    ckpt.shard("w", dim=0, rank=1, world=4)  # other rows: not read, not checked
    ckpt.shard("w", dim=1, rank=1, world=4)  # other columns
    with pytest.raises(CheckpointError, match=r"tensor 'w' is corrupt.*rows 0:8, columns 0:32"):
        ckpt.shard("w", dim=1, rank=0, world=4)


@pytest.mark.parametrize("shape", [(7, 5, 3), (9, 4), (11,), (), (4, 0, 2)])
def test_tiles_touched_covers_exactly_the_selected_elements(shape):
    rows, cols = 3, 4
    numel, n_cols = math.prod(shape), math.prod(shape[1:])
    owner = torch.zeros(max(numel, 1), dtype=torch.long)
    for k in range(tile_count(shape, rows, cols)):
        r0, r1, c0, c1 = tile_bounds(shape, rows, cols, k)
        for r, c in itertools.product(range(r0, r1), range(c0, c1)):
            owner[r * n_cols + c] = k
    owner = owner[:numel].reshape(shape)
    indexes = [None, 1, (slice(1, 3),), (slice(None), slice(1, 3)), (slice(0, 5, 2),)]
    indexes += [(slice(None), 1, slice(0, 2)), (slice(2, 2),), (-1,)]
    for index in indexes:
        try:
            selected = owner if index is None else owner[index]
        except IndexError:
            continue
        want = set(selected.reshape(-1).tolist())
        got = set(tiles_touched(shape, index, rows, cols))
        assert want <= got, (shape, index)
        if len(shape) <= 2 or index is None or isinstance(index, int) or len(index) <= 2:
            assert got == want, (shape, index)  # exact for slices of dims 0 and 1


def test_old_checkpoints_without_checksums_load_unverified(tmp_path, caplog):
    path = save_checkpoint(tmp_path / "c", 1, _tensors())
    index = json.loads((path / "index.json").read_text())
    index["version"] = 1
    for info in index["tensors"].values():
        del info["chunks"], info["crc32"]
    (path / "index.json").write_text(json.dumps(index))
    _corrupt(path, "w", at=100)
    with caplog.at_level(logging.INFO, logger="parallax.checkpoint"):
        ckpt = Checkpoint(path)
    assert [r.message for r in caplog.records if "no checksums" in r.message] == [
        f"{path} has no checksums (format version 1): its data is not verified"
    ]
    ckpt.get("w")  # not verifiable: read as it is
    assert ckpt.bytes_verified == 0 and torch.equal(ckpt.get("b"), _tensors()["b"])


def test_missing_or_miscounted_checksums_are_a_corrupt_index(tmp_path):
    path = save_checkpoint(tmp_path / "c", 1, _tensors())
    index = json.loads((path / "index.json").read_text())
    index["tensors"]["b"]["crc32"].append(7)
    del index["tensors"]["half"]["chunks"]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor 'b' has 2 checksums"):
        Checkpoint(path)


def _read_my_slice(path):
    import torch.distributed as dist

    ckpt = Checkpoint(path)
    rank = dist.get_rank()
    try:
        read_agreed(dist.group.WORLD, lambda: ckpt.shard("w", dim=1, rank=rank, world=2))
    except CheckpointError as err:
        return str(err)
    return None


def test_ranks_agree_on_damage_only_one_of_them_read(tmp_path):
    path = save_checkpoint(tmp_path / "c", 1, _tensors(), chunking=SMALL)
    _corrupt(path, "w", at=200 * 4)  # row 0, column 200: rank 1's half
    errors = run_ranks(_read_my_slice, 2, str(path))
    assert errors[0] == errors[1] and errors[0].startswith("rank 1: ")
    assert "shard-00000.safetensors: tensor 'w' is corrupt" in errors[0]
