"""A preset's model with its layout-free random weights, written in its family's Hugging Face
layout: a checkpoint directory for benchmarks that must read one (the GPU machine has no
network, and speed and memory do not depend on the values).

    python -m benchmarks.tools.random_checkpoint --model openvla-7b --out /tmp/openvla-7b-random
"""

from __future__ import annotations

import argparse
import time

import torch

from parallax import ParallelContext
from parallax.recipe import resolve
from parallax.recipe.adapt import build_chunk
from parallax.run import TrainConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="a preset (tiny, openvla-7b, ...)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    began = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = resolve(TrainConfig(model=args.model, seed=args.seed, precision="bf16"))
    blocks = range(len(run.recipe.model.blocks(run.model_config)))
    ctx = ParallelContext.local(device=device)
    chunk, _ = build_chunk(run, blocks, ctx, dtype=torch.bfloat16, device=device, checkpoint=None)
    run.recipe.model.export(run, chunk, args.out, None)
    print(
        f"wrote {args.model} (seed {args.seed}) to {args.out} in {time.monotonic() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
