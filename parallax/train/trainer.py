"""The composition: one OpenVLA split over pp, sharded over tp, trained with ZeRO-1 over dp.

:class:`Trainer` builds this rank's model chunks, the pipeline schedule, the optimizer and the
learning-rate schedule from a :class:`~parallax.train.config.TrainConfig`, and runs one optimizer
step per :meth:`Trainer.train_step` without waiting for the device: the one agreement of a step
(every rank's inputs are well-formed) is a small all-reduce over the host group. Loss
normalisation follows the global batch: each microbatch contributes ``sum of token losses /
tokens in the global batch``, so the loss (and the update) is the same at every layout.

Speed options, each computing the same step (see ``TrainConfig``): ``logits="labelled"`` has the
last stage return hidden states and applies the final norm and lm_head inside the loss, to the
labelled positions only (8 of 297 per OpenVLA sample); ``fused_projections`` builds q/k/v and
gate/up as one weight each; ``compile`` compiles each block; without ``pipeline_syncs`` the
pipeline agrees on its program once and sizes received activations from the batch. Pass labels
on the host (as the data loader does): the labelled positions and the token count are read from
them without a device synchronisation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from parallax import comm
from parallax.context import ParallelContext
from parallax.models import OpenVLA, OpenVLAConfig
from parallax.models.objectives import (
    action_metrics,
    labelled_rows,
    loss_token_count,
    rows_action_metrics,
    rows_loss,
    vla_loss,
)
from parallax.optim import ZeroOptimizer
from parallax.pipeline import (
    PipelineStage,
    Schedule,
    TensorMeta,
    Timeline,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    run_schedule,
    split,
)
from parallax.train.config import TrainConfig
from parallax.train.flops import batch_flops

log = logging.getLogger(__name__)

METRIC_KEYS = ("loss_sum", "action_correct", "action_l1_sum", "action_tokens")
INPUT_KEYS = ("pixel_values", "input_ids", "labels")  # what each microbatch dict holds


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


def with_fusion(config: OpenVLAConfig, fused: bool) -> OpenVLAConfig:
    """``config`` with fused q/k/v and gate/up projections as asked, where the model allows
    them (grouped-query attention keeps separate projections)."""
    text = config.text
    if fused and text.kv_heads != text.num_attention_heads:
        log.info(
            "fused projections need as many key/value heads as query heads (%d != %d): "
            "keeping separate projections",
            text.kv_heads,
            text.num_attention_heads,
        )
        fused = False
    return config.with_options(fused_projections=fused)


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
        compile_options: dict | None = None,
    ) -> None:
        """``model_config`` overrides ``cfg.model`` (its ``fused_projections`` follows ``cfg``);
        ``compile_options`` go to ``torch.compile`` when ``cfg.compile``."""
        cfg.check()  # fills the model's default learning rate when none was given
        self.cfg, self.ctx = cfg, ctx
        if model_config is None:
            model_config, checkpoint_dir = resolve_model_config(cfg.model)
        self.model_config = with_fusion(model_config, cfg.fused_projections)
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
            chunk.return_hidden = cfg.logits == "labelled"  # the loss applies the head
            if cfg.compile:
                chunk.compile_blocks(**self._compile_options(compile_options))
            self.chunks.append(chunk)
            self.stages.append(PipelineStage(chunk, s, len(self.ranges), ctx))
        self.optimizer = self._build_optimizer()
        if cfg.overlap_param_gather and ctx.dp_size > 1:
            self.optimizer.overlap_param_gather(*self.chunks)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self._metrics: list[torch.Tensor] = []
        self._tokens: torch.Tensor | None = None
        self._tokens_work = None  # the token count's all-reduce, waited for where it is used
        self._agreed = False  # the pipeline ranks agreed on the program once

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
                checkpoint_dir,
                ctx,
                dtype=self.dtype,
                device=ctx.device,
                config=self.model_config,
                **kw,
            )
        return OpenVLA(
            self.model_config, ctx, dtype=self.dtype, device=ctx.device, seed=cfg.seed, **kw
        )

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their global (layout-free) names, with their current
        values (the last step's deferred all-gathers are waited for)."""
        self.optimizer.wait_params()
        return self._named_parameters()

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def _compile_options(self, given: dict | None) -> dict:
        """``torch.compile`` options: those given, and with ``cuda_graphs`` the inductor's
        reduce-overhead mode (other backends take no mode; on the CPU inductor ignores it)."""
        options = dict(given or {})
        if self.cfg.cuda_graphs and options.get("backend", "inductor") == "inductor":
            options.setdefault("mode", "reduce-overhead")
        return options

    def _build_optimizer(self) -> ZeroOptimizer:
        named = [(n, p) for n, p in self._named_parameters() if p.requires_grad]
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
            # a CUDA graph's gradient outputs live in its memory pool, which the next replay
            # on the compute stream may overwrite: copy them out on that stream
            side_stream_grad_copies=not self.cfg.cuda_graphs,
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            **kwargs,
        )

    # -- one step ----------------------------------------------------------------------------
    def _loss_fn(self, out: torch.Tensor, target) -> torch.Tensor:
        """Sum of this microbatch's token losses over the global batch's token count, times
        dp (ZeRO averages gradients over dp); metrics are kept on the side.

        ``out`` is the logits ``(b, s, V/tp)``, or with ``logits="labelled"`` the hidden states
        ``(b, s, h)`` and ``target`` the labelled rows: the head runs on those rows only."""
        chunk, mc = self.chunks[-1], self.model_config
        vocab, tok = mc.text.vocab_size, chunk.action_tokenizer
        if self.cfg.logits == "labelled":
            rows, row_targets = target
            hidden = out.flatten(0, 1).index_select(0, rows)  # (n, h), the same rows on every tp
            logits = chunk.head(hidden)  # (n, V/tp)
            ce = rows_loss(logits, row_targets, self.ctx, vocab_size=vocab)
            m = rows_action_metrics(
                logits, row_targets, self.ctx, vocab_size=vocab, action_tokenizer=tok
            )
        else:
            p = mc.num_patches
            ce = vla_loss(out, target, self.ctx, num_patches=p, vocab_size=vocab, reduction="sum")
            m = action_metrics(
                out, target, self.ctx, num_patches=p, vocab_size=vocab, action_tokenizer=tok
            )
        self._metrics.append(
            torch.stack(
                [ce.detach().float(), m["action_correct"], m["action_l1_sum"], m["action_tokens"]]
            )
        )
        return ce * (self.ctx.dp_size / self._tokens_ready())

    def _global_tokens(self, microbatches: list[dict]) -> torch.Tensor:
        """Loss tokens of the global batch (a collective over dp, left in flight: see
        :meth:`_tokens_ready`); no host sync for host labels."""
        dev = self.ctx.device
        counts = [loss_token_count(mb["labels"]) for mb in microbatches]
        if all(c.device.type == "cpu" for c in counts):  # a fill, not a blocking copy
            count = torch.full((), float(sum(int(c) for c in counts)), device=dev)
        else:
            count = torch.stack([c.to(dev, non_blocking=True) for c in counts]).sum().float()
        self._tokens_work = comm.all_reduce_async(count, self.ctx.dp_group)
        return count

    def _tokens_ready(self) -> torch.Tensor:
        """The global token count, once its all-reduce is done. It is waited for at its first
        use, not when launched: the all-reduce queues behind the previous step's parameter
        all-gathers, and waiting at launch would hold the whole forward back for them. At least
        1 (a batch without labels has loss 0); the clamp is idempotent."""
        comm.wait(self._tokens_work)
        self._tokens_work = None
        return self._tokens.clamp_(min=1.0)

    def _targets(self, microbatches: list[dict]) -> list:
        """What the loss needs per microbatch, on the device: the labels, or the labelled rows
        and their labels (found on the host for host labels)."""
        dev = self.ctx.device
        if self.cfg.logits != "labelled":
            return [mb["labels"].to(dev, non_blocking=True) for mb in microbatches]
        p = self.model_config.num_patches
        return [
            tuple(x.to(dev, non_blocking=True) for x in labelled_rows(mb["labels"], p))
            for mb in microbatches
        ]

    def _recv_metas(self, microbatches: list[dict]):
        """What every later stage receives: the hidden states ``(b, P + t, h)`` in the model's
        dtype, from the batch's shapes (the same on every pipeline rank)."""
        p, h = self.model_config.num_patches, self.model_config.text.hidden_size
        shapes = [tuple(mb["input_ids"].shape) for mb in microbatches]

        def metas(stage: int, m: int) -> list[TensorMeta]:
            b, t = shapes[m]
            return [TensorMeta((b, p + t, h), self.dtype, True)]

        return metas

    def train_step(self, microbatches: list[dict], timeline: Timeline | None = None) -> StepOutput:
        """One optimizer step over this dp rank's microbatches (dicts of ``pixel_values``
        ``(b, 6, S, S)``, ``input_ids`` ``(b, t)``, ``labels`` ``(b, t)``, labels best on the
        host). Every rank passes ``num_microbatches`` of them: the ranks agree on that before
        any collective, so a wrong count on one rank raises the same ``ValueError`` on all."""
        ctx, dev = self.ctx, self.ctx.device
        found = comm.problems(self._input_problem(microbatches), ctx.agreement_group)
        if found:
            raise ValueError("train_step: " + "; ".join(found))
        self._tokens = self._global_tokens(microbatches)
        self._metrics = []
        inputs = [
            (
                mb["pixel_values"].to(dev, non_blocking=True),
                mb["input_ids"].to(dev, non_blocking=True),
            )
            for mb in microbatches
        ]
        targets = self._targets(microbatches)
        syncs = self.cfg.pipeline_syncs
        if self.cfg.cuda_graphs:  # last step's graph outputs are dead: replay on the fast path
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad()
        # the phases are named for profiles (benchmarks/profile_step.py); free otherwise
        with record_function("parallax.schedule"):
            run_schedule(
                self.program,
                self.stages,
                ctx,
                inputs=inputs,
                targets=targets,
                loss_fn=self._loss_fn,
                loss_scale=1.0,
                timeline=timeline,
                agree=syncs or not self._agreed,
                recv_metas=None if syncs or ctx.pp_size == 1 else self._recv_metas(microbatches),
            )
        self._agreed = True
        with record_function("parallax.grad_norm"):
            # before step(): a collective queued after step()'s deferred all-gathers would wait
            metrics = self._reduce_metrics()
            if self.cfg.grad_clip > 0:
                grad_norm = self.optimizer.clip_grad_norm_(self.cfg.grad_clip)
            else:
                grad_norm = self.optimizer.grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        with record_function("parallax.optimizer"):
            self.optimizer.step()
        self.scheduler.step()
        loss = metrics[0] / self._tokens_ready()  # the global batch's mean token loss
        return StepOutput(loss=loss, grad_norm=grad_norm.detach(), metrics=metrics, lr=lr)

    def _input_problem(self, microbatches: list[dict]) -> str | None:
        """What is wrong with this rank's microbatches, or ``None``."""
        if len(microbatches) != self.num_microbatches:
            return (
                f"got {len(microbatches)} microbatches, the schedule runs "
                f"{self.num_microbatches} (global batch / (micro batch x dp))"
            )
        for m, mb in enumerate(microbatches):
            missing = [k for k in INPUT_KEYS if not isinstance(mb, dict) or k not in mb]
            if missing:
                return f"microbatch {m} lacks {', '.join(missing)}"
        return None

    def model_flops(self, microbatches: list[dict]) -> float:
        """Model FLOPs of one step over these microbatches, the lm_head counted where it runs
        (:func:`parallax.train.flops.batch_flops`)."""
        return batch_flops(
            self.model_config,
            microbatches,
            labelled_logits=self.cfg.logits == "labelled",
            frozen_vision=self.cfg.freeze_vision,
        )

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
