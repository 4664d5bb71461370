"""What right-padding costs LLaVA-NeXT-7B on a realistic mix, with and without length grouping.

Samples are those of :mod:`benchmarks.step.llava_workload` (the image mix, 60-140 text tokens) with
``--text-only`` of them text only (LLaVA-v1.6's mix holds some text-only conversations). A
global batch of ``--global-batch`` is cut into microbatches either in the loader's random order
(:class:`~parallax.data.BatchLoader`) or length-grouped
(:func:`~parallax.data.length_grouped_order`, what the llava recipe trains with), dealt over
``--dp`` ranks. Reported per micro-batch size: the share of token positions that are padding,
and the share of the step's model FLOPs spent on padding (every padded position runs through
every decoder layer and attends causally; zero tiles never run through the tower, so the vision
FLOPs are unaffected). CPU only, a few seconds; prints a table, writes nothing.

    python -m benchmarks.step.llava_padding
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.step.llava_workload import samples
from benchmarks.tools.common import print_table
from parallax.data import length_grouped_order
from parallax.data.length_grouped import padding_fraction
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.flops import sample_flops
from parallax.init import param_seed


def lengths(config: LlavaNextConfig, n: int, text_only: float, seed: int) -> tuple[list, list]:
    """Tokens and tiles of ``n`` samples (a share ``text_only`` without an image)."""
    rng = np.random.default_rng(seed + 1)
    out, tiles = [], []
    for p in samples(config, n, seed):
        text = p["before"] + p["after"] + p["answer"] + 1
        if rng.random() < text_only:
            out.append(text)
            tiles.append(0)
        else:
            out.append(text + p["image_tokens"])
            tiles.append(p["tiles"])
    return out, tiles


def flops_waste(config, lens, tiles, mbs) -> float:
    """Share of the model FLOPs that go to padding positions."""
    useful = run = 0.0
    for mb in mbs:
        width = max(lens[i] for i in mb)
        for i in mb:
            useful += sample_flops(config, tiles[i], lens[i], logits_rows=0)
            run += sample_flops(config, tiles[i], width, logits_rows=0)
    return 1.0 - useful / run


def measure(config, lens, tiles, gb: int, micro: int, dp: int, grouped: bool, seed: int = 0):
    n = len(lens) - len(lens) % gb
    if grouped:
        order = length_grouped_order(
            lens,
            global_batch_size=gb,
            micro_batch_size=micro,
            dp_size=dp,
            seed=seed,
            has_image=[t > 0 for t in tiles],
        ).tolist()
    else:
        import torch

        gen = torch.Generator().manual_seed(param_seed(seed, "data.epoch.0"))
        order = torch.randperm(len(lens), generator=gen).tolist()
    mbs = [order[k : k + micro] for k in range(0, n, micro)]
    return padding_fraction(lens, mbs), flops_waste(config, lens, tiles, mbs)


def main(argv: list[str] | None = None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llava-v1.6-vicuna-7b")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--text-only", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--micro", default="1,2,4,8")
    args = p.parse_args(argv)
    config = LlavaNextConfig.preset(args.model)
    lens, tiles = lengths(config, args.samples, args.text_only, seed=0)
    rows = []
    for micro in [int(m) for m in args.micro.split(",")]:
        rand = measure(config, lens, tiles, args.global_batch, micro, args.dp, grouped=False)
        group = measure(config, lens, tiles, args.global_batch, micro, args.dp, grouped=True)
        rows.append([micro, rand[0], rand[1], group[0], group[1]])
    cols = ["micro", "random: padded tokens", "random: FLOPs", "grouped: padded tokens",
            "grouped: FLOPs"]  # fmt: skip
    mean = sum(lens) / len(lens)
    title = (
        f"{args.model}: padding on the image mix with {args.text_only:.0%} text-only samples "
        f"({mean:.0f} tokens per sample), global batch {args.global_batch}, dp {args.dp}"
    )
    print_table(title, cols, rows)
    return rows


if __name__ == "__main__":
    main()
