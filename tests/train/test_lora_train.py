"""``--finetune lora`` through the Trainer: every layout equals one process (loss, grad norm,
updated adapters and ``--train`` modules), the base stays bitwise as built, nothing is kept for
it; checkpoints hold only what trains, resume at another layout, refuse another base; the
export writes the merged model and the PEFT adapter."""

import json

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.checkpoint import Checkpoint, latest_checkpoint
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.config import TrainConfig
from tests.train.test_trainer import _batches, separate

STEPS = 3
LORA = dict(finetune="lora", lora_rank=4, lora_alpha=8.0, train="projector.fc1")


def _cfg(**kw):
    base = dict(
        steps=STEPS,
        global_batch_size=4,
        micro_batch_size=1,
        lr=2e-3,
        lr_groups="projector.*=1e-3",  # the fully trained module in a group of its own
        seed=3,
        **LORA,
    )
    return TrainConfig(**{**base, **kw})


def _run(ctx, cfg):
    from parallax.data import SyntheticTask
    from parallax.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(cfg, ctx)
    frozen = {n: p.detach().clone() for n, p in trainer.named_parameters() if not p.requires_grad}
    data = SyntheticTask(num_episodes=8, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    named = trainer.named_parameters()
    trainable = [(n, p) for n, p in named if p.requires_grad]
    facts = {
        # the base: bitwise as built, no gradient was ever made for it, no optimizer entry
        "base_unchanged": all(torch.equal(frozen[n], p) for n, p in named if n in frozen),
        "base_grads": sum(p.grad is not None for n, p in named if n in frozen),
        "optimizer": sorted(trainer.optimizer.names) == sorted(n for n, _ in trainable),
        "frozen": len(frozen),
    }
    weights = {}
    for name, p in trainable:  # the updated adapters and --train modules
        full = full_tensor(p, ctx.tp_group)
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            weights.update(separate(name, full))
    return history, weights, facts


def _parallel(tp, pp, dp):
    return _run(context(tp=tp, pp=pp, dp=dp), _cfg(tp=tp, pp=pp, dp=dp))


@pytest.fixture(scope="module")
def reference():
    return _run(ParallelContext.local(), _cfg())


def test_lora_defaults_are_openvlas():
    cfg = TrainConfig(finetune="lora")
    cfg.check()
    assert (cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.grad_clip) == (5e-4, "constant", 0, 0)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == (32, 16.0, 0.0)
    full = TrainConfig()
    full.check()
    assert (full.lr_schedule, full.warmup_steps, full.grad_clip) == ("cosine", 20, 1.0)
    given = TrainConfig(finetune="lora", lr=1e-4, warmup_steps=5, grad_clip=1.0)
    given.check()
    assert (given.lr, given.warmup_steps, given.grad_clip) == (1e-4, 5, 1.0)
    for bad, msg in (
        (dict(train="norm"), "need --finetune lora"),
        (dict(finetune="lora", lora_rank=0), "--lora-rank"),
        (dict(finetune="lora", lora_dropout=0.1, tp=2), "one dropout mask"),
        (dict(finetune="lora", lora_init="/nonexistent"), "no such adapter"),
    ):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**bad).check()


def test_bad_globs_fail_before_anything_is_built():
    from parallax.train.trainer import Trainer

    for kw, msg in (
        (dict(lora_targets="nope_proj"), "match no linear"),
        (dict(train="x.*"), "--train"),
    ):
        with pytest.raises(ValueError, match=msg):
            Trainer(_cfg(**kw), ParallelContext.local())


@pytest.mark.parametrize(
    "tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)], ids=["tp2", "pp2", "dp2", "tp2pp2dp2"]
)
def test_layouts_match_one_process(reference, tp, pp, dp):
    ref_history, ref_weights, ref_facts = reference
    assert ref_facts == {
        "base_unchanged": True,
        "base_grads": 0,
        "optimizer": True,
        "frozen": ref_facts["frozen"],
    }
    seen = {}
    for history, weights, facts in run_ranks(_parallel, tp * pp * dp, tp, pp, dp):
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
        assert facts["base_unchanged"] and facts["base_grads"] == 0 and facts["optimizer"]
        seen.update(weights)
    assert seen.keys() == ref_weights.keys()
    assert any(".lora_A" in n for n in seen) and "projector.fc1.weight" in seen
    for name, value in ref_weights.items():
        assert_close(seen[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert ref_history[-1][0] < ref_history[0][0]


RUN = (
    *("--finetune", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--train", "projector.fc1"),
    *("--steps", "4", "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "2e-3"),
    *("--save-interval", "2", "--log-interval", "2", "--seed", "3"),
)


def _cli(tp, pp, dp, out, *extra, stop_after=None):
    """``parallax.train`` in this pool's ranks; the error message of a refused run."""
    from parallax.train.cli import UserError, run
    from parallax.train.config import parse_args

    ctx = context(tp=tp, pp=pp, dp=dp)
    args = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", out, *RUN, *extra]
    try:
        run(parse_args(args), ctx, stop_after=stop_after)
    except UserError as err:
        return str(err)
    return None


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _tensors(out) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(latest_checkpoint(out / "checkpoints"))
    return {n: ckpt.get(n) for n in ckpt.names()}


def test_checkpoints_hold_what_trains_resume_elsewhere_and_refuse_another_base(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_ranks(_cli, 2, 2, 1, 1, str(a)) == [None, None]  # uninterrupted at tp2
    assert run_ranks(_cli, 2, 1, 1, 2, str(b), stop_after=2) == [None, None]  # dp2, stopped
    half = Checkpoint(latest_checkpoint(b / "checkpoints"))
    weights = [n for n in half.names() if not n.startswith("optim.")]
    assert weights and all(".lora_" in n or n.startswith("projector.fc1.") for n in weights)
    assert any("q_proj.lora_A" in n for n in weights)  # fused q/k/v stored as HF's modules
    assert "language_model.model.layers.0.self_attn.q_proj.weight" not in half
    assert half.meta["lora"]["base"] and half.meta["lora"]["rank"] == 4
    # another base (another seed's random weights) is refused on every rank, untouched
    refused = run_ranks(_cli, 2, 1, 2, 1, str(b), "--resume", "--seed", "4")
    assert all(m and "different base model" in m for m in refused), refused
    assert run_ranks(_cli, 2, 1, 2, 1, str(b), "--resume") == [None, None]  # resumed at pp2
    ref, got = _losses(a), _losses(b)
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=1e-5)
    ref_t, got_t = _tensors(a), _tensors(b)
    assert ref_t.keys() == got_t.keys()
    for name, value in ref_t.items():
        assert_close(got_t[name], value, rtol=1e-5, atol=1e-5, msg=name)  # as test_trainer
