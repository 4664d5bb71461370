"""The command line and ``--config`` files of ``parallax.train`` -> one :class:`TrainConfig`:
the core options and every registered family's own (:mod:`parallax.run.command_line` does the
work; the registry says which families declare what, without importing their models).

Nothing is checked beyond each value's type here: the whole config is checked once, when the
run is resolved (:func:`parallax.recipe.resolve`).
"""

from __future__ import annotations

import argparse
import sys

from parallax.recipe import registry
from parallax.run import TrainConfig
from parallax.run import command_line as cl

DESCRIPTION = (
    "Train a model of any registered family (by default a tiny vision-language-action model on "
    "a built-in synthetic robot task) in any dp x tp x pp layout. Launch with torchrun; flags "
    "override --config (TOML)."
)


def option_classes() -> list[type]:
    """The core options and each family's own, in ``--help``'s order (a family registered with
    another's recipe class shares its declarations)."""
    return [TrainConfig, *dict.fromkeys(registry.option_classes().values())]


def words() -> dict[str, str]:
    """What the help texts' placeholders stand for."""
    return {"presets": ", ".join(registry.preset_names())}


def train_parser() -> argparse.ArgumentParser:
    """``parallax.train``'s command line, built from the option declarations."""
    return cl.parser(option_classes(), "parallax.train", DESCRIPTION, words())


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given on the command line (each value
    checked against its field's type); a family's options ride in ``family_values``."""
    argv = sys.argv[1:] if argv is None else argv
    values = cl.parse(argv, option_classes(), train_parser())
    if values.get("layout") == "auto":  # the planner keeps what was given
        values["layout_given"] = ",".join(sorted(k for k in values if k != "config"))
    return TrainConfig.of(**values)


def reference() -> str:
    """Every flag, a table per ``--help`` group, the families' after the core ones."""
    return cl.markdown(option_classes(), words())
