"""A deliberately different family for the recipe protocol's tests: a two-tower model whose loss
needs the embeddings of every microbatch of the step and a dp all-gather (a contrastive softmax
over the global batch), so it runs as a ``"step"`` recipe and refuses pp > 1.

Towers are parallax tensor layers (column- then row-parallel), so tp shards them; the data are
pairs ``(x, y = x @ M + noise)`` the towers learn to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallax import comm
from parallax.init import init_parameters
from parallax.models.stages import StageBlock
from parallax.recipe import DataSide, MetricSpec, ModelSide, ModelSpec, Recipe, StepObjective
from parallax.tensor import ColumnParallelLinear, RowParallelLinear

DIM, HIDDEN, EMBED = 6, 16, 8


@dataclass
class ToyConfig:
    dim: int = DIM
    hidden: int = HIDDEN
    embed: int = EMBED

    def to_dict(self) -> dict:
        return {"dim": self.dim, "hidden": self.hidden, "embed": self.embed}


class Tower(nn.Module):
    def __init__(self, cfg: ToyConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(ctx=ctx, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(cfg.dim, cfg.hidden, True, **kw)
        self.fc2 = RowParallelLinear(cfg.hidden, cfg.embed, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.fc2(F.gelu(self.fc1(x))), dim=-1)


class TwoTowers(nn.Module):
    def __init__(self, cfg: ToyConfig, ctx, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.image = Tower(cfg, ctx, device, dtype)
        self.text = Tower(cfg, ctx, device, dtype)
        self.logit_scale = nn.Parameter(torch.full((), 2.0, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.image(x), self.text(y)


class _GatherDP(torch.autograd.Function):
    """All-gather over dp forward; the backward sums every rank's gradient of each rank's
    block and keeps this rank's (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        ctx.group, ctx.n = group, x.shape[0]
        return comm.all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = comm.all_reduce(grad.contiguous(), ctx.group)
        r = comm.rank(ctx.group)
        return grad[r * ctx.n : (r + 1) * ctx.n], None


class Pairs:
    """``(x, y)`` pairs with ``y = x @ M + noise``: each x has one matching y."""

    name = "pairs"
    statistics: dict = {}

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        m = torch.randn(DIM, DIM, generator=g)
        self.y = self.x @ m + 0.1 * torch.randn(n, DIM, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


class ToyModel(ModelSide):
    freeze_aliases = {"vision": ("image.*",)}
    pin_first = 0

    def presets(self):
        return ("toy",)

    def resolve(self, spec: str) -> ModelSpec:
        return ModelSpec(ToyConfig())

    def default_lr(self, spec: str) -> float:
        return 1e-2

    def check_layout(self, run, dims) -> None:
        if dims.pp > 1:
            raise ValueError("the toy two-tower model runs with pp = 1 (its towers are parallel)")

    def blocks(self, config):
        return [StageBlock("towers", 1.0)]

    def build(self, run, blocks, ctx, *, dtype, device, checkpoint):
        model = TwoTowers(run.model_config, ctx, device=device, dtype=dtype)
        if torch.device(device).type != "meta":
            init_parameters(model, run.seed)
        return model

    def tokens(self, run, microbatches) -> int:
        return 2 * sum(mb["x"].shape[0] for mb in microbatches)


class ToyData(DataSide):
    input_keys = ("x", "y")

    def dataset(self, spec, run):
        return Pairs()

    def collator(self, run, dataset):
        return lambda samples: {
            "x": torch.stack([s["x"] for s in samples]),
            "y": torch.stack([s["y"] for s in samples]),
        }


class MatchObjective(StepObjective):
    metric_sums = ("correct", "pairs")
    metrics = (MetricSpec("match_accuracy", "correct", "pairs", "acc"),)

    def backward_passes(self, num_microbatches: int) -> int:
        return 1  # one backward of the whole step's loss

    def forward_backward(self, chunks, microbatches, ctx, run):
        """Embeddings of every microbatch, gathered over dp with autograd; each rank scores its
        own rows against the global batch (both directions) and backprops their mean: the mean
        over dp of these gradients is the gradient of the global loss."""
        (model,) = chunks
        dev = ctx.device
        pairs = [model(mb["x"].to(dev), mb["y"].to(dev)) for mb in microbatches]
        img = torch.cat([p[0] for p in pairs])  # (local b, e)
        txt = torch.cat([p[1] for p in pairs])
        b, rank = img.shape[0], comm.rank(ctx.dp_group)
        all_txt = _GatherDP.apply(txt, ctx.dp_group) if ctx.dp_size > 1 else txt
        all_img = _GatherDP.apply(img, ctx.dp_group) if ctx.dp_size > 1 else img
        scale = model.logit_scale.exp()
        labels = torch.arange(b, device=dev) + rank * b
        i2t = scale * img @ all_txt.T  # (b, B)
        t2i = scale * txt @ all_img.T
        loss = (F.cross_entropy(i2t, labels) + F.cross_entropy(t2i, labels)) / 2
        loss.backward()
        correct = (i2t.argmax(-1) == labels).sum().float()
        sums = torch.stack([loss.detach() * b, correct, torch.tensor(float(b), device=dev)])
        comm.all_reduce(sums, ctx.dp_group)
        return sums[0] / sums[2], sums


class ToyRecipe(Recipe):
    name = "toy"

    def __init__(self) -> None:
        super().__init__(ToyModel(), ToyData(), MatchObjective())


def reference_loss(model: TwoTowers, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The global batch's loss in one process, written out."""
    img, txt = model(x, y)
    logits = model.logit_scale.exp() * img @ txt.T
    labels = torch.arange(len(x))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
