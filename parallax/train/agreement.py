"""What every rank must agree on before a collective that depends on it: a user error on any
rank becomes the same :class:`UserError` on all of them (one message, rank 0's; exit status 2),
so no rank walks into a collective its peers never reach."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from parallax import comm
from parallax.checkpoint import CheckpointError
from parallax.context import ParallelContext
from parallax.data import DatasetError

T = TypeVar("T")

USER_ERRORS = (ValueError, CheckpointError, DatasetError, FileNotFoundError)


class UserError(Exception):
    """A problem with the run's inputs, agreed on by every rank."""


def agree(ctx: ParallelContext, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails with a user error on any rank, raise that error's
    message on all of them (so no rank walks into a collective its peers never reach)."""
    error, value = None, None
    try:
        value = fn()
    except USER_ERRORS as err:
        error = f"{what}: {err}"
    errors = [e for e in comm.all_gather_object(error, ctx.world_group) if e]
    if errors:
        raise UserError(errors[0])
    return value
