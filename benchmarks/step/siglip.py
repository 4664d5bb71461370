"""SigLIP training steps on one GPU: parallax against a torch-native baseline and HF transformers.

Workload: ``siglip-large-patch16-256`` (Git-RSCLIP's architecture: 24 + 24 layers of width 1024,
256 patches, 64 text tokens), synthetic batches (random pixels, random token ids); one optimizer
step per local batch (one microbatch: no GradCache re-forward), the sigmoid loss over the batch.
bf16 compute with fp32 master weights and fp32 AdamW state everywhere:

- ``parallax``: the Trainer with the siglip recipe, ``--precision bf16`` (bf16 weights, fp32
  masters in ZeRO-1), ``--compile`` of each block unless ``--no-compile``;
- ``torch``: plain torch modules (``benchmarks.step.siglip_native``), fp32 weights under bf16
  autocast, each block ``torch.compile``'d, fused AdamW;
- ``hf``: ``transformers.SiglipModel`` (sdpa attention), fp32 weights under bf16 autocast, fused
  AdamW, its own sigmoid loss (``return_loss=True``); the row is skipped when transformers is
  not installed.

``--cuda-graphs`` replays the compiled blocks of both compiled rows as CUDA graphs (parallax's
``--cuda-graphs``; torch's blocks in inductor's reduce-overhead mode, each step a new round).

Every row starts from the same weights (parallax's layout-free init of seed 0, exported to the HF
layout and loaded by the others) and takes the same first batch: ``loss 1``, the first step's
loss, agrees across rows to bf16 rounding. Activation checkpointing (``--checkpointing``, all
rows) lets each system reach its largest batch; FLOPs are counted without recomputation:
``flops_per_sample(config, B)`` (:mod:`parallax.families.siglip.flops`) = 3 x (vision forward:
patch conv, blocks ``24 n w^2 + 4 n^2 w`` per layer, the MAP head; text forward: blocks; the
logits ``2 B d``) per pair. MFU is against 989 TFLOP/s (dense bf16 H100/H200). Peak memory is
``torch.cuda.max_memory_allocated``.

Pick the systems with ``--frameworks`` (the coordinator runs one per command, each well under
9 minutes) and the local batch with ``--batch``: one number, ``parallax=512,torch=256``, or a
list per system, each a row of its own (``256:384:512`` finds the largest that fits; a batch
that does not is an OOM row; ``loss 1 rel diff`` compares rows of the same batch):

    python -m benchmarks.step.siglip --frameworks parallax --batch 256
    python -m benchmarks.step.siglip --frameworks parallax,torch --batch 256:384:512
    python -m benchmarks.step.siglip --frameworks torch --batch 256
    python -m benchmarks.step.siglip --frameworks hf --batch 128
    python -m benchmarks.step.siglip --smoke          # CPU, siglip-tiny, writes nothing

Rows are printed as one table and appended to ``benchmarks/RESULTS.md`` and ``results.jsonl``
(not with ``--smoke`` unless ``--write``).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.step.siglip_systems import SYSTEMS, make_batch
from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    append_results,
    env_info,
    median,
    peak_memory_gib,
    print_table,
    sync,
)

COLUMNS = [
    "framework",
    "batch",
    "step s",
    "samples/s/GPU",
    "TFLOP/s",
    "MFU",
    "peak GiB",
    "loss 1",
    "loss 1 rel diff",
    "status",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="siglip-large-patch16-256")
    p.add_argument("--frameworks", default="parallax,torch,hf")
    p.add_argument(
        "--batch", default="64", help="local batches: N[:N...], or FRAMEWORK=N[:N...],..."
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--no-compile", action="store_true", help="eager parallax and torch rows")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the compiled blocks replayed as CUDA graphs (parallax --cuda-graphs; torch: "
        "reduce-overhead mode)",
    )
    p.add_argument("--smoke", action="store_true", help="siglip-tiny on CPU, fp32, no writes")
    p.add_argument("--write", action="store_true", help="append results even with --smoke")
    args = p.parse_args(argv)
    for fw in args.frameworks.split(","):
        if fw not in SYSTEMS:
            p.error(f"--frameworks: unknown {fw!r}; choose from {','.join(SYSTEMS)}")
    if args.cuda_graphs and args.no_compile:
        p.error("--cuda-graphs replays compiled blocks: drop --no-compile")
    if args.smoke:
        args.model = "siglip-tiny"
    return args


def batches_of(args: argparse.Namespace, framework: str) -> list[int]:
    """The local batches of ``framework`` (``--batch``), each a row of its own: a list such as
    ``256:384:512`` finds the largest that fits (the ones that do not are OOM rows)."""
    spec = args.batch
    if "=" in spec:
        sizes = dict(part.split("=") for part in spec.split(","))
        if framework not in sizes:
            raise SystemExit(f"--batch {spec}: no size for {framework}")
        spec = sizes[framework]
    return [int(b) for b in spec.split(":")]


def run_row(name: str, b: int, args, config, weights: Path, device: torch.device) -> dict:
    """Build, warm up and time one system at local batch ``b``; its measurements or the error."""
    px, ids = make_batch(config, b, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step = SYSTEMS[name](args, config, weights, device, b)
        t_build = time.perf_counter()
        first = float(step(px, ids))
        for _ in range(max(args.warmup - 1, 0)):
            step(px, ids)
        sync(device)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(px, ids)
            sync(device)
            times.append(time.perf_counter() - t0)
        took = time.perf_counter() - t_build
        print(f"{name} batch {b}: warm-up and timing {took:.0f} s", flush=True)
        return {"batch": b, "time": median(times), "loss": first, "peak": peak_memory_gib(device)}
    except Exception as err:  # an OOM or a missing package becomes the row's status
        text = (str(err).splitlines() or [""])[0][:120]
        return {
            "batch": b,
            "error": text if text.startswith("skipped") else f"{type(err).__name__}: {text}",
        }
    finally:
        step = px = ids = None  # this row's model and batch, before the next row's
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    from parallax.families.siglip.config import SiglipConfig
    from parallax.families.siglip.flops import flops_per_sample
    from parallax.families.siglip.model import Siglip

    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    info = env_info()
    config = SiglipConfig.preset(args.model)
    rows, records = [], []
    with tempfile.TemporaryDirectory() as root:
        weights = Path(root) / "hf"
        Siglip(config, seed=0).save_pretrained(weights)  # the shared starting point
        refs: dict[int, float] = {}  # the first loss of each batch size: rows compare to it
        runs = [(n, b) for n in args.frameworks.split(",") for b in batches_of(args, n)]
        for name, b in runs:
            got = run_row(name, b, args, config, weights, device)
            flops = b * flops_per_sample(config, b)
            ok = "error" not in got
            t = got.get("time", float("nan"))
            loss = got.get("loss", float("nan"))
            ref = refs.setdefault(b, loss) if ok else float("nan")
            row = {
                "framework": name,
                "batch": b,
                "step s": t,
                "samples/s/GPU": b / t if ok else float("nan"),
                "TFLOP/s": flops / t / 1e12 if ok else float("nan"),
                "MFU": flops / t / (PEAK_BF16_TFLOPS * 1e12) if ok else float("nan"),
                "peak GiB": got.get("peak", float("nan")),
                "loss 1": loss,
                "loss 1 rel diff": abs(loss - ref) / abs(ref) if ok else float("nan"),
                "status": got.get("error", "ok"),
            }
            print(f"{name:<9} batch {b}: {row['status']}, step {t:.4g} s", flush=True)
            rows.append(row)
            records.append(
                {
                    "benchmark": "contrastive_step",
                    "model": args.model,
                    "cuda_graphs": args.cuda_graphs,
                    **row,
                }
            )
    title = f"SigLIP training step ({args.model}), one device"
    table = [[r[c] for c in COLUMNS] for r in rows]
    print_table(title, COLUMNS, table)
    if not args.smoke or args.write:
        notes = (
            "bf16 compute, fp32 masters and AdamW state; FLOPs = batch x "
            "siglip.flops.flops_per_sample(config, batch) (3 x forward of both towers + logits, "
            f"no recomputation), MFU vs {PEAK_BF16_TFLOPS:g} TFLOP/s; checkpointing "
            f"{'on' if args.checkpointing else 'off'}; CUDA graphs "
            f"{'on (parallax, torch)' if args.cuda_graphs else 'off'}; same initial weights, "
            "loss 1 = first step"
        )
        append_results(title, COLUMNS, table, notes, records, info)
    return rows


if __name__ == "__main__":
    main()
