"""A model described by its numbers alone, and a machine of round numbers, for cases whose best
layout can be worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

from parallax.models.estimate import BlockEstimate, Part, Split
from parallax.models.stages import StageBlock
from parallax.plan.blocks import BlockParams
from parallax.plan.machine import Link, Machine
from parallax.plan.workload import Workload
from parallax.run import Run, TrainConfig

FLOPS = 1e9  # forward matmul FLOPs of one block on one sample
TOKENS = 100  # rows of its matmuls per sample
PARAMS = 1_000_000  # bf16 parameters per block, all sharded by tp
FREE = Link(busbw_gbs=1e9, latency_us=0.0)  # communication that costs nothing


class ToyModel:
    """The model side the planner asks: where the first stage starts, which layouts it takes."""

    pin_first = 0

    def __init__(self, tp: bool) -> None:
        self.tp = tp

    def check_layout(self, run, dims) -> None:
        if dims.tp > 1 and not self.tp:
            raise ValueError("the toy cannot shard over tp")


class ToyRecipe:
    name = "toy"

    def __init__(self, tp: bool) -> None:
        self.model, self.objective = ToyModel(tp), SimpleNamespace(kind="tokens")


def toy(
    saved: list[float],
    scopes: list[str | None],
    batch: int = 8,
    tp: bool = False,
    grad_clip: float = 1.0,
    host_adamw: str = "torch",
) -> Workload:
    """Blocks of ``FLOPS`` and ``PARAMS`` each; block ``i`` keeps ``saved[i]`` bytes a sample
    (split by tp), or 1 kB when its ``scopes[i]`` recomputes. An offloaded clipped step is
    torch's kernel's unless ``host_adamw`` says otherwise (the hand-worked costs are its)."""
    flags = TrainConfig(
        precision="bf16", global_batch_size=batch, grad_clip=grad_clip, host_adamw=host_adamw
    )
    run = Run(**flags.core_options(), recipe=ToyRecipe(tp), model_name="toy", model_config=None)
    n = len(saved)
    blocks = [StageBlock(f"b{i}", FLOPS) for i in range(n)]
    estimates = [
        BlockEstimate(
            (
                Part(
                    f"b{i}",
                    saved=Split(saved[i], 0.0),
                    scope=scopes[i],
                    kept=Split(0.0, 1e3),
                    gemm_flops=FLOPS,
                    tokens=TOKENS,
                    tp_reduces=2,
                    tp_bytes=1e3,
                ),
            ),
            output_bytes=1e3,
        )
        for i in range(n)
    ]

    def params(tp: int) -> list[BlockParams]:
        p = PARAMS // tp
        block = BlockParams(f"b{tp}", p, p, 0, (p, 0), ((2, p),), (), (2 * p,), p)
        return [block] * n

    return Workload(run, blocks, estimates, params)


def machine(gpu_gib: float, link: Link = FREE, gpus_per_node: int = 8) -> Machine:
    """1 TFLOP/s matmuls at half rate for 100 rows, everything else free, no reserve."""
    return Machine(
        name="hand-made",
        gpu_memory_gib=gpu_gib,
        host_memory_gib=1000.0,
        gpus_per_node=gpus_per_node,
        gemm_tflops=1.0,
        attention_tflops=1.0,
        hbm_gbs=1e12,
        h2d_gbs=1e12,
        host_adam_s=0.0,
        intra=link,
        inter=link,
        host_gbs=1e12,
        gemm_half_tokens=100.0,
        cuda_context_gib=0.0,
        allocator_reserve=0.0,
    )
