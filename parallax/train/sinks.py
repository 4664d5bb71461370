"""Dashboards beside ``metrics.jsonl``: ``--log-to tensorboard,wandb``, written by rank 0 alone.

Each sink gets every row the run writes to ``metrics.jsonl`` and ``eval.jsonl``, under the same
keys, at the row's step (``None`` values, such as MFU on a CPU, are left out).

* ``tensorboard``: event files under ``OUT/tb/`` (``torch.utils.tensorboard``, which needs the
  ``tensorboard`` package). A resumed run purges the events after its resume step, as
  ``metrics.jsonl`` drops its lines.
* ``wandb``: a Weights & Biases run named after ``--out``'s folder, with the resolved flags and
  layout as its config and files under ``OUT/wandb/``. ``WANDB_MODE=offline`` works without an
  account (``wandb sync`` uploads later); ``WANDB_PROJECT`` names the project (default
  ``parallax``). A resumed run is a new W&B run that starts at its resume step.

Both are optional packages (extras ``tensorboard`` and ``wandb``), checked before any work.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Protocol

from parallax.run import TrainConfig

SINKS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # name -> the package it needs


class Sink(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def names(log_to: str | None) -> list[str]:
    """The sinks ``--log-to`` names, in order, without repeats."""
    out: list[str] = []
    for part in (log_to or "").split(","):
        part = part.strip().lower()
        if part and part not in out:
            out.append(part)
    return out


def check(log_to: str | None) -> None:
    """``ValueError`` for an unknown sink or one whose package is not installed: said before
    any work, not after the first step."""
    for name in names(log_to):
        if name not in SINKS:
            raise ValueError(f"--log-to {name!r}: use tensorboard, wandb or both (comma separated)")
        if importlib.util.find_spec(SINKS[name]) is None:
            raise ValueError(
                f"--log-to {name} needs the optional {SINKS[name]!r} package: pip install "
                f"{SINKS[name]} (or the project's extra: pip install -e '.[{name}]')"
            )


def open_sinks(cfg: TrainConfig, out: Path, layout: dict[str, int], start: int = 0) -> list[Sink]:
    """The sinks of ``cfg.log_to`` (call on rank 0 only); ``start``: the resume step."""
    opened: list[Sink] = []
    for name in names(cfg.log_to):
        try:
            if name == "tensorboard":
                opened.append(TensorBoardSink(out / "tb", start))
            elif name == "wandb":
                opened.append(WandbSink(cfg, out, layout, start))
        except Exception as err:  # any package's own error: one message, before training
            for sink in opened:
                sink.close()
            raise ValueError(f"--log-to {name}: could not open it: {err}") from err
    return opened


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's numeric values but the step (``None``, text and non-finite values left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step"
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardSink:
    def __init__(self, path: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard

        # events of an earlier invocation after the resume step are dropped by TensorBoard
        self.writer = SummaryWriter(str(path), purge_step=start + 1 if start else None)

    def log(self, row: dict[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, int(row["step"]))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: TrainConfig, out: Path, layout: dict[str, int], start: int) -> None:
        import wandb  # optional: the extra 'wandb'

        name = Path(cfg.out).resolve().name
        config = {**cfg.to_dict(), **layout, "resumed_at": start}
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "parallax"),
            name=name,
            config=config,
            dir=str(out),
            reinit="create_new",
            settings=wandb.Settings(console="off"),  # the live progress bar is not W&B's to log
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
