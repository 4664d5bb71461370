"""Cross-entropy over logits whose vocabulary is split across tp, without gathering them.

Each rank holds ``(..., V/tp)`` logits. The softmax normaliser and the target logit are summed
across tp (three small all-reduces of ``(...)`` tensors), never the ``(..., V)`` logits. The
backward is the textbook ``softmax - one_hot`` on this rank's slice, computed in float32.
"""

from __future__ import annotations

import torch

from parallax import comm
from parallax.comm import Group
from parallax.tensor.layers import TPLike, resolve_tp


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: Group, vocab_start: int, vocab_size, ignore_index):  # noqa: D102
        local_v = logits.shape[-1]
        z = logits.float()  # (..., V/tp)
        if vocab_size is not None and vocab_start + local_v > vocab_size:
            cols = torch.arange(vocab_start, vocab_start + local_v, device=z.device)
            z = z.masked_fill(cols >= vocab_size, float("-inf"))  # padded rows never count
        zmax = z.max(dim=-1).values  # (...)
        comm.all_reduce(zmax, group, op="max")
        z = z - zmax.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < vocab_start) | (target >= vocab_start + local_v) | ignored
        local_t = (target - vocab_start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)

        exp = z.exp_()  # z is ours (a fresh tensor), so exponentiate in place
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit)
        grad.mul_((grad_loss.float() * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ctx: TPLike,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Like ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ...)``.

    ``logits`` is this rank's contiguous vocabulary shard ``(..., V/tp)``; ``target`` holds
    global ids ``(...)``. ``vocab_size`` is the real vocabulary when the shards were padded (the
    padded columns are masked out of the softmax). ``reduction`` is "mean" (over tokens that are
    not ``ignore_index``), "sum" or "none". The result is float32.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
            "expected logits of shape target.shape + (V/tp,)"
        )
    group, tp_rank, _ = resolve_tp(ctx)
    vocab_start = tp_rank * logits.shape[-1]
    loss = _VocabParallelCE.apply(logits, target, group, vocab_start, vocab_size, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def tp_argmax(logits: torch.Tensor, ctx: TPLike, vocab_size: int | None = None) -> torch.Tensor:
    """Global argmax ids ``(...)`` of logits whose last dim is this rank's vocab shard.

    Each rank takes its own maximum and index; a max-reduction finds the winning value and a
    min-reduction over the ranks holding it picks the lowest id, as ``torch.argmax`` would.
    """
    group, tp_rank, tp_size = resolve_tp(ctx)
    local_v = logits.shape[-1]
    start = tp_rank * local_v
    z = logits
    if vocab_size is not None and start + local_v > vocab_size:
        cols = torch.arange(start, start + local_v, device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))  # tp padding never wins
    idx = z.argmax(dim=-1)  # (...)
    if tp_size == 1:
        return idx
    val = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).float()
    best = comm.all_reduce(val.clone(), group, op="max")
    cand = torch.where(val == best, idx + start, torch.full_like(idx, torch.iinfo(idx.dtype).max))
    return comm.all_reduce(cand, group, op="min")
