"""--zero 2 and 3 in the trainer (tp x pp x dp, LoRA, --freeze, --compile) against one process,
zero-3's memory counted from its own buffers, and a resume across stages and layouts."""

import json

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import SyntheticTask
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.testing import assert_adam_close, context, run_ranks
from parallax.train.trainer import Trainer
from tests.families.openvla.test_trainer import _batches, separate

STEPS = 2
LR = 3e-3
LORA = dict(finetune="lora", lr=LR, warmup_steps=1)  # no clipping: offload steps early
FREEZE = dict(freeze="vision")
COMPILE = dict(compile=True, activation_checkpointing=True)  # with the aot_eager backend
OFFLOAD = dict(offload="optimizer")
OFFLOAD_FLAGS = ["--offload", "optimizer"]


def _cfg(**kw) -> TrainConfig:
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


def _run(ctx, cfg, **trainer_kw):
    """``STEPS`` steps: each step's loss, grad norm and metric sums, and the logical weights
    after them (on the stage's dp 0, tp 0 rank)."""
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx, **trainer_kw)
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
        (1, 1, 2, "full", dict(zero=2, **OFFLOAD)),  # host steps after the clipping
        (1, 1, 2, "lora", dict(zero=3, **OFFLOAD, **LORA)),  # host steps during the backward
    ],
    4: [
        (2, 1, 2, "full", dict(zero=2)),
        (2, 1, 2, "full", dict(zero=3)),
        (1, 2, 2, "full", dict(zero=3, schedule="1f1b")),
        (1, 2, 2, "full", dict(zero=2, schedule="interleaved", chunks=2)),
        (1, 2, 2, "full", dict(zero=3, schedule="interleaved", chunks=2)),
        (1, 2, 2, "lora", dict(zero=3, schedule="gpipe", **LORA)),
        (2, 1, 2, "freeze", dict(zero=3, reshard_after_forward=False, **FREEZE)),
        (1, 2, 2, "full", dict(zero=3, schedule="1f1b", **OFFLOAD)),
        (2, 1, 2, "lora", dict(zero=2, offload_fraction=0.5, **OFFLOAD, **LORA)),
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
            assert_adam_close(seen[name], value, LR, msg=f"{case}: {name}")


def test_offload_at_dp1_equals_the_run_without_it(references):
    """One process, the optimizer offloaded (ZeRO-2 at dp 1: nothing sharded, everything on the
    host), against the same run without offload. CPU tensors both ways: only the kernels
    differ (torch's fused CPU AdamW against its foreach AdamW), ~1e-7."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = _run(ParallelContext.local(), _cfg(zero=2, **OFFLOAD))
    finally:
        torch.set_num_threads(threads)
    ref_history, ref_weights = references["full"]
    assert_close(torch.tensor(got[0]), torch.tensor(ref_history), rtol=1e-6, atol=1e-6)
    for name, value in ref_weights.items():
        assert_close(got[1][name], value, rtol=1e-6, atol=1e-6, msg=name)


def _holds_units(unit, units) -> bool:
    inside = {id(m) for m in unit.module.modules() if m is not unit.module}
    return any(id(v.module) in inside for v in units)


def _zero3_counts(microbatches: int) -> dict:
    """Two 1F1B steps at pp2 dp2 --zero 3 with ``microbatches`` per dp rank: what the rank
    holds after each of its stage's forward and backward actions, and at most (in the second
    step, which prefetches in the order the first one recorded)."""
    ctx = context(pp=2, dp=2)
    cfg = _cfg(pp=2, dp=2, zero=3, schedule="1f1b", global_batch_size=4 * microbatches)
    trainer = Trainer(resolve(cfg), ctx)
    opt, gathers = trainer.optimizer, trainer.optimizer.zero3.gathers
    between = []

    def counted(run):
        def action(*args):
            out = run(*args)
            between.append(gathers.gathered_bytes())
            assert all(p.grad is None for p in opt.params)  # no gradient kept in full
            return out

        return action

    for stage in trainer.stages:
        stage.forward, stage.backward = counted(stage.forward), counted(stage.backward)
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    trainer.train_step(next_batch())
    gathers.peak_bytes = 0
    trainer.train_step(next_batch())
    units = opt.units
    sizes = [sum(p.numel() * p.element_size() for p in u.params) for u in units]
    report = opt.memory_report()
    return dict(
        actions=len(between),
        prefetched=bool(gathers.position),
        between=max(between),
        peak=gathers.peak_bytes,
        two_largest=sum(sorted(sizes)[-2:]),
        # a unit around others (a tower's own embeddings) stays gathered while they run
        parents=sum(s for u, s in zip(units, sizes) if not u.block and _holds_units(u, units)),
        weights=sum(sizes),
        shards=report.param_bytes + report.frozen_bytes,
        grad_bytes=report.grad_bytes + len(opt.flat.grad_buffers),
    )


def test_zero3_holds_its_shards_between_uses_and_two_blocks_at_most():
    """Between the forward and backward actions of a 1F1B schedule a zero-3 rank holds only
    its 1/dp shard of every weight; gathered weights never exceed the block running plus the
    prefetched one (and the units around them), whatever the microbatches in flight; no
    gradient is kept in full."""
    two, four = (run_ranks(_zero3_counts, 4, m, timeout=300) for m in (2, 4))
    for rank2, rank4 in zip(two, four):
        for got in (rank2, rank4):
            assert got["between"] == 0 and got["grad_bytes"] == 0 and got["prefetched"]
            assert got["shards"] <= got["weights"] / 2 + 4 * 16 * 2 * 64  # padding aside
            assert 0 < got["peak"] <= got["two_largest"] + got["parents"]
            assert got["peak"] < got["weights"]  # never the whole stage
        assert rank4["actions"] == 2 * rank2["actions"]  # twice the microbatches in flight
        assert rank4["peak"] == rank2["peak"]  # ... and not a byte more gathered


RUN = ["--steps", "3", "--global-batch-size", "8", "--micro-batch-size", "2"]
RUN += ["--save-interval", "2", "--log-interval", "1", "--warmup-steps", "1", "--lr", "3e-3"]


def _cli(tp: int, dp: int, out: str, flags: list, stop_after=None) -> None:
    from parallax.train import parse_args
    from parallax.train.cli import run

    ctx = context(tp=tp, dp=dp)
    cfg = parse_args(["--tp", str(tp), "--dp", str(dp), "--out", out, *RUN, *flags])
    run(resolve(cfg), ctx, stop_after)


def _losses(out) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_resume_across_stages_layouts_and_offload(tmp_path):
    """Checkpoints are layout-free: one written at --zero 3 dp2 with the optimizer offloaded
    holds the same full logical tensors as one written at --zero 1, and each resumes at
    another stage, layout and offload to the uninterrupted run's next loss."""
    import shutil

    from parallax.checkpoint import Checkpoint

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_ranks(_cli, 2, 1, 2, str(a), ["--zero", "3", *OFFLOAD_FLAGS], 2)  # stops at step 2
    run_ranks(_cli, 2, 2, 1, str(a), ["--zero", "1", "--resume"])  # tp2, offload off
    run_ranks(_cli, 2, 1, 2, str(b), ["--zero", "1"])  # uninterrupted: steps 1 to 3
    shutil.copytree(b / "checkpoints" / "step_00000002", c / "checkpoints" / "step_00000002")
    shutil.copy(b / "metrics.jsonl", c / "metrics.jsonl")
    run_ranks(_cli, 2, 1, 2, str(c), ["--zero", "2", *OFFLOAD_FLAGS, "--resume"])  # offload on
    step3 = _losses(b)[3]
    rows = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert all(r["host_memory_gib"] > 0.1 for r in rows)  # host memory in the metrics
    assert _losses(a)[3] == pytest.approx(step3, rel=1e-5)
    assert _losses(c)[3] == pytest.approx(step3, rel=1e-5)
    x, y = (Checkpoint(d / "checkpoints" / "step_00000002") for d in (a, b))
    with x, y:
        assert x.names() == y.names()
        for name in x.names():
            assert_close(x.get(name), y.get(name), rtol=1e-5, atol=1e-6, msg=name)


BAD = [
    (dict(zero=4), "--zero must be 1, 2 or 3, got 4"),
    (dict(zero=3, compile=True, cuda_graphs=True), "--cuda-graphs cannot replay blocks under"),
    (dict(zero=2, reshard_after_forward=False), "--no-reshard-after-forward needs --zero 3"),
    (dict(zero=1, offload="optimizer"), "it needs --zero 2 or 3 (got --zero 1)"),
    (dict(zero=2, offload_fraction=0.5), "--offload-fraction 0.5 needs --offload optimizer"),
]


def _refused(kw: dict) -> str | None:
    """A Trainer built with a bad combination, on every rank of a dp2 run."""
    try:
        Trainer(resolve(_cfg(dp=2, **kw)), context(dp=2))
    except ValueError as err:
        return str(err)
    return None


def test_bad_combinations_are_refused_on_every_rank_before_any_collective():
    """Checked from the flags alone, so every rank raises the same message before it builds
    anything (a rank left alone would wait in the optimizer's first collective)."""
    for kw, words in BAD:
        messages = run_ranks(_refused, 2, kw, timeout=60)
        assert messages[0] == messages[1] and messages[0] and words in messages[0], messages
