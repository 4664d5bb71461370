"""Optional dependencies of the format readers, imported only when a format is used."""

from __future__ import annotations

import importlib
from types import ModuleType

from parallax.data.stats import DatasetError


class MissingExtra(DatasetError, ImportError):
    """A reader's optional dependency is not installed (the message says which extra)."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or fail with the ``pip install`` line that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(
            f"{what} needs the Python package {module.split('.')[0]!r}: "
            f"pip install -e '.[{extra}]' in the checkout (the extra {extra!r} of parallax-train)"
        ) from None
