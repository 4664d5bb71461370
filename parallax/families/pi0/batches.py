"""Raw robot samples -> pi0's microbatches.

A sample holds its cameras (:data:`~.data.CAMERAS` order; slots past them are absent cameras,
all -1 and masked out), the instruction, the state and the chunk of the next ``H`` actions.
As LeRobot's processors: state and actions normalised (pi0 mean/std, ``(x - mean) / (std +
1e-8)``; pi0.5 quantiles, ``2 (x - q01) / (q99 - q01) - 1``, 0 where q99 = q01) and
zero-padded to the model's widths; images to [-1, 1]; the prompt (:mod:`.prompt`; pi0.5's with
the discretised state) right-padded to ``text_length``; the chunk's padded steps
(``action_pad``, past the episode's end: :mod:`.robot_data`) as a ``(b, H)`` mask, all False for
a sample without one. Each sample is normalised by its own dataset's statistics (a mixture's
datasets each by theirs). The flow-matching noise and time of each sample are drawn here from
the seed and the sample's key: its global stream position for streamed data
(:mod:`.stream_data`), else ``(index, visit)`` (:mod:`.data`); so every layout, worker count
and resume draws the same ones. ``x_t`` is made from them in the stage inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.data import CAMERAS
from parallax.families.pi0.objective import flow_terms, sample_time
from parallax.families.pi0.prompt import ByteTokenizer, padded_ids, prompt_text
from parallax.seeds import param_seed


def normalize(x, stats: Mapping, quantiles: bool) -> np.ndarray:
    """pi0's (mean/std) or pi0.5's (quantile) normalisation of ``x`` (..., d)."""
    x = np.asarray(x, dtype=np.float64)
    if quantiles:
        lo, hi = np.asarray(stats["q01"]), np.asarray(stats["q99"])
        span = hi - lo
        return np.where(span > 0, 2 * (x - lo) / np.where(span > 0, span, 1) - 1, 0.0)
    return (x - np.asarray(stats["mean"])) / (np.asarray(stats["std"]) + 1e-8)


def unnormalize(x, stats: Mapping, quantiles: bool) -> np.ndarray:
    """The inverse of :func:`normalize` on the first ``len(stats["mean"])`` dims of ``x``."""
    x = np.asarray(x, dtype=np.float64)[..., : len(stats["mean"])]
    if quantiles:
        lo, hi = np.asarray(stats["q01"]), np.asarray(stats["q99"])
        return np.where(hi > lo, (x + 1) / 2 * (hi - lo) + lo, lo)
    return x * (np.asarray(stats["std"]) + 1e-8) + np.asarray(stats["mean"])


def padded(x: np.ndarray, width: int, what: str) -> torch.Tensor:
    if x.shape[-1] > width:
        raise ValueError(f"{what} of {x.shape[-1]} dimensions, the model takes at most {width}")
    return F.pad(torch.tensor(x, dtype=torch.float32), (0, width - x.shape[-1]))


def resize_with_pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """``(1, 3, H, W)`` in [0, 1] -> ``(1, 3, size, size)`` as openpi's ``resize_with_pad``:
    the longer side to ``size`` keeping the aspect (bilinear, no corner alignment), then black
    borders split evenly (the odd pixel below and right)."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False).clamp(0, 1)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(x, (left, size - rw - left, top, size - rh - top), value=0.0)  # (1, 3, S, S)


def image_tensor(image, size: int) -> torch.Tensor:
    """``(H, W, 3)`` uint8 (tensor or array) -> ``(3, size, size)`` in [-1, 1]
    (:func:`resize_with_pad`)."""
    pixels = image if isinstance(image, torch.Tensor) else torch.as_tensor(np.array(image))
    x = pixels.to(torch.uint8).permute(2, 0, 1).float()[None] / 255  # (1, 3, H, W) in [0, 1]
    return resize_with_pad(x, size)[0] * 2 - 1  # (3, size, size)


