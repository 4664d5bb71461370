"""Reading TOML files (``--config``, ``--data-config``, ``--lr-groups``): Python 3.11's
``tomllib``, or on 3.10 the ``tomli`` package it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the optional tomli package, the same parser
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The file's tables; a ``ValueError`` that starts with ``what`` (the flag and the file)
    when it is missing, unreadable or not TOML."""
    if tomllib is None:
        raise ValueError(f"{what}: reading TOML on Python 3.10 needs `pip install tomli`")
    if not path.is_file():
        raise ValueError(f"{what}: no such file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError) as err:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{what}: not a valid TOML file: {err}") from None
