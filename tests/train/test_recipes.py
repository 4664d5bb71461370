"""The recipe protocol: OpenVLA through it as before, a second, different family through the same
Trainer, and freezing and learning-rate groups named once for every recipe."""

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import SyntheticTask
from parallax.recipe import registry
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.config import TrainConfig
from parallax.train.groups import param_groups, parse_lr_groups
from parallax.train.trainer import Trainer
from tests.train.test_trainer import STEPS, _batches, _cfg, _parallel, separate
from tests.train.toy_recipe import Pairs, ToyRecipe, reference_loss

GOLDEN = Path(__file__).parent / "data" / "openvla_tp2pp2dp2_before_recipes.json"


def test_openvla_through_the_recipe_equals_the_trainer_before_recipes():
    """tests/train/data/...json was written by the Trainer as it was before recipes (commit
    7886c63, same config as test_trainer's tp2 pp2 dp2 1f1b case): 3 steps of loss, grad norm
    and metric sums, and per tensor the sum, the sum of |x| and the norm of the weights. The
    arithmetic is the same by construction, so the tolerance only covers another CPU's kernels
    (float32 summation order inside a matmul)."""
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


# -- a second family: two towers, a loss over the whole step and a dp all-gather -------------


def _toy_cfg(**kw) -> TrainConfig:
    base = dict(
        model="toy", steps=3, global_batch_size=16, micro_batch_size=4, warmup_steps=1, lr=3e-2
    )
    return TrainConfig(**{**base, **kw})


def _toy_run(tp: int, dp: int) -> tuple[list, dict]:
    ctx = ParallelContext.local() if tp * dp == 1 else context(tp=tp, dp=dp)
    recipe = ToyRecipe()
    cfg = _toy_cfg(tp=tp, dp=dp)
    trainer = Trainer(cfg, ctx, recipe=recipe)
    data, collate = Pairs(), recipe.collator(None, None, None)
    per_rank = cfg.global_batch_size // dp
    history = []
    for step in range(cfg.steps):
        start = step * cfg.global_batch_size + ctx.dp_rank * per_rank
        rows = list(range(start, start + per_rank))
        mbs = [
            collate([data[i] for i in rows[j : j + cfg.micro_batch_size]])
            for j in range(0, per_rank, cfg.micro_batch_size)
        ]
        out = trainer.train_step(mbs)
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    weights = {n: full_tensor(p, ctx.tp_group) for n, p in trainer.named_parameters()}
    return history, weights


@pytest.fixture(scope="module")
def toy_reference():
    return _toy_run(1, 1)


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 1), (2, 2)], ids=["dp2", "tp2", "tp2dp2"])
def test_a_step_level_recipe_matches_one_process(toy_reference, tp, dp):
    ref_history, ref_weights = toy_reference
    for history, weights in run_ranks(_toy_run, tp * dp, tp, dp):
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-6)
        for name, value in ref_weights.items():
            assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert ref_history[-1][0] < ref_history[0][0]


def test_the_step_level_loss_is_the_global_batch_loss_written_out():
    """The recipe's first loss (spread over microbatches) equals the formula on the batch."""
    recipe = ToyRecipe()
    cfg = _toy_cfg(steps=1)
    trainer = Trainer(cfg, ParallelContext.local(), recipe=recipe)
    data = Pairs()
    x, y = data.x[:16], data.y[:16]
    want = reference_loss(trainer.chunks[0], x, y).item()
    collate = recipe.collator(None, None, None)
    mbs = [collate([data[i] for i in range(j, j + 4)]) for j in range(0, 16, 4)]
    assert trainer.train_step(mbs).loss.item() == pytest.approx(want, rel=1e-6)


def _toy_pp2() -> str | None:
    try:
        Trainer(_toy_cfg(pp=2, global_batch_size=8), context(pp=2), recipe=ToyRecipe())
    except ValueError as err:
        return str(err)
    return None


def test_a_recipe_refuses_a_layout_on_every_rank():
    messages = run_ranks(_toy_pp2, 2, timeout=60)
    assert all(m and "pp = 1" in m for m in messages), messages


def test_registry_finds_families_by_preset_checkpoint_and_prefix(tmp_path):
    assert registry.find("tiny").name == "openvla"
    assert registry.find("openvla:tiny").name == "openvla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "openvla"}))
    assert registry.find(str(tmp_path)).name == "openvla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        registry.find(str(tmp_path))
    with pytest.raises(ValueError, match="neither a preset"):
        registry.find("no-such-model")
    registry.register("toy", ToyRecipe())
    try:
        assert registry.find("toy").name == "toy"
    finally:
        registry.FAMILIES.pop("toy")
        registry._LOADED.pop("toy")


