"""The activation terms of the memory model (:mod:`parallax.plan.memory`): what a pipeline
rank's blocks keep for the backward at the schedule's peak of microbatches in flight, and the
backward's transient above it (the workspace)."""

from __future__ import annotations

from parallax.plan.layout import Layout
from parallax.plan.workload import Workload, peak_weighted

# The backward's transient, as a share of a piece's saved bytes: measured as the peak of live
# tensors over what the forward left, on ViT blocks (0.26-0.27) and a Llama layer (0.29), and
# on the same ViT blocks recomputed (1.19-1.20: their saved tensors again, then the gradients)
# (tests/families/siglip/test_activation_peak.py measures whole steps against it)
GRADIENTS_IN_FLIGHT = 0.3
RECOMPUTED = 1.2


def activation_bytes(model: Workload, layout: Layout, pp_rank: int) -> tuple[float, float]:
    """(activations at the schedule's peak, the backward's workspace) of a pipeline rank."""
    kept, largest = _per_sample(model, layout, pp_rank)
    mb = layout.micro_batch_size
    if model.run.compile:  # the compiler keeps at most this share of the fused blocks' own
        mb *= model.run.activation_memory_budget
    states = model.in_flight_states(layout, pp_rank)
    return peak_weighted(states, [mb * k for k in kept]), mb * largest


def _per_sample(model: Workload, layout: Layout, pp_rank: int) -> tuple[list[float], float]:
    """Per local stage, the bytes one sample keeps (with what the stage receives and sends);
    and the largest piece's backward transient."""
    ckpt, compiled = layout.checkpointing, bool(model.run.compile)
    key = ("acts", layout.tp, layout.pp, layout.chunks, pp_rank, ckpt, compiled)
    if key in model.cache:
        return model.cache[key]  # type: ignore[return-value]
    tp, est = layout.tp, model.estimates
    ranges = model.ranges(layout.pp, layout.chunks)
    last = layout.pp * layout.chunks - 1
    kept, largest = [], 0.0
    for s in model.stages_of(layout, pp_rank):
        r = ranges[s]
        k = sum(est[i].keeps(ckpt, compiled).at(tp) for i in r)
        if s > 0:  # what the stage received, held for the gradient it sends back
            k += est[r.start - 1].output_bytes
        if s < last:  # what it sent, held until its gradient comes
            k += est[r[-1]].output_bytes
        kept.append(k)
        parts = [part for i in r for part in est[i].parts]
        largest = max(largest, _transient(parts, ckpt, compiled, tp))
    model.cache[key] = (kept, largest)
    return kept, largest


def _transient(parts: list, ckpt: bool | str, compiled: bool, tp: int) -> float:
    """The backward's transient above what a stage holds, per sample: the gradients in flight
    while a piece's backward runs (:data:`GRADIENTS_IN_FLIGHT` of what it saved; a recomputed
    piece rebuilds its saved tensors first, :data:`RECOMPUTED`), less what the pieces after it
    kept and their backwards, which run first, have freed. A dual encoder's small text tower
    runs last, so its transient, not the larger image tower's, sets the peak."""
    worst, after = 0.0, 0.0
    for part in reversed(parts):  # the backward's order
        again = RECOMPUTED if part.recomputes(ckpt) else GRADIENTS_IN_FLIGHT
        worst = max(worst, again * part.saved.at(tp) - after)
        after += part.keeps(ckpt, compiled).at(tp)
    return worst
