"""LeRobot datasets (v2.x, v3.0), LIBERO's HDF5 demos and RLDS as pi0's ``--data``, read in
place by the readers the OpenVLA family streams with (:mod:`parallax.data`).

A sample (:func:`pi0_sample`): the cameras in the model's slot order (:data:`~.data.CAMERAS`:
the config's ``primary``, ``wrist`` and ``extra`` keys; a LeRobot dataset without a config of
its own maps its first ``num_cameras`` camera features in ``meta/info.json`` order), the
instruction, the state at the step and the chunk of the model's horizon (``config.chunk``) of
the next actions, LeRobot's rule (:mod:`parallax.data.chunks`): every step of an episode is a
sample, the chunk's actions past the episode's end repeat its last action and are flagged in
``action_pad`` (``(H,)`` bool, LeRobot's ``action_is_pad``), which the loss leaves out
(:mod:`.objective`). The samples are normalised by the policy folder's processor statistics
when ``--model FOLDER`` has them (:mod:`.processors`), else by the dataset's own
(``dataset_statistics.json``'s layout, with q01/q99 for pi0.5).

Training streams them (:mod:`.stream_data`, mixtures included); :class:`RobotSamples` reads one
dataset by random access (the evaluation's ``--eval-data``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallax.data.chunks import action_chunk, chunk_pad
from parallax.data.keys import BUILTIN, KeyConfig, load_key_configs
from parallax.data.mixture import (
    DataSpec,
    detect_format,
    open_source,
    parse_data_spec,
    specs_from_toml,
)
from parallax.data.source import OpenEpisode, Source, SourceDataset
from parallax.data.stats import DatasetError
from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.data import CAMERAS, IndexedSamples
from parallax.families.pi0.processors import read_statistics
from parallax.run import Run

FORMATS = ("lerobot", "libero", "rlds")


def camera_slots(source: Source) -> list[str]:
    """The source's cameras in the model's slot order: ``primary``, ``wrist``, ``extraK``."""
    cfg = source.config
    slots = [c for c, key in (("primary", cfg.primary), ("wrist", cfg.wrist)) if key]
    return slots + [f"extra{k}" for k in range(len(cfg.extra))]


def check_source(source: Source, config: Pi0Config) -> None:
    """A dataset pi0 can take: a state, no more cameras than the model's slots."""
    if source.state_dim is None:
        raise DatasetError(
            f"dataset {source.name!r} has no state: pi0 needs one (name its key with "
            '--data-config: state = "...")'
        )
    slots = camera_slots(source)
    if len(slots) > config.num_cameras:
        raise DatasetError(
            f"dataset {source.name!r} maps {len(slots)} cameras ({slots}); the model has "
            f"{config.num_cameras} camera slots"
        )


def pi0_sample(source: Source, opened: OpenEpisode, step: int, chunk: int) -> dict[str, Any]:
    """One raw pi0 sample of an opened episode (module doc); numpy arrays. The streaming
    loader's workers call it too (a module-level function: it pickles by name)."""
    length = len(opened.actions)
    sample = {
        "instruction": opened.instruction(step),
        "state": opened.states[step],  # (S,)
        "actions": action_chunk(opened.actions, step, chunk),  # (H, D), the last repeated
        "action_pad": chunk_pad(length, step, chunk),  # (H,) True past the episode's end
        "dataset": source.name,
        "episode": opened.ref.index,
        "step": step,
    }
    for key, camera in zip(CAMERAS, camera_slots(source)):
        sample[key] = opened.image(step, camera)  # (h, w, 3) uint8
    return sample


