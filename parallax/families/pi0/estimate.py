"""pi0's one pipeline block as the planner sees it (:mod:`parallax.models.estimate`): the
forward FLOPs of every stream (:mod:`.flops`) as matmul work, and a rough count of what one
sample keeps for the backward (each stream's residual, norms, q/k/v/o and MLP activations per
layer, the tower's blocks). A first estimate: not yet checked against saved-tensor hooks."""

from __future__ import annotations

from parallax.families.pi0.config import GemmaConfig, Pi0Config
from parallax.families.pi0.flops import forward_flops
from parallax.models.estimate import BlockEstimate, Part, Split, vision_tower


def _stream_saved(g: GemmaConfig, tokens: int, e: int) -> Split:
    q = g.heads * g.head_dim
    sharded = tokens * (3 * e * q + 3 * e * g.mlp_hidden)  # q, attention out; gate, up, product
    replicated = tokens * (2 * (4 + 2 * e) * g.width + 2 * e * g.head_dim)  # norms; k, v
    return Split(sharded, replicated)


def block_estimates(config: Pi0Config, run) -> list[BlockEstimate]:
    """One per :meth:`~.model.Pi0Model.stage_blocks` block; each but the last hands on the
    two streams' hidden states (and pi0.5's conditioning)."""
    e = 2 if run.precision == "bf16" else 4
    f = forward_flops(config)
    n_p, n_s = config.prefix_length, config.suffix_length
    hands_on = e * (n_p * config.prefix.width + (n_s + config.pi05) * config.expert.width) + n_p
    layer = Part(
        "joint layer",
        saved=_stream_saved(config.prefix, n_p, e) + _stream_saved(config.expert, n_s, e),
        gemm_flops=(f["prefix"] + f["expert"]) / config.depth,
        tokens=n_p + n_s,
    )
    embed = (
        *vision_tower(config.vision, e, images=config.num_cameras),
        Part("suffix heads", gemm_flops=f["heads"] / 2, tokens=config.chunk),
    )
    head = Part("action head", gemm_flops=f["heads"] / 2, tokens=config.chunk)
    body = [BlockEstimate((layer,), hands_on)] * (config.depth - 1)
    return [BlockEstimate(embed, hands_on), *body, BlockEstimate((layer, head), 0.0)]
