"""The built-in synthetic robot task: a camera looking down on a table, deterministic from the seed.

Each episode is one scene: 2-4 objects of distinct colours (red, green, blue, yellow, purple,
orange) and random shapes (cube, ball, triangle) at random places, a gripper drawn as a dark
cross, and an instruction naming one object, e.g. ``"pick up the red cube"`` or
``"move to the blue ball"``. The camera is either on the wrist (``camera="wrist"``, the
default: the view, one table wide, is centred on the gripper and moves with it) or fixed
(``"static"``: the whole table, with the gripper's cross where it is). At every step a scripted
expert emits the 7-D action

* ``x, y``: the offset from the gripper to the target divided by ``max_step``, clipped to
  [-1, 1] and rounded to ``action_levels`` values (x = image right, y = image down), and zero
  once the gripper is within a quarter step of the target;
* ``z``: -1 (descend) once the gripper is over the target and the instruction says "pick up",
  else 0;
* ``roll, pitch, yaw``: 0;
* ``gripper``: 0 (closed) once over the target for "pick up", else 1 (open); OpenVLA's
  convention.

then the gripper moves by ``action * max_step``. Every action is therefore a function of what
the image shows (where the gripper and the objects are) and of what the instruction names
(which object, which verb): a model must read both to predict it. Sample ``i`` is step
``i % episode_length`` of episode ``i // episode_length``; each episode's randomness comes from
its own generator seeded by ``(seed, episode)``, so any sample is computed on demand in a few
hundred microseconds and the same seed always gives the same images, actions and statistics.

**OFT form** (OpenVLA-OFT's inputs and targets; all off by default): ``wrist_image=True``
adds the wrist camera's view as ``"wrist_image"`` beside ``"image"`` (with ``camera="static"``
the two are OFT's third-person and wrist cameras); ``state=True`` adds the robot's state
``"state"`` (the gripper's ``x, y``; its statistics go to ``proprio``); ``chunk=K`` adds
``"actions"``, the expert's next ``K`` actions ``(K, 7)``, and, as OFT's RLDS pipeline does
(``chunk_act_obs`` keeps ``T - K + 1`` steps of a ``T``-step trajectory), only the steps
whose chunk fits in the episode are samples: an episode gives ``episode_length - K + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from parallax.data.episodes import Episode, Sample
from parallax.data.stats import compute_statistics

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 20),
}
SHAPES = ("cube", "ball", "triangle")
VERBS = ("pick up", "move to")
TABLE = (150.0, 120.0, 90.0)  # wood
GRIPPER = (20.0, 20.0, 20.0)
OBJECT_RADIUS = 0.1  # in image units ([0, 1] across)
MIN_SEPARATION = 0.26
START_DISTANCE = 0.25  # the gripper starts at least this far from the target...
START_OFFSET = 0.4  # ...and at most this far along each axis, so a wrist camera sees it
FLOOR = (70.0, 70.0, 78.0)  # beyond the table's edge


@dataclass(frozen=True)
class SyntheticConfig:
    """What the synthetic task looks like; every field changes the data, so keep it in configs."""

    seed: int = 0
    num_episodes: int = 2000
    episode_length: int = 5
    image_size: int = 64
    min_objects: int = 2
    max_objects: int = 4
    action_levels: int = 5  # odd: x and y take values in linspace(-1, 1, levels); 0: continuous
    max_step: float = 0.1  # gripper travel per step, as a fraction of the table, at |action| 1
    camera: str = "wrist"  # "wrist": the view follows the gripper; "static": the whole table
    stats_episodes: int = 1000  # statistics are computed from the first this many episodes
    name: str = "parallax_synthetic"
    wrist_image: bool = False  # OFT form: also the wrist camera's view (module doc)
    state: bool = False  # OFT form: the gripper's position as the robot state
    chunk: int = 1  # OFT form: the next `chunk` actions per sample ("actions"); 1: "action" only

    def __post_init__(self) -> None:
        checks = {
            "seed >= 0": self.seed >= 0,
            "num_episodes >= 1": self.num_episodes >= 1,
            "episode_length >= 1": self.episode_length >= 1,
            "image_size >= 16": self.image_size >= 16,
            "2 <= min_objects <= max_objects <= 6": 2
            <= self.min_objects
            <= self.max_objects
            <= len(COLOURS),
            "action_levels == 0 or odd >= 3": self.action_levels == 0
            or (self.action_levels >= 3 and self.action_levels % 2 == 1),
            "0 < max_step <= 1": 0 < self.max_step <= 1,
            "camera in ('wrist', 'static')": self.camera in ("wrist", "static"),
            "stats_episodes >= 1": self.stats_episodes >= 1,
            "1 <= chunk <= episode_length": 1 <= self.chunk <= self.episode_length,
        }
        bad = [rule for rule, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"SyntheticConfig: need {', '.join(bad)}; got {self}")


@dataclass
class Scene:
    """One episode before rendering: cheap to compute, enough to draw any step."""

    colours: list[str]
    shapes: list[str]
    positions: np.ndarray  # (n, 2) object centres, (x, y) in [0, 1]
    target: int
    verb: str
    brightness: float
    gripper: np.ndarray = field(repr=False)  # (T, 2) gripper position before each step
    actions: np.ndarray = field(repr=False)  # (T, 7) float32

    @property
    def instruction(self) -> str:
        return f"{self.verb} the {self.colours[self.target]} {self.shapes[self.target]}"


def _span(coords: np.ndarray, centre: float, extent: float) -> slice:
    """Indices of the sorted ``coords`` within ``extent`` of ``centre``, plus one on each side
    (the masks drawn in the window decide exactly)."""
    lo = np.searchsorted(coords, centre - extent, side="left") - 1
    hi = np.searchsorted(coords, centre + extent, side="right") + 1
    return slice(max(int(lo), 0), int(hi))


def expert_action(gripper: np.ndarray, target: np.ndarray, pick: bool, cfg: SyntheticConfig):
    """The scripted policy: 7-D action for a gripper at ``gripper`` going to ``target``."""
    offset = (target - gripper) / cfg.max_step  # (2,) in steps
    reached = bool(np.abs(offset).max() <= 0.25)
    xy = np.clip(offset, -1.0, 1.0)
    if cfg.action_levels:
        half = (cfg.action_levels - 1) / 2
        xy = np.round(xy * half) / half + 0.0  # + 0.0 turns -0.0 into 0.0
    if reached:
        xy = np.zeros(2)
    grasp = pick and reached
    action = [xy[0], xy[1], -1.0 if grasp else 0.0, 0.0, 0.0, 0.0, 0.0 if grasp else 1.0]
    return np.asarray(action, dtype=np.float32)


class SyntheticTask:
    """Indexable dataset of raw samples ``{"image", "instruction", "action"}`` (see module doc)."""

    def __init__(self, config: SyntheticConfig | None = None, **overrides: Any) -> None:
        self.config = replace(config or SyntheticConfig(), **overrides)  # a frozen copy
        self.name = self.config.name
        size = self.config.image_size
        self._centres = (np.arange(size, dtype=np.float32) + 0.5) / size  # (S,)

    @property
    def samples_per_episode(self) -> int:
        """Steps whose action chunk fits in the episode (all of them without chunks)."""
        return self.config.episode_length - self.config.chunk + 1

    def __len__(self) -> int:
        return self.config.num_episodes * self.samples_per_episode

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        cfg = self.config
        episode, step = divmod(int(index), self.samples_per_episode)
        scene = self.scene(episode)
        out = {
            "image": self.render(scene, episode, step),
            "instruction": scene.instruction,
            "action": torch.from_numpy(scene.actions[step].copy()),
        }
        if cfg.wrist_image:
            out["wrist_image"] = self.render(scene, episode, step, camera="wrist")
        if cfg.state:
            out["state"] = torch.from_numpy(scene.gripper[step].astype(np.float32))
        if cfg.chunk > 1:
            out["actions"] = torch.from_numpy(scene.actions[step : step + cfg.chunk].copy())
        return out

    def scene(self, episode: int) -> Scene:
        """Objects, instruction and the expert's trajectory of ``episode`` (no pixels)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, episode, 0])
        n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
        names = list(COLOURS)
        colours = [names[i] for i in rng.permutation(len(names))[:n]]
        shapes = [SHAPES[i] for i in rng.integers(0, len(SHAPES), n)]
        positions: list[np.ndarray] = []
        for attempt in range(10_000):  # rejection sampling keeps objects apart
            if len(positions) == n:
                break
            if attempt % 100 == 99:
                positions = []  # a crowded start: begin again
            p = rng.uniform(0.12, 0.88, 2)
            if all(np.linalg.norm(p - q) >= MIN_SEPARATION for q in positions):
                positions.append(p)
        target = int(rng.integers(0, n))
        verb = VERBS[int(rng.integers(0, len(VERBS)))]
        brightness = float(rng.uniform(0.85, 1.15))
        gripper = np.full(2, -1.0)
        while not ((gripper > 0.02) & (gripper < 0.98)).all():  # a few steps away, in view
            offset = rng.uniform(-START_OFFSET, START_OFFSET, 2)
            if np.linalg.norm(offset) >= START_DISTANCE:
                gripper = positions[target] + offset
        track, actions = [], []
        for _ in range(cfg.episode_length):
            action = expert_action(gripper, positions[target], verb == "pick up", cfg)
            track.append(gripper.copy())
            actions.append(action)
            gripper = np.clip(gripper + action[:2] * cfg.max_step, 0.0, 1.0)
        return Scene(
            colours, shapes, np.stack(positions), target, verb, brightness,
            np.stack(track), np.stack(actions),
        )  # fmt: skip

    def render(
        self, scene: Scene, episode: int, step: int, camera: str | None = None
    ) -> torch.Tensor:
        """The image of ``camera`` (default: the config's) at ``step``: (S, S, 3) uint8."""
        camera = camera or self.config.camera
        other = () if camera == self.config.camera else (1,)  # a second camera's own noise
        rng = np.random.default_rng([self.config.seed, episode, step + 1, *other])
        gx, gy = scene.gripper[step]
        xs = ys = self._centres  # (S,) pixel centres in [0, 1]: x by column, y by row
        if camera == "wrist":  # the view (one table wide) moves with the gripper
            xs, ys = xs - 0.5 + gx, ys - 0.5 + gy
        on_table = ((ys >= 0) & (ys <= 1))[:, None] & ((xs >= 0) & (xs <= 1))[None, :]  # (S, S)
        image = np.where(on_table[..., None], np.float32(TABLE), np.float32(FLOOR))  # (S, S, 3)
        image = image.astype(np.float32) * scene.brightness
        image += rng.uniform(-6.0, 6.0, image.shape).astype(np.float32)
        r = OBJECT_RADIUS
        for colour, shape, (cx, cy) in zip(scene.colours, scene.shapes, scene.positions):
            rows, cols = _span(ys, cy, 1.1 * r), _span(xs, cx, 1.1 * r)  # the object's box
            dx, dy = xs[cols][None, :] - cx, ys[rows][:, None] - cy  # (1, w), (h, 1)
            if shape == "cube":
                mask = (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
            elif shape == "ball":
                mask = dx * dx + dy * dy <= r * r
            else:  # triangle, apex up, centred in its bounding box
                mask = (np.abs(dy) <= 0.85 * r) & (np.abs(dx) <= (dy + 0.85 * r) * 0.6)
            image[rows, cols][mask] = COLOURS[colour]
        arm, half_width = 0.06, max(0.012, 0.6 / len(xs))
        rows, cols = _span(ys, gy, arm), _span(xs, gx, arm)
        dx, dy = np.abs(xs[cols][None, :] - gx), np.abs(ys[rows][:, None] - gy)  # (1, w), (h, 1)
        cross = ((dx <= arm) & (dy <= half_width)) | ((dy <= arm) & (dx <= half_width))
        image[rows, cols][cross] = GRIPPER
        return torch.from_numpy(np.clip(image, 0, 255).round().astype(np.uint8))

    def episode(self, episode: int) -> Episode:
        """A whole episode, as written to disk by :func:`parallax.data.write_dataset`."""
        scene = self.scene(episode)
        images = torch.stack([self.render(scene, episode, t) for t in range(len(scene.actions))])
        return Episode(images, torch.from_numpy(scene.actions.copy()), scene.instruction)

    def episodes(self):
        """Every episode in order (one in memory at a time)."""
        return (self.episode(e) for e in range(self.config.num_episodes))

    @cached_property
    def statistics(self) -> dict[str, Any]:
        """``norm_stats`` from the actions of the first ``stats_episodes`` episodes."""
        cfg = self.config
        count = min(cfg.num_episodes, cfg.stats_episodes)
        scenes = [self.scene(e) for e in range(count)]
        actions = np.concatenate([s.actions for s in scenes])
        states = np.concatenate([s.gripper for s in scenes]) if cfg.state else None
        stats = compute_statistics(actions, count, self.name, states=states)
        stats[self.name]["num_trajectories"] = cfg.num_episodes
        stats[self.name]["num_transitions"] = len(self)
        return stats
