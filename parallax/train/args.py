"""The command line and ``--config`` files -> one checked :class:`TrainConfig`.

Defaults, then the TOML file, then the flags given on the command line; each value is checked
against its field as it arrives (:mod:`parallax.train.values`), then the whole config once
(``TrainConfig.check``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from parallax.train.config import TrainConfig
from parallax.train.options import flag, joined_negatives, options, parser
from parallax.train.values import convert, field_kinds, read_toml

KINDS = field_kinds(TrainConfig)
CHOICES = {f.name: o.choices for f, o in options(TrainConfig) if o.choices}
TABLES = tuple(f.name for f, o in options(TrainConfig) if o.table)
DESCRIPTION = (
    "Train a model of any registered family (by default a tiny vision-language-action model on "
    "a built-in synthetic robot task) in any dp x tp x pp layout. Launch with torchrun; flags "
    "override --config (TOML)."
)


def train_parser() -> argparse.ArgumentParser:
    """``parallax.train``'s command line, built from the option declarations."""
    return parser(TrainConfig, "parallax.train", DESCRIPTION)


def load_toml(path: str) -> dict[str, Any]:
    """The flag values of a TOML file (keys as flags, ``-`` or ``_``), each type-checked."""
    kinds = {k: v for k, v in KINDS.items() if k != "config"}
    return read_toml(path, kinds, CHOICES, tables=TABLES)


def _flag_value(key: str, value: Any) -> Any:
    """A command-line value (text, or a switch's bool: always valid) as its field's type."""
    if key in TABLES:
        return value  # text; its own parser checks it (parallax.train.groups, data specs)
    return convert(f"{flag(key)} {value}", value, KINDS[key], CHOICES.get(key), text=True)


def _takes_value() -> set[str]:
    return {
        flag(f.name)
        for f, o in options(TrainConfig)
        if o.switch is None and not o.inverted and not o.hidden
    }


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given on the command line; checked once."""
    argv = sys.argv[1:] if argv is None else argv
    args = train_parser().parse_args(joined_negatives(argv, _takes_value()))
    values: dict[str, Any] = {}
    if args.config:
        values.update(load_toml(args.config))
        values["config"] = args.config
    for key, value in vars(args).items():
        if value is not None and key != "config":
            values[key] = _flag_value(key, value)
    if values.get("layout") == "auto":  # the planner keeps what was given
        values["layout_given"] = ",".join(sorted(k for k in values if k != "config"))
    cfg = TrainConfig(**values)
    cfg.check()
    return cfg