def test_a_family_cannot_take_another_familys_presets():
    """A subclass of a built-in recipe inherits its presets: registered as they are, it would
    silently become what ``--model tiny`` means in this process (and in a test pool's worker
    processes, for every later test). It is refused, the registry left as it was; with
    presets of its own it runs as ``FAMILY:PRESET``."""
    from parallax.families.openvla.recipe import OpenVLARecipe

    class Shadow(OpenVLARecipe):
        name = "shadow"

    before = dict(registry.FAMILIES)
    for given in ({}, {"presets": ("mine", "small")}):
        with pytest.raises(ValueError, match="is family 'openvla''s already"):
            registry.register("shadow", Shadow(), **given)
        assert before == registry.FAMILIES and registry.find("tiny").name == "openvla"
    with pytest.raises(ValueError, match="register 'shadow' with presets of its own"):
        registry.register("shadow", "parallax.families.openvla.recipe:OpenVLARecipe", ("tiny",))
    registry.register("shadow", Shadow(), presets=())
    try:
        assert registry.find("tiny").name == "openvla"
        assert registry.find("shadow:tiny").name == "shadow"
        registry.register("shadow", Shadow(), presets=("shadow-tiny",))  # replacing itself
        assert registry.find("shadow-tiny").name == "shadow"
    finally:
        registry.FAMILIES.pop("shadow")
        registry._LOADED.pop("shadow")
    assert before == registry.FAMILIES


# -- freezing and learning-rate groups --------------------------------------------------------


def test_lr_groups_parse_from_every_form(tmp_path):
    want = [("vision_backbone.*", 2e-6), ("*", 2e-5)]
    assert parse_lr_groups("vision_backbone.*=2e-6, *=2e-5") == want
    assert parse_lr_groups({"vision_backbone.*": 2e-6, "*": 2e-5}) == want
    f = tmp_path / "groups.toml"
    f.write_text('[lr_groups]\n"vision_backbone.*" = 2e-6\n"*" = 2e-5\n')
    assert parse_lr_groups(str(f)) == want
    for bad in ("vision=fast", "=1e-3", "vision"):
        with pytest.raises(ValueError, match="--lr-groups"):
            parse_lr_groups(bad)


def test_groups_split_by_lr_and_decay_and_a_fused_weight_cannot_be_half_frozen():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    named = [("vision_backbone.x.weight", w), ("vision_backbone.x.bias", b), ("lm.weight", w)]
    cfg = TrainConfig(lr=1e-3, lr_groups="vision_backbone.*=1e-5")
    groups = param_groups(named, cfg)
    assert [g["lr"] for g in groups] == [1e-5, 1e-5, 1e-3, 1e-3]
    assert [[n for n, _ in g["params"]] for g in groups] == [
        ["vision_backbone.x.weight"],
        ["vision_backbone.x.bias"],
        ["lm.weight"],
        [],
    ]
    fused = [("language_model.model.layers.0.self_attn.qkv_proj.weight", w)]
    with pytest.raises(ValueError, match="--no-fused-projections"):
        param_groups(fused, TrainConfig(lr=1e-3, lr_groups="*q_proj*=1e-5"))


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
    trainer = Trainer(cfg, ctx)
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
    trainer = Trainer(cfg, ctx)
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed + 1)
    collate = registry.recipe("openvla").collator(trainer.model_config, data, None)
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
        parse_args(["--eval-interval", "-1"])


def test_only_a_family_that_pads_its_text_takes_pad_to_multiple_of():
    from parallax.train.run import resolve

    run = resolve(TrainConfig(model="tiny", pad_to_multiple_of=64))
    assert run.model_config.text_multiple == 64
    from types import SimpleNamespace

    from parallax.families.openvla.estimate import TEXT_TOKENS, text_tokens

    # the planner's width for real data: a typical prompt, rounded up as the collator pads it
    real = SimpleNamespace(data="rlds:anywhere")
    assert text_tokens(run.recipe, run.model_config, real) == 64 > TEXT_TOKENS
    plain = resolve(TrainConfig(model="tiny"))
    assert text_tokens(plain.recipe, plain.model_config, real) == TEXT_TOKENS
    # and the synthetic task's, measured on its collator (each width its own)
    padded = text_tokens(run.recipe, run.model_config, run)
    assert padded % 64 == 0 and text_tokens(plain.recipe, plain.model_config, plain) < padded
    for model in ("llava-tiny", "siglip-tiny"):
        with pytest.raises(ValueError, match="--pad-to-multiple-of: the .* family's batches"):
            resolve(TrainConfig(model=model, pad_to_multiple_of=8))
