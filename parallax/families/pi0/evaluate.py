"""Held-out action error of a pi0 / pi0.5 policy: sampled chunks against the true ones.

On samples the run never trained on (the synthetic task's episodes of another seed), each
chunk is sampled by :func:`~.predict.sample_chunk` (Euler steps over the cached prefix) from
the sample's own noise (or from zero noise: the flow's most likely chunk), and compared with
the true normalised chunk over the real action dimensions, in total and per dimension. The
baseline is the error of always predicting the mean action (normalised as the actions are). A
sampled chunk pays twice the variance the policy is unsure of (its draw and the truth are
independent given what it knows), so a policy that reads nothing of the scene samples at twice
the mean action's error. Rolling one input over the batch (each sample gets its neighbour's
images, or its prompt) shows what the policy reads.

    python -m parallax.families.pi0.evaluate RUN    # RUN: a --export-hf run folder
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from parallax.families.pi0.batches import Pi0Batches, normalize
from parallax.families.pi0.data import IndexedSamples, synthetic_task
from parallax.families.pi0.predict import load_policy, sample_chunk

PREFIX = ("images", "image_masks", "tokens", "token_mask")
ROLLED = {"images": ("images", "image_masks"), "prompts": ("tokens", "token_mask")}


@dataclass(frozen=True)
class ActionError:
    """Mean squared errors per action element (normalised space, real dimensions), in total
    and per action dimension."""

    model: float
    mean_action: float
    samples: int
    model_per_dim: tuple[float, ...] = ()
    mean_per_dim: tuple[float, ...] = ()


@torch.no_grad()
def held_out_error(
    model,
    dataset,
    stats: Mapping,
    samples: int = 64,
    batch: int = 16,
    num_steps=None,
    zero_noise: bool = False,
    roll: str | None = None,
) -> ActionError:
    """:class:`ActionError` of ``model`` (whole, this rank) on the first ``samples`` samples of
    ``dataset`` (raw samples with ``index``; ``stats``: its ``norm_stats`` entry); ``roll``:
    ``"images"`` or ``"prompts"``, given to each sample from its neighbour in the batch."""
    config = model.config
    collate = Pi0Batches(config, stats, seed=0)
    device = next(model.parameters()).device
    mean = torch.tensor(
        np.asarray(normalize(stats["action"]["mean"], stats["action"], config.pi05))
    )
    err = base = None
    count = 0
    for start in range(0, min(samples, len(dataset)), batch):
        stop = min(start + batch, samples, len(dataset))
        mb = collate([dataset[i] for i in range(start, stop)])
        for key in ROLLED.get(roll, ()):
            mb[key] = mb[key].roll(1, dims=0)
        state = None if config.pi05 else mb["state"].to(device)
        prefix = [mb[k].to(device) for k in PREFIX]
        noise = torch.zeros_like(mb["noise"]) if zero_noise else mb["noise"]
        pred = sample_chunk(model, *prefix, state, noise.to(device), num_steps).cpu()
        d = mb["action_dim"]
        actions = mb["actions"][..., :d].double()  # (b, H, D)
        e = ((pred[..., :d].double() - actions) ** 2).sum((0, 1))  # (D,)
        b = ((mean[:d] - actions) ** 2).sum((0, 1))  # (D,)
        err, base = (e, b) if err is None else (err + e, base + b)
        count += actions.shape[0] * actions.shape[1]
    n = int(min(samples, len(dataset)))
    return ActionError(
        float(err.sum() / (count * len(err))),
        float(base.sum() / (count * len(base))),
        n,
        tuple((err / count).tolist()),
        tuple((base / count).tolist()),
    )


def report(run: Path, samples: int, seed: int = 0) -> str:
    """The table :func:`main` prints for a run folder exported with ``--export-hf`` (``seed``:
    the run's; its evaluation split is the synthetic task of ``seed + 1``)."""
    policy = load_policy(run / "hf")
    stats = next(iter(json.loads((run / "dataset_statistics.json").read_text()).values()))
    held = IndexedSamples(synthetic_task(policy.config, seed + 1))
    rows = {
        "sampled": held_out_error(policy, held, stats, samples),
        "zero noise": held_out_error(policy, held, stats, samples, zero_noise=True),
        "prompts rolled": held_out_error(policy, held, stats, samples, roll="prompts"),
        "images rolled": held_out_error(policy, held, stats, samples, roll="images"),
    }
    first = rows["sampled"]
    dims = len(first.model_per_dim)
    lines = [f"{'chunk':<16}{'total':>8}" + "".join(f"{f'dim {i}':>8}" for i in range(dims))]
    for name, e in [*rows.items(), ("mean action", None)]:
        total, per = (e.model, e.model_per_dim) if e else (first.mean_action, first.mean_per_dim)
        lines.append(f"{name:<16}{total:8.3f}" + "".join(f"{v:8.3f}" for v in per))
    head = f"{run}: {first.samples} held-out samples (seed {seed + 1}), normalised squared error"
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallax.families.pi0.evaluate")
    p.add_argument("run", type=Path, help="a run folder written with --export-hf")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the run's --seed")
    args = p.parse_args(argv)
    print(report(args.run, args.samples, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
