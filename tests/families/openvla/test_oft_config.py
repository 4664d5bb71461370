"""OpenVLA-OFT's flags and trainable sets: ``--lr-schedule step`` is torch's MultiStepLR,
the flags refuse what cannot run, the model's OFT options come from the flags and the data,
and LoRA leaves OFT's modules whole and trained while the lm_head neither runs nor trains."""

import io

import pytest
import torch

from parallax import ParallelContext
from parallax.recipe import resolve
from parallax.train import TrainConfig, parse_args
from parallax.train.lr_schedule import lr_lambda


@pytest.mark.parametrize("warmup", [0, 3])
def test_step_schedule_is_multisteplr(warmup):
    cfg = TrainConfig.of(
        lr=0.5, lr_schedule="step", lr_decay_steps=7, lr_decay=0.1, warmup_steps=warmup
    )
    p = torch.nn.Parameter(torch.zeros(1))
    ours = torch.optim.SGD([p], lr=0.5)
    mine = torch.optim.lr_scheduler.LambdaLR(ours, lr_lambda(cfg))
    theirs = torch.optim.SGD([p], lr=0.5)
    multistep = torch.optim.lr_scheduler.MultiStepLR(theirs, milestones=[7], gamma=0.1)
    for step in range(12):
        want = theirs.param_groups[0]["lr"]
        if step < warmup:
            want *= (step + 1) / warmup
        assert ours.param_groups[0]["lr"] == pytest.approx(want), step
        for opt, sched in ((ours, mine), (theirs, multistep)):
            opt.step()
            sched.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(0.05)


def test_flags_refuse_what_cannot_run():
    cfg = parse_args(
        ["--action-head", "l1", "--film", "--lr-schedule", "step", "--lr-decay-steps", "9"]
    )
    assert cfg.family_values == {"action_head": "l1", "film": True} and cfg.lr_decay_steps == 9
    own = resolve(cfg).family_options  # the family's own options, declared in its package
    assert (own.action_head, own.action_chunk, own.film) == ("l1", None, True)
    for argv, msg in (
        (["--action-chunk", "4"], "needs --action-head l1"),
        (["--film"], "needs --action-head l1"),
        (["--action-head", "l1", "--action-chunk", "0"], "must be >= 1"),
        (["--lr-schedule", "step"], "needs --lr-decay-steps"),
        (["--lr-schedule", "step", "--lr-decay-steps", "3", "--lr-decay", "1.5"], r"in \(0, 1\]"),
        (["--action-head", "l2"], "one of tokens, l1"),
    ):
        with pytest.raises(ValueError, match=msg):
            resolve(parse_args(argv))


def _trainer(**kw):
    from parallax.train.trainer import Trainer

    base = dict(
        action_head="l1", action_chunk=3, film=True, global_batch_size=2, micro_batch_size=2
    )
    return Trainer(resolve(TrainConfig.of(**{**base, **kw})), ParallelContext.local())


def test_the_model_takes_the_datas_inputs_and_the_flags_chunk():
    trainer = _trainer(finetune="full")
    oft = trainer.model_config.oft
    assert (oft.chunk, oft.action_dim, oft.proprio_dim, oft.num_images, oft.film) == (
        3,
        7,
        2,
        2,
        True,
    )
    assert trainer.recipe.objective.metric_sums[0] == "current_l1_sum"
    trained = {n for n, p in trainer.named_parameters() if p.requires_grad}
    assert "language_model.lm_head.weight" not in trained  # skipped: no gradient, no state
    assert "vision_backbone.featurizer.blocks.0.attn.qkv.weight" in trained
    tokens = _trainer(action_head="tokens", action_chunk=None, film=False)
    assert tokens.model_config.oft is None
    assert tokens.recipe.objective.metric_sums[0] == "action_correct"


def test_lora_trains_ofts_modules_whole_beside_the_adapters():
    trainer = _trainer(finetune="lora", lora_rank=4)
    named = dict(trainer.named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    oft = {
        n for n in named if n.startswith(("action_head.", "proprio_projector.")) or ".film_" in n
    }
    assert oft and oft <= trained  # fully trained, in the same ZeRO optimizer
    assert set(trainer.optimizer.names) == trained
    assert not any(".film_" in n and "lora" in n for n in named)  # no adapter on them
    assert not any(n.startswith("action_head.") and "lora" in n for n in named)
    assert any("q_proj.lora_A" in n or "qkv_proj.lora_A" in n for n in trained)
    base = trained - oft
    assert all(n.endswith(("lora_A", "lora_B")) for n in base), sorted(base)[:5]


def test_an_oft_model_cannot_train_on_tokens_and_options_must_agree():
    import dataclasses

    from parallax.families.openvla.oft.config import OFTConfig
    from parallax.train.trainer import Trainer

    tiny = _trainer().model_config
    with pytest.raises(ValueError, match="train it with --action-head l1"):
        Trainer(resolve(TrainConfig.of(), model_config=tiny), ParallelContext.local())
    other = dataclasses.replace(tiny, oft=OFTConfig(chunk=5))
    with pytest.raises(ValueError, match="this run's flags ask for chunks of 3"):
        _trainer_with(other)


def _trainer_with(config):
    from parallax.train.trainer import Trainer

    cfg = TrainConfig.of(
        action_head="l1", action_chunk=3, film=True, global_batch_size=2, micro_batch_size=2
    )
    return Trainer(resolve(cfg, model_config=config), ParallelContext.local())


def test_dry_run_plans_an_oft_run():
    from parallax.train.cli import resolve_run
    from parallax.train.dry_run import print_plan

    out = io.StringIO()
    print_plan(
        resolve_run(
            parse_args(["--dry-run", "--action-head", "l1", "--finetune", "lora", "--pp", "2"])
        ),
        file=out,
    )
    assert "LoRA r=32" in out.getvalue()
