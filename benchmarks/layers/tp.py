"""How fast are parallax's tensor-parallel layers on a Llama-7B-sized MLP and attention projection?

Forward + backward of (a) the SwiGLU MLP (gate/up 4096 -> 2x11008, down 11008 -> 4096) and
(b) the attention projections (qkv 4096 -> 3x4096, o 4096 -> 4096) on ``--tokens`` tokens, at every
tp that divides the world, against the dense ``nn.Linear`` block (tp=1) and, as the PyTorch
yardstick, DTensor tensor parallelism (ColwiseParallel / RowwiseParallel) at the same tp.
Ranks outside a tp group repeat the same work (pure dp), so every GPU is busy.

    torchrun --nproc-per-node 2 -m benchmarks.layers.tp          # GPUs: bf16, real sizes
    torchrun --nproc-per-node 2 -m benchmarks.layers.tp --smoke  # CPU: fp32, small sizes

TFLOP/s per GPU counts 6 x params x tokens / tp (forward 2, backward 4) for the linear layers only.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    append_results,
    median,
    peak_memory_gib,
    print_table,
    time_it,
)
from parallax import init_parallel
from parallax.tensor import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, h: int, f: int, ctx=None, dense: bool = False, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        if dense:
            self.gate_up, self.down = nn.Linear(h, 2 * f, **kw), nn.Linear(f, h, **kw)
        else:
            self.gate_up = ColumnParallelLinear(h, 2 * f, ctx=ctx, partitions=2, **kw)
            self.down = RowParallelLinear(f, h, ctx=ctx, **kw)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SplitMLP(nn.Module):
    """The torchtitan-style MLP that DTensor parallelises (separate gate and up)."""

    def __init__(self, h: int, f: int, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate, self.up, self.down = (
            nn.Linear(h, f, **kw),
            nn.Linear(h, f, **kw),
            nn.Linear(f, h, **kw),
        )

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class AttnProj(nn.Module):
    def __init__(self, h: int, ctx=None, dense: bool = False, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        if dense:
            self.qkv, self.o = nn.Linear(h, 3 * h, **kw), nn.Linear(h, h, **kw)
        else:
            self.qkv = ColumnParallelLinear(h, 3 * h, ctx=ctx, partitions=3, **kw)
            self.o = RowParallelLinear(h, h, ctx=ctx, **kw)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.o(q + k + v)  # stands in for attention: same shapes, no extra matmuls


class SplitAttnProj(nn.Module):
    def __init__(self, h: int, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, **kw) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) + self.k(x) + self.v(x))


def dtensor_tp(module: nn.Module, kind: str, tp: int, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = (
        {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
        if kind == "mlp"
        else {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
        }
    )
    return parallelize_module(module, mesh["tp"], plan)


def bench(module: nn.Module, x: torch.Tensor, device, iters: int) -> float:
    grad = torch.randn_like(x)

    def step():
        for p in module.parameters():
            p.grad = None
        module(x).backward(grad)

    return median(time_it(step, device, warmup=3, iters=iters))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small fp32 sizes for a CPU run")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    ctx0 = init_parallel()  # brings up the default group from torchrun's environment
    world, device = ctx0.world_size, ctx0.device
    on_gpu = device.type == "cuda"
    h, f = (4096, 11008) if not args.smoke else (256, 688)
    tokens = args.tokens or (8192 if not args.smoke else 256)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, h, device=device, dtype=dtype)

    rows, records = [], []
    tps = [t for t in (1, 2, 4, 8) if world % t == 0]
    for kind in ("mlp", "attn"):
        params = 3 * h * f if kind == "mlp" else 4 * h * h
        flops = 6 * params * tokens
        dense = (
            MLP(h, f, dense=True, dtype=dtype, device=device)
            if kind == "mlp"
            else AttnProj(h, dense=True, dtype=dtype, device=device)
        )
        t_dense = bench(dense, x, device, args.iters)
        tf_dense = flops / t_dense / 1e12
        del dense
        rows.append(
            [
                kind,
                "dense nn.Linear",
                1,
                t_dense * 1e3,
                tf_dense,
                tf_dense / PEAK_BF16_TFLOPS,
                1.0,
                peak_memory_gib(device),
            ]
        )
        for tp in tps:
            if tp == 1:
                continue
            ctx = init_parallel(tp=tp)
            for framework in ("parallax", "torch-dtensor-tp"):
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats(device)
                if framework == "parallax":
                    mod = (
                        MLP(h, f, ctx, dtype=dtype, device=device)
                        if kind == "mlp"
                        else AttnProj(h, ctx, dtype=dtype, device=device)
                    )
                else:
                    mod = (
                        SplitMLP(h, f, dtype=dtype, device=device)
                        if kind == "mlp"
                        else SplitAttnProj(h, dtype=dtype, device=device)
                    )
                    mod = dtensor_tp(mod, kind, tp, device)
                t = bench(mod, x, device, args.iters)
                tf = flops / tp / t / 1e12
                rows.append(
                    [
                        kind,
                        framework,
                        tp,
                        t * 1e3,
                        tf,
                        tf / PEAK_BF16_TFLOPS,
                        tf / tf_dense,
                        peak_memory_gib(device),
                    ]
                )
                records.append(
                    {
                        "benchmark": "tp_layers",
                        "framework": framework,
                        "block": kind,
                        "layout": f"tp{tp}",
                        "step_time_s": t,
                        "tflops_per_gpu": tf,
                        "ratio_to_dense": tf / tf_dense,
                    }
                )
                del mod

    columns = [
        "block",
        "framework",
        "tp",
        "fwd+bwd ms",
        "TFLOP/s/GPU",
        "MFU",
        "vs dense",
        "peak GiB",
    ]
    title = f"tp_layers: Llama-7B MLP and attention projections, {tokens} tokens, {dtype}"
    if ctx0.rank == 0:
        print_table(title, columns, rows)
        if not args.no_write:
            notes = (
                "TFLOP/s per GPU = 6 x params x tokens / tp / time; MFU vs "
                f"{PEAK_BF16_TFLOPS:.0f} TFLOP/s bf16"
                + ("; CPU smoke run, sizes scaled down" if args.smoke else "")
            )
            append_results(title, columns, rows, notes=notes, records=records)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
