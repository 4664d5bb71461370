"""The ``--out`` folder of a run: where its checkpoints and metrics go, and the rule that one
folder holds one run.

A fresh run refuses a folder that holds another run's checkpoints or metrics, unless told to
``--resume`` it or to ``--overwrite`` it (:func:`check_out`); a resumed run starts from the
latest complete checkpoint there (:func:`find_resume`) and must have steps left.
"""

from __future__ import annotations

from pathlib import Path

from parallax.checkpoint import Checkpoint, latest_checkpoint, remove_checkpoints


def checkpoint_root(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def metrics_path(out: str | Path) -> Path:
    return Path(out) / "metrics.jsonl"


def check_out(out: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse (``ValueError``) a fresh run into a folder that holds another run: its
    checkpoints would be mixed with this run's (and pruned by step, or resumed later as if
    they were this run's) and its metrics overwritten. Cheap: run it before anything else."""
    out = Path(out)
    if resume and overwrite:
        raise ValueError(
            "--resume continues the run in --out and --overwrite deletes it: pass one of them"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    if resume or overwrite:
        return
    found = []
    latest = latest_checkpoint(checkpoint_root(out))
    if latest is not None:
        found.append(f"checkpoints up to {latest.name}")
    if metrics_path(out).exists():
        found.append(metrics_path(out).name)
    if found:
        raise ValueError(
            f"{out} holds another run ({' and '.join(found)}): pass --resume to continue it, "
            "--overwrite to delete it and start afresh, or choose another --out"
        )


def clear_run(out: str | Path) -> None:
    """What ``--overwrite`` removes: the old run's checkpoints and metrics (one rank)."""
    remove_checkpoints(checkpoint_root(out))
    metrics_path(out).unlink(missing_ok=True)


def find_resume(out: str | Path) -> Checkpoint | None:
    """The latest complete checkpoint under ``out``, validated (or ``None`` when there is none).

    Raises :class:`CheckpointError` naming what is wrong with a corrupt or partial one.
    """
    path = latest_checkpoint(checkpoint_root(out))
    return None if path is None else Checkpoint(path)


def check_steps_left(ckpt: Checkpoint, steps: int) -> None:
    """A resumed run must have steps left to train (else it would exit having done nothing)."""
    if steps <= ckpt.step:
        raise ValueError(
            f"the checkpoint {ckpt.path} is at step {ckpt.step} and --steps is {steps}: "
            f"nothing left to train; raise --steps above {ckpt.step} to continue"
        )
