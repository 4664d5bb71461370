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

import json
from pathlib import Path
from typing import Any

import numpy as np

from parallax.atomic import atomic_write_bytes

STAT_KEYS = ("max", "mean", "min", "q01", "q99", "std")


class DatasetError(ValueError):
    """A dataset that cannot be used: missing, incomplete, empty or inconsistent."""


def check_finite(values, what: str, where: str) -> None:
    """A :class:`DatasetError` naming ``where`` and the first step (row) of ``values``
    ``(T, D)`` that holds NaN or inf: a non-finite action or state would train without
    complaint (and poison the statistics) until the loss turns NaN."""
    arr = np.asarray(values, dtype=np.float64).reshape(len(values), -1)  # (T, D)
    bad = ~np.isfinite(arr).all(axis=1)  # (T,)
    if bad.any():
        step = int(np.argmax(bad))
        raise DatasetError(
            f"{where}: step {step}: the {what} {arr[step].tolist()} is not finite (NaN or inf; "
            f"{int(bad.sum())} of {len(arr)} steps are)"
        )


def action_mask(action_dim: int) -> list[bool]:
    """Every dimension is normalised except the last one (the gripper)."""
    return [True] * (action_dim - 1) + [False]


def _summary(values: np.ndarray) -> dict[str, list[float]]:
    as_list = lambda a: [float(v) for v in np.asarray(a, dtype=np.float32)]  # noqa: E731
    return {
        "max": as_list(values.max(0)),
        "mean": as_list(values.mean(0)),
        "min": as_list(values.min(0)),
        "q01": as_list(np.quantile(values, 0.01, axis=0)),
        "q99": as_list(np.quantile(values, 0.99, axis=0)),
        "std": as_list(values.std(0)),
    }


def compute_statistics(
    actions: np.ndarray,
    num_trajectories: int,
    name: str,
    *,
    mask: list[bool] | None = None,
    states: np.ndarray | None = None,
) -> dict[str, Any]:
    """``norm_stats`` for one dataset from all its actions ``(num_transitions, action_dim)``.

    ``mask`` marks the normalised dimensions (default: all but the last, the gripper);
    ``states`` ``(num_transitions, state_dim)``, when given, fill ``proprio`` (else zeros of
    the action's size, as OpenVLA writes when it loads no proprioception).
    """
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim != 2 or actions.shape[0] == 0:
        raise DatasetError(
            f"statistics need a non-empty (transitions, action_dim) array, got {actions.shape}"
        )
    mask = action_mask(actions.shape[1]) if mask is None else [bool(m) for m in mask]
    if len(mask) != actions.shape[1]:
        raise DatasetError(f"mask of {len(mask)} dims for actions of {actions.shape[1]} dims")
    action = {"mask": mask, **_summary(actions)}
    if states is not None and np.asarray(states).size:
        proprio = _summary(np.asarray(states, dtype=np.float32))
    else:
        proprio = {k: [0.0] * actions.shape[1] for k in STAT_KEYS}
    return {
        name: {
            "action": action,
            "proprio": proprio,
            "num_trajectories": int(num_trajectories),
            "num_transitions": int(actions.shape[0]),
        }
    }


def merge_statistics(*stats: dict[str, Any]) -> dict[str, Any]:
    """One ``norm_stats`` dict keyed by dataset, as OpenVLA's ``dataset_statistics.json`` holds
    a mixture's; a name that appears twice is an error."""
    merged: dict[str, Any] = {}
    for entry in stats:
        for name, value in entry.items():
            if name in merged:
                raise DatasetError(f"two datasets are named {name!r}; give one another name")
            merged[name] = value
    return dict(sorted(merged.items()))


def write_statistics(path: str | Path, stats: dict[str, Any]) -> None:
    """Write ``dataset_statistics.json`` (keys sorted, atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(stats, indent=1, sort_keys=True) + "\n").encode())


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
