"""Dataset statistics in OpenVLA's ``norm_stats`` layout (``dataset_statistics.json``).

One entry per dataset name::

    {"<name>": {"action": {"mask": [true]*6 + [false], "max": [7], "mean": [7], "min": [7],
                           "q01": [7], "q99": [7], "std": [7]},
                "proprio": {"max", "mean", "min", "q01", "q99", "std"},   # zeros: no proprio
                "num_trajectories": int, "num_transitions": int}}

q01/q99 are ``np.quantile(actions, 0.01 / 0.99, axis=0)`` over every transition, as OpenVLA
computes them; the mask marks the last dimension (the gripper) as not normalised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STAT_KEYS = ("max", "mean", "min", "q01", "q99", "std")


class DatasetError(ValueError):
    """A dataset that cannot be used: missing, incomplete, empty or inconsistent."""


def action_mask(action_dim: int) -> list[bool]:
    """Every dimension is normalised except the last one (the gripper)."""
    return [True] * (action_dim - 1) + [False]


def compute_statistics(actions: np.ndarray, num_trajectories: int, name: str) -> dict[str, Any]:
    """``norm_stats`` for one dataset from all its actions ``(num_transitions, action_dim)``."""
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim != 2 or actions.shape[0] == 0:
        raise DatasetError(
            f"statistics need a non-empty (transitions, action_dim) array, got {actions.shape}"
        )
    as_list = lambda a: [float(v) for v in np.asarray(a, dtype=np.float32)]  # noqa: E731
    action = {
        "mask": action_mask(actions.shape[1]),
        "max": as_list(actions.max(0)),
        "mean": as_list(actions.mean(0)),
        "min": as_list(actions.min(0)),
        "q01": as_list(np.quantile(actions, 0.01, axis=0)),
        "q99": as_list(np.quantile(actions, 0.99, axis=0)),
        "std": as_list(actions.std(0)),
    }
    zeros = [0.0] * actions.shape[1]
    return {
        name: {
            "action": action,
            "proprio": {k: list(zeros) for k in STAT_KEYS},
            "num_trajectories": int(num_trajectories),
            "num_transitions": int(actions.shape[0]),
        }
    }


def check_statistics(stats: Any, where: str) -> str:
    """Validate a ``norm_stats`` dict holding one dataset; return that dataset's name."""
    if not isinstance(stats, dict) or len(stats) != 1:
        count = len(stats) if isinstance(stats, dict) else type(stats).__name__
        raise DatasetError(f"{where}: expected exactly one dataset entry, found {count}")
    ((name, entry),) = stats.items()
    action = entry.get("action") if isinstance(entry, dict) else None
    missing = [k for k in ("mask", *STAT_KEYS) if not isinstance(action, dict) or k not in action]
    if missing:
        raise DatasetError(f"{where}: dataset {name!r} lacks action statistics {missing}")
    dims = {k: len(action[k]) for k in ("mask", *STAT_KEYS)}
    if len(set(dims.values())) != 1:
        raise DatasetError(f"{where}: action statistics of {name!r} disagree on length: {dims}")
    return name
