"""The one place that names model families: ``--model`` -> the recipe that builds it.

A family is declared as a :class:`Family`: where its recipe lives (``"module:Class"``), the
preset names it takes and where its own options are declared. The recipe is imported only when
a run asks for that family, so a run of one family never imports another's code (or its
optional dependencies); ``--help`` imports the families' option declarations alone.
``--model`` is a preset of some family, a checkpoint directory whose ``config.json`` one family
reads, or ``family:spec`` to pick the family explicitly (``openvla:path/to/ckpt``). A user's
own family is added with :func:`register`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.recipe.base import Recipe, missing_methods
from parallax.recipe.model_side import ModelSpec


@dataclass(frozen=True)
class Family:
    """Where a family's recipe lives, the presets it takes (kept equal to the recipe's own
    ``presets()`` by a test, so listing them imports nothing) and its own options' dataclass
    (``"module:Class"``, a module that imports no model code), if it has any."""

    recipe: str  # "module:Class"
    presets: tuple[str, ...] = ()
    options: str | None = None


FAMILIES: dict[str, Family] = {
    "openvla": Family(
        "parallax.families.openvla.recipe:OpenVLARecipe",
        ("tiny", "small", "openvla-7b"),
        "parallax.families.openvla.oft.options:OFTOptions",
    ),
    "llava": Family(
        "parallax.families.llava_next.recipe:LlavaRecipe", ("llava-tiny", "llava-v1.6-vicuna-7b")
    ),
    "pi0": Family(
        "parallax.families.pi0.recipe:Pi0Recipe",
        ("pi0", "pi05", "pi0-tiny", "pi05-tiny"),
        "parallax.families.pi0.options:Pi0Options",
    ),
    "siglip": Family(
        "parallax.families.siglip.recipe:SiglipRecipe",
        (
            "siglip-tiny",
            "siglip-base-patch16-224",
            "siglip-large-patch16-256",
            "clip-tiny",
            "clip-vit-large-patch14",
        ),
    ),
}
FIRST = "openvla"  # the family checkpoints written before recipes belong to
_LOADED: dict[str, Recipe] = {}
_OPTIONS: dict[str, type | None] = {}


def register(
    name: str,
    recipe: Recipe | str,
    presets: tuple[str, ...] | None = None,
    options: str | None = None,
) -> None:
    """Add (or replace) family ``name``: a recipe object, or its ``"module:Class"`` path with
    the presets it takes and its options' ``"module:Class"`` (imported when first asked for).

    A preset names one family: one that another family takes already is refused. Otherwise a
    subclass of a built-in recipe, which inherits its presets, would silently become what
    ``--model tiny`` means for the rest of the process. Register such a family with presets of
    its own (``presets=()`` for none) and run it as ``--model NAME:PRESET``."""
    if isinstance(recipe, str):
        listed = tuple(presets or ())
        _check_presets(name, listed)
        FAMILIES[name] = Family(recipe, listed, options)
        _LOADED.pop(name, None)
    else:
        missing = missing_methods(recipe)
        if missing:
            raise TypeError(
                f"family {name!r}: {type(recipe).__name__} does not define "
                f"{', '.join(missing)} (what a {recipe.objective.kind!r} recipe must say)"
            )
        listed = tuple(presets if presets is not None else recipe.presets())
        _check_presets(name, listed)
        FAMILIES[name] = Family(f"<object {type(recipe).__name__}>", listed)
        _LOADED[name] = recipe
    _OPTIONS.pop(name, None)


def _check_presets(name: str, listed: tuple[str, ...]) -> None:
    """Refuse presets of ``name`` that another family takes (see :func:`register`)."""
    taken = {p: f for f, fam in FAMILIES.items() if f != name for p in fam.presets}
    clashes = [p for p in listed if p in taken]
    if clashes:
        first = clashes[0]
        raise ValueError(
            f"family {name!r}: preset {first!r} is family {taken[first]!r}'s already "
            f"({len(clashes)} of its {len(listed)} presets are taken: {', '.join(clashes)}); "
            f"register {name!r} with presets of its own (presets=() for none) and run it as "
            f"--model {name}:{first}"
        )


def recipe(name: str) -> Recipe:
    """The recipe of family ``name`` (importing its package on first use)."""
    if name not in _LOADED:
        if name not in FAMILIES:
            raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
        _LOADED[name] = _load(FAMILIES[name].recipe)()
    return _LOADED[name]


def _load(path: str) -> Any:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def options_of(name: str) -> type | None:
    """Family ``name``'s own options (their dataclass), or None; its recipe is not imported
    when the declaration names the options' module."""
    if name not in _OPTIONS:
        fam = FAMILIES[name]
        if fam.options is not None:
            _OPTIONS[name] = _load(fam.options)
        else:
            _OPTIONS[name] = recipe(name).options if name in _LOADED else None
    return _OPTIONS[name]


def option_classes() -> dict[str, type]:
    """Every family's own options, by family (what ``--help``, TOML files and the reference
    show beside the core options)."""
    found = {name: options_of(name) for name in FAMILIES}
    return {name: cls for name, cls in found.items() if cls is not None}


def owner_of(option: str) -> str | None:
    """The family that declares ``option`` (a field name), if one does."""
    for name, cls in option_classes().items():
        if option in {f.name for f in dataclasses.fields(cls)}:
            return name
    return None


def families() -> list[Recipe]:
    """Every family's recipe (imports them all: for a checkpoint whose family is unknown)."""
    return [recipe(name) for name in FAMILIES]


def presets() -> dict[str, str]:
    """Every preset name -> its family, from the declarations (no import)."""
    return {p: name for name, fam in FAMILIES.items() for p in fam.presets}


def preset_names() -> list[str]:
    """The presets ``--model`` takes, sorted."""
    return sorted(presets())


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
    by_preset = presets()
    if spec in by_preset:
        return recipe(by_preset[spec])
    config = _config_json(Path(spec))
    if config is not None:
        for r in families():
            if r.model.reads_checkpoint(config):
                return r
        kind = config.get("model_type", "unknown")
        raise ValueError(
            f"--model {spec}: no model family reads a checkpoint of model_type {kind!r} "
            f"(families: {', '.join(sorted(FAMILIES))})"
        )
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(preset_names())}) nor a "
        "checkpoint directory with a config.json"
    )


def strip_family(spec: str, r: Recipe) -> str:
    """``--model`` without an explicit ``FAMILY:`` prefix naming ``r``'s family."""
    family, sep, rest = spec.partition(":")
    return rest if sep and family == r.name and rest else spec


def resolve(spec: str) -> tuple[Recipe, ModelSpec]:
    """``--model spec`` -> (its recipe, the resolved model)."""
    r = find(spec)
    return r, r.model.resolve(strip_family(spec, r))
