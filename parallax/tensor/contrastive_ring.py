"""The chunked sigmoid loss: text embeddings travel the dp ring both ways, blocks stay ``b x b``.

Forward, on the rank at ring position ``r`` of ``D``: score the own block (positives on its
diagonal) while the own texts leave for both neighbours; then, for ``k = 1 .. ceil((D-1)/2)``,
forward the texts that arrived (rightward ones to ``r+1``, leftward ones to ``r-1``; the last
round of an even ``D`` goes rightward only) while scoring them. After ``k`` rounds a rank holds
the texts of ``r-k`` and ``r+k``, so every pair is scored exactly once.

Backward: the same trips again, one hop behind each text travels its gradient accumulator.
At each step a rank sends the texts on, sends the accumulator of the block it finished last
step, scores the block in hand (adding to the image gradient), waits, and adds its part to the
accumulator that just arrived for that block. After the last hop every accumulator goes
straight home to the text's owner. Each batch of sends and receives is ordered the same way on
both peers (rightward text, rightward accumulator, then leftward), so two ranks that are each
other's both neighbours (``D = 2``, one direction only) cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallax import comm
from parallax.comm import Group


@dataclass(frozen=True)
class Ring:
    """The dp group as a ring: ``ranks`` (global, in dp order) and this rank's ``index``."""

    group: Group
    ranks: list[int]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, offset: int) -> int:
        """Global rank ``offset`` places to the right (negative: left)."""
        return self.ranks[(self.index + offset) % self.size]

    @property
    def hops(self) -> tuple[int, int]:
        """Rounds rightward and leftward: together every other rank, once."""
        others = self.size - 1
        return (others + 1) // 2, others // 2

    def exchange(self, sends: list, recvs: list) -> list:
        """Post ``[(tensor, offset)]`` sends and receives as one batch; returns the works."""
        return comm.post_send_recv(
            [(t, self.peer(o)) for t, o in sends],
            [(t, self.peer(o)) for t, o in recvs],
            self.group,
        )


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _signed(logits: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """``z * l``: -l off the diagonal, +l on it (the positives)."""
    zl = -logits
    if diagonal:
        zl.diagonal().neg_()
    return zl


class _SigmoidRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, scale, bias, ring: Ring, trace):  # noqa: D102
        ctx.ring, ctx.trace = ring, trace
        ctx.dtypes = (x.dtype, y.dtype, scale.dtype, bias.dtype)
        x32, y32 = x.detach().float(), y.detach().float()
        t, b32 = scale.detach().float().exp(), bias.detach().float()
        right_hops, left_hops = ring.hops
        total = torch.zeros((), device=x.device)
        pending, right, left = [(y32, True)], y32, y32
        for k in range(1, right_hops + 1):
            sends, recvs = [(right, 1)], [(torch.empty_like(y32), -1)]
            if k <= left_hops:
                sends.append((left, -1))
                recvs.append((torch.empty_like(y32), 1))
            works = ring.exchange(sends, recvs)
            for block, diagonal in pending:  # scored while the exchange is in flight
                total += _block_loss(x32, block, t, b32, diagonal, trace)
            _wait(works)
            right = recvs[0][0]
            pending = [(right, False)]
            if k <= left_hops:
                left = recvs[1][0]
                pending.append((left, False))
        for block, diagonal in pending:
            total += _block_loss(x32, block, t, b32, diagonal, trace)
        ctx.save_for_backward(x32, y32, t, b32)
        return total / x.shape[0]

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, y, t, bias = ctx.saved_tensors
        ring, trace = ctx.ring, ctx.trace
        acc = _Grads(x, t, bias, grad_out.float() / x.shape[0], trace)
        right_hops, left_hops = ring.hops
        hops = {1: right_hops, -1: left_hops}  # direction -> number of hops
        texts = {d: y for d in hops}  # the text each direction has in hand
        done: dict[int, torch.Tensor] = {}  # direction -> accumulator finished last step
        own = None
        for k in range(0, right_hops + 1):
            sends, recvs, slots = [], [], []
            for d, n in hops.items():
                if k < n:  # the next text comes in, this one goes on
                    sends.append((texts[d], d))
                    recvs.append((torch.empty_like(y), -d))
                    slots.append((d, "text"))
                if 2 <= k <= n:  # the accumulator of last step's block follows it
                    sends.append((done[d], d))
                    recvs.append((torch.empty_like(y), -d))
                    slots.append((d, "acc"))
            works = ring.exchange(sends, recvs)
            mine = {}  # this rank's part of the gradient of each block in hand at hop k
            if k == 0:
                own = acc.block(y, diagonal=True)
            else:
                mine = {d: acc.block(texts[d], diagonal=False) for d, n in hops.items() if k <= n}
            _wait(works)
            arrived = {(d, kind): buf for (d, kind), (buf, _) in zip(slots, recvs)}
            for d, part in mine.items():
                incoming = arrived.get((d, "acc"))
                done[d] = part if incoming is None else part + incoming
            for d in hops:
                if (d, "text") in arrived:
                    texts[d] = arrived[(d, "text")]
        home_sends = [(done[d], -d * n) for d, n in hops.items() if n > 0]
        home_recvs = [(torch.empty_like(y), d * n) for d, n in hops.items() if n > 0]
        _wait(ring.exchange(home_sends, home_recvs))
        grad_y = own + sum((buf for buf, _ in home_recvs), torch.zeros_like(y))
        dx, dy, ds, db = ctx.dtypes
        grads = acc.grad_x.to(dx), grad_y.to(dy), acc.grad_scale().to(ds), acc.grad_bias.to(db)
        return (*grads, None, None)


def _block_loss(x, y, t, bias, diagonal: bool, trace) -> torch.Tensor:
    logits = t * (x @ y.T) + bias  # (b, b)
    if trace is not None:
        trace.append(tuple(logits.shape))
    return -F.logsigmoid(_signed(logits, diagonal)).sum()


class _Grads:
    """What the backward accumulates on this rank: the image gradient, d/dt and d/db."""

    def __init__(self, x, t, bias, scale: torch.Tensor, trace) -> None:
        self.x, self.t, self.scale, self.trace = x, t, scale, trace
        self.bias = bias
        self.grad_x = torch.zeros_like(x)
        self.dt = torch.zeros((), device=x.device)
        self.grad_bias = torch.zeros_like(bias)

    def block(self, y: torch.Tensor, diagonal: bool) -> torch.Tensor:
        """Score ``y`` against this rank's images again; return d loss / d y."""
        sims = self.x @ y.T  # (b, b)
        logits = self.t * sims + self.bias
        if self.trace is not None:
            self.trace.append(tuple(logits.shape))
        g = torch.sigmoid(-_signed(logits, diagonal)) * self.scale  # d/dl = -z sigmoid(-z l)
        if diagonal:  # -z is -1 for the positives, +1 for every negative
            g.diagonal().neg_()
        self.grad_x += self.t * (g @ y)
        self.dt += (g * sims).sum()
        self.grad_bias += g.sum()
        return self.t * (g.T @ self.x)

    def grad_scale(self) -> torch.Tensor:
        """d loss / d logit_scale, with ``t = exp(logit_scale)``."""
        return (self.dt * self.t).reshape(self.t.shape)


def sigmoid_ring_loss(x, y, logit_scale, logit_bias, ring: Ring, trace=None) -> torch.Tensor:
    """This rank's sigmoid loss over the ring (see the module doc and
    :func:`parallax.tensor.contrastive.sigmoid_loss`)."""
    return _SigmoidRing.apply(x, y, logit_scale, logit_bias, ring, trace)
