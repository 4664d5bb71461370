"""The README's own-model example (examples/custom_recipe.py) trains under parallax.train at
tp2 pp2 and matches the same run in one process."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.recipe import registry
from parallax.testing import context, run_ranks

EXAMPLE = Path(__file__).parents[2] / "examples" / "custom_recipe.py"
FLAGS = ["--steps", "25", "--global-batch-size", "16", "--micro-batch-size", "4"]
FLAGS += ["--log-interval", "25", "--save-interval", "0", "--warmup-steps", "2"]


@pytest.fixture
def library_families_only():
    """The example registers its family in this process: take it out again afterwards, so that
    later tests (the flag reference, which lists every family's presets) see the library's."""
    before = set(registry.FAMILIES)
    yield
    for name in set(registry.FAMILIES) - before:  # the registry has no unregister
        for table in (registry.FAMILIES, registry._LOADED, registry._OPTIONS):
            table.pop(name, None)


def _example():
    spec = importlib.util.spec_from_file_location("custom_recipe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_recipe"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # registers the "counting" family
    return module


def _train(out: str, tp: int, pp: int) -> list[dict]:
    from parallax.train import cli, parse_args

    _example()
    torch.set_num_threads(1)
    ctx = ParallelContext.local() if tp * pp == 1 else context(tp=tp, pp=pp)
    cli.run(
        cli.resolve_run(
            parse_args(
                ["--model", "counting", "--out", out, "--tp", str(tp), "--pp", str(pp)] + FLAGS
            )
        ),
        ctx,
    )
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.usefixtures("library_families_only")
def test_the_custom_recipe_learns_at_tp2_pp2_as_in_one_process(tmp_path):
    ref = _train(str(tmp_path / "one"), 1, 1)
    got = run_ranks(_train, 4, str(tmp_path / "four"), 2, 2)[0]
    assert_close(
        torch.tensor([r["loss"] for r in got]),
        torch.tensor([r["loss"] for r in ref]),
        rtol=1e-4,
        atol=1e-5,
    )
    assert ref[-1]["loss"] < 0.8 * ref[0]["loss"] and ref[-1]["accuracy"] > 0.15  # learns
