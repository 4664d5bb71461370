"""The composition: one OpenVLA split over pp, sharded over tp, trained with ZeRO-1 over dp.

:class:`Trainer` builds this rank's model chunks, the pipeline schedule, the optimizer and the
learning-rate schedule from a :class:`~parallax.train.config.TrainConfig`, and runs one optimizer
step per :meth:`Trainer.train_step` without host synchronisation. Loss normalisation follows the
global batch: each microbatch contributes ``sum of token losses / tokens in the global batch``,
so the loss (and the update) is the same at every layout.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from parallax import comm
from parallax.context import ParallelContext
from parallax.models import OpenVLA, OpenVLAConfig
from parallax.models.objectives import action_metrics, loss_token_count, vla_loss
from parallax.optim import ZeroOptimizer
from parallax.pipeline import (
    PipelineStage,
    Schedule,
    Timeline,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    run_schedule,
    split,
)
from parallax.train.config import TrainConfig

log = logging.getLogger(__name__)

METRIC_KEYS = ("loss_sum", "action_correct", "action_l1_sum", "action_tokens")


def resolve_model_config(spec: str) -> tuple[OpenVLAConfig, Path | None]:
    """A preset name or an OpenVLA checkpoint directory -> (config, checkpoint dir or None)."""
    from parallax.models.config import PRESETS

    if spec in PRESETS:
        return OpenVLAConfig.preset(spec), None
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        return OpenVLAConfig.from_pretrained(path), path
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint "
        "directory with a config.json"
    )


def make_schedule(name: str, pp: int, num_microbatches: int, chunks: int) -> Schedule:
    """The schedule named by ``--schedule``; raises ``ValueError`` saying what would work."""
    if name == "gpipe":
        return gpipe(pp, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, num_microbatches)
    if name == "interleaved":
        return interleaved_1f1b(pp, num_microbatches, chunks)
    raise ValueError(f"unknown schedule {name!r}: use gpipe, 1f1b or interleaved")


def num_microbatches(cfg: TrainConfig, dp: int) -> int:
    """Microbatches each dp rank runs per step (the pipeline's m); checks the batch sizes."""
    from parallax.data import check_batch_sizes

    check_batch_sizes(cfg.global_batch_size, cfg.micro_batch_size, dp)
    return cfg.global_batch_size // (cfg.micro_batch_size * dp)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to ``lr``, then constant or cosine down to ``min_lr`` at ``steps``."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class StepOutput:
    """What one step returns, as tensors (read them only at log steps: no host sync)."""

    loss: torch.Tensor  # global mean token loss
    grad_norm: torch.Tensor
    metrics: torch.Tensor  # METRIC_KEYS summed over the global batch (valid on every rank)
    lr: float


class Trainer:
    """This rank's share of the model, the schedule and the optimizer; see the module doc."""

    def __init__(
        self,
        cfg: TrainConfig,
        ctx: ParallelContext,
        model_config: OpenVLAConfig | None = None,
        checkpoint_dir: Path | None = None,
    ) -> None:
        self.cfg, self.ctx = cfg, ctx
        if model_config is None:
            model_config, checkpoint_dir = resolve_model_config(cfg.model)
        self.model_config = model_config
        self.dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        self.num_microbatches = num_microbatches(cfg, ctx.dp_size)
        # the schedule first: it validates pp, microbatches and chunks before anything is built
        self.schedule = make_schedule(cfg.schedule, ctx.pp_size, self.num_microbatches, cfg.chunks)
        self.program = lower(self.schedule)
        blocks = OpenVLA.stage_blocks(model_config)
        self.ranges = split([b.cost for b in blocks], ctx.pp_size, cfg.chunks, pin_first=1)
        self.block_names = [b.name for b in blocks]
        self.chunks: list[OpenVLA] = []
        self.stages: list[PipelineStage] = []
        for s, rng in enumerate(self.ranges):
            if self.schedule.rank_of(s) != ctx.pp_rank:
                continue
            chunk = self._build_chunk(rng, checkpoint_dir)
            self.chunks.append(chunk)
            self.stages.append(PipelineStage(chunk, s, len(self.ranges), ctx))
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self._metrics: list[torch.Tensor] = []
        self._scale: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None

    # -- building ----------------------------------------------------------------------------
    def _build_chunk(self, blocks: range, checkpoint_dir: Path | None) -> OpenVLA:
        cfg, ctx = self.cfg, self.ctx
        kw = dict(
            blocks=blocks,
            activation_checkpointing=cfg.activation_checkpointing,
            freeze_vision=cfg.freeze_vision,
        )
        if checkpoint_dir is not None:
            return OpenVLA.from_pretrained(
                checkpoint_dir, ctx, dtype=self.dtype, device=ctx.device, **kw
            )
        return OpenVLA(
            self.model_config, ctx, dtype=self.dtype, device=ctx.device, seed=cfg.seed, **kw
        )

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their global (layout-free) names."""
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def _build_optimizer(self) -> ZeroOptimizer:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        decay = [(n, p) for n, p in named if p.dim() >= 2]
        no_decay = [(n, p) for n, p in named if p.dim() < 2]
        kwargs = {}
        if self.ctx.device.type == "cuda":
            kwargs["fused"] = True  # one kernel for the whole fp32 shard
        return ZeroOptimizer(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
            torch.optim.AdamW,
            self.ctx,
            overlap=self.cfg.overlap_grad_reduce,
            backward_passes_per_step=self.num_microbatches,
            param_order=[p for _, p in named],
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            **kwargs,
        )

    # -- one step ----------------------------------------------------------------------------
    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of this microbatch's token losses over the global batch's token count, times
        dp (ZeRO averages gradients over dp); metrics are kept on the side."""
        chunk = self.chunks[-1]
        ce = vla_loss(
            logits,
            labels,
            self.ctx,
            num_patches=self.model_config.num_patches,
            vocab_size=self.model_config.text.vocab_size,
            reduction="sum",
        )
        m = action_metrics(
            logits,
            labels,
            self.ctx,
            num_patches=self.model_config.num_patches,
            vocab_size=self.model_config.text.vocab_size,
            action_tokenizer=chunk.action_tokenizer,
        )
        self._metrics.append(
            torch.stack(
                [ce.detach().float(), m["action_correct"], m["action_l1_sum"], m["action_tokens"]]
            )
        )
        return ce * self._scale

    def _global_tokens(self, microbatches: list[dict]) -> torch.Tensor:
        count = sum(loss_token_count(mb["labels"]) for mb in microbatches)
        count = torch.as_tensor(count, dtype=torch.float32, device=self.ctx.device).clone()
        return comm.all_reduce(count, self.ctx.dp_group).clamp_(min=1.0)

    def train_step(self, microbatches: list[dict], timeline: Timeline | None = None) -> StepOutput:
        """One optimizer step over this dp rank's microbatches (dicts of ``pixel_values``
        ``(b, 6, S, S)``, ``input_ids`` ``(b, t)``, ``labels`` ``(b, t)``)."""
        ctx, dev = self.ctx, self.ctx.device
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"train_step got {len(microbatches)} microbatches, the schedule "
                f"runs {self.num_microbatches}"
            )
        self._tokens = self._global_tokens(microbatches)
        self._scale = ctx.dp_size / self._tokens
        self._metrics = []
        inputs = [
            (
                mb["pixel_values"].to(dev, non_blocking=True),
                mb["input_ids"].to(dev, non_blocking=True),
            )
            for mb in microbatches
        ]
        targets = [mb["labels"].to(dev, non_blocking=True) for mb in microbatches]
        self.optimizer.zero_grad()
        run_schedule(
            self.program,
            self.stages,
            ctx,
            inputs=inputs,
            targets=targets,
            loss_fn=self._loss_fn,
            loss_scale=1.0,
            timeline=timeline,
        )
        if self.cfg.grad_clip > 0:
            grad_norm = self.optimizer.clip_grad_norm_(self.cfg.grad_clip)
        else:
            grad_norm = self.optimizer.grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        metrics = self._reduce_metrics()
        loss = metrics[0] / self._tokens  # the global batch's mean token loss
        return StepOutput(loss=loss, grad_norm=grad_norm.detach(), metrics=metrics, lr=lr)

    def _reduce_metrics(self) -> torch.Tensor:
        """Metric sums over the global batch, on every rank (from the last stage)."""
        dev = self.ctx.device
        if self._metrics:
            local = torch.stack(self._metrics).sum(0)
        else:
            local = torch.zeros(len(METRIC_KEYS), device=dev)
        comm.all_reduce(local, self.ctx.dp_group)
        if self.ctx.pp_size > 1:
            last = self.ctx.pp_peer(self.schedule.rank_of(self.schedule.num_stages - 1))
            comm.broadcast(local, src=last, group=self.ctx.pp_group)
        return local
