"""pi0's one pipeline block as the planner sees it (:mod:`parallax.models.estimate`): the
forward FLOPs of every stream (:mod:`.flops`) as matmul work, and a rough count of what one
sample keeps for the backward (each stream's residual, norms, q/k/v/o and MLP activations per
layer, the tower's blocks), checked against what autograd keeps (saved-tensor hooks, in
``tests/families/pi0/test_estimate.py``)."""

from __future__ import annotations

from parallax.families.pi0.config import GemmaConfig, Pi0Config
from parallax.families.pi0.flops import forward_flops
from parallax.models.estimate import BlockEstimate, Part, Split, vision_tower


def _norm_saved(width: int, e: int) -> int:
    """Bytes a token's Gemma norm keeps: its input and ``rms(x)`` in float32 and its output
    in the stream's dtype (its weight's float32 copy is per layer, not per token)."""
    return width * (8 + e)


def _stream_saved(g: GemmaConfig, tokens: int, e: int, adaptive: bool) -> Split:
    """One stream's tokens in a joint layer: q, the attention output and its flattened copy
    (the output projection's input), the softmax statistics (float32), the GeGLU's gate,
    up, gelu(gate) and product (sharded); both norms, the key and value, and behind adaptive
    norms the two gated sublayer outputs (replicated)."""
    q = g.heads * g.head_dim
    sharded = tokens * (3 * e * q + 4 * g.heads + 4 * e * g.mlp_hidden)
    replicated = tokens * (2 * _norm_saved(g.width, e) + 2 * e * g.head_dim)
    replicated += tokens * 2 * e * g.width if adaptive else 0
    return Split(sharded, replicated)


def _layer(config: Pi0Config, e: int, last: bool) -> Part:
    """A joint layer (the last: the prefix stream's input norm, key and value alone, its
    queries and MLP never computed). Checkpointed under the ``text`` scope, it keeps both
    streams' inputs (and pi0.5's conditioning); compiled, the norms' float32 copies are fused
    away (each keeps its output)."""
    p, x = config.prefix, config.expert
    n_p, n_s = config.prefix_length, config.suffix_length
    expert = _stream_saved(x, n_s, e, config.pi05)
    kv = n_p * 2 * e * p.head_dim
    if last:
        prefix = Split(0, n_p * _norm_saved(p.width, e) + kv)
        fused = Split(0, n_p * e * p.width + kv)
    else:
        prefix = _stream_saved(p, n_p, e, False)
        fused = Split(prefix.sharded, n_p * 2 * e * p.width + kv)
    norms = n_s * (_norm_saved(x.width, e) - e * x.width) * 2  # what fusing drops
    f = forward_flops(config)
    attention = 4 * n_s * (n_p + n_s) * x.heads * x.head_dim
    attention += 0 if last else 4 * n_p * n_p * p.heads * p.head_dim
    flops = (f["prefix"] + f["expert"]) / config.depth  # the layers' mean
    streams = n_s * x.width + (0 if last else n_p * p.width)  # rows behind the all-reduces
    return Part(
        "last joint layer" if last else "joint layer",
        saved=prefix + expert,
        compiled=fused + Split(expert.sharded, expert.replicated - norms),
        scope="text",
        kept=Split(0, e * (n_p * p.width + (n_s + config.pi05) * x.width)),
        gemm_flops=flops - attention,
        attention_flops=attention,
        tokens=n_p + n_s,
        seq=n_p + n_s,
        tp_reduces=2 if last else 4,  # o_proj and down_proj of each stream run
        tp_bytes=2.0 * e * streams,
    )


def block_estimates(config: Pi0Config, run) -> list[BlockEstimate]:
    """One per :meth:`~.model.Pi0Model.stage_blocks` block; each but the last hands on the
    two streams' hidden states (and pi0.5's conditioning). The joint attention's mask and the
    rotary tables are made once per forward and shared by every layer, so they are counted
    once, in the first block."""
    e = 2 if run.precision == "bf16" else 4
    f = forward_flops(config)
    n_p, n_s = config.prefix_length, config.suffix_length
    t = n_p + n_s
    hands_on = e * (n_p * config.prefix.width + (n_s + config.pi05) * config.expert.width) + n_p
    embed = (
        *vision_tower(config.vision, e, images=config.num_cameras),
        Part("suffix heads", gemm_flops=f["heads"] / 2, tokens=config.chunk),
        Part("mask and rotary tables", saved=Split(0, e * t * (t + 2 * config.prefix.head_dim))),
    )
    head = Part("action head", gemm_flops=f["heads"] / 2, tokens=config.chunk)
    body = [BlockEstimate((_layer(config, e, False),), hands_on)] * (config.depth - 1)
    last = BlockEstimate((_layer(config, e, True), head), 0.0)
    return [BlockEstimate(embed, hands_on), *body, last]
