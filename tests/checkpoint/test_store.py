"""Checkpoint directories: atomic publish, keep-last-K, lazy reads, and every corruption named."""

import json
import multiprocessing as mp
import os

import pytest
import torch

from parallax.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorSource,
    latest_checkpoint,
    list_checkpoints,
    remove_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    staging_dir,
    step_dir,
)


def _tensors(step):
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(6, 4, generator=g),
        "embed.weight.master": torch.randn(6, 4, generator=g),
        "embed.weight.exp_avg": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "head.bias": torch.randn(5, generator=g),
        "step": torch.tensor([step]),
    }


def _save(root, step, **kw):
    return save_checkpoint(
        root, step, _tensors(step), {"config": {"lr": 0.1}, "data": [step]}, **kw
    )


def test_save_and_read_back(tmp_path):
    root = tmp_path / "ckpt"
    path = _save(root, 100)
    assert path == step_dir(root, 100) == latest_checkpoint(root)
    assert (root / "latest").read_text() == "step_00000100\n"
    ckpt = Checkpoint(path)
    assert ckpt.step == 100 and ckpt.meta == {"step": 100, "config": {"lr": 0.1}, "data": [100]}
    for name, value in _tensors(100).items():
        assert ckpt.dtype(name) == value.dtype and ckpt.shape(name) == tuple(value.shape)
        assert torch.equal(ckpt.get(name), value)
    full = _tensors(100)["embed.weight"]
    assert torch.equal(ckpt.get("embed.weight", (slice(2, 4),)), full[2:4])
    assert torch.equal(ckpt.shard("embed.weight", dim=1, rank=1, world=2), full[:, 2:])
    assert torch.equal(ckpt.shard("embed.weight", dim=0, rank=2, world=3), full[4:])
    with pytest.raises(CheckpointError, match="dim 0 of size 6 does not split into 4"):
        ckpt.shard("embed.weight", 0, 0, 4)
    index = json.loads((path / "index.json").read_text())
    assert index["weight_map"] == {n: "shard-00000.safetensors" for n in _tensors(0)}


