"""Model FLOPs of pi0 / pi0.5 per sample, every stream counted (2 per multiply-add; training
3 x the forward: forward and backward, no recomputation counted).

- the tower and projector per camera: :meth:`ViTConfig.flops` + ``2 p w_v w_p``;
- per joint layer, each stream's matmuls over its own tokens: ``2 n (w q + 2 w d + q w +
  3 w f)`` with ``q = heads x head_dim`` and ``d = head_dim`` (one key/value head), pi0.5's
  adaptive norms ``2 x 2 w (3 w)`` per sample; attention ``4 T_q T_k q`` per stream over the
  keys it sees (the prefix: the prefix; the suffix: prefix and suffix), the full squares
  counted (the mask's zeros are still computed);
- the suffix heads: ``action_in_proj``, pi0's state token and action-time MLP, pi0.5's time
  MLP and the final adaptive norm's dense, ``action_out_proj``.

The last layer's prefix stream after its keys and values is not run (it reaches nothing).
"""

from __future__ import annotations

from parallax.families.pi0.config import GemmaConfig, Pi0Config


def stream_layer_flops(g: GemmaConfig, tokens: int, keys: int, adaptive: bool = False) -> float:
    """One stream's half of a joint layer over ``tokens`` queries attending to ``keys``."""
    q, d = g.heads * g.head_dim, g.kv_heads * g.head_dim
    matmuls = 2 * tokens * g.width * (2 * q + 2 * d + 3 * g.mlp_hidden)
    norms = 2 * 2 * g.width * 3 * g.width if adaptive else 0
    return matmuls + 4 * tokens * keys * q + norms


def forward_flops(config: Pi0Config) -> dict[str, float]:
    """Forward FLOPs per sample, by part (``vision``, ``prefix``, ``expert``, ``heads``)."""
    v, p, e = config.vision, config.prefix, config.expert
    n_p, n_s = config.prefix_length, config.suffix_length
    per_camera = v.flops() + 2 * v.num_patches * v.width * p.width
    prefix = (config.depth - 1) * stream_layer_flops(p, n_p, n_p)
    prefix += 2 * n_p * p.width * 2 * p.head_dim * p.kv_heads  # the last layer's k and v
    expert = config.depth * stream_layer_flops(e, n_s, n_p + n_s, config.pi05)
    w, a, h = e.width, config.max_action_dim, config.chunk
    heads = 2 * h * a * w * 2  # action_in_proj, action_out_proj
    if config.pi05:  # the time MLP, the final adaptive norm's dense
        heads += 2 * 2 * w * w + 2 * w * 3 * w
    else:  # the state token, the action-time MLP
        heads += 2 * config.max_state_dim * w + 2 * h * 3 * w * w
    return {
        "vision": config.num_cameras * per_camera,
        "prefix": prefix,
        "expert": expert,
        "heads": heads,
    }


def attention_flops(config: Pi0Config) -> float:
    """The attention part of :func:`forward_flops` (scores and weighted values)."""
    v, p, e = config.vision, config.prefix, config.expert
    n_p, n_s = config.prefix_length, config.suffix_length
    vision = config.num_cameras * (v.feature_index + 1) * 4 * v.num_patches**2 * v.width
    prefix = (config.depth - 1) * 4 * n_p * n_p * p.heads * p.head_dim
    return vision + prefix + config.depth * 4 * n_s * (n_p + n_s) * e.heads * e.head_dim


def flops_per_sample(config: Pi0Config, train: bool = True) -> float:
    """Model FLOPs of one sample's training step (3 x the forward) or forward."""
    return (3 if train else 1) * sum(forward_flops(config).values())
