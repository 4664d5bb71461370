"""``--quantize-base`` in the planner: the quantized bytes it counts are the built model's, the
weights drop by what quantizing frees, the rest of the step's bytes stay, and the predicted step
pays for rebuilding each weight from its codes (more when the block is recomputed)."""

import dataclasses

import torch

from parallax import ParallelContext
from parallax.plan.cost import step_time
from parallax.plan.layout import Layout
from parallax.plan.machine import H200
from parallax.plan.memory import rank_memory
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.recipe.adapt import build_chunk
from parallax.run import TrainConfig
from parallax.tensor.quant import quantized_weights


def _run(**kw):
    return resolve(TrainConfig(finetune="lora", precision="bf16", micro_batch_size=2, **kw))


def test_the_planner_counts_the_built_models_codes_and_prices_their_rebuild():
    plain, nf4 = _run(), _run(quantize_base="nf4")
    blocks = range(len(nf4.recipe.model.blocks(nf4.model_config)))
    chunk, _ = build_chunk(
        nf4, blocks, ParallelContext.local(), dtype=torch.bfloat16, device="cpu", checkpoint=None
    )
    held = [q for _, q in quantized_weights(chunk)]
    built = sum(q.nbytes() for q in held)
    freed = sum(2 * q.numel() for q in held) - built
    machine = H200
    times = {}
    for run in (plain, nf4):
        model = Workload(run)
        layout = Layout.of(run, 1)
        mem = rank_memory(model, layout, 0)
        times[run.quantize_base] = step_time(model, layout, machine, [mem]).seconds
        if run is nf4:
            assert mem.quantized == built
            assert sum(b.params for b in model.params(1)) == sum(
                p.numel() for p in chunk.parameters()
            ) + sum(q.numel() for q in held)
        else:
            before = mem
    assert before.weights - mem.weights == freed
    assert (before.gradients, before.optimizer) == (mem.gradients, mem.optimizer)
    assert times["nf4"] > times[None]
    ckpt = dataclasses.replace(nf4, activation_checkpointing=True)
    model = Workload(ckpt)
    layout = Layout.of(ckpt, 1)
    mem = rank_memory(model, layout, 0)
    assert step_time(model, layout, machine, [mem]).seconds > times["nf4"]
