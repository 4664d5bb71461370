"""Model FLOPs of LLaVA-NeXT, per sample, in the convention of :mod:`parallax.train.flops`.

Per sample, a training step costs forward + backward = 3 x the forward of every trained part
(1 x for a frozen CLIP tower, which needs no backward):

    FLOPs = 3 x [2 x N_c x T_c + attention_c]   summed over the parts c

with ``N_c`` the parameters applied per token (embedding and position lookups excluded) and
``T_c`` the tokens the part sees:

- CLIP tower, per tile (``n_tiles`` = 1 + grid tiles, 3-5 for LLaVA-v1.6; zero padding tiles are
  never run): the patch convolution over ``P`` = 576 patches, ``pre_layrnorm`` and blocks
  0..22 over ``P + 1`` = 577 tokens, bidirectional attention ``4 x 577^2 x w`` per block;
- projector over the ``P`` patch features of every tile;
- Llama layers and the final norm over the ``S`` real tokens of the sample (text plus image
  tokens; the right padding is not useful work and is not counted), causal attention
  ``2 x S^2 x h`` per layer;
- lm_head over ``S`` positions, or only the labelled ones (``logits_rows``).
"""

from __future__ import annotations

from parallax.families.llava_next.config import LlavaNextConfig


def _vit_parts(config: LlavaNextConfig) -> tuple[float, float, float]:
    """(patch params per patch, block params per token, attention FLOPs) of one tile."""
    v = config.vision
    w, f, n = v.width, v.mlp_hidden, v.num_patches + 1
    blocks = v.feature_index + 1
    block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * f + f) + (f * w + w)
    patch = 3 * v.patch_size**2 * w + (w if v.patch_bias else 0)
    norms = 2 * w if v.pre_norm else 0
    return patch, blocks * block + norms, blocks * 4.0 * n * n * w


def vision_forward_flops(config: LlavaNextConfig, n_tiles: int) -> float:
    """Forward FLOPs of the tower and projector on ``n_tiles`` tiles (the "vision" block)."""
    p, d, h = config.vision.num_patches, config.vision.width, config.text.hidden_size
    patch, blocks, attention = _vit_parts(config)
    tower = 2 * patch * p + 2 * blocks * (p + 1) + attention
    projector = 2 * p * (d * h + h + h * h + h)
    return n_tiles * (tower + projector)


def llm_forward_flops(
    config: LlavaNextConfig, seq_len: int, logits_rows: int | None = None
) -> float:
    """Forward FLOPs of the Llama layers, final norm and lm_head on ``seq_len`` tokens."""
    t = config.text
    h, kv, f = t.hidden_size, t.kv_heads * t.head_dim, t.intermediate_size
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    rows = seq_len if logits_rows is None else logits_rows
    body = t.num_hidden_layers * (2 * layer * seq_len + 2.0 * seq_len * seq_len * h)
    return body + 2 * h * seq_len + 2 * h * t.vocab_size * rows


def sample_flops(
    config: LlavaNextConfig,
    n_tiles: int,
    seq_len: int,
    *,
    vision_trained: bool = True,
    logits_rows: int | None = None,
) -> float:
    """Training FLOPs of one sample with ``n_tiles`` tiles (0: no image) and ``seq_len`` real
    tokens. A frozen tower counts its forward only; the projector is always trained."""
    p, d, h = config.vision.num_patches, config.vision.width, config.text.hidden_size
    patch, blocks, attention = _vit_parts(config)
    tower = n_tiles * (2 * patch * p + 2 * blocks * (p + 1) + attention)
    projector = n_tiles * 2 * p * (d * h + h + h * h + h)
    llm = llm_forward_flops(config, seq_len, logits_rows)
    return (3 if vision_trained else 1) * tower + 3 * (projector + llm)
