"""Where a microbatch's host time goes at micro-batch 1: OpenVLA LoRA with the 7B's block and
adapter counts (DINOv2 24, SigLIP 27, Llama 32 blocks; 654 trainable tensors) at the tiny
preset's widths, so the arithmetic is negligible and the per-microbatch overheads show.

    python -m benchmarks.plan.host_overhead [--configs z1,z2,z2off,z2ac,z2offac] [--compile]
        [--batch 16 --steps 3 --warmup 2]

Prints, per configuration, the step's milliseconds per microbatch and the wall time inside
parallax's optimizer hooks (timed around the calls, no profiler): the gradient hook of each
trainable tensor, the end of each backward pass (ZeRO-2's launches and drain) and offload's
accumulator adds. On the CPU the rest is torch: op dispatch, compiled blocks' wrappers and the
kernels. Writes nothing to RESULTS.md (a CPU proxy for the GPU host's time, not a GPU result).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from dataclasses import replace

import torch

from benchmarks.plan.accuracy import batch_source
from benchmarks.tools.common import median, print_table
from parallax.context import ParallelContext
from parallax.families.openvla.config import OpenVLAConfig
from parallax.optim.zero.offload import host_steps as offload
from parallax.optim.zero.reduction import arrivals as grads
from parallax.optim.zero.reduction import pass_reducer as passes
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.train.trainer import Trainer

CONFIGS = {
    "z1": dict(zero=1),
    "z2": dict(zero=2),
    "z2off": dict(zero=2, offload="optimizer"),
    "z1ac": dict(zero=1, activation_checkpointing=True),
    "z2ac": dict(zero=2, activation_checkpointing=True),
    "z2offac": dict(zero=2, offload="optimizer", activation_checkpointing=True),
}
TIMED = {  # (class, method): column
    (grads.GradArrivals, "on_grad"): "hooks ms",
    (passes.PassReducer, "end_pass"): "pass end ms",
    (offload.HostSteps, "arrive"): "offload add ms",
}
SPENT: collections.Counter = collections.Counter()


def _timed(f, column: str):
    @functools.wraps(f)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[column] += time.perf_counter() - start

    return timed


def deep_tiny() -> OpenVLAConfig:
    """The tiny preset with OpenVLA-7B's depths."""
    c = OpenVLAConfig.preset("tiny")
    dino, siglip = c.vision
    vision = (replace(dino, depth=24), replace(siglip, depth=27))
    return replace(c, vision=vision, text=replace(c.text, num_hidden_layers=32))


def measure(name: str, args) -> list[object]:
    cfg = TrainConfig(
        model="tiny", finetune="lora", global_batch_size=args.batch, micro_batch_size=1,
        precision="fp32", compile=args.compile, **CONFIGS[name],
    )  # fmt: skip
    run = resolve(cfg, model_config=deep_tiny())
    ctx = ParallelContext.local(device=torch.device("cpu"))
    trainer = Trainer(run, ctx)
    next_batch = batch_source(run, ctx)
    tensors = sum(p.requires_grad for _, p in trainer.named_parameters())
    times = []
    for i in range(args.warmup + args.steps):
        batch = next_batch()
        if i == args.warmup:
            SPENT.clear()
        start = time.perf_counter()
        trainer.train_step(batch).loss.item()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    mbs = args.steps * len(batch)
    per_mb = [round(1e3 * SPENT[c] / mbs, 2) for c in TIMED.values()]
    step = median(times)
    return [
        name,
        tensors,
        len(batch),
        round(1e3 * step),
        round(1e3 * step / len(batch), 1),
        *per_mb,
    ]


def main(argv: list[str] | None = None) -> list[list[object]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    originals = {key: getattr(*key) for key in TIMED}
    for (cls, method), column in TIMED.items():
        setattr(cls, method, _timed(getattr(cls, method), column))
    try:
        rows = [measure(name, args) for name in args.configs.split(",")]
    finally:  # the classes as they were, for whatever runs next in this process
        for (cls, method), f in originals.items():
            setattr(cls, method, f)
        torch.set_num_threads(threads)
    columns = ["config", "trainable tensors", "microbatches", "step ms", "ms per microbatch"]
    title = "host time per microbatch, LoRA mb 1 (CPU" + (", compiled)" if args.compile else ")")
    print_table(title, columns + [f"{c} per mb" for c in TIMED.values()], rows)
    return rows


if __name__ == "__main__":
    main()
