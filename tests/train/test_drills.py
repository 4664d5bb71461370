"""The drill of issue 29 over the command line: each bad input or fault ends in one clear message
and a non-zero status, and loses nothing; a resumed run with changed schedule flags says what it
does. Single-process cases run ``parallax.train.main`` in this process; the cases where several
ranks matter (the ``--out`` lock between two runs, SIGTERM to torchrun) launch one torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from parallax.train.cli import main
from tests.train.conftest import BASE

LLAVA = ["--model", "llava-tiny", "--steps", "1", "--global-batch-size", "4",
         "--micro-batch-size", "2"]  # fmt: skip


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``parallax.train.main`` in this process: its status and what it said on stderr."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(argv)
    finally:
        signal.signal(signal.SIGTERM, handler)
    return status, capsys.readouterr().err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def digest(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("tb", "wandb"))
    return out


# -- the setups: each returns the argv (and may prepare files under tmp_path) ----------------------
def _lr_groups(tmp_path: Path, base: Path) -> list[str]:
    return ["--out", str(tmp_path / "o"), *BASE, "--lr-groups", "nomatch.*=1e-3"]


def _mixture_weight(tmp_path: Path, base: Path) -> list[str]:
    data = f"{tmp_path / 'a'}@abc,{tmp_path / 'b'}@0.5"
    return ["--out", str(tmp_path / "o"), *BASE, "--data", data]


def _other_model(tmp_path: Path, base: Path) -> list[str]:
    out = _copy(base, tmp_path)
    return ["--out", str(out), *BASE, "--resume", "--steps", "6", "--model", "small"]


def _locked(tmp_path: Path, base: Path) -> list[str]:
    out = _copy(base, tmp_path)
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "since": "earlier"}
    (out / ".parallax.lock").write_text(json.dumps(holder))
    return ["--out", str(out), *BASE, "--overwrite"]  # it would delete the other run's files


def _disk_full(tmp_path: Path, base: Path, monkeypatch) -> list[str]:
    from parallax.checkpoint import distributed

    write = distributed.write_shard

    def full(stage, *args, **kw):
        if "00000004" in str(stage):
            raise OSError(28, "No space left on device")
        return write(stage, *args, **kw)

    monkeypatch.setattr(distributed, "write_shard", full)
    return ["--out", str(tmp_path / "o"), *BASE]


def _image_data(tmp_path: Path, content: bytes, good: int = 7) -> list[str]:
    pil = pytest.importorskip("PIL.Image")
    pil.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(content)
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "red"}]
    samples = [
        {"id": f"s{k}", "image": "good.png" if k < good else "bad.png", "conversations": turns}
        for k in range(8)
    ]
    (tmp_path / "c.json").write_text(json.dumps(samples))
    return ["--out", str(tmp_path / "o"), *LLAVA, "--data", str(tmp_path / "c.json")]


def _garbage_image(tmp_path: Path, base: Path) -> list[str]:
    return _image_data(tmp_path, b"this is not an image at all" * 10)


def _truncated_png(tmp_path: Path, base: Path) -> list[str]:
    pil = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    pil.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(tmp_path / "full.png")
    return _image_data(tmp_path, (tmp_path / "full.png").read_bytes()[:-300], good=0)


def _nan_episode(tmp_path: Path, base: Path) -> list[str]:
    """A parallax dataset whose episode 1 got a NaN action at step 2 after it was written
    (the writer refuses one: :func:`test_convert_refuses_non_finite_actions_and_writes_0644`)."""
    from safetensors.torch import load_file, save_file

    from parallax.data import convert

    data = tmp_path / "ds"
    assert convert.main(["synthetic", str(data), "--episodes", "4", "--image-size", "56"]) == 0
    file = data / "episodes" / "episode_000001.safetensors"
    tensors = load_file(str(file))
    tensors["actions"][2, 3] = float("nan")
    save_file(tensors, str(file))
    return ["--out", str(tmp_path / "o"), *BASE, "--data", str(data), "--workers", "0"]


def _export_over_a_file(tmp_path: Path, base: Path) -> list[str]:
    out = tmp_path / "o"
    out.mkdir()
    (out / "hf").write_text("a file where the export goes")
    return ["--out", str(out), *BASE, "--export-hf", "--save-interval", "0"]


def _oft_flag_on_llava(tmp_path: Path, base: Path) -> list[str]:
    return ["--out", str(tmp_path / "o"), *LLAVA, "--film"]


def _robot_flag_on_siglip(tmp_path: Path, base: Path) -> list[str]:
    return ["--out", str(tmp_path / "o"), "--model", "siglip-tiny", *BASE, "--augment"]


def _oft_resumes_tokens(tmp_path: Path, base: Path) -> list[str]:
    out = _copy(base, tmp_path)
    return ["--out", str(out), *BASE, "--resume", "--steps", "6", "--action-head", "l1"]


def _episodes(tmp_path: Path, episodes: int = 4) -> Path:
    from parallax.data import convert

    data = tmp_path / "ds"
    assert convert.main(["synthetic", str(data), "--episodes", str(episodes)]) == 0
    return data


def _chunk_past_every_episode(tmp_path: Path, base: Path) -> list[str]:
    data = _episodes(tmp_path)
    oft = ["--action-head", "l1", "--action-chunk", "500", "--data", str(data)]
    return ["--out", str(tmp_path / "o"), *BASE, *oft]


@dataclass
class Drill:
    name: str
    setup: Callable[..., list[str]]
    status: int
    says: tuple[str, ...]  # substrings of the one message
    step: bool = False  # found by a step's batch (the run started): no metrics row for it


DRILLS = [
    Drill("lr-groups glob", _lr_groups, 2, ("--lr-groups 'nomatch.*' matches no parameter",)),
    Drill("mixture weight", _mixture_weight, 2, ("the weight 'abc' after '@' is not a number",)),
    Drill(
        "resume another model",
        _other_model,
        2,
        ("the model differs from the one saved", "--model tiny", "--model small"),
    ),
    Drill("--out in use", _locked, 2, ("is in use by another run (pid", "since earlier")),
    Drill(
        "disk full",
        _disk_full,
        2,
        (
            "saving checkpoint step 4 failed while writing: rank 0: OSError: [Errno 28]",
            "step_00000002, is the last good one",
        ),
    ),  # fmt: skip
    Drill(
        "LLaVA garbage image", _garbage_image, 2, ("sample 's7': cannot decode image", "bad.png")
    ),
    Drill(
        "LLaVA truncated PNG",
        _truncated_png,
        2,
        ("cannot decode image", "bad.png", "truncated"),
        step=True,
    ),
    Drill(
        "NaN action",
        _nan_episode,
        2,
        ("episode 1 (episodes/episode_000001.safetensors), step 2", "is not finite"),
        step=True,
    ),
    Drill(
        "export over a file",
        _export_over_a_file,
        2,
        ("--export-hf writes", "hf, which is a file here", "nothing has run yet"),
    ),
    Drill(
        "OFT flag on LLaVA",
        _oft_flag_on_llava,
        2,
        ("--film is an option of the openvla family; the llava family does not read it",),
    ),
    Drill(
        "robot flag on SigLIP",
        _robot_flag_on_siglip,
        2,
        ("--augment: the siglip family does not read it",),
    ),
    Drill(
        "OFT resumes a token run",
        _oft_resumes_tokens,
        2,
        ("written by a run of OpenVLA's action tokens", "drop --action-head l1"),
    ),
    Drill(
        "chunk past every episode",
        _chunk_past_every_episode,
        2,
        ("every episode is shorter than the action chunk of 500 steps", "the longest has"),
    ),
]


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_drill(drill: Drill, base, tmp_path, capsys, monkeypatch):
    kw = {"monkeypatch": monkeypatch} if "monkeypatch" in drill.setup.__code__.co_varnames else {}
    argv = drill.setup(tmp_path, base, **kw)
    out = Path(argv[argv.index("--out") + 1])
    before = digest(out) if out.exists() else {}
    status, err = run_main(argv, capsys)
    assert status == drill.status, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parallax.train: error: "), err
    for text in drill.says:
        assert text in lines[0], (text, err)
    assert "Traceback" not in err
    assert not (out / ".parallax.lock").exists() or before.get(".parallax.lock"), "lock left"
    if before:  # nothing of the run that was there is lost
        after = digest(out)
        assert {k: v for k, v in after.items() if k in before} == before
    if drill.name == "disk full":  # the steps before the failed save are kept
        assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
        kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
        assert kept == ["step_00000002"], kept


def test_oft_trains_on_an_episode_folder(tmp_path, capsys, caplog):
    """--action-head l1 on the README's own data path (convert / write_dataset folders): every
    sample carries its chunk; an episode shorter than it is named with its length."""
    from parallax.data import Episode, write_dataset

    rng = np.random.default_rng(0)
    lengths = (12, 3, 10)
    episodes = [
        Episode(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
                rng.normal(size=(n, 7)).astype(np.float32), "pick up the cup")
        for n in lengths
    ]  # fmt: skip
    write_dataset(tmp_path / "mine", episodes, name="mine")
    argv = ["--out", str(tmp_path / "o"), *BASE, "--steps", "2", "--data", str(tmp_path / "mine")]
    status, err = run_main([*argv, "--action-head", "l1", "--action-chunk", "4"], capsys)
    assert status == 0, err
    assert "episode 1 (3 steps) shorter than the action chunk of 4 steps" in caplog.text
    assert [r["step"] for r in metrics(tmp_path / "o")] == [1, 2]


def test_an_oft_checkpoint_resumed_without_its_head_names_it(tmp_path, capsys):
    """Resumed without --action-head l1 (or at another chunk), an OFT run's checkpoint is
    refused naming its head and the flags that resume it, not a missing optimizer state."""
    out = tmp_path / "oft"
    oft = ["--action-head", "l1", "--action-chunk", "2"]
    status, err = run_main(["--out", str(out), *BASE, "--steps", "2", *oft], capsys)
    assert status == 0, err
    before = digest(out)
    for extra, says in (
        ([], "written by an OpenVLA-OFT run (L1 head, chunks of 2, FiLM off)"),
        (["--action-head", "l1", "--action-chunk", "3"], "predicts chunks of 2, FiLM off"),
    ):
        status, err = run_main(["--out", str(out), *BASE, "--resume", *extra], capsys)
        line = err.strip().splitlines()
        assert status == 2 and len(line) == 1 and says in line[0], err
        assert "resume with --action-head l1 --action-chunk 2" in line[0], err
        assert "lm_head" not in line[0]
    assert digest(out) == before  # nothing of the run changed


def test_a_resume_in_warm_up_says_so():
    from parallax.run import TrainConfig
    from parallax.train.lr_schedule import schedule_changes

    saved = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 20, "steps": 3}
    run = TrainConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=20, steps=10)
    lines = schedule_changes(saved, run, 3)
    assert "still in its warm-up of 20 steps (it never decayed)" in lines[1], lines
    assert not any("finished its cosine decay" in line for line in lines)


def test_resume_follows_changed_schedule_flags_and_takes_a_stale_lock(base, tmp_path, caplog):
    """``--resume --steps 6 --lr 2e-3`` on the finished 4-step cosine run: step 5 trains at
    the new schedule's lr (not the finished run's 0), and one line says what changed; a lock
    left by a process that is gone is taken over with a note."""
    from parallax.train import parse_args
    from parallax.train.lr_schedule import lr_lambda

    out = _copy(base, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = {"host": socket.gethostname(), "pid": dead.pid, "since": "yesterday"}
    (out / ".parallax.lock").write_text(json.dumps(holder))
    argv = ["--out", str(out), *BASE, "--resume", "--steps", "6", "--lr", "2e-3"]
    caplog.set_level("INFO")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    said = caplog.text
    assert f"taking over the lock of a run that is gone (pid {dead.pid}" in said, said
    assert "follows this run's flags (--lr 0.001 -> 0.002, --steps 4 -> 6)" in said, said
    assert "had finished its cosine decay at step 4" in said and "restarts" in said, said
    assert "--lr RATE" in said and "--lr 0 " not in said, said  # a floor of 0 is no rate
    cfg = parse_args(argv)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    want = [2e-3 * lr_lambda(cfg)(s - 1) for s in (5, 6)]
    assert [r["lr"] for r in rows[4:]] == pytest.approx(want, rel=1e-6)
    assert rows[3]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + np.cos(np.pi * 2 / 3)), rel=1e-6)
    assert not (out / ".parallax.lock").exists()


def test_unchanged_flags_resume_silently(base, tmp_path, caplog):
    from parallax.train import parse_args, resolve
    from parallax.train.lr_schedule import schedule_changes

    ckpt = json.loads((base / "checkpoints" / "step_00000002" / "meta.json").read_text())
    cfg = resolve(parse_args(["--out", str(base), *BASE]))  # what the run resolved
    assert cfg.lr == 1e-3
    assert schedule_changes(ckpt["config"], cfg, 2) == []
    (line,) = schedule_changes(ckpt["config"], cfg.replace(min_lr=1e-5), 2)
    assert "--min-lr 0 -> 1e-05" in line and "step 3 trains at lr" in line
    step = cfg.replace(lr_schedule="step", lr_decay_steps=3, lr_decay=0.5)
    (line,) = schedule_changes({**ckpt["config"], "lr_decay": 0.1}, step, 2)
    assert "--lr-decay 0.1 -> 0.5" in line and "--lr-schedule cosine -> step" in line


def test_convert_refuses_non_finite_actions_and_writes_0644(tmp_path, capsys):
    from parallax.data import convert

    for k in range(2):
        ep = tmp_path / "src" / f"ep{k}"
        ep.mkdir(parents=True)
        np.save(ep / "images.npy", np.zeros((4, 8, 8, 3), np.uint8))
        actions = np.zeros((4, 7), np.float32)
        np.save(ep / "actions.npy", actions)
        (ep / "instruction.txt").write_text("pick")
    assert convert.main(["folder", str(tmp_path / "src"), str(tmp_path / "good")]) == 0
    modes = {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "good").rglob("*") if p.is_file()}
    assert modes == {oct(0o666 & ~_umask())}, modes
    actions[3, 0] = np.inf
    np.save(tmp_path / "src" / "ep1" / "actions.npy", actions)
    capsys.readouterr()
    assert convert.main(["folder", str(tmp_path / "src"), str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "ep1/actions.npy: step 3: the action [inf, 0.0" in err and "not finite" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_readers_refuse_non_finite_actions_and_states(tmp_path):
    pytest.importorskip("h5py")
    from benchmarks.data.writers import make_episodes, write_libero
    from parallax.data.mixture import open_source
    from parallax.data.stats import DatasetError

    episodes = make_episodes(3, size=8)
    episodes[1].actions = episodes[1].actions.copy()
    episodes[1].actions[2, 1] = np.nan
    write_libero(tmp_path / "a", {"open_it": episodes})
    with pytest.raises(DatasetError, match=r"episode 1 \(data/demo_1\): step 2: the action"):
        open_source(f"libero:{tmp_path / 'a'}")
    episodes = make_episodes(3, size=8)
    episodes[2].states = episodes[2].states.copy()
    episodes[2].states[0, 0] = np.inf
    write_libero(tmp_path / "b", {"open_it": episodes})
    with pytest.raises(DatasetError, match=r"episode 2 \(data/demo_2\): step 0: the state"):
        open_source(f"libero:{tmp_path / 'b'}")


# -- several ranks: the lock between two runs, SIGTERM to torchrun ------------------------------
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_sigterm_saves_and_resumes_and_the_lock_refuses_a_second_run(tmp_path, capsys):
    """torchrun with 2 ranks; while it trains, a second run into the same --out (with
    --overwrite, which would delete it) stops with one message and touches nothing. Then
    SIGTERM to torchrun (a scheduler's preemption): every rank saves the same step, rank 0 says
    ``preempted: saved step N``, the lock is released, and --resume carries on from N."""
    out = tmp_path / "run"
    args = [*BASE[2:], "--steps", "40", "--save-interval", "0", "--log-interval", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", "parallax.train", "--out", str(out), *args]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step was logged"
            time.sleep(0.1)
        before = (out / "metrics.jsonl").read_text()
        status, err = run_main(["--out", str(out), *args, "--overwrite"], capsys)
        assert status == 2 and "is in use by another run (pid" in err, err
        assert len(err.strip().splitlines()) == 1
        assert (out / "metrics.jsonl").read_text().startswith(before)  # nothing deleted
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    ours = [line for line in err.splitlines() if line.startswith("parallax.train")]
    assert len(ours) == 1 and "preempted (SIGTERM): saved step" in ours[0], err[-3000:]
    step = int(ours[0].split("saved step ")[1].split(";")[0])
    assert launcher.returncode != 0 and "most likely because another rank failed" not in err
    assert (out / "checkpoints" / f"step_{step:08d}").is_dir()
    assert not (out / ".parallax.lock").exists()
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 1))
    resumed = ["--out", str(out), *args, "--resume", "--steps", str(step + 1)]
    status, err = run_main(resumed, capsys)
    assert status == 0, err
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 2))


def test_the_stop_request_of_one_rank_reaches_every_rank():
    from parallax.testing import run_ranks

    assert run_ranks(_stop_agreement, 2) == [(0.5, True), (0.5, True)]


def _stop_agreement():
    import torch.distributed as dist

    from parallax import comm
    from parallax.testing import context

    ctx = context(dp=2)
    rank = dist.get_rank()
    found, (wait, stop) = comm.problems_and_max(
        None, (0.5 * rank, float(rank == 1)), ctx.world_group
    )
    assert found == []
    return wait, stop > 0


def test_dry_run_on_synthetic_data_says_nothing_of_robot_workers(capsys):
    from parallax.train import parse_args
    from parallax.train.dry_run import data_note

    note = data_note(parse_args(["--dry-run"]))
    assert "built-in task" in note and "worker" not in note, note
    assert "decoding worker" in data_note(parse_args(["--dry-run", "--data", "rlds:/x"]))


def test_decoded_images_are_writable():
    pil = pytest.importorskip("PIL.Image")
    import io
    import warnings

    from parallax.data.pairs import decode_image

    buf = io.BytesIO()
    pil.new("RGB", (5, 4), (1, 2, 3)).save(buf, format="PNG")
    image = decode_image(buf.getvalue(), "png", "x.png")
    assert image.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.as_tensor(image)
