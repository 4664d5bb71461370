"""A tiny model of 8 blocks that exercises what crosses pipeline stages: two float tensors that
need gradients (a hidden state and a gate) and one integer tensor that passes through without,
with a sequence length that changes between microbatches. Built from parallax.tensor layers, so
the same blocks run under tp; with ``ctx=None`` they are the single-process reference."""

import torch
import torch.nn.functional as F
from torch import nn

from parallax import init_parameters
from parallax.pipeline import BlockChunk
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

VOCAB, FEAT, HIDDEN, FFN, GATE, OUT = 16, 6, 8, 16, 4, 6
NUM_BLOCKS = 8
SEED = 1234


class Embed(nn.Module):
    """(ids, feats) -> (h, gate, ids)"""

    def __init__(self, ctx) -> None:
        super().__init__()
        self.tok = VocabParallelEmbedding(VOCAB, HIDDEN, ctx=ctx)
        self.feat = nn.Linear(FEAT, HIDDEN)
        self.gate = nn.Linear(FEAT, GATE)

    def forward(self, ids, feats):
        h = self.tok(ids) + self.feat(feats)  # (b, s, h)
        return h, torch.tanh(self.gate(feats)), ids  # gate: (b, s, g); ids: int, no gradient


class Block(nn.Module):
    """(h, gate, ids) -> (h, gate, ids): a tp MLP scaled by the gate and masked by the ids."""

    def __init__(self, ctx) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = ColumnParallelLinear(HIDDEN, FFN, ctx=ctx)
        self.down = RowParallelLinear(FFN, HIDDEN, ctx=ctx)
        self.mix = nn.Linear(GATE, HIDDEN)
        self.back = nn.Linear(HIDDEN, GATE)

    def forward(self, h, gate, ids):
        mask = (ids % 3 != 0).unsqueeze(-1).to(h.dtype)  # (b, s, 1)
        h = h + self.down(F.gelu(self.up(self.norm(h)))) * torch.sigmoid(self.mix(gate)) * mask
        return h, gate + 0.5 * torch.tanh(self.back(h)), ids


class Head(nn.Module):
    """(h, gate, ids) -> (b, s, OUT)"""

    def __init__(self, ctx) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = ColumnParallelLinear(HIDDEN, OUT, gather_output=True, ctx=ctx)
        self.gate_out = nn.Linear(GATE, OUT)

    def forward(self, h, gate, ids):
        return self.out(self.norm(h)) + self.gate_out(gate)


def make_block(index: int, ctx) -> nn.Module:
    if index == 0:
        return Embed(ctx)
    if index == NUM_BLOCKS - 1:
        return Head(ctx)
    return Block(ctx)


def loss_fn(output, target):
    return F.mse_loss(output, target)


def microbatches(count: int, offset: int = 0, batch: int = 2):
    """``count`` microbatches (seq lengths 3, 4, 5, 3, ...) and their targets."""
    gen = torch.Generator().manual_seed(99)
    data = []
    for m in range(offset + count):
        seq = 3 + m % 3
        ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        feats = torch.randn(batch, seq, FEAT, generator=gen)
        target = torch.randn(batch, seq, OUT, generator=gen)
        data.append(((ids, feats), target))
    data = data[offset:]
    return [d[0] for d in data], [d[1] for d in data]


def reference(num_microbatches: int):
    """Loss and gradients (by parameter name) of the unsplit model on all microbatches, each
    loss scaled by 1 / num_microbatches, in one process."""
    model = BlockChunk([make_block(i, None) for i in range(NUM_BLOCKS)])
    init_parameters(model, SEED)
    inputs, targets = microbatches(num_microbatches)
    total = 0.0
    for x, y in zip(inputs, targets):
        loss = loss_fn(model(*x), y) / num_microbatches
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}
