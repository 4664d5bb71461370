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


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """A family package's ``__getattr__`` and ``__dir__``: ``exports`` maps each public name to
    the module of the package that defines it, imported when the name is first asked for. So
    importing a family's options (for ``--help``) imports no model code."""

    def getattr_(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
