"""The command a user types: torchrun -m parallax.train, its files, its failures, resume."""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.recipe import resolve
from tests import warm

KEYS = {"step", "loss", "action_accuracy", "l1", "lr", "grad_norm", "tokens_per_s", "mfu"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_cmd(nproc: int, *args: str, extra: tuple = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *extra,
        "-m",
        "parallax.train",
        *args,
    ]


def torchrun(nproc: int, *args: str, extra: tuple = (), timeout: float = 240, **kw):
    return subprocess.run(
        torchrun_cmd(nproc, *args, extra=extra),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def launch(nproc: int, *args: str, extra: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd(nproc, *args, extra=extra),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def single(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m parallax.train ARGS`` in this process, through ``main`` (what the module
    runs; the commands above start it as a process): its status, stdout and stderr."""
    from parallax.train.cli import main

    handler = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    try:
        status = main(list(args))
    finally:
        signal.signal(signal.SIGTERM, handler)
    out, err = capsys.readouterr()
    return status, out, err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


RUN = (
    "--steps",
    "8",
    "--global-batch-size",
    "16",
    "--micro-batch-size",
    "2",
    "--save-interval",
    "4",
    "--log-interval",
    "4",
    "--warmup-steps",
    "2",
    "--lr",
    "2e-3",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The README's CI command: tp2 pp2 dp2 on 8 CPU ranks, a short run (in the warm pool of
    8 ranks; tests/test_readme.py runs the README's command itself under torchrun)."""
    from parallax.testing import run_ranks

    out = tmp_path_factory.mktemp("tp2pp2dp2")
    run_ranks(_run_in_pool, 8, 2, 2, 2, str(out), timeout=300)
    return out, metrics(out)


def test_default_command_learns_and_logs(reference):
    out, rows = reference
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r.keys() >= KEYS for r in rows)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step_00000004",
        "step_00000008",
    ]


def _run_in_pool(tp, pp, dp, out, stop_after=None, resume=False):
    from parallax.testing import context
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    ctx = context(tp=tp, pp=pp, dp=dp)
    cfg = parse_args(
        ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", out, *RUN]
        + (["--resume"] if resume else [])
    )
    run(resolve_run(cfg), ctx, stop_after=stop_after)
    return True


def _losses(out: Path, start: int = 1) -> list[float]:
    return [r["loss"] for r in metrics(out) if r["step"] >= start]


def test_resume_at_another_layout_matches_uninterrupted(reference, tmp_path):
    from parallax.testing import run_ranks

    _, ref = reference
    later = [r["loss"] for r in ref if r["step"] > 4]
    # interrupted after step 4 at tp2 pp2, resumed at dp2 (another layout); a resume at the
    # same layout (dp2) is test_killed_rank_stops_the_run_and_torchrun_restart_resumes's
    run_ranks(_run_in_pool, 4, 2, 2, 1, str(tmp_path / "a"), 4)
    run_ranks(_run_in_pool, 2, 1, 1, 2, str(tmp_path / "a"), None, True)
    steps = [r["step"] for r in metrics(tmp_path / "a")]
    assert steps == list(range(1, 9)), steps
    assert _losses(tmp_path / "a", 5) == pytest.approx(later, rel=1e-4)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _kill_one_worker(launcher: subprocess.Popen) -> list[int]:
    """SIGKILL one training worker (a child of torchrun's agent); the others' pids."""
    children = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    assert children, "no worker processes found"
    os.kill(int(children[-1]), signal.SIGKILL)
    return [int(pid) for pid in children[:-1]]


def test_killed_rank_stops_the_run_and_torchrun_restart_resumes(reference, tmp_path):
    """kill -9 of one worker under ``torchrun --max-restarts 1 ... --resume`` (from scratch the
    first time): the surviving rank says once why it stopped, with no traceback of its own,
    and the restarted workers carry on from the last checkpoint to the uninterrupted losses.
    (torchrun's status and summary for a failed worker: the bad-layout test below.)"""
    _, ref = reference
    args = ("--out", str(tmp_path / "k"), *RUN, "--save-interval", "2", "--resume")
    launcher = launch(2, *args, extra=("--max-restarts=1",))
    _wait_for(tmp_path / "k" / "checkpoints" / "step_00000002", launcher)
    survivors, t0 = _kill_one_worker(launcher), time.monotonic()
    while any(_alive(pid) for pid in survivors):  # they stop promptly, before the restart
        assert time.monotonic() - t0 < 60, "a surviving rank trains on after its peer died"
        time.sleep(0.1)
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, err[-3000:]
    # the surviving rank 0's one line (a failed collective, or torchrun's SIGTERM before the
    # restart); torchrun names the killed rank before it restarts the workers
    stopped = [line for line in err.splitlines() if line.startswith("parallax.train: rank")]
    assert len(stopped) == 1, err[-3000:]
    assert stopped[0].startswith("parallax.train: rank 0: stopped"), err[-3000:]
    assert "Exception ignored" not in err and "SystemExit" not in err, err[-3000:]
    assert "Traceback" not in err and "(exitcode: -9) local_rank: 1" in err, err[-3000:]
    rows = metrics(tmp_path / "k")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-4)


def test_ranks_leave_when_their_launcher_dies(tmp_path):
    """kill -9 of torchrun: every worker saves after its step, releases the lock of --out and
    leaves with one line; none trains on headless."""
    out = tmp_path / "orphaned"
    launcher = launch(2, "--out", str(out), *RUN, "--steps", "400", "--save-interval", "2")
    _wait_for(out / "checkpoints" / "step_00000002", launcher)
    workers = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(workers) == 2, workers
    os.kill(launcher.pid, signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)  # the workers hold the pipe until they leave
    deadline = time.monotonic() + 30
    while any(_alive(int(w)) for w in workers):
        assert time.monotonic() < deadline, "a worker trains on without its launcher"
        time.sleep(0.1)
    ours = [line for line in err.splitlines() if line.startswith("parallax.train:")]
    assert len(ours) == 1 and "the launcher (pid" in ours[0] and "is gone" in ours[0], err[-2000:]
    saved = int(ours[0].split("saved step ")[1].split()[0])
    assert (out / "checkpoints" / f"step_{saved:08d}").is_dir() and saved < 400
    assert not (out / ".parallax.lock").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().split()[2] == "Z")  # a zombie has left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_on_one_machine(tmp_path):
    """Two torchrun launchers, one a node, meet at one rendezvous and train data-parallel across
    them (one process a node: the launch is what is tested, not the layout)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={n}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "parallax.train",
                "--dp",
                "2",
                "--steps",
                "2",
                "--global-batch-size",
                "4",
                "--micro-batch-size",
                "2",
                "--out",
                str(tmp_path / "nodes"),
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "nodes")] == [1, 2]


def test_bad_layout_fails_on_every_rank_and_rank_0_says_it(tmp_path):
    proc = torchrun(2, "--tp", "3", "--out", str(tmp_path))
    err = proc.stderr
    message = "parallax.train: error: world size 2 is not divisible by tp*pp = 3*1 = 3"
    assert err.startswith(message), err  # the first line a user reads
    assert proc.returncode == 1  # torchrun's status for any failed worker
    # rank 0 exits 2 and its line is the root cause in torchrun's summary; rank 1 exits 2 too
    # once it has made the same check, but the check needs no collective, so a rank 1 still
    # starting up (a loaded machine) when rank 0 has left is stopped by torchrun instead
    root = err.split("Root Cause")[1]
    assert "rank      : 0" in root and "exitcode  : 2 (pid" in root and message in root, err
    stopped = err.count("exitcode  : -15 (pid") + err.count("exitcode  : 143 (pid")
    assert err.count("exitcode  : 2 (pid") + stopped == 2, err
    assert err.count(message) == 2 and root.count(message) == 1, err  # said once, summarised once
    assert err.count("Traceback") == 1 and "ChildFailedError" in err  # torchrun's own


def test_dry_run_under_torchrun_prints_the_plan_once(warm_server, tmp_path):
    """Two ranks with torchrun's environment, forked warm (``tests/warm.py``)."""
    planned = warm.plan(torchrun_cmd(2, "--dry-run", "--tp", "2"))
    code, out = warm_server.run(planned, tmp_path, warm.command_env(), 120)
    assert code == 0, out[-3000:]
    assert out.count("parallax plan") == 1, out
    assert "tp2 pp1 dp1 = 2 ranks" in out and "not under torchrun" not in out


