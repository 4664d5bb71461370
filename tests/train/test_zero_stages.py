"""--zero 2 and 3 in the trainer (tp x pp x dp, LoRA, --freeze, --compile) against one process,
zero-3's memory counted from its own buffers, and a resume across stages and layouts."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import SyntheticTask
from parallax.testing import context, run_ranks
from parallax.train.config import TrainConfig
from parallax.train.trainer import Trainer
from tests.train.test_trainer import _batches, separate

STEPS = 2
LORA = dict(finetune="lora", lr=3e-3, grad_clip=1.0, warmup_steps=1)
FREEZE = dict(freeze="vision")
COMPILE = dict(compile=True, activation_checkpointing=True)  # with the aot_eager backend


def _cfg(**kw) -> TrainConfig:
    base = dict(
        steps=STEPS,
        global_batch_size=8,
        micro_batch_size=2,
        warmup_steps=1,
        lr=3e-3,
        grad_clip=1.0,
        seed=3,
    )
    return TrainConfig(**{**base, **kw})


def _run(ctx, cfg, **trainer_kw):
    """``STEPS`` steps: each step's loss, grad norm and metric sums, and the logical weights
    after them (on the stage's dp 0, tp 0 rank)."""
    torch.manual_seed(0)
    trainer = Trainer(cfg, ctx, **trainer_kw)
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    weights = {}
    for name, value in trainer.full_weights():  # at zero 3 a collective over dp and tp
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            weights.update(separate(name, value))
    return history, weights


REFERENCES = {"full": {}, "lora": LORA, "freeze": FREEZE}


@pytest.fixture(scope="module")
def references():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: tiny matmuls on shared cores
    try:
        return {name: _run(ParallelContext.local(), _cfg(**kw)) for name, kw in REFERENCES.items()}
    finally:
        torch.set_num_threads(threads)


# (tp, pp, dp, reference, flags): several configurations per spawned run
CASES = {
    2: [
        (1, 1, 2, "full", dict(zero=2)),
        (1, 1, 2, "full", dict(zero=3, **COMPILE)),
        (1, 1, 2, "lora", dict(zero=3, **LORA)),
        (1, 1, 2, "freeze", dict(zero=3, **FREEZE)),
    ],
    4: [
        (2, 1, 2, "full", dict(zero=2)),
        (2, 1, 2, "full", dict(zero=3)),
        (1, 2, 2, "full", dict(zero=3, schedule="1f1b")),
        (1, 2, 2, "full", dict(zero=2, schedule="interleaved", chunks=2)),
        (1, 2, 2, "full", dict(zero=3, schedule="interleaved", chunks=2)),
        (1, 2, 2, "lora", dict(zero=3, schedule="gpipe", **LORA)),
        (2, 1, 2, "freeze", dict(zero=3, reshard_after_forward=False, **FREEZE)),
    ],
    8: [
        (2, 2, 2, "full", dict(zero=3, schedule="1f1b")),
        (2, 2, 2, "lora", dict(zero=2, schedule="1f1b", **LORA)),
    ],
}


def _cases(cases: list) -> list:
    out = []
    for tp, pp, dp, _, kw in cases:
        ctx = context(tp=tp, pp=pp, dp=dp)
        trainer_kw = {"compile_options": {"backend": "aot_eager"}} if kw.get("compile") else {}
        out.append(_run(ctx, _cfg(tp=tp, pp=pp, dp=dp, **kw), **trainer_kw))
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_zero_2_and_3_match_one_process(references, world):
    """Losses, gradient norms, metric sums and the updated weights equal one process's at every
    layout, schedule and fine-tuning mode (tp reductions and the dp sum's order: ~1e-6)."""
    per_rank = run_ranks(_cases, world, CASES[world], timeout=300)
    for k, (tp, pp, dp, ref, kw) in enumerate(CASES[world]):
        ref_history, ref_weights = references[ref]
        case = f"tp{tp} pp{pp} dp{dp} {kw}"
        seen = {}
        for results in per_rank:
            history, weights = results[k]
            assert_close(
                torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5, msg=case
            )
            seen.update(weights)
        assert seen.keys() == ref_weights.keys(), case
        for name, value in ref_weights.items():
            assert_close(seen[name], value, rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")
