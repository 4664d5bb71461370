"""What keeps a run's folder and checkpoints safe: one run per --out, --overwrite, leftovers of
a killed prune, a --resume with no steps left, and a non-finite step that stops before saving.

Every case runs the real ``parallax.train.cli.run`` on two gloo ranks (dp 2, tiny model, a few
steps) and checks that both ranks raise the same message. The synthetic dataset (immutable;
its statistics take seconds to compute) is built once per worker and reused across runs.
"""

import hashlib
import json
from pathlib import Path

import torch

from parallax.families.openvla.objective import ActionTokenObjective
from parallax.families.openvla.recipe import OpenVLARecipe
from parallax.families.openvla.sides import OpenVLAData, OpenVLAModel
from parallax.recipe import Recipe
from parallax.testing import run_ranks

_DATASETS: dict = {}  # per worker process

RUN = [
    "--steps",
    "4",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",  # one microbatch per dp rank and step
    "--save-interval",
    "2",
    "--log-interval",
    "2",
    "--warmup-steps",
    "1",
]


class _PoisonedData(OpenVLAData):
    """OpenVLA's data with the synthetic dataset built once per worker and, from
    ``poison_step`` on (counted from this invocation's first microbatch), an inf in dp rank 0's
    pixels, which makes the loss and the gradients NaN on every rank."""

    poison_step: int | None = None

    def dataset(self, spec, run):
        if (spec, run.seed) not in _DATASETS:
            _DATASETS[spec, run.seed] = super().dataset(spec, run)
        return _DATASETS[spec, run.seed]

    def collator(self, run, dataset):
        import torch.distributed as dist

        build, calls = super().collator(run, dataset), [0]

        def poisoned(samples):
            mb = build(samples)
            calls[0] += 1
            if calls[0] == self.poison_step and dist.get_rank() == 0:
                mb["pixel_values"][0, 0, 0, 0] = float("inf")
            return mb

        return poisoned


class _Poisoned(OpenVLARecipe):
    name = "poisoned"

    def __init__(self, poison_step: int | None) -> None:
        data = _PoisonedData()
        data.poison_step = poison_step
        Recipe.__init__(self, OpenVLAModel(data), data, ActionTokenObjective())


def _train(out: str, *args: str, poison_step: int | None = None):
    """``run`` on this rank: ``None`` when it finished, else the UserError's message."""
    from parallax.recipe import registry
    from parallax.testing import context
    from parallax.train import cli, parse_args

    recipe = _Poisoned(poison_step)
    # no presets of its own (OpenVLA's are openvla's), and gone afterwards: the worker
    # processes serve later tests, whose --model tiny must stay OpenVLA's
    registry.register("poisoned", recipe, presets=())
    try:
        cli.run(
            cli.resolve_run(parse_args(["--out", out, "--model", "poisoned:tiny", *RUN, *args])),
            context(dp=2),
        )
    except cli.UserError as err:
        return str(err)
    finally:
        registry.FAMILIES.pop("poisoned")
        registry._LOADED.pop("poisoned")
    return None


def _family_of(spec: str) -> str:
    from parallax.recipe import registry

    return registry.find(spec).name


def _agreed(results: list) -> str:
    assert results[0] is not None and results[0] == results[1], results
    return results[0]


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_one_run_per_out_resume_overwrite_and_leftovers(tmp_path):
    out = tmp_path / "run"
    assert run_ranks(_train, 2, str(out)) == [None, None]
    before = _digest(out)
    # a fresh run into it refuses, naming both ways out, and touches nothing
    message = _agreed(run_ranks(_train, 2, str(out), "--steps", "3"))
    assert "holds another run (checkpoints up to step_00000004 and metrics.jsonl)" in message
    assert "--resume" in message and "--overwrite" in message
    # a resume with no steps left says so instead of exiting as if it had trained
    message = _agreed(run_ranks(_train, 2, str(out), "--resume"))
    assert "at step 4 and --steps is 4: nothing left to train; raise --steps above 4" in message
    assert _digest(out) == before
    # what a kill during pruning leaves is never resumed and is removed by the next save
    leftover = out / "checkpoints" / "step_00000008.deleting"
    leftover.mkdir()
    (leftover / "meta.json").write_text("{}")
    assert run_ranks(_train, 2, str(out), "--resume", "--steps", "6") == [None, None]
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    assert _checkpoints(out) == ["latest", "step_00000004", "step_00000006"]
    # --overwrite removes the old run first: the new one's checkpoints are all that is left
    assert run_ranks(_train, 2, str(out), "--overwrite", "--steps", "2") == [None, None]
    assert _steps(out) == [1, 2]
    assert _checkpoints(out) == ["latest", "step_00000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002\n"


def _finite_checkpoint(path: Path) -> bool:
    from parallax.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    return all(bool(torch.isfinite(ckpt.get(n).float()).all()) for n in ckpt.names())


def test_a_non_finite_step_stops_the_run_before_any_later_save(tmp_path):
    out = tmp_path / "nan"
    # step 3 is reported while step 4 runs: the run stops there, before step 4's checkpoint
    message = _agreed(run_ranks(_train, 2, str(out), poison_step=3))
    assert message.startswith("step 3: the loss is nan and the gradient norm nan, not finite")
    assert f"the latest checkpoint, {out / 'checkpoints' / 'step_00000002'}," in message
    assert _checkpoints(out) == ["latest", "step_00000002"]
    assert _finite_checkpoint(out / "checkpoints" / "step_00000002")
    # a step that would be saved is checked before its checkpoint is written
    message = _agreed(run_ranks(_train, 2, str(tmp_path / "nan2"), poison_step=2))
    assert message.startswith("step 2: the loss is nan") and "no checkpoint was written" in message
    assert not list((tmp_path / "nan2" / "checkpoints").glob("step_*"))
    # the poisoned family is gone from the workers: later tests' --model tiny is OpenVLA's
    assert run_ranks(_family_of, 2, "tiny") == ["openvla", "openvla"]