class Pi0Batches:
    """Lists of raw samples -> ``{"images", "image_masks", "tokens", "token_mask", "state",
    "actions", "action_pad", "action_dim", "noise", "time", "mean_action"}`` (module doc).
    ``stats``: a ``norm_stats`` entry (``action``, ``proprio``), for the samples of a dataset
    ``by_dataset`` (name -> entry) does not name."""

    def __init__(
        self,
        config: Pi0Config,
        stats: Mapping,
        seed: int,
        tokenizer=None,
        by_dataset: Mapping | None = None,
    ) -> None:
        self.config, self.stats, self.seed = config, stats, seed
        self.by_dataset = dict(by_dataset or {})
        self.tokenizer = tokenizer or ByteTokenizer()

    def stats_of(self, sample: Mapping) -> Mapping:
        """The statistics ``sample`` is normalised by: its dataset's."""
        return self.by_dataset.get(sample.get("dataset"), self.stats)

    def noise_and_time(self, sample: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if "position" in sample:  # streamed: the global stream position
            key = f"pi0-flow:stream:{sample['position']}"
        else:
            key = f"pi0-flow:{sample.get('index', 0)}:{sample.get('visit', 0)}"
        g = torch.Generator().manual_seed(param_seed(self.seed, key))
        noise = torch.randn(c.chunk, c.max_action_dim, generator=g)  # (H, A)
        return noise, sample_time(1, g)[0]

    def images(self, sample: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
        c, size = self.config, self.config.vision.image_size
        present = [k for k in CAMERAS[: c.num_cameras] if k in sample]
        out = [image_tensor(sample[k], size) for k in present]
        out += [torch.full((3, size, size), -1.0)] * (c.num_cameras - len(out))
        mask = torch.arange(c.num_cameras) < len(present)
        return torch.stack(out), mask  # (n, 3, S, S), (n,)

    def __call__(self, samples: Sequence[Mapping]) -> dict:
        c, pi05 = self.config, self.config.pi05
        rows: dict[str, list] = {k: [] for k in ("images", "masks", "state", "actions", "ids")}
        rows.update(noise=[], time=[], pad=[], mean=[])
        dims = set()
        for s in samples:
            stats = self.stats_of(s)
            state = normalize(s["state"], stats["proprio"], pi05)
            actions = normalize(s["actions"], stats["action"], pi05)  # (H, D)
            dims.add(actions.shape[-1])
            images, mask = self.images(s)
            text = prompt_text(s["instruction"], state if pi05 else None, pi05)
            noise, time = self.noise_and_time(s)
            rows["images"].append(images)
            rows["masks"].append(mask)
            rows["state"].append(padded(state, c.max_state_dim, "a state"))
            rows["actions"].append(padded(actions, c.max_action_dim, "actions"))
            rows["ids"].append(self.tokenizer.encode(text))
            rows["noise"].append(noise)
            rows["time"].append(time)
            pad = s.get("action_pad")
            rows["pad"].append(torch.zeros(c.chunk, dtype=torch.bool) if pad is None else pad)
            rows["mean"].append(self.mean_action(stats))
        if len(dims) != 1:
            raise ValueError(f"a microbatch mixes action widths {sorted(dims)}")
        tokens, token_mask = padded_ids(rows["ids"], c.text_length, self.tokenizer.pad_id)
        return {
            "images": torch.stack(rows["images"]),  # (b, n, 3, S, S)
            "image_masks": torch.stack(rows["masks"]),  # (b, n)
            "tokens": tokens,  # (b, L)
            "token_mask": token_mask,  # (b, L)
            "state": torch.stack(rows["state"]),  # (b, Ds)
            "actions": torch.stack(rows["actions"]),  # (b, H, A)
            "action_pad": torch.stack([torch.as_tensor(p) for p in rows["pad"]]).bool(),  # (b, H)
            "action_dim": dims.pop(),
            "noise": torch.stack(rows["noise"]),  # (b, H, A)
            "time": torch.stack(rows["time"]),  # (b,)
            "mean_action": torch.stack(rows["mean"]),  # (b, A)
        }

    def mean_action(self, stats: Mapping | None = None) -> torch.Tensor:
        """The data's mean action (``stats``', default the run's), normalised and padded
        ``(A,)``: what the evaluation's baseline predicts
        (:class:`~.objective.FlowMatchingObjective`)."""
        stats = (stats or self.stats)["action"]
        mean = normalize(stats["mean"], stats, self.config.pi05)
        return padded(np.asarray(mean), self.config.max_action_dim, "the mean action")


def stage_inputs(mb: Mapping) -> tuple[torch.Tensor, ...]:
    """What the model's forward takes from a microbatch, in order: the prefix's inputs, the
    state (pi0.5's model ignores it), the noisy actions and the times."""
    terms = flow_terms(mb["actions"], mb["noise"], mb["time"])
    prefix = (mb["images"], mb["image_masks"], mb["tokens"], mb["token_mask"])
    return (*prefix, mb["state"], terms.x_t, terms.time)
