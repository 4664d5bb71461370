"""Which camera, state and action keys a dataset's samples come from, and how its actions are
standardised: one small config per dataset, the common ones built in, a user's own in TOML.

A key is a path in the dataset's own terms:

* RLDS: below ``steps/`` (``observation/image``, ``action``, ``language_instruction``);
* LIBERO HDF5: below ``data/demo_N/`` (``obs/agentview_rgb``, ``actions``);
* LeRobot: a feature name of ``meta/info.json`` (``observation.images.top``, ``action``).

``state`` and ``action`` may list several keys, concatenated along the last axis (Open
X-Embodiment's RT-1 data stores ``action/world_vector``, ``action/rotation_delta`` and the
gripper apart). ``transform`` names an episode-level action transform as OpenVLA's per-dataset
standardisation applies it (gripper to absolute [0, 1] with 1 = open; see :data:`TRANSFORMS`).
``unnormalized`` lists the action dimensions left unnormalised (OpenVLA's mask: the gripper).

A user's TOML file (``--data-config FILE``) holds one table per dataset name::

    [my_so100_set]
    format = "lerobot"              # optional: which reader the table is for
    primary = "observation.images.top"
    wrist = "observation.images.wrist"
    extra = ["observation.images.side"]   # further cameras (LeRobot; pi0's third slot)
    state = "observation.state"
    action = "action"
    transform = "none"
    unnormalized = [5]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallax.data.stats import DatasetError
from parallax.tomlfile import read_toml

FORMATS = ("rlds", "libero", "lerobot", "parallax")


@dataclass(frozen=True)
class KeyConfig:
    """Where one dataset's sample fields live (see the module doc)."""

    primary: str | None = None  # None: the format's first camera
    wrist: str | None = None
    extra: tuple[str, ...] = ()  # further cameras (pi0's third slot): LeRobot features
    state: tuple[str, ...] = ()
    action: tuple[str, ...] = ("action",)
    instruction: str | None = "language_instruction"  # None: from the format's metadata
    transform: str = "none"
    unnormalized: tuple[int, ...] = (-1,)
    rotate180: bool = False  # LIBERO's simulator renders upside down
    name: str | None = None  # the dataset's name in the statistics (default: the reader's)
    format: str | None = None  # which reader this config is for (None: any)

    def __post_init__(self) -> None:
        for attr in ("extra", "state", "action", "unnormalized"):
            value = getattr(self, attr)
            if isinstance(value, (str, int)):
                object.__setattr__(self, attr, (value,))
            else:
                object.__setattr__(self, attr, tuple(value))
        if self.transform not in TRANSFORMS:
            raise DatasetError(
                f"unknown action transform {self.transform!r}; choose one of {sorted(TRANSFORMS)}"
            )
        if self.format is not None and self.format not in FORMATS:
            raise DatasetError(f"unknown format {self.format!r}; choose one of {list(FORMATS)}")
        if not self.action:
            raise DatasetError("a dataset config needs at least one action key")

    def mask(self, action_dim: int) -> list[bool]:
        """OpenVLA's normalisation mask: True for every dimension that is normalised."""
        mask = [True] * action_dim
        for dim in self.unnormalized:
            if not -action_dim <= dim < action_dim:
                raise DatasetError(
                    f"unnormalized dimension {dim} is outside an action of {action_dim} dims"
                )
            mask[dim] = False
        return mask

    def replace(self, **changes: Any) -> KeyConfig:
        return dataclasses.replace(self, **changes)


# --- episode-level action transforms (OpenVLA's standardisation of the gripper) ---------------


def _binarize(gripper: np.ndarray) -> np.ndarray:
    """Continuous gripper -> {0, 1}: in-between values take the state reached after them
    (a reverse scan starting from the last value), as OpenVLA's ``binarize_gripper_actions``."""
    out = np.empty_like(gripper)
    carry = gripper[-1]
    for i in range(len(gripper) - 1, -1, -1):
        if gripper[i] > 0.95 or gripper[i] < 0.05:
            carry = float(gripper[i] > 0.95)
        out[i] = carry
    return out


def _rel2abs(gripper: np.ndarray) -> np.ndarray:
    """Relative gripper (+1 close, -1 open, 0 no change) -> absolute (0 closed, 1 open), as
    OpenVLA's ``rel2abs_gripper_actions`` (open throughout when it never moves)."""
    steps = np.where(gripper < -0.1, 1, np.where(gripper > 0.1, -1, 0))
    moves = np.flatnonzero(steps)
    carry = -steps[moves[0]] if len(moves) else 1
    out = np.empty(len(gripper), dtype=np.float32)
    for i, s in enumerate(steps):
        carry = s if s != 0 else carry
        out[i] = carry / 2 + 0.5
    return out


def _with_gripper(actions: np.ndarray, gripper: np.ndarray) -> np.ndarray:
    return np.concatenate([actions[:, :-1], gripper[:, None].astype(np.float32)], axis=1)


def _bridge(actions, states):
    """Bridge V2 (OpenVLA's ``bridge_orig``): drop the all-zero first step, binarize the
    gripper, and relabel xyz/rpy as the reached state's change (dropping the last step)."""
    if states is None or states.shape[1] < 6:
        raise DatasetError("the 'bridge' transform needs a state of at least 6 dims (EEF pose)")
    actions, states = actions[1:], states[1:]
    gripper = _binarize(actions[:, -1])
    moved = states[1:, :6] - states[:-1, :6]
    actions = np.concatenate([moved, gripper[:-1, None]], axis=1).astype(np.float32)
    return actions, states[:-1], 1, 1


