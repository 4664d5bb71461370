"""``--host-masters auto`` (the default): whole fp32 masters on the host, unless no layout's host
memory fits with them; then the planner searches again with the offloaded masters split
(``--host-masters split``: 2 bytes a parameter less, a slower host step, docs/zero.md) and the
run takes that. Both ``python -m parallax.plan`` and ``--layout auto`` plan through here."""

from __future__ import annotations

from typing import Any

from parallax.plan.machine import Machine
from parallax.plan.search import Result, search
from parallax.plan.workload import Workload
from parallax.run import Run


def search_run(
    run: Run, machine: Machine, world: int, fixed: dict[str, Any], **kw: Any
) -> tuple[Run, Workload, Result]:
    """The run (``host_masters`` decided), its workload and the search's result; ``kw`` goes to
    :func:`~parallax.plan.search.search`."""
    model = Workload(run)
    result = search(model, machine, world, fixed, **kw)
    if result.ranked or not _short_of_host(result) or run.host_masters != "auto":
        return run, model, result
    split = run.replace(host_masters="split")
    if not split.host_masters_split:  # (nothing steps split masters: unclipped, torch's kernel)
        return run, model, result
    model_split = Workload(split)
    again = search(model_split, machine, world, fixed, **kw)
    return (split, model_split, again) if again.ranked else (run, model, result)


def _short_of_host(result: Result) -> bool:
    """Whether the nearest layout misses only the host's memory, with an offloaded optimizer."""
    if not result.closest:
        return False
    c = result.closest[0]
    return bool(c.layout.offload) and c.host > result.usable_host and c.gpu <= result.usable_gpu


SPLIT_WORDS = (
    "whole fp32 masters fit no layout's host memory: planned with --host-masters split (their "
    "low 16 bits on the host, 2 bytes a parameter less, a slower host step)"
)