def test_keep_last_k_and_rewriting_a_step(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 4, 5):
        _save(root, step, keep_last=2)
    assert [p.name for p in list_checkpoints(root)] == ["step_00000004", "step_00000005"]
    (root / ".step_00000003.old-0123abcd").mkdir()  # a replaced copy a crash left behind
    save_checkpoint(root, 5, {"x": torch.ones(2)}, keep_last=2)  # a resumed run saves step 5 again
    assert Checkpoint(latest_checkpoint(root)).names() == ["x"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000005"]


def test_a_failed_write_leaves_the_previous_checkpoint_alone(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    before = {p.name: p.read_bytes() for p in step_dir(root, 1).iterdir()}

    def boom():
        raise OSError("disk full")

    srcs = [TensorSource.of("a", torch.ones(3)), TensorSource("b", (2,), torch.float32, boom)]
    with pytest.raises(CheckpointError, match="rank 0: OSError: disk full"):
        save_checkpoint(root, 2, srcs, keep_last=1)
    with pytest.raises(CheckpointError, match="meta must hold JSON values only"):
        save_checkpoint(root, 3, {"a": torch.ones(1)}, {"meta": object()})
    assert latest_checkpoint(root) == step_dir(root, 1)
    assert {p.name: p.read_bytes() for p in step_dir(root, 1).iterdir()} == before
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]


def _crash_while_writing(root):
    def die():
        os._exit(3)  # the process is killed mid-write: no cleanup, no exception handling

    save_checkpoint(
        root, 2, [TensorSource.of("a", torch.ones(3)), TensorSource("b", (2,), torch.float32, die)]
    )


def test_a_killed_writer_is_ignored_and_cleaned_up(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1)
    proc = mp.get_context("fork").Process(target=_crash_while_writing, args=(root,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 3
    assert (staging_dir(root, 2) / "shard-00000.safetensors").exists()  # the half-written step
    assert latest_checkpoint(root) == step_dir(root, 1)
    Checkpoint(latest_checkpoint(root))  # still valid
    _save(root, 2)  # the restarted run writes the same step over the debris
    _save(root, 3, keep_last=5)
    assert not staging_dir(root, 2).exists()
    assert [p.name for p in list_checkpoints(root)] == [f"step_0000000{i}" for i in (1, 2, 3)]


def _killed_while_pruning(root):
    import parallax.checkpoint.store as store

    def die(path, ignore_errors=False):
        (path / "index.json").unlink()  # a first file gone, then the kill
        os._exit(3)

    store.shutil.rmtree = die
    _save(root, 3, keep_last=1)


def test_pruning_keeps_the_new_step_and_a_killed_prune_leaves_nothing_resumable(tmp_path):
    root = tmp_path / "ckpt"
    for step in (10, 20):
        _save(root, step)  # an older run's checkpoints
    _save(root, 3, keep_last=2)  # pruning by step alone would delete this one at once
    assert [p.name for p in list_checkpoints(root)] == ["step_00000003", "step_00000020"]
    assert (root / "latest").read_text() == "step_00000003\n"

    root = tmp_path / "killed"
    _save(root, 1)
    _save(root, 2)
    proc = mp.get_context("fork").Process(target=_killed_while_pruning, args=(root,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 3
    assert (root / "step_00000001.deleting").is_dir()  # renamed before its files went
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(root) == step_dir(root, 3)
    _save(root, 4, keep_last=2)  # the next prune removes the leftover
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    remove_checkpoints(root)  # what --overwrite does
    assert list(root.iterdir()) == []


def _corrupt(root, name, edit):
    path = _save(root / name, 7)
    edit(path)
    return path


def _edit_json(path, file, fn):
    data = json.loads((path / file).read_text())
    fn(data)
    (path / file).write_text(json.dumps(data))


def test_every_corruption_is_a_checkpoint_error_naming_it(tmp_path):
    shard = "shard-00000.safetensors"

    def truncate(p):
        blob = (p / shard).read_bytes()
        (p / shard).write_bytes(blob[:-10])

    def garble_header(p):
        blob = bytearray((p / shard).read_bytes())
        blob[8:16] = b"#garbage"
        (p / shard).write_bytes(bytes(blob))

    cases = {
        "does not exist": tmp_path / "nothing",
        "no index.json": _corrupt(tmp_path, "a", lambda p: (p / "index.json").unlink()),
        "no meta.json": _corrupt(tmp_path, "b", lambda p: (p / "meta.json").unlink()),
        "index.json: corrupt": _corrupt(
            tmp_path, "c", lambda p: (p / "index.json").write_text("{")
        ),
        f"{shard}: truncated": _corrupt(tmp_path, "d", truncate),
        f"{shard}: corrupt header": _corrupt(tmp_path, "e", garble_header),
        "other.safetensors: shard file named by index.json is missing": _corrupt(
            tmp_path,
            "f",
            lambda p: _edit_json(
                p, "index.json", lambda d: d["weight_map"].update(x="other.safetensors")
            ),
        ),
        "tensor 'ghost' is missing or differs": _corrupt(
            tmp_path,
            "g",
            lambda p: _edit_json(
                p,
                "index.json",
                lambda d: (
                    d["weight_map"].update(ghost=shard),
                    d["tensors"].update(ghost=d["tensors"]["step"]),
                ),
            ),
        ),
        "tensor 'head.bias' is missing or differs": _corrupt(
            tmp_path,
            "h",
            lambda p: _edit_json(
                p, "index.json", lambda d: d["tensors"]["head.bias"].update(shape=[6])
            ),
        ),
    }
    for expected, path in cases.items():
        with pytest.raises(CheckpointError, match=expected.replace(".", r"\.")):
            Checkpoint(path)
    ckpt = Checkpoint(_save(tmp_path / "ok", 7))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'head\.weight' is not in checkpoint .*close names: .*'head\.bias'",
    ):
        ckpt.get("head.weight")
    with pytest.raises(CheckpointError, match=r"lacks 2 tensors: 'layers\.0\.w', 'layers\.1\.w'"):
        ckpt.require(["embed.weight", "layers.0.w", "layers.1.w"])
    assert latest_checkpoint(tmp_path / "nowhere") is None
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="not a directory"):
        latest_checkpoint(tmp_path / "file")


def test_rng_state_is_json_and_restores():
    import random

    import numpy as np

    state = json.loads(json.dumps(rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
