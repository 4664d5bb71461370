"""``--data`` specs: one dataset or a weighted mixture, each a format and a path.

A spec is a comma-separated list of ``[FORMAT:]PATH[@WEIGHT]``, ``FORMAT`` one of ``rlds``,
``lerobot``, ``libero``, ``parallax`` (parallax's episode format), or left out to detect it
from the directory; ``synthetic`` is the built-in task. For example
``rlds:/data/bridge_orig@0.7,lerobot:/data/so100_pick@0.3``. Weights are sampling
probabilities (normalised to sum 1); with none given, each dataset is drawn in proportion to
its number of transitions (as if they were concatenated). The TOML form is a list::

    [[data]]
    path = "rlds:/data/bridge_orig"
    weight = 0.7
    [[data]]
    path = "/data/so100_pick"          # format detected
    weight = 0.3
    config = { primary = "observation.images.top", unnormalized = [5] }   # or a name

Each dataset keeps its own action statistics, keyed by its name (unique across the mixture).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallax.data.chunks import chunk_lengths
from parallax.data.episodes import EpisodeDataset
from parallax.data.indexed import IndexedSource
from parallax.data.keys import BUILTIN, FORMATS, KeyConfig, config_from_mapping
from parallax.data.lerobot import LeRobotSource
from parallax.data.libero import LiberoSource
from parallax.data.rlds import RLDSSource, find_rlds_dir
from parallax.data.source import Source
from parallax.data.stats import DatasetError, merge_statistics
from parallax.data.synthetic import SyntheticTask


@dataclass(frozen=True)
class DataSpec:
    """One dataset of a ``--data`` spec."""

    path: str
    format: str | None = None  # None: detect
    weight: float | None = None
    config: KeyConfig | None = None
    name: str | None = None


def _split_weight(item: str) -> tuple[str, float | None]:
    head, sep, tail = item.rpartition("@")
    if not sep:
        return item, None
    try:
        weight = float(tail)
    except ValueError:
        if "/" in tail or Path(item.partition(":")[2] or item).exists() or Path(item).exists():
            return item, None  # an '@' that is part of the path
        raise DatasetError(
            f"--data {item!r}: the weight {tail!r} after '@' is not a number (write PATH@0.3; "
            "a path that holds '@' must exist)"
        ) from None
    if not weight >= 0:
        raise DatasetError(f"--data {item!r}: a weight must be a number >= 0, got {tail!r}")
    return head, weight


def parse_data_spec(spec: str) -> list[DataSpec]:
    """``"rlds:A@0.7,lerobot:B@0.3"`` -> two :class:`DataSpec` (see the module doc)."""
    out = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise DatasetError(f"--data {spec!r}: an empty entry between commas")
        item, weight = _split_weight(item)
        fmt, sep, path = item.partition(":")
        if not sep or fmt not in FORMATS:  # no known prefix: the whole item is the path
            fmt, path = None, item
        out.append(DataSpec(path=path, format=fmt, weight=weight))
    return out


def specs_from_toml(entries: list[dict[str, Any]], where: str = "[[data]]") -> list[DataSpec]:
    """The ``[[data]]`` list of a TOML config -> :class:`DataSpec` list."""
    out = []
    for i, entry in enumerate(entries):
        unknown = sorted(set(entry) - {"path", "weight", "config", "name", "format"})
        if unknown or "path" not in entry:
            raise DatasetError(f"{where} entry {i}: needs 'path'; unknown keys {unknown}")
        (spec,) = parse_data_spec(str(entry["path"]))
        config = entry.get("config")
        if isinstance(config, str):
            if config not in BUILTIN:
                raise DatasetError(f"{where} entry {i}: no built-in config {config!r}")
            config = BUILTIN[config]
        elif isinstance(config, dict):
            config = config_from_mapping(config, f"{where} entry {i}")
        weight = entry.get("weight", spec.weight)
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)):
            raise DatasetError(f"{where} entry {i}: the weight {weight!r} is not a number")
        out.append(
            DataSpec(
                path=spec.path,
                format=entry.get("format", spec.format),
                weight=None if weight is None else float(weight),
                config=config,
                name=entry.get("name"),
            )
        )
    return out


def detect_format(path: str | Path) -> str:
    """Which reader a directory needs (``rlds``, ``lerobot``, ``libero`` or ``parallax``)."""

    path = Path(path)
    if (path / "index.json").is_file():
        try:
            if json.loads((path / "index.json").read_text()).get("format") == "parallax-episodes":
                return "parallax"
        except (OSError, ValueError, AttributeError):
            pass
    if (path / "meta" / "info.json").is_file():
        return "lerobot"
    if path.suffix in (".hdf5", ".h5") or any(path.glob("*.hdf5")) or any(path.glob("*/*.hdf5")):
        return "libero"
    try:
        find_rlds_dir(path)
        return "rlds"
    except DatasetError:
        pass
    what = "does not exist" if not path.exists() else "is not a dataset this reader knows"
    raise DatasetError(
        f"{path} {what}: expected an RLDS directory (features.json + .tfrecord shards, or its "
        "parent), a LeRobot directory (meta/info.json), LIBERO .hdf5 files, or a parallax "
        "episode directory (index.json); or prefix the path with rlds:, lerobot:, libero:"
    )


def open_source(
    spec: DataSpec | str,
    *,
    user_configs: dict[str, KeyConfig] | None = None,
    seed: int = 0,
    image_size: int | None = None,
    cache_dir: str | Path | None = None,
) -> Source:
    """Open (and scan, or read the scan from ``cache_dir``) one dataset."""

    if isinstance(spec, str):
        (spec,) = parse_data_spec(spec)
    if spec.format is None and spec.path == "synthetic":
        size = {"image_size": image_size} if image_size else {}
        return IndexedSource(SyntheticTask(seed=seed, **size))
    fmt = spec.format or detect_format(spec.path)
    kw = {"config": spec.config, "user_configs": user_configs, "cache_dir": cache_dir}
    if fmt == "rlds":
        source: Source = RLDSSource(spec.path, **kw)
    elif fmt == "libero":
        source = LiberoSource(spec.path, **kw)
    elif fmt == "lerobot":
        source = LeRobotSource(spec.path, **kw)
    else:
        source = IndexedSource(EpisodeDataset(spec.path))
    if spec.name is not None:  # the statistics follow the new name
        source.statistics = {spec.name: next(iter(source.statistics.values()))}
        source.name = spec.name
    return source


@dataclass
class Mixture:
    """Opened datasets and their sampling weights (normalised)."""

    sources: list[Source]
    weights: list[float]

    @property
    def statistics(self) -> dict[str, Any]:
        """``norm_stats`` of every dataset, keyed by name (``dataset_statistics.json``)."""
        return merge_statistics(*(s.statistics for s in self.sources))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]


def load_mixture(
    data: str | list[dict[str, Any]] | list[DataSpec],
    *,
    user_configs: dict[str, KeyConfig] | None = None,
    seed: int = 0,
    image_size: int | None = None,
    cache_dir: str | Path | None = None,
) -> Mixture:
    """Open every dataset of a spec string or ``[[data]]`` list (see the module doc)."""
    if isinstance(data, str):
        specs = parse_data_spec(data)
    elif data and isinstance(data[0], dict):
        specs = specs_from_toml(data)  # type: ignore[arg-type]
    else:
        specs = list(data)  # type: ignore[arg-type]
    if not specs:
        raise DatasetError("no dataset given")
    given = [s.weight is not None for s in specs]
    if any(given) and not all(given):
        raise DatasetError("give every dataset of a mixture a weight (@W), or none of them")
    sources = [
        open_source(
            s, user_configs=user_configs, seed=seed, image_size=image_size, cache_dir=cache_dir
        )
        for s in specs
    ]
    merge_statistics(*(s.statistics for s in sources))  # names must be unique
    raw = [s.weight for s in specs] if all(given) else [s.num_transitions for s in sources]
    weights = np.asarray(raw, dtype=np.float64)
    if weights.sum() <= 0:
        raise DatasetError(f"mixture weights {raw} sum to zero")
    return Mixture(sources, (weights / weights.sum()).tolist())


def sources_and_weights(
    data: Mixture | Source | Sequence[Source], weights: Sequence[float] | None, chunk: int
) -> tuple[list[Source], Sequence[float]]:
    """The datasets a loader reads and their weights (a mixture's, else by default their
    transitions), each checked to give at least one action chunk of ``chunk`` steps."""
    if isinstance(data, Mixture):
        sources, weights = data.sources, weights or data.weights
    else:
        sources = [data] if isinstance(data, Source) else list(data)
    if not sources:
        raise DatasetError("no dataset to load")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    chunk = int(chunk)
    for s in sources:
        if not chunk_lengths(s.lengths, chunk).any():
            raise DatasetError(
                f"dataset {s.name!r}: no episode has {chunk} steps, so none gives an "
                f"action chunk of {chunk} (its longest has {int(s.lengths.max())})"
            )
    weights = weights or [s.num_transitions for s in sources]
    if len(weights) != len(sources):
        raise ValueError(f"{len(weights)} weights for {len(sources)} datasets")
    return sources, weights


def common_image_size(
    image_size: int | tuple[int, int] | None, sources: Sequence[Source]
) -> tuple[int, int] | None:
    """The frames' (height, width); ``None`` (each dataset's own) only where they all agree."""
    size = (image_size, image_size) if isinstance(image_size, int) else image_size
    if size is None:
        shapes = {s.name: s.image_shape for s in sources}
        if len({tuple(v[:2]) for v in shapes.values() if v}) > 1:
            raise DatasetError(f"the datasets' images differ {shapes}: pass an image_size")
    return None if size is None else tuple(size)
