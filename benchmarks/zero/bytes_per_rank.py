"""How many bytes does each ZeRO stage leave on a rank? The ``small`` preset in bf16 at dp 8,
``--zero 1``, ``2`` and ``3``: the tensors each rank holds after a step, counted by the
optimizer (:meth:`~parallax.optim.ZeroOptimizer.memory_report`: weights, gradients, fp32
masters, reduced gradients, AdamW state, ZeRO-3's gathered peak and pass buffers), against the
planner's formula for the same layout (:func:`parallax.plan.memory.rank_memory`).

    torchrun --nproc-per-node 8 -m benchmarks.zero.bytes_per_rank          # CPU, gloo (issue 26)
    torchrun --nproc-per-node 2 -m benchmarks.zero.bytes_per_rank --smoke  # tiny, writes nothing

Weights are left uninitialised (only sizes matter); the step runs on one synthetic batch.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from benchmarks.tools.common import append_results, print_table
from parallax import init_parallel
from parallax.data import BatchLoader, SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.models import vlm
from parallax.plan.layout import Layout
from parallax.plan.memory import rank_memory
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.train.trainer import Trainer

MIB = 2**20
COLUMNS = ["model", "dp", "zero", "weights MiB", "grads MiB", "optimizer MiB", "counted MiB",
           "formula MiB", "formula/counted", "plain AdamW MiB"]  # fmt: skip


def measure(model: str, dp: int, zero: int, ctx) -> dict:
    cfg = resolve(TrainConfig(model=model, dp=dp, precision="bf16", zero=zero,
                              global_batch_size=dp, micro_batch_size=1))  # fmt: skip
    init, vlm.init_parameters = vlm.init_parameters, lambda *args, **kwargs: None
    try:
        trainer = Trainer(resolve(cfg), ctx)
    finally:
        vlm.init_parameters = init
    data = SyntheticTask(num_episodes=max(8, dp), episode_length=2, image_size=32, seed=0)
    loader = BatchLoader(data, global_batch_size=dp, micro_batch_size=1, dp_rank=ctx.dp_rank,
                         dp_size=dp, seed=0)  # fmt: skip
    config = trainer.model_config
    builder = BatchBuilder(config, data.statistics, text_tokenizer(config))
    trainer.train_step([builder(m) for m in loader.next_batch()])  # AdamW makes its state
    r = trainer.optimizer.memory_report()
    mem = rank_memory(Workload(cfg), Layout.of(cfg, dp), 0, cfg.overlap_grad_reduce)
    staging = mem.buffers if zero == 1 else 0.0  # ZeRO-2/3's pass buffers live in a pass
    formula = mem.weights + mem.gradients + mem.optimizer + staging
    counted = r.total_bytes + (0 if zero == 3 else _frozen_bytes(trainer))
    return {
        "model": model, "dp": dp, "zero": zero,
        "weights_mib": (r.param_bytes + r.frozen_bytes) / MIB, "grads_mib": r.grad_bytes / MIB,
        "optimizer_mib": r.optimizer_bytes / MIB, "counted_mib": counted / MIB,
        "formula_mib": formula / MIB, "ratio": formula / counted,
        "plain_adamw_mib": r.plain_adamw_bytes / MIB,
    }  # fmt: skip


def _frozen_bytes(trainer) -> int:
    """Frozen weights (outside the optimizer below ZeRO-3)."""
    frozen = [p for c in trainer.chunks for p in c.parameters() if not p.requires_grad]
    return sum(p.numel() * p.element_size() for p in frozen)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the tiny preset; writes nothing")
    args = p.parse_args(argv)
    ctx = init_parallel()
    dp, model = ctx.dp_size, "tiny" if args.smoke else "small"
    records = [measure(model, dp, zero, ctx) for zero in (1, 2, 3)]
    if dist.get_rank() == 0:
        rows = [list(r.values()) for r in records]
        title = f"zero_bytes: bytes per rank by ZeRO stage, {model} bf16 at dp {dp} (CPU, gloo)"
        print_table(title, COLUMNS, rows)
        if not args.smoke:
            notes = ("counted = the optimizer's memory_report (rank 0) plus frozen weights; "
                     "formula = parallax.plan.memory.rank_memory for the same layout")  # fmt: skip
            append_results(title, COLUMNS, rows, notes,
                           [{"benchmark": "zero_bytes", **r} for r in records])  # fmt: skip
    dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
