"""How a run ends when it cannot go on: one line per rank at most, and a known exit status.

* a user error every rank sees alike (flags, layout, an error the ranks agreed on): rank 0 says
  it, the other ranks stay silent; status 2 everywhere;
* a user error one rank found alone: that rank says it, with its rank; status 2;
* a collective that failed or timed out (a peer died or hung): each rank says so once; status 1;
* any other exception (a bug): that rank prints its traceback; status 1;
* SIGTERM before training (torchrun stopping the workers because one failed): a rank that has
  said nothing yet says it was stopped; it then leaves at once with ``os._exit`` (its status,
  else 143), so no exception is raised at whatever point the signal arrived;
* SIGTERM while training (a scheduler preempting the job; torchrun forwards it to every
  worker): :class:`Preemption`. The ranks agree on it in the step's input agreement (the signal
  may reach them at different times), save a checkpoint after that step, and rank 0 says
  ``preempted: saved step N``; status 143, and ``--resume`` continues. A second signal leaves at
  once. A rank whose peer died meanwhile finds its next collective failing and says so (status 1);
  under torchrun, one that cannot reach a step boundary within ``PREEMPT_GRACE_S`` (a peer hung
  in a collective) says why before torchrun's SIGKILL comes (30 s after its SIGTERM);
* the launcher dies (``kill -9`` of torchrun): the kernel sends each worker SIGTERM
  (``PR_SET_PDEATHSIG`` on Linux, :func:`watch_launcher`; elsewhere each step notices that the
  worker's parent changed), and the ranks stop as for a preemption: a checkpoint after the
  step, the ``--out`` lock released, one line (``the launcher ... is gone``); no rank trains on
  headless;
* Ctrl-C: rank 0 says it; status 130.

Under torchrun the rank that reports a user error also writes its line to
``TORCHELASTIC_ERROR_FILE``, so torchrun's failure summary shows it in place of a link to its
documentation. The other lines are not written there: their rank is not the root cause, and
torchrun takes the earliest reply as the root cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

USER_ERROR, FAILED, TERMINATED, INTERRUPTED = 2, 1, 143, 130
PROG = "parallax.train"
LINGER_S = 60.0  # how long a silent rank waits for torchrun to stop it (see Ending.user_error)
SHOW_CURSOR = "\x1b[?25h"  # the live progress bar hides it; os._exit skips its cleanup


PREEMPT_GRACE_S = 25.0  # torchrun SIGKILLs its workers 30 s after their SIGTERM
PR_SET_PDEATHSIG = 1  # prctl(2): the signal to get when the parent dies
REPEAT_S = 1.0  # a second delivery of the same signal (a scheduler's and torchrun's), not a second


class Preempted(Exception):
    """Every rank stopped after saving ``step`` because some rank got SIGTERM."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"preempted: saved step {step}")


class Preemption:
    """What the step loop and the SIGTERM handler share. While ``armed`` (the step loop runs),
    a first SIGTERM only sets ``requested``: the loop passes it to the step's agreement, and
    every rank saves after the same step. ``cleanups`` run before an exit at once (the
    ``--out`` lock)."""

    def __init__(self) -> None:
        self.armed = False
        self.requested = False
        self.launcher: int | None = None  # torchrun's agent, the parent this worker watches
        self.agreed = False  # the ranks agreed to stop: the save is under way
        self.saved: int | None = None  # the step whose checkpoint the preemption wrote
        self.first_at: float | None = None
        self.cleanups: list[Callable[[], None]] = []

    def cleanup(self) -> None:
        for fn in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                fn()

    def launcher_gone(self) -> bool:
        """Whether the launcher this worker was started by has died (its parent changed)."""
        return self.launcher is not None and os.getppid() != self.launcher

    def stop_asked(self) -> bool:
        """A SIGTERM came, or the launcher is gone (checked at every step)."""
        if not self.requested and self.armed and self.launcher_gone():
            self.requested, self.first_at = True, time.monotonic()
        return self.requested


