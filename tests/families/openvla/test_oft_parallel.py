"""OpenVLA-OFT (``--action-head l1``) through the Trainer: every layout equals one process.

Two images, the proprio token and FiLM on, chunks of 2; full fine-tuning and LoRA (the head,
the proprio projector and FiLM trained whole beside the adapters) run in the same spawn of
ranks. Per step the loss, the gradient norm and the metric sums on every rank, and every
updated weight after the steps, against the same run in one process (float32 on gloo,
1e-5: the sums differ only in order, see tests/families/openvla/test_trainer.py for why
weights agree to that under Adam)."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.data import BatchLoader, SyntheticTask
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.testing import assert_adam_close, context, run_ranks
from tests.families.openvla.test_trainer import separate

STEPS = 2
OFT = dict(action_head="l1", action_chunk=2, film=True)
RUNS = {
    "full": dict(finetune="full", grad_clip=1.0, warmup_steps=0, lr=2e-3),
    "lora": dict(finetune="lora", lora_rank=4, lora_alpha=8.0, lr=2e-3),
}


def _cfg(kind: str, **kw) -> TrainConfig:
    base = dict(steps=STEPS, global_batch_size=4, micro_batch_size=1, seed=5, **OFT)
    return TrainConfig.of(**{**base, **RUNS[kind], **kw})


def _data(cfg) -> SyntheticTask:
    """The recipe's synthetic OFT task, small: 6 episodes of 32 px."""
    from parallax.families.openvla.oft.data import synthetic_task
    from parallax.recipe import resolve

    task = synthetic_task(resolve(cfg).family_options, cfg.seed)
    return SyntheticTask(task.config, num_episodes=6, image_size=32)


def _run(ctx, cfg):
    from parallax.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    data = _data(cfg)
    loader = BatchLoader(
        data,
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        seed=cfg.seed,
    )
    build = trainer.recipe.data.collator(trainer.run, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step([build(m) for m in loader.next_batch()])
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    trainable = {name for name, p in trainer.named_parameters() if p.requires_grad}
    weights = {}
    for name, full in trainer.full_weights():  # at zero 3 a collective over dp and tp
        if name in trainable and ctx.dp_rank == 0 and ctx.tp_rank == 0:
            weights.update(separate(name, full))
    return history, weights


def _parallel(tp, pp, dp, kinds=tuple(RUNS), **memory):
    ctx = context(tp=tp, pp=pp, dp=dp)
    return {k: _run(ctx, _cfg(k, tp=tp, pp=pp, dp=dp, **memory)) for k in kinds}


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {k: _run(ParallelContext.local(), _cfg(k)) for k in RUNS}
    finally:
        torch.set_num_threads(threads)


LAYOUTS = {
    "tp2": (2, 1, 1, {}),
    "pp2": (1, 2, 1, {}),
    "dp2": (1, 1, 2, {}),
    "tp2pp2dp2": (2, 2, 2, {}),
    "dp2-zero2-offload": (1, 1, 2, dict(zero=2, offload="optimizer")),
    "pp2dp2-zero3": (1, 2, 2, dict(zero=3)),
}


@pytest.mark.parametrize("tp,pp,dp,memory", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts_match_one_process(reference, tp, pp, dp, memory):
    for kind, (_, ref_weights) in reference.items():
        assert any(n.startswith("action_head.proj_in") for n in ref_weights), kind
        assert "proprio_projector.fc1.weight" in ref_weights
        assert any(".film_scale." in n for n in ref_weights)
        assert "language_model.lm_head.weight" not in ref_weights  # never runs, never trains
    _match(run_ranks(_parallel, tp * pp * dp, tp, pp, dp, **memory), reference)


def _match(results: list[dict], reference: dict) -> None:
    """Every rank's history and the union of their weights equal one process's, per kind run."""
    for kind in results[0]:
        ref_history, ref_weights = reference[kind]
        seen = {}
        for by_kind in results:
            history, weights = by_kind[kind]
            assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
            seen.update(weights)
        assert seen.keys() == ref_weights.keys(), kind
        for name, value in ref_weights.items():
            lr = RUNS[kind]["lr"]  # (Adam and the order of sums: see assert_adam_close)
            assert_adam_close(seen[name], value, lr, msg=f"{kind}: {name}")
        assert ref_history[-1][0] != ref_history[0][0]


def test_padded_text_at_tp2_pp2_matches_one_process_unpadded(reference):
    # the padding meets the layout in the shapes tp splits and pp sends; full fine-tuning only:
    # LoRA's adapter weights at tp2 pp2 sit at 9e-6 of one process without padding already
    # (Adam magnifies the order of tp's sums on near-zero gradients), so their 1e-5 tells
    # nothing about the padding
    results = run_ranks(_parallel, 4, 2, 2, 1, kinds=("full",), pad_to_multiple_of=16)
    _match(results, reference)


def test_padded_text_matches_one_process(reference):
    # --pad-to-multiple-of 16 widens every microbatch (the key-padding mask hides the pads):
    # the same losses, gradient norms and updated weights as the unpadded run
    from parallax.recipe import resolve

    cfg = _cfg("full", pad_to_multiple_of=16)
    data = _data(cfg)

    def batch(run) -> dict:
        return run.recipe.data.collator(run, data)([data[0]])

    runs = resolve(cfg), resolve(_cfg("full"))
    padded, plain = (batch(r)["input_ids"].shape[1] for r in runs)
    assert padded % 16 == 0 and plain < padded, (plain, padded)  # the run does pad
    tokens = [r.recipe.model.tokens(r, [batch(r)]) for r in runs]
    assert tokens[0] == tokens[1]  # tokens/s counts the data, not the pads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        history, weights = _run(ParallelContext.local(), cfg)
    finally:
        torch.set_num_threads(threads)
    ref_history, ref_weights = reference["full"]
    assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)
