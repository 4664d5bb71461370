"""The one place that names model families: ``--model`` -> the recipe that builds it.

A family is registered as ``"name": "module:Class"`` and imported only when asked for, so a run
of one family never imports another's code (or its optional dependencies). ``--model`` is a
preset of some family, a checkpoint directory whose ``config.json`` one family reads, or
``family:spec`` to pick the family explicitly (``openvla:path/to/ckpt``). A user's own family is
added with :func:`register`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from parallax.recipe.protocol import ModelSpec, Recipe

FAMILIES: dict[str, str] = {
    "openvla": "parallax.families.openvla.recipe:OpenVLARecipe",
    "llava": "parallax.families.llava_next.recipe:LlavaRecipe",
    "siglip": "parallax.families.siglip.recipe:SiglipRecipe",
}
FIRST = "openvla"  # the family checkpoints written before recipes belong to
_LOADED: dict[str, Recipe] = {}


def register(name: str, recipe: Recipe | str) -> None:
    """Add (or replace) family ``name``: a recipe object or its ``"module:Class"`` path."""
    if isinstance(recipe, str):
        FAMILIES[name] = recipe
        _LOADED.pop(name, None)
    else:
        FAMILIES[name] = f"<object {type(recipe).__name__}>"
        _LOADED[name] = recipe


def recipe(name: str) -> Recipe:
    """The recipe of family ``name``."""
    if name not in _LOADED:
        if name not in FAMILIES:
            raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
        module, cls = FAMILIES[name].split(":")
        _LOADED[name] = getattr(importlib.import_module(module), cls)()
    return _LOADED[name]


def families() -> list[Recipe]:
    return [recipe(name) for name in FAMILIES]


def presets() -> dict[str, str]:
    """Every preset name -> its family."""
    return {p: r.name for r in families() for p in r.presets()}


def _config_json(path: Path) -> dict | None:
    file = path / "config.json"
    if not (path.is_dir() and file.is_file()):
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--model {path}: cannot read {file}: {err}") from err


def find(spec: str) -> Recipe:
    """The family of ``--model spec`` (see the module docstring); a ``ValueError`` that lists
    what would work otherwise."""
    family, sep, rest = spec.partition(":")
    if sep and family in FAMILIES and rest:
        return recipe(family)
    for r in families():
        if spec in r.presets():
            return r
    config = _config_json(Path(spec))
    if config is not None:
        for r in families():
            if r.reads_checkpoint(config):
                return r
        kind = config.get("model_type", "unknown")
        raise ValueError(
            f"--model {spec}: no model family reads a checkpoint of model_type {kind!r} "
            f"(families: {', '.join(sorted(FAMILIES))})"
        )
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(sorted(presets()))}) nor a "
        "checkpoint directory with a config.json"
    )


def resolve(spec: str) -> tuple[Recipe, ModelSpec]:
    """``--model spec`` -> (its recipe, the resolved model)."""
    r = find(spec)
    family, sep, rest = spec.partition(":")
    if sep and family == r.name and rest:
        spec = rest
    return r, r.resolve(spec)