def watch_launcher(preemption: Preemption) -> None:
    """Under torchrun, have the kernel send this worker SIGTERM when its launcher dies (Linux's
    ``PR_SET_PDEATHSIG``, through libc), and remember the launcher so that every step can
    also see it gone where the signal is not available."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    preemption.launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes  # the one libc call, only on Linux

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if preemption.launcher_gone():  # it died before the call: the signal will not come
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_held():
    """SIGTERM waits (pending) while this block runs, and is delivered when it ends (also
    when an enclosing block still runs: the first to end releases it)."""
    if not hasattr(signal, "pthread_sigmask"):  # not a POSIX system: nothing to hold
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def short_cause(err: BaseException, limit: int = 160) -> str:
    """The first sentence of an error, without a source-file prefix such as ``[pair.cc:553]``."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(". ", 1)[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_comm_failure(err: BaseException) -> bool:
    """A collective that failed or timed out (gloo reports these as plain RuntimeErrors)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    words = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in words)


class Ending:
    """This process's exit: decided once, said at most once (see the module doc)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.status: int | None = None
        self.under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        self.preemption = Preemption()

    def _where(self) -> str:
        return f"{PROG}: rank {self.rank}" if self.world > 1 else PROG

    def end(self, status: int, message: str | None = None, *, root_cause: bool = False) -> int:
        """Decide the exit status (the first decision stands) and say ``message``, if any;
        a ``root_cause`` (a user error) also goes into torchrun's reply file."""
        with sigterm_held():  # a SIGTERM now must not cut the line off or say a second one
            if self.status is not None:
                return self.status
            self.status = status
            if message:
                print(message, file=sys.stderr, flush=True)
                if root_cause:
                    _write_error_file(message)
        return status

    def user_error(self, err: BaseException, *, agreed: bool) -> int:
        """Exit status 2; rank 0 says an error every rank saw, any rank one it saw alone.

        A silent rank under torchrun then waits for the launcher to stop it, which happens
        once rank 0 has said the error and left: leaving first would get rank 0 stopped by
        SIGTERM, perhaps before it could say anything (it may still be importing)."""
        if agreed:
            message = f"{PROG}: error: {err}" if self.rank == 0 else None
        else:
            message = f"{self._where()}: error: {err}"
        status = self.end(USER_ERROR, message, root_cause=True)
        if message is None and self.under_torchrun:
            time.sleep(LINGER_S)  # ended by on_sigterm, with status 2
        return status

    def hold_on(self) -> None:
        """Once the status is decided, a SIGTERM during the interpreter's shutdown must not
        turn it into "killed by SIGTERM": under torchrun, hold the signal until exit."""
        if self.under_torchrun and self.status is not None and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def peer_failed(self, err: BaseException, timeout: float) -> int:
        return self.end(
            FAILED,
            f"{self._where()}: stopped: a collective failed or timed out (--timeout {timeout:g} "
            f"s): {short_cause(err)}; most likely another rank died or hung; restart with "
            "--resume to continue from the last checkpoint",
        )

    def crashed(self, trace: str) -> int:
        """An unexpected exception (a bug): its traceback, said before a launcher's SIGTERM
        can cut it off; status 1."""
        return self.end(FAILED, f"{self._where()}: crashed (a bug):\n{trace.rstrip()}")

    def interrupted(self) -> int:
        message = f"{PROG}: interrupted; --resume continues from the last checkpoint"
        return self.end(INTERRUPTED, message if self.rank == 0 else None)

    def preempted(self, step: int) -> int:
        if self.preemption.launcher_gone():
            message = (
                f"{PROG}: the launcher (pid {self.preemption.launcher}) is gone: saved step "
                f"{step} and stopped; start it again with --resume to continue"
            )
        else:
            message = f"{PROG}: preempted (SIGTERM): saved step {step}; --resume continues from it"
        return self.end(TERMINATED, message if self.rank == 0 else None)

    def on_sigterm(self, signum, frame) -> None:
        """While training, ask for a checkpoint at the next step boundary (see
        :class:`Preemption`); otherwise, or on a second signal, say once why this rank stops and
        leave at once (no exception at an arbitrary point, no teardown that may wait on dead
        peers)."""
        p, now = self.preemption, time.monotonic()
        if p.saved is not None:  # the checkpoint is written: say so (rank 0) and go
            self.preempted(p.saved)
            self._exit_now(None)
        if p.armed and not p.requested:
            p.requested, p.first_at = True, now
            if self.under_torchrun:
                timer = threading.Timer(PREEMPT_GRACE_S, self._no_boundary)
                timer.daemon = True
                timer.start()
            return
        if p.requested and now - p.first_at < REPEAT_S:
            return  # the same signal delivered twice (to the job and forwarded by torchrun)
        if p.requested:
            message = "stopped by a second SIGTERM before saving"
        elif p.launcher_gone():
            message = f"stopped: the launcher (pid {p.launcher}) is gone"
        else:
            message = "stopped by the launcher (SIGTERM), most likely because another rank failed"
        self._exit_now(f"{self._where()}: {message}; --resume continues from the last checkpoint")

    def _no_boundary(self) -> None:
        if self.preemption.agreed or self.status is not None:
            return  # saving, or already ending: torchrun's own deadline applies
        self._exit_now(
            f"{self._where()}: stopped by SIGTERM: no step boundary within {PREEMPT_GRACE_S:g} "
            "s to save at (most likely another rank failed or hung); --resume continues from the "
            "last checkpoint"
        )

    def _exit_now(self, message: str | None) -> None:
        self.end(TERMINATED, message)
        self.preemption.cleanup()
        with contextlib.suppress(Exception):
            if sys.stdout.isatty():
                sys.stdout.write(SHOW_CURSOR)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(self.status)


def _write_error_file(message: str) -> None:
    """torchrun's per-worker reply file (the layout its ``record`` decorator writes): its
    failure summary then prints ``message`` where it would print a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)
