"""``--host-masters auto`` (the default): whole fp32 masters on the host, unless the host's
memory turned offloaded layouts away and the same search with the masters split
(``--host-masters split``: 2 bytes a parameter less, a slower host step, docs/zero.md) finds a
faster first choice; then the run takes that. Both ``python -m parallax.plan`` and
``--layout auto`` plan through here.

Taking the faster of the two first choices keeps "more GPU memory never chooses slower": each
search's first choice is no slower with a larger cap, and so is the faster of two. Splitting
only when no layout fitted did not: under 32 GiB and 92 GiB of host memory a few whole-master
layouts (their sums on the GPU) fitted at 14.0 s, where the split layout of 24 GiB took 11.1."""

from __future__ import annotations

from typing import Any

from parallax.plan.machine import Machine
from parallax.plan.search import Result, search
from parallax.plan.workload import Workload
from parallax.run import Run


def search_run(
    run: Run, machine: Machine, world: int, fixed: dict[str, Any], **kw: Any
) -> tuple[Run, Workload, Result, str]:
    """The run (``host_masters`` decided), its workload, the search's result and why the
    masters were split (empty when they were not); ``kw`` goes to
    :func:`~parallax.plan.search.search`."""
    model = Workload(run)
    result = search(model, machine, world, fixed, **kw)
    if not result.host_short or run.host_masters != "auto":
        return run, model, result, ""
    split = run.replace(host_masters="split")
    if not split.host_masters_split:  # (nothing steps split masters: unclipped, torch's kernel)
        return run, model, result, ""
    model_split = Workload(split)
    again = search(model_split, machine, world, fixed, **kw)
    if not again.ranked or (result.ranked and _seconds(again) >= _seconds(result)):
        return run, model, result, ""
    return split, model_split, again, _split_words(result)


def _seconds(result: Result) -> float:
    return result.ranked[0].time.seconds


def _split_words(whole: Result) -> str:
    """Why the run splits its masters: nothing fitted with whole ones, or only slower."""
    split = (
        "planned with --host-masters split (their low 16 bits on the host, 2 bytes a parameter "
        "less, a slower host step)"
    )
    if not whole.ranked:
        return f"whole fp32 masters fit no layout's host memory: {split}"
    return (
        "with whole fp32 masters the host's memory leaves only slower layouts (the fastest "
        f"{_seconds(whole):.3f} s a step): {split}"
    )
