"""How much memory does ZeRO-1 save per rank, and what does it cost per step?

A stack of Llama-7B-sized decoder layers (hidden 4096, MLP 11008, 32 heads; ``--layers`` of
them) trained with AdamW at dp = 1, 2, 4 (up to the world size; ranks outside a dp group run the
same experiment in their own group). Per rank: bytes per parameter measured from the tensors
(parameters, gradients, masters, fp32 reduced-gradient slice, optimizer state, staging buffers)
against the formula (bf16: ``2 + 2 + 12/dp``, plus ``4/dp`` for the fp32 gradient slice that
overlap needs at dp >= 2; fp32: ``4 + 4 + 8/dp``; staging excluded), and the step time of
parallax's ZeroOptimizer (overlap on and off) against DDP + torch.optim.AdamW and
DDP + torch.distributed.optim.ZeroRedundancyOptimizer on the same model, in one run.

    torchrun --nproc-per-node 4 -m benchmarks.zero.memory          # GPUs: bf16, real sizes
    torchrun --nproc-per-node 2 -m benchmarks.zero.memory --smoke  # CPU: fp32, small sizes
    torchrun --nproc-per-node 2 -m benchmarks.zero.memory --smoke --dtype bf16  # CPU, bf16
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.tools.common import append_results, median, peak_memory_gib, print_table, time_it
from parallax import ParallelContext, ParallelDims, init_parallel
from parallax.optim import ZeroOptimizer
from parallax.optim.zero.memory_report import tensor_bytes

NO_OVERLAP = "parallax ZeRO-1 no-overlap"


def parallax_formula(dtype: torch.dtype, dp: int, overlap: bool) -> float:
    """Bytes per parameter of ZeroOptimizer with AdamW, staging buffers excluded."""
    if dtype == torch.float32:
        return 4 + 4 + 8 / dp  # the parameters are the masters, reduced in place
    return 2 + 2 + 12 / dp + (4 / dp if overlap and dp > 1 else 0)


class Layer(nn.Module):
    """A Llama decoder layer: RMSNorm, causal attention (fused qkv), RMSNorm, SwiGLU MLP."""

    def __init__(self, h: int, f: int, heads: int, dtype, device) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.heads = heads
        self.norm1 = nn.RMSNorm(h, dtype=dtype, device=device)
        self.qkv, self.o = nn.Linear(h, 3 * h, **kw), nn.Linear(h, h, **kw)
        self.norm2 = nn.RMSNorm(h, dtype=dtype, device=device)
        self.gate_up, self.down = nn.Linear(h, 2 * f, **kw), nn.Linear(f, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, hd)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def dp_context(ctx0: ParallelContext, dp: int, groups: dict[int, dist.ProcessGroup]):
    """A pure-dp context over the block of ``dp`` neighbouring ranks that holds this rank."""
    group = groups[dp]
    return ParallelContext(
        dims=ParallelDims(dp=dp),
        rank=ctx0.rank % dp,
        device=ctx0.device,
        backend=ctx0.backend,
        dp_group=group if dp > 1 else None,
        world_group=group if dp > 1 else None,
    )


def make_groups(world: int, dps: list[int]) -> dict[int, dist.ProcessGroup]:
    """Every rank creates every group, in the same order; returns the ones holding this rank."""
    mine = {}
    for dp in dps:
        for start in range(0, world, dp):
            g = dist.new_group(list(range(start, start + dp)))
            if start <= dist.get_rank() < start + dp:
                mine[dp] = g
    return mine


def run(framework: str, ctx, group, args, dims, dtype) -> dict:
    device = ctx.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    model = nn.Sequential(*(Layer(*dims, dtype, device) for _ in range(args.layers)))
    numel = sum(p.numel() for p in model.parameters())
    if framework.startswith("parallax"):
        opt = ZeroOptimizer(
            model.named_parameters(),
            torch.optim.AdamW,
            ctx,
            overlap=framework == "parallax ZeRO-1",
            param_order=model.parameters(),
            lr=1e-5,
        )
        net = model
    else:
        net = DDP(model, process_group=group)
        opt = (
            torch.optim.AdamW(model.parameters(), lr=1e-5)
            if framework == "DDP + AdamW"
            else ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-5
            )
        )
    x = torch.randn(1, args.tokens, dims[0], device=device, dtype=dtype)

    def step():
        opt.zero_grad()
        net(x).float().pow(2).mean().backward()
        opt.step()

    t = median(time_it(step, device, warmup=2, iters=args.iters))
    if framework.startswith("parallax"):
        report = opt.memory_report()
        measured, staging = report.total_bytes, report.staging_bytes
    else:
        inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        measured = tensor_bytes(list(model.parameters()) + grads + states)
        staging = float("nan")
    alloc = (torch.cuda.memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    out = dict(step_time_s=t, numel=numel, bytes_per_param=measured / numel)
    out.update(staging_bytes_per_param=staging / numel)
    out.update(alloc_gib=alloc if alloc is not None else float("nan"))
    out.update(peak_gib=peak_memory_gib(device))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small fp32 sizes for a CPU run")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (GPU: 8)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="GPU: bf16")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    ctx0 = init_parallel()
    world, device = ctx0.world_size, ctx0.device
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dims = (4096, 11008, 32) if not args.smoke else (256, 688, 4)
    args.layers = args.layers or (8 if not args.smoke else 2)
    args.tokens = args.tokens or (4096 if not args.smoke else 128)
    dps = [d for d in (1, 2, 4) if world % d == 0]
    groups = make_groups(world, dps)
    rows, records = [], []
    frameworks = ("parallax ZeRO-1", NO_OVERLAP, "DDP + AdamW", "DDP + ZeroRedundancyOpt")
    for dp in dps:
        ctx = dp_context(ctx0, dp, groups)
        for framework in frameworks:
            if framework == NO_OVERLAP and dp == 1:
                continue  # nothing to overlap: the same run as with overlap
            formula = (
                parallax_formula(dtype, dp, overlap=framework != NO_OVERLAP)
                if framework.startswith("parallax")
                else float("nan")
            )
            r = run(framework, ctx, groups[dp], args, dims, dtype)
            rows.append(
                [
                    framework,
                    dp,
                    r["numel"] / 1e6,
                    r["step_time_s"] * 1e3,
                    r["bytes_per_param"],
                    r["staging_bytes_per_param"],
                    formula,
                    r["alloc_gib"],
                    r["peak_gib"],
                ]
            )
            records.append(
                {
                    "benchmark": "zero_memory",
                    "framework": framework,
                    "layout": f"dp{dp}",
                    "layers": args.layers,
                    "tokens": args.tokens,
                    "step_time_s": r["step_time_s"],
                    "bytes_per_param": r["bytes_per_param"],
                    "staging_bytes_per_param": r["staging_bytes_per_param"],
                    "formula_bytes_per_param": formula,
                    "alloc_gib": r["alloc_gib"],
                    "peak_gib": r["peak_gib"],
                }
            )
    columns = [
        "framework",
        "dp",
        "params (M)",
        "step ms",
        "B/param (tensors)",
        "of which staging",
        "formula (parallax)",
        "alloc GiB",
        "peak GiB",
    ]
    title = (
        f"zero_memory: {args.layers} Llama-7B-sized layers (h={dims[0]}), AdamW, "
        f"{args.tokens} tokens, {dtype}"
    )
    if ctx0.rank == 0:
        print_table(title, columns, rows, width=160)
        if not args.no_write:
            notes = (
                "B/param measured from the tensors on one rank: parameters, gradients, "
                "optimizer state and (parallax) its fp32 staging buffers of about one bucket "
                "each. For bf16 parameters parallax keeps fp32 masters and moments (12/dp) and "
                "an fp32 reduced-gradient slice only where overlap needs one (4/dp at dp >= 2): "
                "at dp=1 each bucket's fp32 gradient is made right before it is stepped, "
                "without overlap it is written over the bucket's own bf16 gradient bytes. fp32 "
                "parameters are their own masters (8/dp). DDP's torch AdamW keeps its moments "
                "in the parameter dtype and no master; its gradient buckets (another copy of "
                "the gradients) are in alloc GiB, not in the tensor count. "
                "ZeroRedundancyOptimizer shards whole parameters"
                + ("; CPU smoke run, sizes scaled down" if args.smoke else "")
            )
            append_results(title, columns, rows, notes=notes, records=records)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
