"""One run at a time in an ``--out`` folder: an exclusive lock file that names its holder.

Two runs started together into one folder would interleave their ``metrics.jsonl`` lines and
overwrite each other's checkpoints, and both would exit 0. Rank 0 of a run therefore creates
``OUT/.parallax.lock`` (``{"host", "pid", "since"}``) before any work, atomically (the file is
written complete under a temporary name and hard-linked into place, which fails if it exists),
and removes it when the run ends. A second run finds it and stops with one message naming the
holder. A lock left behind by a run that died without removing it (a ``kill -9``, a machine that
lost power) is *stale* when it names this host and a process that no longer runs (or this very
process, which cannot hold it yet): it is taken over with a note. A lock of another host cannot
be checked from here; the message says to delete it if that run is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from parallax.atomic import temp_sibling

log = logging.getLogger("parallax.train")

LOCK_NAME = ".parallax.lock"


class RunLock:
    """This process's hold on ``out`` (see the module doc): :meth:`acquire`, :meth:`release`."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        self.path, self.holder = path, holder

    @classmethod
    def acquire(cls, out: str | Path) -> RunLock:
        """Take the lock of ``out`` (creating the folder), or raise ``ValueError`` naming the
        run that holds it."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK_NAME
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
        for _ in range(3):  # a stale lock taken over by another process meanwhile: look again
            if _create(path, me):
                return cls(path, me)
            holder = _read(path)
            if holder is None:
                continue  # removed meanwhile
            if not _is_stale(holder):
                raise ValueError(_held_message(out, path, holder))
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, temp_sibling(path, "stale"))  # only one taker renames it
                log.info(
                    "%s: taking over the lock of a run that is gone (pid %s on %s, since %s)",
                    out,
                    holder.get("pid"),
                    holder.get("host"),
                    holder.get("since"),
                )
            for old in out.glob(f".{LOCK_NAME}.stale-*"):
                with contextlib.suppress(OSError):
                    old.unlink()
        raise ValueError(f"{out}: could not take the lock {path}; another run is starting there")

    def release(self) -> None:
        """Remove the lock if it is still this process's (idempotent)."""
        if _read(self.path) == self.holder:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _create(path: Path, holder: dict[str, Any]) -> bool:
    """Write the lock complete under a temporary name, then link it into place: the link
    fails if a lock exists, so no reader ever sees a half-written one."""
    tmp = temp_sibling(path)
    tmp.write_text(json.dumps(holder) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"host": "?", "pid": "?", "since": "?"}  # unreadable: held by someone unknown
    return holder if isinstance(holder, dict) else {"host": "?", "pid": "?", "since": "?"}


def _is_stale(holder: dict[str, Any]) -> bool:
    """Held by a process of this host that no longer runs (or by this process: a pid reused
    after the holder died, e.g. in a fresh container)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _held_message(out: Path, path: Path, holder: dict[str, Any]) -> str:
    return (
        f"{out} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}, since "
        f"{holder.get('since')}): wait for it to end or choose another --out (if that run is "
        f"gone, delete {path})"
    )
