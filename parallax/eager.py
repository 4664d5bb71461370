"""Functions kept out of ``torch.compile`` graphs, without importing the compiler until a
compile needs it.

``torch.compiler.disable`` imports torch's compiler (about a second of every process's start,
most of what importing parallax costs). :func:`eager` wraps a function so that it runs as it is
until :func:`arm` (called by :func:`parallax.models.compile.compile_modules` before it compiles
anything) swaps in its disabled twin: calls traced after that run eagerly, outside the graph,
as if the function had been decorated with ``torch.compiler.disable``. Code that compiles
parallax modules itself (``module.compile()``, ``torch.compile``) calls :func:`arm` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_BOXES: list[list[Callable[..., Any]]] = []  # [the function, what calls run] per wrapper


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, disabled for the compiler once :func:`arm` ran (see the module docstring)."""
    box = [fn, fn]
    _BOXES.append(box)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return box[1](*args, **kwargs)

    return call


def arm() -> None:
    """Every :func:`eager` function from now on disabled for the compiler (idempotent)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:  # (a torch without torch.compiler: nothing compiles these)
        return
    for box in _BOXES:
        if box[1] is box[0]:
            box[1] = disable(box[0])
