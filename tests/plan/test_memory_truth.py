"""One source of memory truth: the planner's bytes of a rank are the real ZeroOptimizer's.

On 2 gloo ranks (dp=2, then dp=1 x tp=2) a small model is trained one step by the real
ZeroOptimizer at stages 1, 2 and 3, bf16 and fp32, with and without overlap and offload, and its
own ``memory_report()`` is compared with what the planner's memory model
(:func:`parallax.plan.memory.rank_memory`) says of the same model, counted by the planner's own
code (:mod:`parallax.plan.blocks`): weights, gradients, optimizer state, host bytes (and the
floor of 12 bytes an offloaded element they are reported against) and ZeRO-1's fp32 staging,
equal to the byte. Every parameter's size is a multiple of dp x 16 elements, so ZeRO's bucket
padding, which the planner leaves out, is zero here. The buckets the planner packs
its counts into, and the ones it offloads, are the optimizer's own too (at a small bucket size,
where there are several)."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from parallax.optim import ZeroOptimizer
from parallax.optim.zero.buffers.packing import bucket_numels
from parallax.optim.zero.offload.share import kept_buckets, offloaded_buckets
from parallax.plan import blocks
from parallax.plan.layout import Layout
from parallax.plan.memory import rank_memory
from parallax.plan.workload import Workload
from parallax.testing import context, run_ranks
from tests.plan.toy import toy

W, DEPTH = 32, 3  # a layer's weight and bias: 1056 elements, a multiple of 2 x 16
SMALL_BUCKET = 1100  # elements: a layer a bucket

# (stage, dtype, overlap, share offloaded, a frozen layer[, share of that summed on the device])
CASES = [
    (1, torch.bfloat16, True, 0.0, False),  # the fp32 reduced slice beside the bf16 buffer
    (1, torch.bfloat16, False, 0.0, True),  # dp=2: reduced over the bf16 bytes; dp=1: staged
    (1, torch.float32, True, 0.0, False),  # fp32: its own buffer is its home
    (2, torch.bfloat16, True, 0.0, True),
    (2, torch.bfloat16, True, 0.5, False),  # one bucket at the default size: all of it
    (3, torch.bfloat16, True, 0.0, True),  # the frozen layer sharded too
    (3, torch.float32, True, 1.0, False),
    (3, torch.bfloat16, True, 1.0, False, 1.0),  # every sum on the device, none on the host
]


class Net(nn.Module):
    """Units of every kind ZeRO-3 finds: layers in a ModuleList (blocks), modules with their own
    parameters (embedding, norm, head) and, with ``frozen``, a frozen layer."""

    def __init__(self, dtype: torch.dtype, frozen: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W, dtype=dtype)
        self.blocks = nn.ModuleList(nn.Linear(W, W, dtype=dtype) for _ in range(DEPTH))
        self.frozen = nn.Linear(W, W, bias=False, dtype=dtype) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(W, dtype=dtype)
        self.head = nn.Linear(W, W, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = F.gelu(block(h))
        if self.frozen is not None:
            h = self.frozen(h)
        return self.head(self.norm(h))


def _build(dtype: torch.dtype, frozen: bool) -> Net:
    torch.manual_seed(0)
    return Net(dtype, frozen)


def _counted(dtype: torch.dtype, frozen: bool) -> blocks.BlockParams:
    """The model as one planner block, counted by the planner's own code."""
    run = SimpleNamespace(lr_groups=None, lr=1e-3)  # what its optimizer groups read
    return blocks._block("net", _build(dtype, frozen), run, adapters=0)


def _measured(ctx, stage, dtype, overlap, share, frozen, kept=0.0) -> dict[str, float]:
    """This rank's bytes by the optimizer's own report, after one step (AdamW's state exists)."""
    net = _build(dtype, frozen)
    opt = ZeroOptimizer(
        [(n, p) for n, p in net.named_parameters() if p.requires_grad],
        torch.optim.AdamW,
        ctx,
        stage=stage,
        modules=[net],
        overlap=overlap,
        offload=share > 0,
        offload_fraction=share or 1.0,
        gpu_accumulation=kept,
        lr=1e-3,
    )
    opt.zero_grad()
    net(torch.ones(4, W, dtype=dtype)).float().square().mean().backward()
    opt.step()
    r = opt.memory_report()
    outside = 0 if stage == 3 else sum(p.nbytes for p in net.parameters() if not p.requires_grad)
    return dict(
        weights=r.param_bytes + r.frozen_bytes + outside,  # frozen: outside ZeRO-1/2
        gradients=r.grad_bytes + r.grad_shard_bytes + r.kept_bytes,
        optimizer=r.master_bytes + r.state_bytes,
        host=r.host_bytes,
        floor=r.host_floor_bytes,  # 12 B an offloaded element: what host_ratio is against
        staging=r.staging_bytes,
    )


def _planned(tp: int, dp: int, stage, dtype, overlap, share, frozen, kept=0.0) -> dict:
    """The planner's bytes of pipeline rank 0 at this layout."""
    counted = _counted(dtype, frozen)
    hand = toy([0.0], [None])  # a one-block model's run, schedule and activations
    model = Workload(hand.run, hand.blocks, hand.estimates, lambda tp: [counted])
    layout = Layout(tp=tp, dp=dp, zero=stage, offload=share, accumulate=kept)
    mem = rank_memory(model, layout, 0, overlap)
    return dict(
        weights=mem.weights,
        gradients=mem.gradients,
        optimizer=mem.optimizer,
        host=mem.host - mem.pinned,  # (the CPU makes no pinned staging)
        floor=mem.host_floor,
        staging=mem.buffers if stage == 1 else 0.0,  # ZeRO-2/3's pass buffers live in a pass
    )


def _buckets(ctx) -> tuple[list[tuple[tuple[int, bool], int]], list[int]]:
    """The optimizer's buckets at the small size (``((element size, partial), elements)`` in
    launch order), those it offloads at 0.8 and, of those, the ones whose sums it keeps on the
    device at 0.7."""
    net = _build(torch.bfloat16, False)
    opt = ZeroOptimizer(
        list(net.named_parameters()),
        torch.optim.AdamW,
        ctx,
        stage=2,
        modules=[net],
        bucket_numel=SMALL_BUCKET,
        offload=True,
        offload_fraction=0.8,
        gpu_accumulation=0.7,
    )
    dtypes, buckets = opt.layout.dtypes, opt.layout.buckets
    packed = [((dtypes[b.buffer].itemsize, b.sequence_parallel), b.numel) for b in buckets]
    return packed, sorted(opt.flat.offload), sorted(opt.host.kept)


def _on_ranks(tp: int) -> tuple[list[dict[str, float]], tuple]:
    ctx = context(tp=tp)
    return [_measured(ctx, *case) for case in CASES], _buckets(ctx)


def test_the_planner_counts_what_the_optimizer_holds():
    for tp in (1, 2):
        dp = 2 // tp
        sizes = _counted(torch.bfloat16, False).sizes
        packed = bucket_numels(sizes, dp, SMALL_BUCKET)
        for rank, (measured, (buckets, offloaded, kept)) in enumerate(run_ranks(_on_ranks, 2, tp)):
            for case, got in zip(CASES, measured):
                assert got == _planned(tp, dp, *case), (f"tp={tp} dp={dp} rank={rank}", case)
            assert packed == buckets and len(buckets) > 2, (tp, rank)
            numels = [n for _, n in packed]
            assert offloaded_buckets(numels, 0.8) == offloaded, (tp, rank)
            assert kept_buckets(numels, offloaded, 0.7) == kept and kept, (tp, rank)
