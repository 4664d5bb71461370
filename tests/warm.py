"""Run a Python command as a fresh process forked from one warm interpreter.

Starting a process that trains costs about 4 s of CPU before its first line of work (torch, then
torch._dynamo, which every torch optimizer imports, then parallax); the docs' blocks start about
ninety such processes, torchrun's ranks included, and that was most of their time. A server that
has imported all of it once forks a child per process instead: each child is still a process of
its own (its own globals, exit hooks, process group), with the command's argv, working directory
and environment, output redirected at the file-descriptor level.

``torchrun --standalone --nproc-per-node N (-m module | script) args`` runs as torchrun's workers
would: N children with the environment torchrun gives its workers (ranks, world size, a free
``MASTER_PORT`` that rank 0 serves); when one fails the others are stopped, as torchrun does. What
torchrun itself does (restarts, rendezvous, its failure summary) is tested with the real launcher
in ``tests/train/test_cli.py``. Anything else returns None from :func:`plan` and runs as usual.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "parallax.train.cli", "parallax.plan.cli")
TORCHRUN = ("-m", "torch.distributed.run")


def command_env() -> dict[str, str]:
    """The environment of the commands tests run: this checkout importable, one torch thread a
    process, collectives that give up after 120 s, and no torchrun above them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PARALLAX_TIMEOUT_S="120")
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def plan(argv: list[str]) -> tuple[list[str], int] | None:
    """(python argv after the interpreter, ranks) for a command the server can run, else None."""
    if not argv or argv[0] != sys.executable:
        return None
    words = argv[1:]
    if tuple(words[:2]) != TORCHRUN:
        return (words, 0) if words and (words[0] == "-m" or words[0].endswith(".py")) else None
    words, ranks = words[2:], 1
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0).partition("=")
        if flag == "--standalone":
            continue
        if flag != "--nproc-per-node":
            return None  # another launcher option: the real torchrun
        ranks = int(value or words.pop(0))
    return (words, ranks) if words else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(env: dict[str, str], rank: int, ranks: int, port: int, run_id: str) -> dict:
    """The variables torchrun sets for a worker of a one-node standalone run."""
    return dict(
        env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        ROLE_WORLD_SIZE=str(ranks),
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="False",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )


def _child(words: list[str], cwd: str, env: dict[str, str], out: int) -> None:
    """In the forked child: become the command, run it, leave with its exit code."""
    import atexit
    import runpy
    import traceback

    os.setsid()  # its own group: a timeout stops what it started too
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not its input
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = cwd if words[0] == "-m" else str(Path(cwd, words[0]).parent)
    code = 0
    try:
        if words[0] == "-m":
            sys.argv = [words[1], *words[2:]]
            runpy.run_module(words[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(words)
            runpy.run_path(words[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the command's own failure, reported as Python would
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pids: list[int], timeout: float) -> int:
    """Every child's end; the first failure (or a timeout) stops the rest, as torchrun does."""
    deadline, codes = time.monotonic() + timeout, {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(c != 0 for c in codes.values())
        if failed or time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)  # the child and what it started
                    except ProcessLookupError:  # not yet its own group leader
                        os.kill(pid, signal.SIGKILL)
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return next((c for c in codes.values() if c != 0), 0) if failed else -9
        time.sleep(0.02)
    return 0


def serve() -> None:
    """The server's loop: one JSON request a line on stdin, one exit code a line on stdout."""
    import importlib

    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print of the server's own goes to stderr, not into the replies
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        req = json.loads(line)
        port, run_id = _free_port(), uuid.uuid4().hex
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        pids = []
        for rank in range(max(1, req["ranks"])):
            env = req["env"]
            if req["ranks"]:
                env = _rank_env(env, rank, req["ranks"], port, run_id)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req["words"], req["cwd"], env, out)
            pids.append(pid)
        os.close(out)
        reply.write(json.dumps(_wait(pids, req["timeout"])) + "\n")
        reply.flush()


class Server:
    """The client side: ``run`` returns (exit code, output) of one planned command."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, planned, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
        words, ranks = planned
        out = Path(tempfile.gettempdir()) / f"parallax-warm-{uuid.uuid4().hex}.log"
        req = dict(words=words, ranks=ranks, cwd=str(cwd), env=env, out=str(out), timeout=timeout)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm server ended (exit {self.proc.wait()})")
        text = out.read_text() if out.exists() else ""
        out.unlink(missing_ok=True)
        return json.loads(line), text

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
