"""A finished tiny run shared by the drill, dashboard and report tests (one run per session)."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

BASE = [
    "--steps", "4", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--save-interval", "2", "--log-interval", "2", "--warmup-steps", "1",
]  # fmt: skip


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    """A finished 4-step tiny run (cosine, checkpoints at steps 2 and 4, evaluations at 2 and
    4), logged to the dashboards whose packages are installed (W&B offline). Read it; copy it
    before changing it."""
    from parallax.train import sinks
    from parallax.train.cli import main

    out = tmp_path_factory.mktemp("finished") / "base"
    extra = ["--eval-interval", "2", "--eval-batches", "1"]
    dashboards = [name for name, package in sinks.SINKS.items() if installed(package)]
    if dashboards:
        extra += ["--log-to", ",".join(dashboards)]
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        try:
            assert main(["--out", str(out), *BASE, *extra]) == 0
        finally:
            signal.signal(signal.SIGTERM, handler)
    return out
