"""``torchrun -m parallax.train``: parse flags, build, train, log, checkpoint, resume.

Every failure that a user can cause (a bad layout, batch sizes that do not divide, a missing
dataset, a corrupt or partial checkpoint) ends with one clear message (rank 0's) and exit status
2 on every rank, before training starts and without touching existing checkpoints. Ranks agree
on such errors before any collective that depends on them, so none is left waiting. A peer that
dies or hangs mid-run ends the others' collectives within ``--timeout`` seconds: they exit with
status 1 and say so once each; ``torchrun --max-restarts N ... --resume`` then carries on from
the last checkpoint. :mod:`parallax.train.failures` says who says what.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import traceback
from pathlib import Path

from parallax.context import DEFAULT_TIMEOUT_S, ParallelContext, init_parallel, shutdown
from parallax.dims import ParallelDims
from parallax.plan import auto
from parallax.recipe import resolve
from parallax.recipe.flags import parse_args
from parallax.run import Run, TrainConfig
from parallax.train import checkpoints, sinks
from parallax.train.agreement import USER_ERRORS, UserError, agree
from parallax.train.dry_run import print_plan
from parallax.train.failures import (
    Ending,
    Preempted,
    Preemption,
    is_comm_failure,
    sigterm_held,
    watch_launcher,
)
from parallax.train.lock import RunLock
from parallax.train.memory_limit import default_allocator
from parallax.train.session import export_hf, train

log = logging.getLogger("parallax.train")

__all__ = ["USER_ERRORS", "UserError", "agree", "export_hf", "main", "resolve_run", "run"]


def resolve_run(cfg: TrainConfig) -> Run:
    """The run of ``cfg``, resolved once (:func:`parallax.recipe.resolve`), with the planner's
    layout filled in for ``--layout auto`` (:func:`parallax.plan.auto.choose`)."""
    resolved = resolve(cfg)
    return auto.choose(resolved) if resolved.layout == "auto" else resolved


def run(
    resolved: Run,
    ctx: ParallelContext,
    stop_after: int | None = None,
    preemption: Preemption | None = None,
) -> dict[str, float]:
    """Train as the ``resolved`` run says on this rank, holding the lock of ``--out`` (one run
    at a time: :mod:`parallax.train.lock`); returns the last step's metrics. ``preemption``
    (the SIGTERM handler's, see :mod:`parallax.train.failures`) makes a SIGTERM save and raise
    :class:`Preempted`."""
    out = Path(resolved.out)
    agree(ctx, "--out", lambda: checkpoints.check_out(out, resolved.resume, resolved.overwrite))
    agree(ctx, "--log-to", lambda: sinks.check(resolved.log_to) if ctx.rank == 0 else None)
    held = agree(ctx, "--out", lambda: RunLock.acquire(out) if ctx.rank == 0 else None)
    preemption = preemption or Preemption()
    if held is not None:
        preemption.cleanups.append(held.release)
    try:
        return train(resolved, ctx, stop_after, preemption)
    finally:
        preemption.armed = False
        if held is not None:
            held.release()
            preemption.cleanups.remove(held.release)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m parallax.train`` and ``parallax-train``. What each rank says
    and which exit status it gives when the run cannot go on: :mod:`parallax.train.failures`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    default_allocator()
    ending = Ending(int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1))
    signal.signal(signal.SIGTERM, ending.on_sigterm)
    watch_launcher(ending.preemption)  # no rank trains on once torchrun is gone
    resolved = ctx = None
    clean = False  # a run that ended well meets its peers before tearing the group down
    try:
        # what every rank checks alike, rank 0 says; a launcher's SIGTERM (a peer that already
        # failed on the same check) waits until it has been said
        with sigterm_held():
            try:
                resolved = _resolved(parse_args(argv), ending)
                if resolved.dry_run:
                    print_plan(resolved, file=None if ending.rank == 0 else io.StringIO())
                    return ending.end(0)
            except USER_ERRORS as err:
                return ending.user_error(err, agreed=True)
        ctx = init_parallel(
            tp=resolved.tp, pp=resolved.pp, dp=resolved.dp, timeout=resolved.timeout
        )
        if ctx.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        run(resolved, ctx, preemption=ending.preemption)
        clean = True
        return ending.end(0)
    except Preempted as err:
        return ending.preempted(err.step)
    except UserError as err:
        return ending.user_error(err, agreed=True)
    except USER_ERRORS as err:
        return ending.user_error(err, agreed=False)
    except KeyboardInterrupt:
        return ending.interrupted()
    except Exception as err:
        if is_comm_failure(err):
            return ending.peer_failed(err, resolved.timeout if resolved else DEFAULT_TIMEOUT_S)
        return ending.crashed(traceback.format_exc())  # a bug: say where
    finally:
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down
            shutdown(clean)
        ending.hold_on()


def _resolved(cfg: TrainConfig, ending: Ending) -> Run:
    """The run, once, every rank alike, before any process group: the layout checked against
    the world torchrun started (a dry run plans for the layout given)."""
    if not cfg.dry_run and cfg.layout != "auto":
        ParallelDims.from_world(ending.world, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    return resolve_run(cfg)
