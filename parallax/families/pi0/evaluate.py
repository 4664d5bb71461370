"""Held-out action error of a pi0 / pi0.5 policy: sampled chunks against the true ones.

On samples the run never trained on (the synthetic task's episodes of another seed), each
chunk is sampled by :func:`~.predict.sample_chunk` (Euler steps over the cached prefix) from
the sample's own noise, and compared with the true normalised chunk over the real action
dimensions. The baseline is the error of always predicting the mean action (normalised as the
actions are): a policy that learned something from the images and the prompt is well below it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from parallax.families.pi0.batches import Pi0Batches, normalize
from parallax.families.pi0.predict import sample_chunk

PREFIX = ("images", "image_masks", "tokens", "token_mask")


@dataclass(frozen=True)
class ActionError:
    """Mean squared errors per action element (normalised space, real dimensions)."""

    model: float
    mean_action: float
    samples: int


@torch.no_grad()
def held_out_error(
    model, dataset, stats: Mapping, samples: int = 64, batch: int = 16, num_steps=None
) -> ActionError:
    """:class:`ActionError` of ``model`` (whole, this rank) on the first ``samples`` samples of
    ``dataset`` (raw samples with ``index``; ``stats``: its ``norm_stats`` entry)."""
    config = model.config
    collate = Pi0Batches(config, stats, seed=0)
    device = next(model.parameters()).device
    mean = normalize(stats["action"]["mean"], stats["action"], config.pi05)  # (D,)
    err = base = count = 0.0
    for start in range(0, min(samples, len(dataset)), batch):
        stop = min(start + batch, samples, len(dataset))
        mb = collate([dataset[i] for i in range(start, stop)])
        state = None if config.pi05 else mb["state"].to(device)
        prefix = [mb[k].to(device) for k in PREFIX]
        pred = sample_chunk(model, *prefix, state, mb["noise"].to(device), num_steps).cpu()
        d = mb["action_dim"]
        actions = mb["actions"][..., :d]  # (b, H, D)
        err += float(((pred[..., :d] - actions) ** 2).sum())
        base += float(((torch.tensor(np.asarray(mean), dtype=torch.float32) - actions) ** 2).sum())
        count += actions.numel()
    return ActionError(err / count, base / count, int(min(samples, len(dataset))))