TRANSFORMS: dict[str, Any] = {
    # name -> f(actions (T, D), states (T, S) | None) -> (actions, states, cut_front, cut_back)
    "none": lambda a, s: (a, s, 0, 0),
    "libero": lambda a, s: (_with_gripper(a, 1.0 - np.clip(a[:, -1], 0.0, 1.0)), s, 0, 0),
    "clip": lambda a, s: (_with_gripper(a, np.clip(a[:, -1], 0.0, 1.0)), s, 0, 0),
    "invert": lambda a, s: (_with_gripper(a, 1.0 - a[:, -1]), s, 0, 0),
    "binarize": lambda a, s: (_with_gripper(a, _binarize(a[:, -1])), s, 0, 0),
    "rel2abs": lambda a, s: (_with_gripper(a, _rel2abs(a[:, -1])), s, 0, 0),
    "bridge": _bridge,
}
MIN_STEPS = {"bridge": 3}  # raw steps a transform needs to leave one


def transform_episode(config: KeyConfig, actions: np.ndarray, states: np.ndarray | None):
    """Apply ``config.transform``: ``(actions, states, first raw step kept)``; the steps kept
    are raw steps ``first .. first + len(actions) - 1``."""
    actions = np.asarray(actions, dtype=np.float32)
    need = MIN_STEPS.get(config.transform, 1)
    if len(actions) < need:
        raise DatasetError(f"transform {config.transform!r} needs {need}+ steps")
    actions, states, front, _ = TRANSFORMS[config.transform](actions, states)
    return np.ascontiguousarray(actions, dtype=np.float32), states, front


# --- built-in configs ----------------------------------------------------------------------

_LIBERO_RLDS = KeyConfig(
    primary="observation/image",
    wrist="observation/wrist_image",
    state=("observation/state",),
    transform="libero",
    format="rlds",
)
_RT1 = KeyConfig(
    primary="observation/image",
    action=("action/world_vector", "action/rotation_delta", "action/gripper_closedness_action"),
    state=("observation/base_pose_tool_reached", "observation/gripper_closed"),
    instruction="observation/natural_language_instruction",
    transform="rel2abs",
    format="rlds",
)
BUILTIN: dict[str, KeyConfig] = {
    # OpenVLA's LIBERO RLDS sets (already upright: the builder rotated them)
    **{f"libero_{s}_no_noops": _LIBERO_RLDS for s in ("spatial", "object", "goal", "10")},
    "libero_90": _LIBERO_RLDS,
    "bridge_orig": KeyConfig(
        primary="observation/image_0",
        state=("observation/state",),
        transform="bridge",
        format="rlds",
    ),
    "fractal20220817_data": _RT1,
    "taco_play": KeyConfig(
        primary="observation/rgb_static",
        wrist="observation/rgb_gripper",
        action=("action/rel_actions_world",),
        instruction="observation/natural_language_instruction",
        transform="clip",
        format="rlds",
    ),
}
BUILTIN["bridge_dataset"] = BUILTIN["bridge_orig"]
DEFAULTS: dict[str, KeyConfig] = {
    "rlds": KeyConfig(
        primary="observation/image",
        wrist="observation/wrist_image",
        state=("observation/state",),
        format="rlds",
    ),
    # LIBERO's raw HDF5 demos: upside-down frames, gripper -1 open / +1 close
    "libero": KeyConfig(
        primary="obs/agentview_rgb",
        wrist="obs/eye_in_hand_rgb",
        state=("obs/ee_states", "obs/gripper_states"),
        action=("actions",),
        instruction=None,
        transform="libero",
        rotate180=True,
        format="libero",
    ),
    "lerobot": KeyConfig(state=("observation.state",), instruction=None, format="lerobot"),
    "parallax": KeyConfig(instruction=None, format="parallax"),
}
OPTIONAL_IN_DEFAULTS = ("wrist", "state")  # dropped from a default when the data lacks them


def resolve_config(
    fmt: str, name: str, user: dict[str, KeyConfig] | None = None, given: KeyConfig | None = None
) -> tuple[KeyConfig, bool]:
    """The config for dataset ``name`` read by reader ``fmt``: ``given``, else the user's
    table of that name, else the built-in one, else the format's default. Returns it and
    whether it is a default (whose optional keys a reader may drop when absent)."""
    for config in (given, (user or {}).get(name), BUILTIN.get(name)):
        if config is not None and config.format in (None, fmt):
            return config, False
    return DEFAULTS[fmt], True


def _config_from_table(name: str, table: dict[str, Any], where: str) -> KeyConfig:
    fields = {f.name for f in dataclasses.fields(KeyConfig)}
    unknown = sorted(set(table) - fields)
    if unknown:
        raise DatasetError(f"{where}: [{name}] has unknown keys {unknown}; known: {sorted(fields)}")
    return KeyConfig(**table)


def load_key_configs(path: str | Path) -> dict[str, KeyConfig]:
    """The dataset tables of a TOML file (see the module doc); a top-level ``data`` list (the
    mixture form) is skipped."""
    path = Path(path)
    try:
        tables = read_toml(path, str(path))
    except ValueError as err:
        raise DatasetError(f"cannot read the dataset configs: {err}") from None
    return {
        name: _config_from_table(name, table, str(path))
        for name, table in tables.items()
        if name != "data" and isinstance(table, dict)
    }


def config_from_mapping(table: dict[str, Any], where: str = "config") -> KeyConfig:
    """A :class:`KeyConfig` from a plain mapping (an inline TOML table)."""
    return _config_from_table(table.get("name") or "dataset", dict(table), where)


__all__ = [
    "BUILTIN",
    "DEFAULTS",
    "KeyConfig",
    "TRANSFORMS",
    "config_from_mapping",
    "load_key_configs",
    "resolve_config",
    "transform_episode",
]
