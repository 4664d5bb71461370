"""Train a custom model, written as a list of blocks, pipelined across ranks (with tp and dp).

The model is ordinary PyTorch built from parallax tensor-parallel layers: an embedding block,
a stack of pre-norm attention + MLP blocks, and a head. It learns a synthetic task: each
sequence counts up modulo the vocabulary with its own step, so predicting the next token needs
attention over the context. Microbatches have different sequence lengths.

    torchrun --nproc-per-node 2 examples/pipeline_custom_model.py                  # pp=2, 1F1B
    torchrun --nproc-per-node 2 examples/pipeline_custom_model.py --schedule interleaved
    torchrun --nproc-per-node 4 examples/pipeline_custom_model.py --pp 2 --tp 2
    torchrun --nproc-per-node 4 examples/pipeline_custom_model.py --pp 2 --dp 2 --trace runs/trace

Runs on CPU (gloo) or GPUs (NCCL). dp gradients are averaged with a plain all-reduce here; the
ZeRO-1 optimizer does that (sharded) in real training.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import parallax
from parallax import comm
from parallax.pipeline import (
    Timeline,
    build_stages,
    gather_events,
    gpipe,
    interleaved_1f1b,
    measured_bubble,
    one_f_one_b,
    run_schedule,
    simulate,
    write_chrome_trace,
)
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    heads_per_rank,
    vocab_parallel_cross_entropy,
)

VOCAB, HIDDEN, HEADS, LAYERS = 64, 64, 4, 8


class Embed(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        self.tok = VocabParallelEmbedding(VOCAB, HIDDEN, ctx=ctx)

    def forward(self, ids):
        return self.tok(ids)  # (b, s, h)


class Block(nn.Module):
    """Pre-norm causal attention and MLP; heads and MLP features split across tp."""

    def __init__(self, ctx) -> None:
        super().__init__()
        self.heads = heads_per_rank(HEADS, ctx.tp_size, "example block")
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, ctx=ctx, partitions=3)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, ctx=ctx)
        self.up = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, ctx=ctx)
        self.down = RowParallelLinear(4 * HIDDEN, HIDDEN, ctx=ctx)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads/tp, s, hd)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))  # (b, s, h)


class Head(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = ColumnParallelLinear(HIDDEN, VOCAB, bias=False, ctx=ctx)

    def forward(self, x):
        return self.out(self.norm(x))  # (b, s, V/tp)


def make_block(index: int, ctx) -> nn.Module:
    if index == 0:
        return Embed(ctx)
    return Head(ctx) if index == LAYERS + 1 else Block(ctx)


def batch(gen: torch.Generator, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    step = torch.randint(1, 8, (size, 1), generator=gen)
    tokens = (start + step * torch.arange(seq + 1)) % VOCAB  # (b, s + 1)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trace", default=None, help="folder for a Chrome trace of the last step")
    args = parser.parse_args()

    ctx = parallax.init_parallel(tp=args.tp, pp=args.pp, dp=args.dp)
    m, pp = args.microbatches, ctx.pp_size
    schedule = {
        "gpipe": lambda: gpipe(pp, m),
        "1f1b": lambda: one_f_one_b(pp, m),
        "interleaved": lambda: interleaved_1f1b(pp, m, chunks_per_rank=2),
    }[args.schedule]()

    # the whole pipeline setup: this rank's chunks of the block list, layout-free weights
    stages = build_stages(lambda i: make_block(i, ctx), LAYERS + 2, ctx, schedule.chunks_per_rank)
    for stage in stages:
        parallax.init_parameters(stage.module, seed=0)
    params = [p for stage in stages for p in stage.module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3)

    def loss_fn(logits, target):
        return vocab_parallel_cross_entropy(logits, target, ctx)

    if ctx.rank == 0:
        print(schedule)
        print(f"simulated bubble {simulate(schedule).bubble_fraction:.1%} ({ctx.dims})")
    gen = torch.Generator().manual_seed(1000 + ctx.dp_rank)  # each replica its own data
    timeline = Timeline() if args.trace else None
    for step in range(args.steps):
        data = [batch(gen, 8, seq=12 + 4 * (i % 3)) for i in range(m)]  # varying lengths
        last = step == args.steps - 1
        loss = run_schedule(
            schedule,
            stages,
            ctx,
            inputs=[x for x, _ in data],
            targets=[y for _, y in data],
            loss_fn=loss_fn,
            timeline=timeline if last else None,
        )
        for p in params:
            comm.all_reduce(p.grad, ctx.dp_group, op="avg")
        optimizer.step()
        optimizer.zero_grad()
        comm.all_reduce(loss, ctx.dp_group, op="avg")
        if ctx.rank == 0 and (step % 10 == 0 or last):
            print(f"step {step:3d}  loss {loss.item():.3f}")
    if timeline is not None:
        events = gather_events(timeline, ctx)
        if ctx.rank == 0:
            path = write_chrome_trace(f"{args.trace}/pipeline_custom_model.trace.json", events)
            print(f"trace: {path} (measured bubble {measured_bubble(events):.1%})")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