def test_bad_inputs_fail_before_training(tmp_path, capsys):
    """In this process, through ``main`` (``test_bad_layout_fails_on_every_rank...`` runs the
    command itself under torchrun)."""
    from parallax.train.cli import main

    cases = [
        (["--global-batch-size", "30", "--micro-batch-size", "4"], "not divisible by micro batch"),
        (["--data", str(tmp_path / "nope")], "nope"),
        (["--model", "llama-9000"], "neither a preset"),
        (["--schedule", "1f1b", "--pp", "2"], "world size 1"),
        (["--chunks", "2"], "--chunks 2 needs --schedule interleaved"),
    ]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        for args, message in cases:
            assert main(["--out", str(tmp_path / "o"), *args]) == 2, args
            err = capsys.readouterr().err
            assert err.startswith("parallax.train: error: ") and message in err, (args, err)
            assert "Traceback" not in err, err
            assert not (tmp_path / "o" / "metrics.jsonl").exists()
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_bad_values_end_in_one_line_and_status_2(tmp_path, capsys):
    from parallax.train.cli import main

    (tmp_path / "file").write_text("")
    (tmp_path / "run.toml").write_text('steps = "100"\n')
    handler = signal.getsignal(signal.SIGTERM)
    try:
        for args, message in (
            (["--steps", "ten"], "--steps ten: expected an integer"),
            (["--out", str(tmp_path / "file")], "is a file, not a directory"),
            (["--config", str(tmp_path / "run.toml")], 'steps = "100": expected an integer'),
        ):
            assert main(args) == 2
            err = capsys.readouterr().err
            assert err.startswith("parallax.train: error: ") and message in err, err
            assert len(err.splitlines()) == 1, err
    finally:
        signal.signal(signal.SIGTERM, handler)


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _scribble(shard: Path) -> str:
    """Write random bytes into the middle of the largest tensor's data (the header intact);
    return the tensor's name."""
    import random

    from parallax.checkpoint import read_header

    header = {k: v for k, v in read_header(shard).items() if k != "__metadata__"}
    name = max(header, key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    start = shard.stat().st_size - max(v["data_offsets"][1] for v in header.values())
    raw = bytearray(shard.read_bytes())
    pos = start + (begin + end) // 2
    raw[pos : pos + 64] = random.Random(0).randbytes(64)
    shard.write_bytes(bytes(raw))
    return name


def test_corrupt_or_partial_checkpoint_is_refused_untouched(reference, tmp_path, capsys):
    import shutil

    src, _ = reference
    cases = (
        ("truncate", "shard-00000.safetensors"),
        ("meta", "meta.json"),
        ("corrupt", "shard-00004.safetensors: tensor '"),
    )
    for damage, message in cases:
        out = tmp_path / damage
        shutil.copytree(src / "checkpoints", out / "checkpoints")
        last = out / "checkpoints" / "step_00000008"
        if damage == "truncate":
            shard = last / "shard-00000.safetensors"
            shard.write_bytes(shard.read_bytes()[:-100])
        elif damage == "corrupt":  # inside a tensor's data: only its checksum can tell
            name = _scribble(last / "shard-00004.safetensors")
            message += f"{name}' is corrupt"
        else:
            (last / "meta.json").unlink()
        before = _digest(out)
        status, _, err = single(capsys, "--out", str(out), *RUN, "--resume", "--steps", "10")
        assert status == 2, err[-2000:]
        assert message in err, err[-2000:]
        assert _digest(out) == before  # nothing written, nothing removed


def _resume_expecting_error(tp, pp, dp, out, steps):
    from parallax.testing import context
    from parallax.train import parse_args
    from parallax.train.cli import UserError, resolve_run, run

    ctx = context(tp=tp, pp=pp, dp=dp)
    args = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", out, *RUN]
    try:
        run(resolve_run(parse_args([*args, "--resume", "--steps", str(steps)])), ctx)
    except UserError as err:
        return str(err)
    return None


def test_damage_one_rank_reads_is_refused_on_every_rank(reference, tmp_path):
    import shutil

    from parallax.testing import run_ranks

    src, _ = reference
    shutil.copytree(src / "checkpoints", tmp_path / "c" / "checkpoints")
    last = tmp_path / "c" / "checkpoints" / "step_00000008"
    name = _scribble(last / "shard-00004.safetensors")  # the last stage's: rank 1 at pp 2
    errors = run_ranks(_resume_expecting_error, 2, 1, 2, 1, str(tmp_path / "c"), 10)
    assert errors[0] == errors[1] and errors[0].startswith("--resume: rank 1: "), errors
    assert f"shard-00004.safetensors: tensor '{name}' is corrupt" in errors[0]


def test_resume_with_no_steps_left_fails(reference, tmp_path, capsys):
    import shutil

    src, _ = reference
    shutil.copytree(src / "checkpoints", tmp_path / "checkpoints")
    args = ("--out", str(tmp_path), *RUN, "--resume", "--steps", "6")  # (equal: see
    status, _, err = single(capsys, *args)  # tests/families/openvla/test_run_safety.py)
    assert status == 2, err[-2000:]
    assert "is at step 8 and --steps is 6: nothing left to train" in err
    assert "raise --steps above 8" in err


def test_dry_run_prints_the_plan(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status, out, err = single(capsys, "--dry-run", "--tp", "2", "--pp", "2", "--dp", "2")
    assert status == 0, err
    for text in ("tp2 pp2 dp2 = 8 ranks", "vision", "head", "rank 1 | 1F0", "bubble"):
        assert text in out, out
    assert "not under torchrun: planning for the 8 processes" in out


def test_dry_run_outside_torchrun_says_it_plans_one_process(monkeypatch):
    import io

    from parallax.train import parse_args
    from parallax.train.cli import resolve_run
    from parallax.train.dry_run import print_plan

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = io.StringIO()
    print_plan(resolve_run(parse_args(["--dry-run"])), file=out)
    assert "not under torchrun: planning for one process; pass --dp N" in out.getvalue()
    assert "tp1 pp1 dp1 = 1 rank;" in out.getvalue()


def test_toml_config_and_flag_override(tmp_path):
    from parallax.train import parse_args

    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nglobal-batch-size = 64\nschedule = "gpipe"\n')
    cfg = parse_args(["--config", str(path), "--steps", "9"])
    assert (cfg.steps, cfg.global_batch_size, cfg.schedule) == (9, 64, "gpipe")
    path.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match="unknown keys"):
        resolve(parse_args(["--config", str(path)]))


@pytest.mark.parametrize(
    "toml, message",
    [
        ('steps = "100"', 'steps = "100": expected an integer, not a string (write it without'),
        ('lr = "fast"', 'lr = "fast": expected a number, not a string (or leave it out)'),
        ("tp = 1.5", "tp = 1.5: expected an integer"),
        ('resume = "yes"', 'resume = "yes": expected true or false, not a string'),
        ("steps = true", "steps = true: expected an integer"),
        ('schedule = "fast"', 'schedule = "fast": expected one of gpipe, 1f1b, interleaved'),
        ("steps = = 3", "not a valid TOML file: "),
    ],
)
def test_toml_values_are_checked_against_their_flags(tmp_path, toml, message):
    from parallax.train import parse_args

    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ValueError) as err:
        resolve(parse_args(["--config", str(path)]))
    assert str(err.value).startswith(f"--config {path}: {message}"), str(err.value)


def test_command_line_values_and_config_fields_are_checked():
    from parallax.train import TrainConfig, parse_args

    for argv, message in (
        (["--tp", "1.5"], "--tp 1.5: expected an integer"),
        (["--lr", "fast"], "--lr fast: expected a number (or leave it out)"),
        (["--timeout", "inf"], "--timeout inf: expected a finite number"),
        (["--precision", "fp8"], "--precision fp8: expected one of fp32, bf16"),
        (["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve(parse_args(argv))
    cfg = parse_args(["--lr", "1", "--tp", "2"])  # an integer is a fine float
    assert (cfg.lr, type(cfg.lr), cfg.tp) == (1.0, float, 2)
    with pytest.raises(ValueError, match=re.escape('steps = "100": expected an integer')):
        TrainConfig(steps="100").check()  # a config built in Python is checked too
