"""The composed trainer (pp x tp x ZeRO-1 dp) against the same run in one process."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import BatchLoader, SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.models.hf_io import fused_parts
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.tensor import full_tensor
from parallax.testing import assert_adam_close, context, run_ranks
from parallax.train.trainer import Trainer, lr_lambda

STEPS = 3
LR = 3e-3


def _batches(trainer, ctx, cfg, data):
    """A function returning this dp rank's microbatches of the next global batch."""
    loader = BatchLoader(
        data,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        seed=cfg.seed,
    )
    builder = BatchBuilder(
        trainer.model_config, data.statistics, text_tokenizer(trainer.model_config)
    )
    return lambda: [builder(m) for m in loader.next_batch()]


def train_steps(trainer, ctx, cfg) -> list[list[float]]:
    """``STEPS`` steps on the synthetic task: each step's loss, grad norm and metric sums."""
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    return history


def _run(ctx, cfg, **trainer_kw):
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx, **trainer_kw)
    history = train_steps(trainer, ctx, cfg)
    weights = {}
    if ctx.dp_rank == 0:  # logical weights after the steps, from each stage
        for name, p in trainer.named_parameters():
            weights.update(separate(name, full_tensor(p, ctx.tp_group)))
    return history, (weights if ctx.tp_rank == 0 else {})


def separate(name, tensor):
    """A (fused) parameter's logical value under the separate Hugging Face names."""
    parts = fused_parts(name)
    return dict(zip(parts, tensor.chunk(len(parts)))) if len(parts) > 1 else {name: tensor}


def _cfg(**kw):
    base = dict(
        steps=STEPS,
        global_batch_size=8,
        micro_batch_size=2,
        warmup_steps=1,
        lr=LR,
        grad_clip=1.0,
        seed=3,
    )
    return TrainConfig(**{**base, **kw})


def _parallel(tp, pp, dp, **kw):
    return _run(context(tp=tp, pp=pp, dp=dp), _cfg(tp=tp, pp=pp, dp=dp, **kw))


@pytest.fixture(scope="module")
def reference():
    return _run(ParallelContext.local(), _cfg())


@pytest.mark.parametrize(
    "tp,pp,dp,kw",
    [
        (2, 2, 2, dict(schedule="1f1b")),
        # the step as it was before the speed options: it must give the same numbers
        (
            1,
            2,
            2,
            dict(schedule="gpipe", logits="all", fused_projections=False, pipeline_syncs=True),
        ),
        (2, 2, 1, dict(schedule="interleaved", chunks=2)),
        (1, 1, 4, dict(overlap_grad_reduce=False)),
    ],
    ids=["tp2pp2dp2-1f1b", "pp2dp2-gpipe-base", "tp2pp2-interleaved", "dp4-no-overlap"],
)
def test_layouts_match_one_process(reference, tp, pp, dp, kw):
    ref_history, ref_weights = reference
    results = run_ranks(_parallel, tp * pp * dp, tp, pp, dp, **kw)
    seen = {}
    for history, weights in results:
        # loss, grad norm and metric sums on every rank, every step (tp reductions: ~1e-7)
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
        seen.update(weights)
    assert seen.keys() == ref_weights.keys()  # every parameter lives on some stage
    # (Adam and the order of sums: parallax.testing.assert_adam_close)
    for name, value in ref_weights.items():
        assert_adam_close(seen[name], value, LR, msg=name)
    assert ref_history[-1][0] < ref_history[0][0]  # and it learns


@pytest.mark.parametrize("dp", [1, 2])
def test_a_batch_without_labelled_tokens_gives_a_finite_loss(dp):
    """The global token count is clamped to 1 whether or not it is all-reduced (dp=1 has no
    all-reduce to wait for): no labels means a zero loss, not NaN."""
    losses = run_ranks(_unlabelled_step, dp) if dp > 1 else [_unlabelled_step()]
    assert losses == [0.0] * dp


def _unlabelled_step() -> float:
    ctx = context(dp=2) if torch.distributed.is_initialized() else ParallelContext.local()
    cfg = _cfg(dp=ctx.dp_size, grad_clip=0.0)
    trainer = Trainer(resolve(cfg), ctx)
    data = SyntheticTask(num_episodes=4, episode_length=2, image_size=32, seed=0)
    batch = _batches(trainer, ctx, cfg, data)()
    for mb in batch:
        mb["labels"] = torch.full_like(mb["labels"], -100)
    return trainer.train_step(batch).loss.item()


def test_lr_schedule():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="cosine")
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)
    assert lr_lambda(cfg.replace(lr_schedule="constant"))(50) == 1.0


def _bad_schedule():
    ctx = context(pp=2)
    try:
        Trainer(resolve(_cfg(pp=2, global_batch_size=2, micro_batch_size=2)), ctx)
    except ValueError as err:
        return str(err)
    return None


def test_too_few_microbatches_fail_on_every_rank():
    messages = run_ranks(_bad_schedule, 2, timeout=60)
    assert all(m and "microbatch" in m for m in messages), messages


def _wrong_count_on_one_rank(tp: int, pp: int, bad_rank: int) -> str | None:
    """Rank ``bad_rank`` alone passes one microbatch too few; the others' count is right."""
    ctx = context(tp=tp, pp=pp)
    cfg = _cfg(tp=tp, pp=pp, dp=ctx.dp_size, global_batch_size=4, micro_batch_size=1)
    trainer = Trainer(resolve(cfg), ctx)
    data = SyntheticTask(num_episodes=4, episode_length=2, image_size=32, seed=0)
    batch = _batches(trainer, ctx, cfg, data)()
    try:
        trainer.train_step(batch[1:] if ctx.rank == bad_rank else batch)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("tp,pp,bad_rank", [(1, 1, 1), (1, 2, 3)], ids=["dp2", "pp2dp2"])
def test_a_wrong_microbatch_count_on_one_rank_fails_everywhere(tp, pp, bad_rank):
    """Checked before the step's first collective and agreed on: every rank raises (a rank
    left alone would wait in the dp all-reduce or the pipeline until the timeout)."""
    world = 2 * tp * pp
    for msg in run_ranks(_wrong_count_on_one_rank, world, tp, pp, bad_rank, timeout=60):
        assert msg and f"rank {bad_rank}: got 1 microbatches, the schedule runs 2" in msg, msg


def _waits(tp: int, pp: int) -> float:
    """Each rank says it waited ``0.1 x (rank + 1)`` s for its batch; the step reports."""
    ctx = context(tp=tp, pp=pp)
    cfg = _cfg(tp=tp, pp=pp, dp=ctx.dp_size, global_batch_size=4, micro_batch_size=1)
    trainer = Trainer(resolve(cfg), ctx)
    data = SyntheticTask(num_episodes=4, episode_length=2, image_size=32, seed=0)
    batch = _batches(trainer, ctx, cfg, data)()
    return trainer.train_step(batch, data_wait_s=0.1 * (ctx.rank + 1)).data_wait_s


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1)], ids=["dp2", "tp2dp2"])
def test_the_step_reports_the_slowest_ranks_wait_for_data(tp, pp):
    """metrics.jsonl's data_wait_s is the largest wait over every rank (the step waits for
    the slowest), on every rank: it travels in the inputs' agreement."""
    world = 2 * tp * pp
    waits = run_ranks(_waits, world, tp, pp, timeout=60)
    assert waits == [pytest.approx(0.1 * world)] * world, waits
