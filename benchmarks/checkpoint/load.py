"""Does a sharded bf16 OpenVLA checkpoint load fast, in bounded memory, to the same logits?

Builds ``openvla-7b`` (``small`` with ``--smoke``) with random layout-free weights, writes it with
``save_pretrained`` as a sharded bf16 Hugging Face checkpoint into ``--out``, loads it back at
tp = world size and, on rank 0 alone, at tp = 1, and compares the logits of a fixed input. Reports
per rank: save and load time, bytes read from the checkpoint, peak memory.

    torchrun --nproc-per-node 2 -m benchmarks.checkpoint.load --out out/openvla-7b-rand
    torchrun --nproc-per-node 2 -m benchmarks.checkpoint.load --smoke --out out/ov-smoke
    (the first on GPUs, the second on CPU)
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from pathlib import Path

import torch

from benchmarks.tools.common import append_results, print_table
from parallax import comm, init_parallel
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.models.meta import materialize
from parallax.tensor import gather_from_tp


def peak_gib(device: torch.device) -> float:
    """Peak GPU memory since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fixed_input(config: OpenVLAConfig, device: torch.device, text: int = 40):
    g = torch.Generator().manual_seed(0)
    s = config.image_size
    px = torch.randn(2, 6, s, s, generator=g)
    ids = torch.randint(3, config.tokenizer_vocab_size, (2, text), generator=g)
    ids[:, 0] = 1
    return px.to(device), ids.to(device)


def load_and_run(path, ctx, dtype, device, px, ids):
    reset_peak(device)
    start = time.perf_counter()
    model = OpenVLA.from_pretrained(path, ctx, dtype=dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = peak_gib(device)
    with torch.no_grad():
        logits = model(px, ids)
        if ctx is not None:
            logits = gather_from_tp(logits, ctx.tp_group, dim=-1)
    stats = model.load_stats
    del model
    return seconds, peak, stats.bytes_read, logits.float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the checkpoint")
    parser.add_argument("--smoke", action="store_true", help="CPU: the 'small' preset")
    parser.add_argument("--preset", default=None, help="default openvla-7b (small with --smoke)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    parser.add_argument("--max-shard-size", default=None, help="default 5GB (40MB with --smoke)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    ctx0 = init_parallel()
    world, device = ctx0.world_size, ctx0.device
    ctx = init_parallel(tp=world)
    preset = args.preset or ("small" if args.smoke else "openvla-7b")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    config = OpenVLAConfig.preset(preset)

    model = materialize(OpenVLA(config, ctx, dtype=dtype, device="meta"), device)
    model.init_weights(seed=0)
    start = time.perf_counter()
    shard_size = args.max_shard_size or ("40MB" if args.smoke else "5GB")
    model.save_pretrained(args.out, max_shard_size=shard_size)
    save_s = time.perf_counter() - start
    del model
    px, ids = fixed_input(config, device)

    load_s, peak, read, logits = load_and_run(args.out, ctx, dtype, device, px, ids)
    rows = comm.all_gather_object((ctx.rank, save_s, load_s, read, peak), ctx.world_group)
    comm.barrier(ctx.world_group)
    total = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    table = [[f"tp{world}", r, s, t, b / 2**30, b / total, p, "-", "-"] for r, s, t, b, p in rows]
    records = []
    if ctx.rank == 0:
        load1, peak1, read1, ref = load_and_run(args.out, None, dtype, device, px, ids)
        err = (logits - ref).abs().max().item() / ref.abs().max().item()
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        for row in table:
            row[7:] = [err, agree]
        table.append(["tp1", 0, float("nan"), load1, read1 / 2**30, read1 / total, peak1, 0.0, 1.0])
        for row in table:
            records.append(
                dict(
                    benchmark="openvla_load",
                    preset=preset,
                    dtype=dtype_name,
                    layout=row[0],
                    rank=row[1],
                    save_s=row[2],
                    load_s=row[3],
                    read_gib=row[4],
                    read_fraction=row[5],
                    peak_gib=row[6],
                    logits_rel_err=err,
                    argmax_agreement=agree,
                )
            )
    comm.barrier(ctx.world_group)
    if ctx.rank == 0:
        columns = [
            "layout",
            "rank",
            "save s",
            "load s",
            "read GiB",
            "read / ckpt",
            "peak GiB",
            "logits err vs tp1",
            "argmax agree",
        ]
        title = (
            f"openvla_load: {preset} random weights, sharded bf16 checkpoint "
            f"({total / 2**30:.2f} GiB), {dtype_name} model, tp{world} vs tp1"
        )
        print_table(title, columns, table)
        if not args.no_write:
            notes = (
                "logits err = max |tp_world - tp1| / max |tp1| on a fixed (2 x 6 x S x S, 40 ids) "
                "input; peak = max allocated GPU memory during the load (CPU: process peak RSS, "
                "which includes building and saving the model)"
                + ("; CPU smoke run" if args.smoke else "")
            )
            append_results(title, columns, table, notes=notes, records=records)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
