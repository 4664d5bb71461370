"""The memory model against the run: on 4 gloo ranks, the predicted bytes of weights, gradients,
optimizer state and ZeRO's staging buffers of each rank are within 10 % of what the Trainer's
tensors hold (the optimizer's memory report, and the frozen weights outside it), for the tiny
preset at several layouts, precisions and ZeRO stages, and with LoRA (on a bf16 and
on an NF4 base: the quantized weights are buffers, whole on every dp rank)."""

import dataclasses

import pytest

import parallax.models.vlm as vlm
from parallax.data import BatchLoader, SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.optim.zero.stage import host_adamw_kernel
from parallax.plan.layout import Layout
from parallax.plan.memory import rank_memory
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.tensor.quant import quantized_weights
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer

CASES = [
    ("tiny", (1, 1, 4), dict(precision="fp32")),
    ("tiny", (2, 1, 2), dict(precision="bf16")),
    ("tiny", (1, 2, 2), dict(precision="bf16", finetune="lora")),
    ("tiny", (2, 1, 2), dict(precision="bf16", finetune="lora", quantize_base="nf4", zero=3)),
    ("tiny", (1, 1, 4), dict(precision="bf16", zero=2)),
    ("tiny", (2, 1, 2), dict(precision="bf16", zero=3)),
    ("tiny", (1, 1, 4), dict(precision="fp32", zero=3, offload="optimizer")),
    ("tiny", (1, 1, 4), dict(precision="bf16", zero=2, offload="optimizer", offload_fraction=0.5)),
]


def _sizes(model: str, tp: int, pp: int, dp: int, options: dict) -> tuple[float, ...]:
    """(predicted, counted) bytes on this rank's GPU, then on its host, with the model built
    but not initialised (only sizes matter: initialising the small preset would take most of
    the test's time). On the CPU the offload makes no pinned staging. None of the bytes
    counted depends on the batch, so each rank runs the fewest microbatches its schedule takes."""
    cfg = resolve(
        TrainConfig(
            model=model,
            tp=tp,
            pp=pp,
            dp=dp,
            global_batch_size=pp * dp,  # pp microbatches a rank: the fewest 1F1B takes
            micro_batch_size=1,
            **options,
        )
    )
    ctx = context(tp=tp, pp=pp, dp=dp)
    init, vlm.init_parameters = vlm.init_parameters, lambda *args, **kwargs: None
    try:
        trainer = Trainer(cfg, ctx)
    finally:
        vlm.init_parameters = init
    trainer.train_step(_microbatches(trainer, ctx, cfg))  # AdamW makes its state in a step
    report = trainer.optimizer.memory_report()
    stage = options.get("zero", 1)
    outside = [p for c in trainer.chunks for p in c.parameters() if not p.requires_grad]
    frozen = 0 if stage == 3 else sum(p.numel() * p.element_size() for p in outside)
    frozen += sum(q.nbytes() for c in trainer.chunks for _, q in quantized_weights(c))  # whole
    # the planner plans a GPU's run, whose offloaded step (--host-adamw auto) is the one-pass
    # kernel; this CPU run steps with torch's, and its scratch: planned as the kernel that ran
    ran = dataclasses.replace(cfg, host_adamw=host_adamw_kernel(cfg.host_adamw, ctx.device.type))
    mem = rank_memory(Workload(ran), Layout.of(cfg, dp), ctx.pp_rank, cfg.overlap_grad_reduce)
    staging = mem.buffers if stage == 1 else 0.0  # ZeRO-2/3's pass buffers live in a pass
    predicted = mem.weights + mem.gradients + mem.optimizer + staging
    host = getattr(report, "host_bytes", 0)
    return predicted, report.total_bytes + frozen, mem.host - mem.pinned, host


def _microbatches(trainer, ctx, cfg) -> list:
    data = SyntheticTask(num_episodes=8, episode_length=2, image_size=32, seed=0)
    loader = BatchLoader(data, global_batch_size=cfg.global_batch_size, micro_batch_size=1,
                         dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, seed=0)  # fmt: skip
    config = trainer.model_config
    builder = BatchBuilder(config, data.statistics, text_tokenizer(config))
    return [builder(m) for m in loader.next_batch()]


def _all_cases() -> list[tuple[float, ...]]:
    return [_sizes(model, *layout, options) for model, layout, options in CASES]


def test_predicted_bytes_per_rank_are_within_ten_percent_of_the_tensors():
    for rank, sizes in enumerate(run_ranks(_all_cases, 4)):
        for (model, layout, options), (gpu, counted, host, on_host) in zip(CASES, sizes):
            assert gpu == pytest.approx(counted, rel=0.10), (rank, model, layout, options)
            assert host == pytest.approx(on_host, rel=0.10), (rank, model, layout, options)
