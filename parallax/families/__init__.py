"""Model families, one package each: OpenVLA, LLaVA-NeXT, SigLIP/CLIP dual encoders.

A family package holds everything about its models: config and presets, the model, the
checkpoint layout (read and write), tokenizer and processor, objectives, FLOPs, the recipe the
one Trainer runs, and the code that turns samples into microbatches. Nothing here imports a
family: the registry (:mod:`parallax.recipe.registry`) imports one when a run asks for it, and
a family package's ``__init__`` imports none of its modules until a name is asked for
(:func:`lazy_exports`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, tuple[str, ...]]
) -> tuple[Callable, Callable, list[str]]:
    """A family package's ``__getattr__``, ``__dir__`` and ``__all__``: ``exports`` maps each
    module of the package to the public names it defines, imported when one of them is first
    asked for. So importing a family's options (for ``--help``) imports no model code."""
    where = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def dir_() -> list[str]:
        return sorted(where)

    return getattr_, dir_, sorted(where)
