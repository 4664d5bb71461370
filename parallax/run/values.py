"""One flag value checked against the type its option's field declares.

The field annotations are the one source of truth, so a new flag is checked without more code:
``int``, ``float`` (an int is fine), ``bool``, ``str`` (some with a fixed set of choices), each
perhaps ``| None``. A command-line value is text and is parsed; a TOML value already has a type,
which must be the field's (TOML's ``"100"`` is a string, ``1.5`` is not an integer, ``"yes"`` is
not a boolean). Every mismatch is one ``ValueError`` naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from parallax import tomlfile
from parallax.atomic import folder_problems

KINDS = (int, float, bool, str)
Kind = tuple[type, bool]  # (int | float | bool | str, whether None is allowed)


def _hints(cls: type) -> dict[str, Any]:
    """The evaluated annotations of ``cls`` and its bases; a class whose annotations name what
    only type checkers import (:class:`~parallax.run.Run`'s recipe) adds none of its own."""
    hints: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if "__annotations__" not in base.__dict__:
            continue
        try:
            hints.update(typing.get_type_hints(base))
        except NameError:
            continue
    return hints


def field_kinds(cls: type) -> dict[str, Kind]:
    """``{field: (type, optional)}`` for every field of dataclass ``cls`` of a simple type."""
    hints = _hints(cls)
    kinds = {}
    for f in dataclasses.fields(cls):
        if f.name not in hints:
            continue
        hint = hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        args = typing.get_args(hint) if union else (hint,)
        base = [a for a in args if a is not type(None)]
        if len(base) == 1 and base[0] in KINDS:
            kinds[f.name] = (base[0], type(None) in args)
    return kinds


def allowed(kind: Kind, choices: Sequence[str] | None = None) -> str:
    """What a field takes, in words: ``an integer``, ``one of gpipe, 1f1b, interleaved``..."""
    base, _ = kind
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[base]
    if choices:
        words = "one of " + ", ".join(choices)
    return words


def show(value: Any) -> str:
    """A value as TOML writes it (``"100"``, ``1.5``, ``true``)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _parse(text: str, base: type) -> Any:
    """Command-line text as ``base``; ``ValueError`` when it is not one."""
    if base is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(text)
    return base(text)


def _typed(value: Any, base: type) -> Any:
    """A typed value (TOML, Python) as ``base``; ``TypeError`` when it is not one."""
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not base:  # bool is an int to Python, not to a flag
        raise TypeError(type(value).__name__)
    return value


def convert(
    label: str, value: Any, kind: Kind, choices: Sequence[str] | None = None, *, text: bool
) -> Any:
    """``value`` as the field's type (parsed first when ``text``), or a ``ValueError`` that
    starts with ``label`` (how the user wrote the key and value) and says what is allowed."""
    base, optional = kind
    if value is None and optional:
        return None
    expected = f"{label}: expected {allowed(kind, choices)}"
    unset = " (or leave it out)" if optional else ""
    try:
        out = _parse(value, base) if text and isinstance(value, str) else _typed(value, base)
    except (TypeError, ValueError):
        hint = ""
        if not text and isinstance(value, str):  # "100" in a TOML file: a quoted number
            try:
                hint = f", not a string (write it without quotes: {show(_parse(value, base))})"
            except ValueError:
                hint = ", not a string"
        raise ValueError(expected + hint + unset) from None
    if base is float and not math.isfinite(out):
        raise ValueError(f"{label}: expected a finite number")
    if choices and out not in choices:
        raise ValueError(expected + unset)
    return out


def read_toml(
    path: str,
    kinds: Mapping[str, Kind],
    choices: Mapping[str, Sequence[str]],
    tables: Sequence[str] = (),
) -> dict:
    """``{field: value}`` of a TOML file of flag values; names the file in every error.
    ``tables`` are fields that also take a TOML table or array (their own parser checks it)."""
    data = read_toml_file(Path(path), "--config")
    values = {k.replace("-", "_"): v for k, v in data.items()}
    tabled: dict[str, Any] = {}
    known = set(kinds) | set(tables)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; known keys: {sorted(known)}")
    for key in tables:
        value = values.pop(key, None)
        if value is not None and not isinstance(value, str | dict | list):
            raise ValueError(
                f"--config {path}: {key} = {show(value)}: expected a string or a table"
            )
        if value is not None:
            tabled[key] = value
    return tabled | {
        key: convert(
            f"--config {path}: {key} = {show(value)}",
            value,
            kinds[key],
            choices.get(key),
            text=False,
        )
        for key, value in values.items()
    }


def out_problems(out: str) -> list[str]:
    """Why ``--out`` cannot hold a run, if it cannot: checked before any process group, on a
    file system every rank shares (checkpoints are written there by several ranks)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        return [
            f"--out {out} is a file, not a directory (it would hold metrics.jsonl and "
            "checkpoints/): pass a directory"
        ]
    return folder_problems(f"--out {out}", path)


def read_toml_file(path: Path, what: str) -> dict[str, Any]:
    """A TOML file's contents; a ``ValueError`` that starts with ``what`` (the flag) otherwise."""
    return tomlfile.read_toml(path, f"{what} {path}")


def load_toml_table(path: Path, what: str) -> dict[str, Any]:
    """A TOML file given to ``what`` as a table: its ``[lr_groups]``-style table named after
    the flag if present, else the whole file."""
    data = read_toml_file(path, what)
    key = what.lstrip("-").replace("-", "_")
    table = data.get(key, data)
    if not isinstance(table, dict):
        raise ValueError(f"{what} {path}: expected a table of glob = value")
    return table
