"""The dual encoders' objective: the contrastive loss of the whole global batch, run by the
recipe itself (a ``"step"`` objective: :func:`~parallax.families.siglip.step.contrastive_step`
caches embeddings across microbatches, so gradient accumulation never shrinks the negatives).

Training metrics: the temperature ``t = exp(logit_scale)``, the bias, and the shares of
captions truncated and images resized (:mod:`parallax.families.siglip.batches`). Evaluation: the
loss, zero-shot top-1/top-5 accuracy and image->text / text->image recall@1/5/10
(:mod:`parallax.families.siglip.evaluate`).
"""

from __future__ import annotations

import torch

from parallax import comm
from parallax.families.siglip.evaluate import evaluate_batch
from parallax.families.siglip.step import contrastive_step
from parallax.recipe import MetricSpec, Microbatch, StepObjective

KS = (1, 5, 10)


class ContrastiveObjective(StepObjective):
    """SigLIP's sigmoid or CLIP's softmax loss over the global batch (the config says which)."""

    metric_sums = ("scale_sum", "bias_sum", "truncated", "resized", "pairs")
    metrics = (
        MetricSpec("temperature", "scale_sum", "pairs", "t", ".2f"),
        MetricSpec("logit_bias", "bias_sum", "pairs", "b", ".2f"),
        MetricSpec("truncated", "truncated", "pairs", "trunc", ".2f"),
        MetricSpec("resized", "resized", "pairs", "resized", ".2f"),
    )
    eval_metric_sums = (
        *(f"{d}_r{k}" for d in ("i2t", "t2i") for k in KS),
        "queries",
        "zs_top1",
        "zs_top5",
        "zs_images",
    )
    eval_metrics = (
        *(
            MetricSpec(f"{name}_r@{k}", f"{d}_r{k}", "queries", f"{d} r@{k}")
            for d, name in (("i2t", "image_to_text"), ("t2i", "text_to_image"))
            for k in KS
        ),
        MetricSpec("zero_shot_top1", "zs_top1", "zs_images", "zs@1"),
        MetricSpec("zero_shot_top5", "zs_top5", "zs_images", "zs@5"),
    )

    def loss_units(self, mb: Microbatch) -> int:
        return int(mb["pixel_values"].shape[0])

    def forward_backward(self, chunks, microbatches, ctx, run):
        (model,) = chunks
        dev = ctx.device
        pairs = [(mb["pixel_values"].to(dev), mb["input_ids"].to(dev)) for mb in microbatches]
        result = contrastive_step(model, pairs)
        b = float(result.samples)
        bias = model.logit_bias.detach().float() if model.logit_bias is not None else None
        local = [
            result.local_loss.float() * b,
            model.logit_scale.detach().float().exp().reshape(()) * b,
            (bias.reshape(()) * b) if bias is not None else torch.zeros((), device=dev),
            torch.tensor(float(sum(int(mb.get("truncated", 0)) for mb in microbatches))),
            torch.tensor(float(sum(int(mb.get("resized", 0)) for mb in microbatches))),
            torch.tensor(b),
        ]
        sums = torch.stack([x.to(dev) for x in local])
        comm.all_reduce(sums, ctx.dp_group)
        return sums[0] / sums[-1], sums

    @torch.no_grad()
    def evaluate_step(self, chunks, microbatches, ctx, run) -> torch.Tensor:
        return evaluate_batch(chunks[0], microbatches, ctx, KS)
