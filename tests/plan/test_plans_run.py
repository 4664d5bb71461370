"""Every layout the planner prints is one the trainer accepts: for every preset of every family
at 1 to 64 GPUs, ``--dry-run`` of each printed layout's command succeeds (in-process, under the
world size it was planned for). And ``--layout auto`` trains."""

import io
import shlex

import pytest
from rich.console import Console

from parallax.plan.cli import plan
from parallax.plan.report import command
from parallax.recipe import registry
from parallax.testing import run_ranks
from parallax.train import main, parse_args
from parallax.train.cli import resolve_run
from parallax.train.dry_run import print_plan

PRESETS = [p for family in registry.FAMILIES.values() for p in family.presets]
WORLDS = (1, 2, 4, 8, 16, 64)


def _train_argv(line: str) -> list[str]:
    return shlex.split(line.split(" -m parallax.train ", 1)[1])


@pytest.mark.parametrize("model", PRESETS)
def test_every_printed_layout_dry_runs(model, monkeypatch):
    for gpus in WORLDS:
        out = io.StringIO()
        argv = ["--gpus", str(gpus), "--gpu-memory", "140", "--top", "3", "--model", model]
        result, first = plan(argv, Console(file=out, width=300))
        assert result.ranked, out.getvalue()
        assert first in out.getvalue()
        monkeypatch.setenv("WORLD_SIZE", str(gpus))
        per_node = min(gpus, 8)
        for c in result.ranked:
            line = command(["--model", model, "--precision", "bf16"], c, gpus // per_node, per_node)
            print_plan(
                resolve_run(parse_args([*_train_argv(line), "--dry-run"])), file=io.StringIO()
            )


def test_layout_auto_trains_the_tiny_model(tmp_path, capsys, caplog):
    caplog.set_level("INFO")
    argv = ["--layout", "auto", "--gpu-memory", "1", "--steps", "2", "--save-interval", "0"]
    assert (
        main([*argv, "--micro-batch-size", "8", "--log-interval", "1", "--out", str(tmp_path)]) == 0
    )
    said = caplog.text
    assert "--layout auto: tp1 pp1 dp1, zero 1, mb 8" in said, said  # the given size kept
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def _auto_rank(out: str) -> tuple[int, int, int, int]:
    from parallax.testing import context
    from parallax.train.cli import resolve_run, run

    argv = ["--layout", "auto", "--gpu-memory", "1", "--steps", "1", "--out", out]
    cfg = resolve_run(parse_args([*argv, "--save-interval", "0"]))  # planned for WORLD_SIZE=2
    run(cfg, context(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp))
    return cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch_size


def test_every_rank_plans_the_same_layout_for_its_world(tmp_path):
    got = run_ranks(_auto_rank, 2, str(tmp_path / "two"))
    assert got[0] == got[1] and got[0][0] * got[0][1] * got[0][2] == 2, got
