"""Why the search found no layout to try, or none the run accepts: which flag given rules out
which layouts.

The search keeps every layout flag given (:data:`parallax.plan.layout.LAYOUT_OPTIONS`); when
they leave nothing, "none searched" would say nothing. The reasons follow the search's own
order: tp within a node, tp x pp x dp making the world, the global batch over dp, the
micro-batch over a rank's batch; anything else is found by leaving each flag out in turn. When
layouts were searched but the run refuses each (a tp that does not divide the heads, more
stages than blocks), the run's reasons are said with the flags that force them.
"""

from __future__ import annotations

from typing import Any

from parallax.plan.search import Result, Searcher, divisors, layouts
from parallax.plan.workload import Workload
from parallax.run.option import flag

GRID = ("tp", "pp", "dp")


def given(name: str, value: Any) -> str:
    """A layout option as the flag that sets it (``--tp 8``, ``--no-reshard-after-forward``)."""
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + flag(name)[2:]
    return f"{flag(name)} {value}"


def _grid(world: int, node: int, fixed: dict[str, Any]) -> tuple[list[tuple], str | None]:
    """The (tp, pp, dp) the flags allow, or why there is none."""
    tp = fixed.get("tp")
    if tp is not None and tp not in divisors(node):
        if tp > node:
            return [], (
                f"{given('tp', tp)} needs {tp} GPUs in one node (tp stays within a node); a node "
                f"here has {node} (--gpus, --gpus-per-node)"
            )
        return [], f"{given('tp', tp)} does not divide the {node} GPUs of a node"
    grids = [(t, p, world // (t * p)) for t in divisors(node) for p in divisors(world // t)]
    allowed = [g for g in grids if all(fixed.get(k, v) == v for k, v in zip(GRID, g))]
    if allowed:
        return allowed, None
    flags = ", ".join(given(k, fixed[k]) for k in GRID if k in fixed)
    could = []
    for i, name in enumerate(GRID):
        if name in fixed:
            others = [
                g for g in grids if all(fixed.get(k, v) == v for k, v in zip(GRID, g) if k != name)
            ]
            values = ", ".join(str(v) for v in sorted({g[i] for g in others}))
            could.append(f"{name} can be {values or 'nothing'}")
    return [], (
        f"{flags} cannot make {world} GPUs: tp x pp x dp must be {world}, tp within a node of "
        f"{node}; with the other flags given, {'; '.join(could)}"
    )


def _batch(batch: int, grids: list[tuple], fixed: dict[str, Any]) -> str | None:
    """Why no allowed grid splits the global batch and its micro-batches, if none does."""
    dps = sorted({g[2] for g in grids})
    fixing = ", ".join(given(k, fixed[k]) for k in GRID if k in fixed) or "the GPUs"
    split = [dp for dp in dps if batch % dp == 0]
    if not split:
        return (
            f"--global-batch-size {batch} does not split over dp {', '.join(map(str, dps))} "
            f"(what {fixing} leave)"
        )
    mb = fixed.get("micro_batch_size")
    if mb is not None and all((batch // dp) % mb for dp in split):
        per_rank = ", ".join(f"{batch // dp} at dp {dp}" for dp in split)
        return f"--micro-batch-size {mb} does not divide a rank's batch ({per_rank})"
    return None


def _left_out(
    model: Workload, world: int, per_node: int, fixed: dict[str, Any], ok=lambda layout: True
) -> list[str]:
    """The flags without which some layout (one that ``ok`` takes) would be searched."""
    found = []
    for name in fixed:
        others = {k: v for k, v in fixed.items() if k != name}
        if any(ok(layout) for layout in layouts(model, world, per_node, others)):
            found.append(given(name, fixed[name]))
    return found


def none_searched(model: Workload, world: int, per_node: int, fixed: dict[str, Any]) -> str:
    """Why no layout of ``world`` GPUs (``per_node`` a node) was searched for ``model`` with
    the layout options ``fixed``, naming the flags."""
    grids, why = _grid(world, min(world, per_node), fixed)
    why = why or _batch(model.global_batch, grids, fixed)
    if why is None:
        flags = _left_out(model, world, per_node, fixed)
        if flags:
            why = f"{', '.join(flags)} leave no layout between them (leave one of them out)"
        else:
            both = ", ".join(given(k, v) for k, v in fixed.items())
            why = f"{both} leave no layout between them"
    return f"no layout of {world} GPUs can be searched: {why}"


def none_valid(
    result: Result, model: Workload, world: int, per_node: int, fixed: dict[str, Any]
) -> str:
    """Why the run refuses every layout searched, and the flags given without which it would
    take some."""
    reasons = "; ".join(f"{n} layouts: {p}" for p, n in result.problems.items())
    said = f"no layout of {world} GPUs is valid for this run ({reasons})"
    searcher = Searcher(model, result.machine)
    flags = _left_out(model, world, per_node, fixed, lambda lay: searcher.problem(lay) is None)
    if len(flags) == 1:
        said += f"; {flags[0]} rules them out (without it the run takes other layouts)"
    elif flags:
        said += f"; each of {', '.join(flags)} rules them out (leave one out)"
    return said


def ruled_out(
    result: Result, model: Workload, world: int, per_node: int, fixed: dict[str, Any]
) -> str | None:
    """The message when no layout was searched or the run takes none of them, else ``None``
    (what fits in memory is :func:`parallax.plan.report.nothing_fits`'s)."""
    if not result.searched:
        return none_searched(model, world, per_node, fixed)
    if not result.fitting and not result.closest:
        return none_valid(result, model, world, per_node, fixed)
    return None
