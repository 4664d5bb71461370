"""How a training option is declared, once: ``opt()`` on a ``TrainConfig`` field gives its flag,
TOML key, default, help text, ``--help`` group and checks.

Everything that shows or reads an option is derived from these declarations: the command line
(:func:`parser`), ``--config`` TOML files (:mod:`parallax.train.values`), the checks of a value
(:func:`problems`), and the flag reference in ``docs/training.md`` (:func:`markdown`, kept
current by a test). A new option is one field; nothing else needs to know it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Check = Callable[[Any], "str | None"]  # the problem with a set value, in words, or None

# the --help groups, in the order --help and the reference show them
GROUPS = (
    "layout",
    "model and data",
    "LoRA",
    "actions",
    "schedule",
    "optimisation",
    "memory",
    "speed (same results either way)",
    "run",
    "evaluation",
)


@dataclass(frozen=True)
class Option:
    """One option's declaration (see the module docstring)."""

    help: str
    group: str
    choices: tuple[str, ...] | None = None
    checks: tuple[Check, ...] = ()
    switch: str | None = None  # "on": a bare --flag sets True; "both": --flag / --no-flag
    spellings: tuple[str, ...] = ()  # more names of the flag (--no-overlap)
    inverted: bool = False  # the spellings set False (--no-overlap: overlap_grad_reduce=False)
    metavar: str | None = None
    default_text: str | None = None  # the default in words, when it is None or derived
    table: bool = False  # also a TOML table (or [[data]] list) in --config
    hidden: bool = False  # kept for --config files and scripts, not shown by --help
    # (option, value[, why]): set away from its default, this option needs that one at that
    # value (True: on), e.g. --chunks needs --schedule interleaved
    needs: tuple | None = None


def opt(default: Any, help: str, group: str, **declared: Any) -> Any:
    """A dataclass field declared as an option (see :class:`Option`); ``check`` is one check,
    ``checks`` several."""
    if "check" in declared:
        declared["checks"] = (declared.pop("check"),)
    if group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}")
    return field(default=default, metadata={"option": Option(help, group, **declared)})


def options(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every declared option of dataclass ``cls``, in declaration order."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- checks ------------------------------------------------------------------------------------
def at_least(low: float, meaning: str = "") -> Check:
    def check(v: Any) -> str | None:
        return None if v >= low else f"must be >= {low:g}{meaning}, got {v:g}"

    return check


ONE = at_least(1)  # the most common check: a count of at least one


def positive(v: Any) -> str | None:
    return None if v > 0 else f"must be positive, got {v:g}"


def within(low: float, high: float, closed: str = "[]") -> Check:
    """A value in ``[low, high]`` (``closed`` says which ends are in: ``"[]"``, ``"(]"``...)."""

    def check(v: Any) -> str | None:
        ok_low = v >= low if closed[0] == "[" else v > low
        ok_high = v <= high if closed[1] == "]" else v < high
        interval = f"{closed[0]}{low:g}, {high:g}{closed[1]}"
        return None if ok_low and ok_high else f"must be in {interval}, got {v:g}"

    return check


def problems(cfg: Any) -> list[str]:
    """Every declared check that fails on ``cfg``'s set (not ``None``) values."""
    found = []
    for f, o in options(type(cfg)):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        for check in o.checks:
            problem = check(value)
            if problem:
                found.append(f"{flag(f.name)} {problem}")
    return found


def needs_problems(cfg: Any) -> list[str]:
    """Options set away from their default whose ``needs`` are not met."""
    found = []
    for f, o in options(type(cfg)):
        value = getattr(cfg, f.name)
        if o.needs is None or value == f.default or value is None:
            continue
        other, want, *why = o.needs
        have = getattr(cfg, other)
        if bool(have) if want is True else have == want:
            continue
        shown = "" if isinstance(value, bool) else f" {value}"
        name = flag(f.name) if value is not False else "--no-" + flag(f.name)[2:]
        wanted = "" if want is True else f" {want}"
        reason = f" ({why[0]})" if why else ""
        found.append(f"{name}{shown} needs {flag(other)}{wanted}{reason}")
    return found


# -- the command line --------------------------------------------------------------------------
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


def _add(group: argparse._ArgumentGroup, f: dataclasses.Field, o: Option) -> None:
    help = f"{o.help} (default {default_words(f, o)})".replace("%", "%%")
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


def parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of dataclass ``cls``'s options: every value arrives as text (or a
    switch's bool), to be checked against the field by :mod:`parallax.train.values`."""
    p = _Parser(prog=prog, description=description)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in GROUPS:
        groups[name] = p.add_argument_group(name)
    for f, o in options(cls):
        if o.hidden:
            continue
        target = p if f.name == "config" else groups[o.group]
        _add(target, f, o)
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


# -- the reference -----------------------------------------------------------------------------
def markdown(cls: type) -> str:
    """The flag reference of ``docs/training.md``: a table per group."""
    lines: list[str] = []
    by_group: dict[str, list] = {g: [] for g in GROUPS}
    for f, o in options(cls):
        if not o.hidden:
            by_group[o.group].append((f, o))
    for group, rows in by_group.items():
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
            text = o.help.replace("|", "\\|")
            lines.append(f"| {shown} | {default_words(f, o)} | {text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
