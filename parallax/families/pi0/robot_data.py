"""LeRobot datasets (v2.x, v3.0), LIBERO's HDF5 demos and RLDS as pi0's ``--data``, read in
place by the readers the OpenVLA family streams with (:mod:`parallax.data`).

A sample: the cameras in the model's slot order (:data:`~.data.CAMERAS`: the config's
``primary``, ``wrist`` and ``extra`` keys; a LeRobot dataset without a config of its own maps
its first ``num_cameras`` camera features in ``meta/info.json`` order), the instruction, the
state at the step and the chunk of the model's horizon (``config.chunk``) of the next actions,
OFT's rule (:mod:`parallax.data.chunks`: an episode of ``T`` steps gives ``T - H + 1``
samples, every chunk inside it). The samples are normalised by the policy folder's processor
statistics when ``--model FOLDER`` has them (:mod:`.processors`), else by the dataset's own
(``dataset_statistics.json``'s layout, with q01/q99 for pi0.5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallax.data.chunks import action_chunk
from parallax.data.keys import BUILTIN, KeyConfig, load_key_configs
from parallax.data.mixture import DataSpec, detect_format, open_source, parse_data_spec
from parallax.data.source import Source, SourceDataset
from parallax.data.stats import DatasetError
from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.data import CAMERAS, IndexedSamples
from parallax.families.pi0.processors import read_statistics
from parallax.run import Run

FORMATS = ("lerobot", "libero", "rlds")


class RobotSamples(SourceDataset):
    """pi0's samples of a scanned source (module doc), random access."""

    def __init__(self, source: Source, config: Pi0Config) -> None:
        super().__init__(source, chunk=config.chunk)
        if source.state_dim is None:
            raise DatasetError(
                f"dataset {source.name!r} has no state: pi0 needs one (name its key with "
                '--data-config: state = "...")'
            )
        cfg = source.config
        slots = [c for c, key in (("primary", cfg.primary), ("wrist", cfg.wrist)) if key]
        slots += [f"extra{k}" for k in range(len(cfg.extra))]
        if len(slots) > config.num_cameras:
            raise DatasetError(
                f"dataset {source.name!r} maps {len(slots)} cameras ({slots}); the model has "
                f"{config.num_cameras} camera slots"
            )
        self.cameras = slots

    def __getitem__(self, index: int) -> dict[str, Any]:
        episode, step = self.index.locate(int(index))
        opened = self.opened(episode)
        sample = {
            "instruction": opened.instruction(step),
            "state": opened.states[step],  # (S,)
            "actions": action_chunk(opened.actions, step, self.chunk),  # (H, D)
            "dataset": self.name,
            "episode": opened.ref.index,
            "step": step,
        }
        for key, camera in zip(CAMERAS, self.cameras):
            sample[key] = opened.image(step, camera)  # (h, w, 3) uint8
        return sample


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


def open_source_for(spec: str, run: Run, config: Pi0Config) -> Source:
    """The one dataset ``--data spec`` names, scanned (the scan kept in ``OUT/data_index``)."""
    specs = parse_data_spec(spec) if isinstance(spec, str) else []
    if len(specs) != 1 or specs[0].weight is not None:
        raise DatasetError(f"--data {spec}: pi0 reads one dataset (no mixtures yet)")
    (one,) = specs
    fmt = one.format or detect_format(one.path)
    if fmt not in FORMATS:
        raise DatasetError(f"--data {spec}: a {fmt} dataset; pi0 reads {', '.join(FORMATS)}")
    user = load_key_configs(run.data_config) if run.data_config else {}
    given = None
    name = Path(one.path).name
    if fmt == "lerobot" and name not in user and name not in BUILTIN:
        given = lerobot_cameras(one.path, config.num_cameras)
    spec_one = DataSpec(one.path, fmt, config=given)
    return open_source(spec_one, user_configs=user, cache_dir=Path(run.out) / "data_index")


def robot_dataset(spec: str, run: Run) -> IndexedSamples:
    """``--data spec`` for pi0 (module doc): samples with their index and epoch (``visit``), and the
    statistics they are normalised by."""
    config: Pi0Config = run.model_config
    source = open_source_for(spec, run, config)
    data = RobotSamples(source, config)
    entry = next(iter(source.statistics.values()))
    folder = read_statistics(run.checkpoint) if run.checkpoint else None
    if folder is not None:
        entry = folder_statistics(folder, entry, config, run.checkpoint)
    return IndexedSamples(data, statistics={source.name: entry})


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
