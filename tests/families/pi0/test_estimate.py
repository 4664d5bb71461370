"""The planner's activation estimate of a pi0 / pi0.5 joint layer against what autograd keeps
(the bytes of the tensors saved for the backward, weights left out), in float32 and bfloat16:
a middle layer (both streams whole) and the last (the prefix stream's input norm, key and value
alone), with the attention mask and the rotary tables counted once (the first block's)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from parallax.families.pi0.config import PRESETS, GemmaConfig
from parallax.families.pi0.estimate import block_estimates
from parallax.families.pi0.joint import JointLayer, attention_bias, joint_layout
from parallax.families.pi0.suffix import suffix_flags
from parallax.models.llama import rope_cos_sin
from tests.models.test_estimate import DTYPES, saved_bytes

PREFIX = GemmaConfig(width=128, depth=2, heads=4, head_dim=32, mlp_hidden=344, vocab_size=300)
EXPERT = GemmaConfig(width=64, depth=2, heads=4, head_dim=32, mlp_hidden=176)


@pytest.mark.parametrize("e", [4, 2])
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("last", [False, True])
def test_a_joint_layer_keeps_what_the_estimate_says(variant, e, last):
    cfg = replace(PRESETS[f"{variant}-tiny"], prefix=PREFIX, expert=EXPERT)
    dtype, b = DTYPES[e], 3
    n_p, n_s = cfg.prefix_length, cfg.suffix_length
    layer = JointLayer(cfg, None, 0, dtype=dtype)
    prefix = torch.randn(b, n_p, PREFIX.width, dtype=dtype, requires_grad=True)
    suffix = torch.randn(b, n_s, EXPERT.width, dtype=dtype, requires_grad=True)
    cond = torch.randn(b, EXPERT.width, dtype=dtype, requires_grad=True) if cfg.pi05 else None
    allowed, _ = joint_layout(torch.ones(b, n_p, dtype=torch.bool), suffix_flags(cfg))
    bias = attention_bias(allowed, dtype)  # (b, 1, T, T)
    cos, sin = rope_cos_sin(torch.arange(n_p + n_s), PREFIX.head_dim, 1e4, dtype)
    cos, sin = (x.expand(b, 1, -1, -1).contiguous() for x in (cos, sin))  # per sample, as run
    args = ((prefix, suffix), cos, sin, bias, cond, None, (not last, True))
    got = saved_bytes(lambda: layer(*args), layer)
    blocks = block_estimates(cfg, SimpleNamespace(precision="bf16" if e == 2 else "fp32"))
    part = blocks[-1].parts[0] if last else blocks[1].parts[0]
    mask = blocks[0].parts[-1]
    assert mask.name == "mask and rotary tables"
    want = b * (part.saved.at(1) + mask.saved.at(1))
    assert got == pytest.approx(want, rel=0.03)
