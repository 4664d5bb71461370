"""The contrastive losses' memory per rank: it grows with the local batch only (sigmoid ring), or
with local x global (softmax rows), never global x global.

For each dp size (the first ``dp`` ranks of the world, gloo on the CPU) and local batch ``b``,
every rank scores random L2-normalised embeddings ``(b, d)`` with
:func:`parallax.tensor.contrastive.sigmoid_loss` (the chunked ring) and
:func:`~parallax.tensor.contrastive.softmax_loss` (all-gather, local rows) and backpropagates;
measured on each rank, max over ranks:

- ``largest logits``: the elements of the largest logits block the loss computes (forward and
  backward; the loss's ``trace``): the dominant temporary, ``b x b`` for the ring whatever dp
  is, ``b x B`` for the softmax rows (``B = dp x b``); a naive loss would hold ``B x B``;
- ``saved``: bytes the loss keeps for its backward (``torch.autograd.graph.saved_tensors_hooks``
  over the loss call): ``O(b d)`` for the ring, ``O(B d + b B)`` for the softmax.

    torchrun --nproc-per-node 8 -m benchmarks.layers.contrastive_memory          # CPU, writes
    torchrun --nproc-per-node 2 -m benchmarks.layers.contrastive_memory --smoke  # writes nothing

Nothing is appended to the results files with ``--smoke`` unless ``--write`` is given.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.tools.common import append_results, env_info, print_table
from parallax.tensor.contrastive_ring import Ring, sigmoid_ring_loss

COLUMNS = ["loss", "dp", "local b", "global B", "largest logits", "saved KiB", "naive B x B"]


def _saved_bytes(fn):
    """``fn()``'s value and the bytes autograd saved for its backward."""
    total = [0]

    def pack(t: torch.Tensor):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _softmax_rows(x, y, scale, group, index: int, dp: int, trace: list) -> torch.Tensor:
    """The softmax loss's local rows against gathered columns (as
    :func:`parallax.tensor.contrastive.softmax_loss` computes them, on a sub-group)."""
    from parallax.tensor.contrastive import _GatherWithGrad

    all_x = _GatherWithGrad.apply(x, group) if dp > 1 else x
    all_y = _GatherWithGrad.apply(y, group) if dp > 1 else y
    rows_i, rows_t = scale.exp() * x @ all_y.T, scale.exp() * y @ all_x.T  # (b, B)
    trace += [tuple(rows_i.shape), tuple(rows_t.shape)]
    labels = torch.arange(x.shape[0]) + index * x.shape[0]
    return (F.cross_entropy(rows_i, labels) + F.cross_entropy(rows_t, labels)) / 2


def measure(kind: str, dp: int, b: int, d: int, groups: dict, rank: int) -> tuple[int, int]:
    """(largest logits elements, saved bytes) on this rank, max over the ``dp`` ranks taking
    part (every rank of the world calls it; ranks >= dp take no part but join the max)."""
    largest = saved = 0
    if rank < dp:
        g = torch.Generator().manual_seed(rank)
        x = F.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
        y = F.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
        scale = torch.full((1,), 2.3, requires_grad=True)
        bias = torch.full((1,), -10.0, requires_grad=True)
        group, trace = groups[dp], []
        if kind == "sigmoid":
            ring = Ring(group, list(range(dp)), rank)
            loss, saved = _saved_bytes(lambda: sigmoid_ring_loss(x, y, scale, bias, ring, trace))
        else:
            loss, saved = _saved_bytes(lambda: _softmax_rows(x, y, scale, group, rank, dp, trace))
        loss.backward()
        largest = max(r * c for r, c in trace)
    out = torch.tensor([largest, saved], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out[0]), int(out[1])


def main(argv: list[str] | None = None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="2,8,32", help="local batch sizes")
    p.add_argument("--dim", type=int, default=64, help="embedding width (tiny towers)")
    p.add_argument("--smoke", action="store_true", help="small, writes nothing")
    p.add_argument("--write", action="store_true", help="append results even with --smoke")
    args = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    owns = world > 1 and not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= world]
    groups = {n: dist.new_group(list(range(n))) if n > 1 else None for n in sizes}
    batches = [2, 4] if args.smoke else [int(x) for x in args.batches.split(",")]
    info, rows = env_info(), []
    for kind in ("sigmoid", "softmax"):
        for dp in sizes:
            for b in batches:
                largest, saved = measure(kind, dp, b, args.dim, groups, rank)
                rows.append([kind, dp, b, dp * b, largest, saved / 1024, (dp * b) ** 2])
    if rank == 0:
        title = "Contrastive loss memory per rank (gloo, CPU)"
        print_table(title, COLUMNS, rows)
        if not args.smoke or args.write:
            notes = (
                f"embedding width {args.dim}; 'largest logits' = elements of the largest "
                "logits block the loss computes (forward or backward), 'saved' = bytes kept "
                "for the backward; max over ranks. Sigmoid (ring): b x b at every dp; softmax "
                "(local rows): b x B"
            )
            records = [dict(zip(COLUMNS, r), benchmark="contrastive_memory") for r in rows]
            append_results(title, COLUMNS, rows, notes, records, info)
    if owns:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
