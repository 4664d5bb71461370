"""OpenVLA through the recipe protocol: the Trainer as it was before recipes, freezing and
learning-rate groups at tp2 pp2 dp2, evaluation at every layout, and which family pads its text.
(The protocol with a second family and the registry: ``tests/recipe/``; the groups' parsing:
``tests/train/test_groups.py``.)"""

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import SyntheticTask
from parallax.recipe import registry, resolve
from parallax.run import TrainConfig
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer
from tests.families.openvla.test_trainer import STEPS, _batches, _cfg, _parallel, separate

GOLDEN = Path(__file__).parent / "data" / "openvla_tp2pp2dp2_before_recipes.json"


def test_openvla_through_the_recipe_equals_the_trainer_before_recipes():
    """tests/families/openvla/data/...json was written by the Trainer as it was before recipes
    (commit 7886c63, same config as test_trainer's tp2 pp2 dp2 1f1b case): 3 steps of loss,
    grad norm and metric sums, and per tensor the sum, the sum of |x| and the norm of the
    weights. The arithmetic is the same by construction, so the tolerance only covers another
    CPU's kernels (float32 summation order inside a matmul)."""
    golden = json.loads(GOLDEN.read_text())
    results = run_ranks(_parallel, 8, 2, 2, 2, schedule="1f1b")
    assert_close(torch.tensor(results[0][0]), torch.tensor(golden["history"]), rtol=1e-5, atol=1e-5)
    seen = {}
    for _, w in results:
        seen.update(w)
    assert sorted(seen) == sorted(golden["weights"])
    for name, (s, a, n) in golden["weights"].items():
        t = seen[name].double()
        got = torch.tensor([float(t.sum()), float(t.abs().sum()), float(t.norm())])
        scale = max(a / t.numel(), 1e-3) * t.numel()
        assert_close(got, torch.tensor([s, a, n]), rtol=1e-5, atol=1e-5 * scale, msg=name)


# -- freezing and learning-rate groups at tp2 pp2 dp2, and evaluation --------------------------


FREEZE = dict(
    freeze="vision,language_model.model.layers.1.*",
    lr_groups="projector.*=1e-2,language_model.lm_head.*=1e-3",
)


def _frozen_run(tp: int, pp: int, dp: int):
    """Three steps with freezing and lr groups; per rank: the history, the logical weights, the
    frozen names and what the optimizer holds for them."""
    ctx = ParallelContext.local() if tp * pp * dp == 1 else context(tp=tp, pp=pp, dp=dp)
    cfg = _cfg(tp=tp, pp=pp, dp=dp, **FREEZE)
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    frozen = [n for n, p in trainer.named_parameters() if not p.requires_grad]
    before = {n: full_tensor(p, ctx.tp_group).clone() for n, p in trainer.named_parameters()}
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item()])
    opt = trainer.optimizer
    held = {  # what ZeRO-1 keeps for frozen parameters: must be nothing
        "named": [n for n in opt.names if n in frozen],
        "grads": [n for n, p in trainer.named_parameters() if n in frozen and p.grad is not None],
        "buffer_numel": sum(b.numel() for b in opt.flat.grad_buffers),
        "trainable_numel": sum(p.numel() for p in opt.params),
        "lrs": sorted({g["initial_lr"] for g in opt.param_groups if g["params"]}),
    }
    after = {n: full_tensor(p, ctx.tp_group) for n, p in trainer.named_parameters()}
    unchanged = all(torch.equal(before[n], after[n]) for n in frozen)
    weights = {}
    for name, value in after.items():
        weights.update(separate(name, value))
    return history, weights, frozen, held, unchanged


def test_freeze_and_lr_groups_at_tp2_pp2_dp2_match_one_process():
    ref_history, ref_weights, ref_frozen, ref_held, ref_unchanged = _frozen_run(1, 1, 1)
    assert ref_unchanged and ref_held["named"] == ref_held["grads"] == []
    assert any(n.startswith("vision_backbone.") for n in ref_frozen)
    assert any(".layers.1." in n for n in ref_frozen)
    assert ref_held["lrs"] == [1e-3, 3e-3, 1e-2]  # lm_head, the rest (--lr), the projector
    seen, frozen = {}, set()
    for history, weights, names, held, unchanged in run_ranks(_frozen_run, 8, 2, 2, 2):
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
        assert unchanged, "a frozen tensor changed"
        assert held["named"] == [] and held["grads"] == []
        assert held["buffer_numel"] >= held["trainable_numel"] > 0  # no room for the frozen
        seen.update(weights)
        frozen.update(names)
    assert frozen == set(ref_frozen)
    for name, value in ref_weights.items():
        assert_close(seen[name], value, rtol=1e-5, atol=1e-5, msg=name)


def _eval_run(tp: int, pp: int, dp: int, chunks: int = 1) -> list[float]:
    """The held-out loss and metric sums of one step-0 model, forward only, via the Evaluator."""
    from parallax.train.evaluate import Evaluator

    ctx = ParallelContext.local() if tp * pp * dp == 1 else context(tp=tp, pp=pp, dp=dp)
    kw = dict(schedule="interleaved", chunks=chunks) if chunks > 1 else {}
    cfg = _cfg(tp=tp, pp=pp, dp=dp, eval_interval=1, eval_batches=2, **kw)
    trainer = Trainer(resolve(cfg), ctx)
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed + 1)
    collate = registry.recipe("openvla").data.collator(trainer.run, data)
    evaluator = Evaluator(trainer, data, collate, Path(cfg.out))
    evaluator.path = Path("/dev/null")
    row = evaluator.run(0)
    return [row["eval_loss"], row["eval_action_accuracy"], row["eval_l1"]]


def test_evaluation_is_forward_only_and_the_same_at_every_layout():
    ref = _eval_run(1, 1, 1)
    for got in run_ranks(_eval_run, 8, 2, 2, 2):
        assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for got in run_ranks(_eval_run, 2, 1, 2, 1, 2):  # two chunks per pipeline rank
        assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert ref[0] > 0


def test_evaluation_flags_reach_the_config():
    from parallax.train import parse_args

    cfg = parse_args(["--eval-interval", "3", "--eval-batches", "1", "--eval-data", "held/out"])
    assert (cfg.eval_interval, cfg.eval_batches, cfg.eval_data) == (3, 1, "held/out")
    with pytest.raises(ValueError, match="--eval-interval must be >= 0"):
        resolve(parse_args(["--eval-interval", "-1"]))


def test_only_a_family_that_pads_its_text_takes_pad_to_multiple_of():
    from parallax.recipe import resolve

    run = resolve(TrainConfig(model="tiny", pad_to_multiple_of=64))
    assert run.model_config.text_multiple == 64
    from parallax.families.openvla.estimate import TEXT_TOKENS, text_tokens

    # the planner's width for real data: a typical prompt, rounded up as the collator pads it
    plain = resolve(TrainConfig(model="tiny"))
    data = run.recipe.data
    assert text_tokens(data, run.replace(data="rlds:anywhere")) == 64 > TEXT_TOKENS
    assert text_tokens(data, plain.replace(data="rlds:anywhere")) == TEXT_TOKENS
    # and the synthetic task's, measured on its collator (each width its own)
    padded = text_tokens(data, run)
    assert padded % 64 == 0 and text_tokens(data, plain) < padded
    for model in ("llava-tiny", "siglip-tiny"):
        with pytest.raises(ValueError, match="--pad-to-multiple-of: the .* family's batches"):
            resolve(TrainConfig(model=model, pad_to_multiple_of=8))
