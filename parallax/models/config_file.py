"""What configs do alike: a family's presets and a checkpoint's config.json (a mixin, so that a
family's config keeps only what is its own: how a config.json dict becomes the config,
``from_dict``, and back, ``to_dict``), and the check that a width splits into its heads.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="ConfigFile")


class ConfigFile:
    """Presets by name and checkpoint directories, for a config class that defines
    ``from_dict(d, source)``. The family's module sets ``PRESETS`` (name -> config, shared
    between runs: :meth:`preset` hands out a copy) once its presets are built; ``PRESET_KIND``
    names the family in the error for an unknown name."""

    PRESETS: ClassVar[Mapping[str, Any]] = {}
    PRESET_KIND: ClassVar[str] = "model"

    @classmethod
    def preset(cls: type[C], name: str) -> C:
        if name not in cls.PRESETS:
            raise ValueError(
                f"unknown {cls.PRESET_KIND} preset {name!r}; choose one of {sorted(cls.PRESETS)}"
            )
        return copy.deepcopy(cls.PRESETS[name])

    @classmethod
    def from_pretrained(cls: type[C], path: str | Path) -> C:
        """The config of a checkpoint directory, read from its config.json."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        return cls.from_dict(json.loads(file.read_text()), source=str(path))

    @classmethod
    def from_dict(cls: type[C], d: dict, source: str | None = None) -> C:
        """The config a config.json dict describes (``source``: where it was read)."""
        raise NotImplementedError


def check_divisible(config: Any, field: str, by: str) -> None:
    """A ``ValueError`` naming both fields of ``config`` unless ``by`` divides ``field`` (a
    width split into attention heads)."""
    value, divisor = getattr(config, field), getattr(config, by)
    if value % divisor:
        name = type(config).__name__
        raise ValueError(f"{name}: {field} {value} is not divisible by {by} {divisor}")
