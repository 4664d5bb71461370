"""The docs' runner (``tests/warm.py``): forked commands keep their exit codes, output and argv;
torchrun's form gives its ranks a working process group; a failing rank or a timeout stops the
rest instead of hanging."""

import sys

from tests import warm

SCRIPT = r"""
import os, sys, time
import torch, torch.distributed as dist
say = lambda *words: os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write a line
say("rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"), sys.argv[1:])
if "RANK" in os.environ:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    say("sum", int(t.item()))
    if sys.argv[1:] == ["fail"] and dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()  # rank 0 waits here for a rank that left: the runner must stop it
if sys.argv[1:] == ["sleep"]:
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


def _run(warm_server, tmp_path, argv, timeout=60):
    (tmp_path / "a.py").write_text(SCRIPT)
    planned = warm.plan([sys.executable, *argv])
    assert planned is not None, argv
    return warm_server.run(planned, tmp_path, warm.command_env(), timeout)


def test_plan_takes_python_and_standalone_torchrun_only():
    assert warm.plan([sys.executable, "-m", "parallax.train", "--steps", "2"]) == (
        ["-m", "parallax.train", "--steps", "2"],
        0,
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert warm.plan([*run, "--nproc-per-node", "4", "x.py", "--a"]) == (["x.py", "--a"], 4)
    assert warm.plan([*run, "--nproc-per-node=2", "-m", "m"]) == (["-m", "m"], 2)
    assert warm.plan([*run, "--nnodes", "2", "x.py"]) is None  # a launcher option: real torchrun
    assert warm.plan(["ls"]) is None


def test_exit_codes_and_output_are_the_commands(warm_server, tmp_path):
    assert _run(warm_server, tmp_path, ["a.py", "0"]) == (0, "rank None of None ['0']\n")
    code, out = _run(warm_server, tmp_path, ["a.py", "5"])
    assert code == 5 and "['5']" in out


def test_torchrun_form_gives_ranks_a_process_group(warm_server, tmp_path):
    run = ["-m", "torch.distributed.run", "--nproc-per-node=3", "a.py"]
    code, out = _run(warm_server, tmp_path, run)
    assert code == 0 and out.count("sum 3") == 3, out


def test_a_failing_rank_or_a_timeout_stops_the_rest(warm_server, tmp_path):
    run = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "a.py"]
    code, out = _run(warm_server, tmp_path, [*run, "fail"])  # rank 0 waits at a barrier meanwhile
    assert code == 3 and out.count("['fail']") == 2, out
    assert _run(warm_server, tmp_path, ["a.py", "sleep"], timeout=2)[0] == -9
