"""How a training option is declared, once: ``opt()`` on a dataclass field gives its flag,
TOML key, default, help text, ``--help`` group and checks.

Everything that shows or reads an option is derived from these declarations: the command line
and the flag reference (:mod:`parallax.run.command_line`), ``--config`` TOML files
(:mod:`parallax.run.values`) and the checks of a value (:func:`problems`). A new option is one
field; nothing else needs to know it. The core options are :class:`~parallax.run.TrainConfig`'s;
a family declares its own in its package (a dataclass of ``opt()`` fields, in a group named
after the family), and the registry adds them to the command line, TOML files and the
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Check = Callable[[Any], "str | None"]  # the problem with a set value, in words, or None

# the core --help groups, in the order --help and the reference show them (a family's own
# groups come after them)
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
    # it changes the model's parameters (their set, shapes or dtype): the planner's per-block
    # counts are keyed on such options (parallax.plan.blocks)
    params: bool = False


def opt(default: Any, help: str, group: str, **declared: Any) -> Any:
    """A dataclass field declared as an option (see :class:`Option`); ``check`` is one check,
    ``checks`` several. ``group``: one of :data:`GROUPS`, or a family's own."""
    if "check" in declared:
        declared["checks"] = (declared.pop("check"),)
    if not group:
        raise ValueError("an option needs a --help group")
    return field(default=default, metadata={"option": Option(help, group, **declared)})


def options(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every declared option of dataclass ``cls``, in declaration order."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def as_given(name: str, value: Any) -> str:
    """An option as a command line gives it: ``--film``, ``--no-overlap``, ``--tp 2``."""
    if value is False:
        return "--no-" + flag(name)[2:]
    return flag(name) if value is True else f"{flag(name)} {value}"


def shared(cls: type, name: str, **changes: Any) -> Any:
    """Option ``name`` of dataclass ``cls`` declared again for another command (the planner's
    ``--gpu-memory`` is the trainer's), with its checks; ``changes`` replace parts of the
    declaration (``default``, ``help``, ``group``, ``needs``...)."""
    found = {f.name: (f, o) for f, o in options(cls)}
    if name not in found:
        raise ValueError(f"{cls.__name__} declares no option {flag(name)}")
    f, o = found[name]
    default = changes.pop("default", f.default)
    return field(default=default, metadata={"option": dataclasses.replace(o, **changes)})


# -- checks ------------------------------------------------------------------------------------
def number(v: float) -> str:
    """A number as a message shows it: an integer in full, a float short (``1e+09``)."""
    return str(v) if isinstance(v, int) else f"{v:g}"


def at_least(low: float, meaning: str = "") -> Check:
    def check(v: Any) -> str | None:
        return None if v >= low else f"must be >= {number(low)}{meaning}, got {number(v)}"

    return check


ONE = at_least(1)  # the most common check: a count of at least one


def at_most(high: float, meaning: str = "") -> Check:
    """A bound a real value stays under (``meaning``: why, in words)."""

    def check(v: Any) -> str | None:
        return None if v <= high else f"must be <= {number(high)}{meaning}, got {number(v)}"

    return check


def positive(v: Any) -> str | None:
    return None if v > 0 else f"must be positive, got {number(v)}"


def within(low: float, high: float, closed: str = "[]", meaning: str = "") -> Check:
    """A value in ``[low, high]`` (``closed`` says which ends are in: ``"[]"``, ``"(]"``...);
    ``meaning`` follows the interval in the message (what the bounds stand for)."""

    def check(v: Any) -> str | None:
        ok_low = v >= low if closed[0] == "[" else v > low
        ok_high = v <= high if closed[1] == "]" else v < high
        interval = f"{closed[0]}{number(low)}, {number(high)}{closed[1]}"
        return None if ok_low and ok_high else f"must be in {interval}{meaning}, got {number(v)}"

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


def needs_problems(cfg: Any, core: Any = None) -> list[str]:
    """Options set away from their default whose ``needs`` are not met; an option ``cfg`` does
    not hold is looked up in ``core`` (a family's option that needs a core one)."""
    found = []
    for f, o in options(type(cfg)):
        value = getattr(cfg, f.name)
        if o.needs is None or value == f.default or value is None:
            continue
        other, want, *why = o.needs
        have = getattr(cfg, other) if hasattr(cfg, other) else getattr(core, other)
        if bool(have) if want is True else have == want:
            continue
        wanted = "" if want is True else f" {want}"
        reason = f" ({why[0]})" if why else ""
        found.append(f"{as_given(f.name, value)} needs {flag(other)}{wanted}{reason}")
    return found
