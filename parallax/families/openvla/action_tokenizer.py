"""OpenVLA's action tokenizer and the q01/q99 action normalisation.

Continuous actions are normalised to [-1, 1] with the dataset's 1st/99th percentiles (only the
dimensions the mask selects: the gripper stays in [0, 1]), cut into ``n_bins`` uniform bins, and
bin ``d`` (1..n_bins, ``np.digitize`` of the bin edges) becomes token ``vocab_size - d``: the
least used ids at the end of the text vocabulary. Decoding maps a token to its bin centre.
``vocab_size`` is the text tokenizer's vocabulary (32000 for Llama-2, 512 for the tiny preset),
not the padded embedding size.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


class ActionTokenizer:
    def __init__(
        self, vocab_size: int, n_bins: int = 256, min_action: float = -1.0, max_action: float = 1.0
    ) -> None:
        if vocab_size <= n_bins:
            raise ValueError(f"vocab_size {vocab_size} must exceed n_bins {n_bins}")
        self.vocab_size, self.n_bins = vocab_size, n_bins
        self.min_action, self.max_action = min_action, max_action
        self.bins = np.linspace(min_action, max_action, n_bins)  # edges
        self.bin_centers = (self.bins[:-1] + self.bins[1:]) / 2.0  # n_bins - 1 centres
        self.action_token_begin_idx = vocab_size - (n_bins + 1)  # ids above this are actions
        self._centers: dict[torch.device, torch.Tensor] = {}  # bin_centers on each device

    @classmethod
    def from_config(cls, config) -> ActionTokenizer:
        """For an :class:`~parallax.models.OpenVLAConfig` (text vocabulary, not padded rows)."""
        return cls(config.tokenizer_vocab_size, config.n_action_bins)

    def encode(self, normalized_actions) -> np.ndarray:
        """Token ids (int64) of actions in normalised space; values outside [-1, 1] are clipped."""
        a = np.clip(
            np.asarray(normalized_actions, dtype=np.float64), self.min_action, self.max_action
        )
        return (self.vocab_size - np.digitize(a, self.bins)).astype(np.int64)

    def decode(self, token_ids) -> np.ndarray:
        """Normalised actions (float64) at the bin centres; non-action ids clip to an end bin."""
        ids = np.asarray(token_ids, dtype=np.int64)
        d = np.clip(self.vocab_size - ids - 1, 0, self.bin_centers.shape[0] - 1)
        return self.bin_centers[d]

    def decode_torch(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` on a tensor, on its device (float32); used by the training metrics.

        The centres are copied to a device once: a copy from host memory on every call would
        synchronise the GPU stream each training step."""
        centers = self._centers.get(token_ids.device)
        if centers is None:
            centers = torch.as_tensor(self.bin_centers, dtype=torch.float32)
            centers = self._centers.setdefault(token_ids.device, centers.to(token_ids.device))
        d = (self.vocab_size - token_ids - 1).clamp(0, centers.shape[0] - 1)
        return centers[d]

    def is_action(self, token_ids):
        return token_ids > self.action_token_begin_idx


def _stats(stats: Mapping, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q01 = np.asarray(stats["q01"], dtype=np.float64)
    q99 = np.asarray(stats["q99"], dtype=np.float64)
    mask = np.asarray(stats.get("mask", [True] * len(q01)), dtype=bool)
    if not len(q01) == len(q99) == len(mask) == n:
        raise ValueError(
            f"action statistics have {len(q01)} q01, {len(q99)} q99 and {len(mask)} mask entries "
            f"but the action has {n} dimensions"
        )
    return q01, q99, mask


def normalize_actions(actions, stats: Mapping) -> np.ndarray:
    """OpenVLA's BOUNDS_Q99: ``clip(2 (a - q01) / (q99 - q01 + 1e-8) - 1, -1, 1)`` where the
    mask is set, untouched elsewhere; dimensions whose min equals max become 0."""
    a = np.asarray(actions, dtype=np.float64)
    q01, q99, mask = _stats(stats, a.shape[-1])
    scaled = np.clip(2.0 * (a - q01) / (q99 - q01 + 1e-8) - 1.0, -1.0, 1.0)
    out = np.where(mask, scaled, a)
    if "min" in stats and "max" in stats:
        const = np.asarray(stats["min"], dtype=np.float64) == np.asarray(stats["max"], np.float64)
        out = np.where(const, 0.0, out)
    return out


def unnormalize_actions(normalized, stats: Mapping) -> np.ndarray:
    """Inverse of :func:`normalize_actions` on masked dims: ``0.5 (a + 1)(q99 - q01) + q01``."""
    a = np.asarray(normalized, dtype=np.float64)
    q01, q99, mask = _stats(stats, a.shape[-1])
    return np.where(mask, 0.5 * (a + 1.0) * (q99 - q01) + q01, a)