class RobotSamples(SourceDataset):
    """pi0's samples of a scanned source (module doc), random access: every step of every
    episode, in order."""

    def __init__(self, source: Source, config: Pi0Config) -> None:
        super().__init__(source, chunk=1)  # every step a sample (LeRobot's rule)
        check_source(source, config)
        self.chunk = config.chunk
        self.cameras = camera_slots(source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        episode, step = self.index.locate(int(index))
        return pi0_sample(self.source, self.opened(episode), step, self.chunk)


def lerobot_cameras(path: str | Path, n: int) -> KeyConfig:
    """A LeRobot dataset's first ``n`` camera features as primary, wrist and extra cameras."""
    features = json.loads((Path(path) / "meta" / "info.json").read_text()).get("features", {})
    cams = [k for k, f in features.items() if f.get("dtype") in ("video", "image")][:n]
    state = ("observation.state",) if "observation.state" in features else ()
    return KeyConfig(
        primary=cams[0] if cams else None,
        wrist=cams[1] if len(cams) > 1 else None,
        extra=tuple(cams[2:]),
        state=state,
        instruction=None,
        format="lerobot",
    )


def data_specs(data: str | list, run: Run, config: Pi0Config) -> list[DataSpec]:
    """``--data`` (a spec string or a ``[[data]]`` list) as specs of pi0's formats, each LeRobot
    dataset without a key config of its own given its cameras (:func:`lerobot_cameras`)."""
    specs = specs_from_toml(data) if isinstance(data, list) else parse_data_spec(data)
    user = load_key_configs(run.data_config) if run.data_config else {}
    out = []
    for one in specs:
        fmt = one.format or detect_format(one.path)
        if fmt not in FORMATS:
            raise DatasetError(
                f"--data {one.path}: a {fmt} dataset; pi0 reads {', '.join(FORMATS)}"
            )
        given = one.config
        name = Path(one.path).name
        if given is None and fmt == "lerobot" and name not in user and name not in BUILTIN:
            given = lerobot_cameras(one.path, config.num_cameras)
        out.append(DataSpec(one.path, fmt, one.weight, given, one.name))
    return out


def open_source_for(spec: str, run: Run, config: Pi0Config) -> Source:
    """The one dataset ``--data spec`` names, scanned (the scan kept in ``OUT/data_index``)."""
    specs = data_specs(spec, run, config)
    if len(specs) != 1 or specs[0].weight is not None:
        raise DatasetError(f"--data {spec}: random access reads one dataset (no mixture)")
    user = load_key_configs(run.data_config) if run.data_config else {}
    return open_source(specs[0], user_configs=user, cache_dir=Path(run.out) / "data_index")


def robot_dataset(spec: str, run: Run) -> IndexedSamples:
    """One dataset by random access (module doc): samples with their index and epoch
    (``visit``), and the statistics they are normalised by."""
    config: Pi0Config = run.model_config
    source = open_source_for(spec, run, config)
    data = RobotSamples(source, config)
    return IndexedSamples(data, statistics=run_statistics(source.statistics, run))


def run_statistics(statistics: dict, run: Run) -> dict:
    """What each dataset (by name) is normalised by: its own statistics, or the policy
    folder's where ``--model FOLDER`` has processor files (checked against each dataset)."""
    config: Pi0Config = run.model_config
    folder = read_statistics(run.checkpoint) if run.checkpoint else None
    if folder is None:
        return dict(statistics)
    return {
        name: folder_statistics(folder, entry, config, run.checkpoint)
        for name, entry in statistics.items()
    }


def folder_statistics(folder: dict, data: dict, config: Pi0Config, where: Any) -> dict:
    """The policy folder's statistics (the dataset's for a part it lacks), checked: the
    dataset's action and state widths, and the statistics the variant normalises by."""
    need = ("q01", "q99") if config.pi05 else ("mean", "std")
    for what in ("action", "proprio"):
        if what not in folder:
            continue
        have, want = len(next(iter(folder[what].values()))), len(data[what]["mean"])
        if have != want:
            raise DatasetError(
                f"{where}: the processor statistics' {what} has {have} dims, the dataset {want}"
            )
        missing = [k for k in need if k not in folder[what]]
        if missing:
            raise DatasetError(f"{where}: the processor statistics' {what} lack {missing}")
    return {**data, **folder}
