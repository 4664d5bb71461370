"""Your own model under ``parallax.train``: a recipe is all the one trainer needs.

The model is ordinary PyTorch built from parallax tensor-parallel layers (an embedding, pre-norm
attention + MLP blocks, a head), written so that a pipeline stage can build any contiguous range
of its blocks under their global names. The recipe below tells the trainer its blocks, how to
build a chunk, how samples become microbatches and what the loss is; the trainer does the rest
(the layout, the schedule, ZeRO-1, freezing and lr groups, checkpoints, resume, metrics). The
task: each sequence counts up modulo the vocabulary with its own step, so predicting the next
token needs attention over the context.

    torchrun --nproc-per-node 4 examples/custom_recipe.py --tp 2 --pp 2 --out runs/counting
    torchrun --nproc-per-node 2 examples/custom_recipe.py --dp 2 --freeze 'embed.*' --out runs/c2

Every ``parallax.train`` flag works; ``--model counting`` is set for you.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import parallax
from parallax.models import StageBlock
from parallax.pipeline import TensorMeta
from parallax.recipe import (
    DataSide,
    MetricSpec,
    ModelSide,
    ModelSpec,
    Recipe,
    TokenObjective,
)
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    heads_per_rank,
    resolve_tp,
    vocab_parallel_cross_entropy,
)
from parallax.tensor.loss import tp_argmax


@dataclass(frozen=True)
class CountingConfig:
    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 16

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    """Pre-norm causal attention and MLP; heads and MLP features split across tp."""

    def __init__(self, c: CountingConfig, ctx, device=None) -> None:
        super().__init__()
        kw = dict(ctx=ctx, device=device)
        self.heads = heads_per_rank(c.heads, resolve_tp(ctx)[2], "counting block")
        self.norm1 = nn.LayerNorm(c.hidden, device=device)
        self.norm2 = nn.LayerNorm(c.hidden, device=device)
        self.qkv = ColumnParallelLinear(c.hidden, 3 * c.hidden, partitions=3, **kw)
        self.proj = RowParallelLinear(c.hidden, c.hidden, **kw)
        self.up = ColumnParallelLinear(c.hidden, 4 * c.hidden, **kw)
        self.down = RowParallelLinear(4 * c.hidden, c.hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads/tp, s, hd)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))  # (b, s, h)


class CountingLM(nn.Module):
    """Blocks ``[embed, layers.0 .. layers.L-1, head]``; builds only those in ``blocks``."""

    def __init__(self, c: CountingConfig, ctx, blocks: range, device=None) -> None:
        super().__init__()
        self.config, self.ctx = c, ctx
        self.first, self.last = 0 in blocks, c.layers + 1 in blocks
        if self.first:
            self.embed = VocabParallelEmbedding(c.vocab, c.hidden, ctx=ctx, device=device)
        layers = [i - 1 for i in blocks if 1 <= i <= c.layers]
        self.layers = nn.ModuleDict({str(i): Block(c, ctx, device) for i in layers})
        if self.last:
            self.norm = nn.LayerNorm(c.hidden, device=device)
            self.out = ColumnParallelLinear(c.hidden, c.vocab, bias=False, ctx=ctx, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)  # ids (b, s) -> (b, s, h)
        for layer in self.layers.values():
            x = layer(x)
        return self.out(self.norm(x)) if self.last else x  # (b, s, V/tp) on the last stage


class Counting:
    """Sequences ``start, start + k, start + 2k, ...`` modulo the vocabulary."""

    name, statistics = "counting", {}

    def __init__(self, c: CountingConfig, n: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, c.vocab, (n, 1), generator=g)
        step = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + step * torch.arange(c.seq + 1)) % c.vocab  # (n, s + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class CountingModel(ModelSide):
    """The model side: its presets, its blocks (with their costs) and this rank's chunk."""

    pin_first = 1  # the embedding opens the first stage

    def presets(self):
        return ("counting",)

    def resolve(self, spec: str) -> ModelSpec:
        return ModelSpec(CountingConfig())

    def default_lr(self, spec: str) -> float:
        return 3e-3

    def blocks(self, c: CountingConfig) -> list[StageBlock]:
        layer = 2 * c.seq * 12 * c.hidden**2  # forward FLOPs per sample of one block
        head = 2 * c.seq * c.hidden * c.vocab
        return (
            [StageBlock("embed", 0.0)]
            + [StageBlock(f"layers.{i}", layer) for i in range(c.layers)]
            + [StageBlock("head", head)]
        )

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint):
        model = CountingLM(run.model_config, ctx, blocks, device=device).to(dtype)
        if torch.device(device).type != "meta":
            parallax.init_parameters(model, run.seed)  # layout-free: the same at every layout
        return model

    def tokens(self, run, microbatches) -> int:
        return sum(mb["input_ids"].numel() for mb in microbatches)


class CountingData(DataSide):
    """The data side (``run``: the resolved run, parallax.run.Run): the dataset, the collator
    and what the pipeline's stages take."""

    input_keys = ("input_ids", "labels")

    def dataset(self, spec: str, run):
        return Counting(CountingConfig(), seed=run.seed)

    def eval_dataset(self, spec, run):
        return Counting(CountingConfig(), n=256, seed=run.seed + 1)

    def collator(self, run, dataset):
        def collate(samples):
            tokens = torch.stack(list(samples))  # (b, s + 1)
            return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

        return collate

    def stage_inputs(self, mb):
        return (mb["input_ids"],)

    def stage_metas(self, run, mb, dtype):
        b, s = mb["input_ids"].shape
        return [TensorMeta((b, s, run.model_config.hidden), dtype, True)]


class NextToken(TokenObjective):
    """The objective: a next-token loss per microbatch on the last stage, and its accuracy."""

    metric_sums = ("correct", "tokens")
    metrics = (MetricSpec("accuracy", "correct", "tokens", "acc"),)

    def loss_units(self, mb) -> int:
        return mb["labels"].numel()

    def loss_target(self, run, mb):
        return mb["labels"]

    def loss(self, chunk, logits, labels, ctx, run):
        ce = vocab_parallel_cross_entropy(logits, labels, ctx, reduction="sum")
        with torch.no_grad():
            correct = (tp_argmax(logits, ctx) == labels).sum().float()
        return ce, torch.stack([correct, torch.tensor(float(labels.numel()))])


class CountingRecipe(Recipe):
    """The three sides composed. A "tokens" recipe must write ten methods (parallax.recipe.
    REQUIRED): the model's resolve, blocks and build; the data's dataset, collator,
    stage_inputs and stage_metas; the objective's loss_units, loss_target and loss. presets,
    default_lr, eval_dataset and tokens are optional hooks it overrides too; every other hook
    has a default (parallax/recipe/model_side.py, data_side.py, objective.py)."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__(CountingModel(), CountingData(), NextToken())


parallax.register("counting", CountingRecipe())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from parallax.train import main as train  # the trainer, once the family is registered

    return train(["--model", "counting", "--steps", "60", *argv])


if __name__ == "__main__":
    sys.exit(main())
