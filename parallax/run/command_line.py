"""The command line, ``--config`` TOML files and the flag reference of a set of option classes.

A run's options are :class:`~parallax.run.TrainConfig`'s and each family's own (a dataclass of
``opt()`` fields in the family's package); the registry hands the family classes over
(:mod:`parallax.recipe.flags`). Values arrive as text (flags) or typed (TOML) and are checked
against their field's type as they arrive (:mod:`parallax.run.values`): defaults, then the TOML
file, then the flags given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from parallax.run.option import GROUPS, Option, flag, options
from parallax.run.values import convert, field_kinds, read_toml

Declared = list[tuple[dataclasses.Field, Option]]


def declared(classes: Sequence[type]) -> Declared:
    """Every option of ``classes``, in their order (a name declared twice is refused: one flag
    means one thing)."""
    out: Declared = []
    seen: dict[str, str] = {}
    for cls in classes:
        for f, o in options(cls):
            if f.name in seen:
                raise ValueError(
                    f"option {flag(f.name)} is declared by {seen[f.name]} and {cls.__name__}"
                )
            seen[f.name] = cls.__name__
            out.append((f, o))
    return out


class _Parser(argparse.ArgumentParser):
    """Raises its errors instead of printing them, so the CLI decides which rank says them."""

    def error(self, message: str):
        raise ValueError(f"{message} (--help lists the flags)")


def default_words(f: dataclasses.Field, o: Option) -> str:
    """The default as the help text and the reference show it."""
    if o.default_text is not None:
        return o.default_text
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if f.default is None:
        return "none"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def help_text(o: Option, words: dict[str, str] | None) -> str:
    """``o``'s help with its ``{name}`` placeholders filled from ``words`` (the presets the
    registry knows, say: the run's layer cannot list them itself)."""
    text = o.help
    for key, value in (words or {}).items():
        text = text.replace("{" + key + "}", value)
    return text


def _add(group: argparse._ArgumentGroup, f: dataclasses.Field, o: Option, words) -> None:
    help = f"{help_text(o, words)} (default {default_words(f, o)})".replace("%", "%%")
    if o.inverted:  # only its spellings, which turn it off (--no-overlap)
        group.add_argument(*o.spellings, dest=f.name, action="store_false", default=None, help=help)
        return
    if o.switch == "both":
        action: Any = argparse.BooleanOptionalAction
        group.add_argument(flag(f.name), dest=f.name, action=action, default=None, help=help)
    elif o.switch == "on":
        group.add_argument(flag(f.name), dest=f.name, action="store_true", default=None, help=help)
    else:
        metavar = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else None)
        group.add_argument(flag(f.name), dest=f.name, metavar=metavar, help=help)
    if o.spellings:  # other names of the same flag, not shown
        group.add_argument(*o.spellings, dest=f.name, help=argparse.SUPPRESS)


def _by_group(options_: Declared) -> dict[str, Declared]:
    """The shown options by ``--help`` group: the core groups first, then the families'."""
    by_group: dict[str, Declared] = {g: [] for g in GROUPS}
    for f, o in options_:
        if not o.hidden:
            by_group.setdefault(o.group, []).append((f, o))
    return by_group


def parser(
    classes: Sequence[type], prog: str, description: str, words: dict[str, str] | None = None
) -> argparse.ArgumentParser:
    """The command line of ``classes``' options: every value arrives as text (or a switch's
    bool), to be checked against its field by :func:`parse`."""
    p = _Parser(prog=prog, description=description)
    for name, rows in _by_group(declared(classes)).items():
        group = p.add_argument_group(name)
        for f, o in rows:
            _add(p if f.name == "config" else group, f, o, words)
    return p


def joined_negatives(argv: Sequence[str], takes_value: set[str]) -> list[str]:
    """``--lr -1e-3`` as ``--lr=-1e-3``: argparse reads a value that starts with ``-`` and is
    not a plain decimal as another flag, and would say the flag lacks its argument."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if a in takes_value and nxt is not None and _is_number(nxt) and nxt.startswith("-"):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse(argv: Sequence[str], classes: Sequence[type], cli: argparse.ArgumentParser) -> dict:
    """``{field: value}`` of the options given: the TOML file of ``--config`` (if any), then
    the flags, each checked against its field's type (nothing else is checked here)."""
    return _parse(argv, classes, cli, known=False)[0]


def parse_known(
    argv: Sequence[str], classes: Sequence[type], cli: argparse.ArgumentParser
) -> tuple[dict, list[str]]:
    """:func:`parse` of the flags ``classes`` declare, and the rest of ``argv`` in its order
    (another command's flags: the planner passes parallax.train's on)."""
    return _parse(argv, classes, cli, known=True)


def _parse(
    argv: Sequence[str], classes: Sequence[type], cli: argparse.ArgumentParser, known: bool
) -> tuple[dict, list[str]]:
    options_ = declared(classes)
    kinds: dict = {}
    for cls in classes:
        kinds.update(field_kinds(cls))
    choices = {f.name: o.choices for f, o in options_ if o.choices}
    tables = tuple(f.name for f, o in options_ if o.table)
    takes = {
        flag(f.name) for f, o in options_ if o.switch is None and not o.inverted and not o.hidden
    }
    argv = joined_negatives(argv, takes)
    args, rest = cli.parse_known_args(argv) if known else (cli.parse_args(argv), [])
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        file_kinds = {k: v for k, v in kinds.items() if k != "config"}
        values.update(read_toml(args.config, file_kinds, choices, tables=tables))
        values["config"] = args.config
    for key, value in vars(args).items():
        if value is None or key == "config":
            continue
        if key in tables:  # text; its own parser checks it (parallax.run.param_groups, data)
            values[key] = value
        else:  # a command-line value (text, or a switch's bool: always valid)
            label = f"{flag(key)} {value}"
            values[key] = convert(label, value, kinds[key], choices.get(key), text=True)
    return values, rest


def markdown(classes: Sequence[type], words: dict[str, str] | None = None) -> str:
    """The flag reference of ``docs/training.md``: a table per group."""
    lines: list[str] = []
    for group, rows in _by_group(declared(classes)).items():
        if not rows:
            continue
        lines += [f"**{group}**", "", "| flag | default | meaning |", "|---|---|---|"]
        for f, o in rows:
            names = ([] if o.inverted else [flag(f.name)]) + list(o.spellings)
            if o.switch == "both":
                names = [f"{flag(f.name)}, --no-{f.name.replace('_', '-')}"]
            shown = ", ".join(f"`{n}`" for n in names)
            if o.choices:
                shown += " " + "/".join(f"`{c}`" for c in o.choices)
            text = help_text(o, words).replace("|", "\\|")
            lines.append(f"| {shown} | {default_words(f, o)} | {text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
