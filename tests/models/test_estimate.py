"""The planner's activation estimates against what autograd really keeps: the bytes of the
tensors saved for the backward (``saved_tensors_hooks``) by a Llama decoder layer and a ViT
block, in float32 and bfloat16, weights left out."""

from dataclasses import replace

import pytest
import torch

from parallax.models.estimate import Split, llama_layer, vit_blocks
from parallax.models.llama import LlamaConfig, LlamaDecoderLayer, rope_cos_sin
from parallax.models.vit import ViTBlock, ViTConfig

DTYPES = {4: torch.float32, 2: torch.bfloat16}


def saved_bytes(forward, module: torch.nn.Module) -> int:
    """Bytes of distinct storage autograd keeps from ``forward()``, parameters left out."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


@pytest.mark.parametrize("e", [4, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_a_decoder_layer_keeps_what_the_estimate_says(e, fused):
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=1,
        num_attention_heads=4,
        fused_projections=fused,
    )
    dtype, b, s = DTYPES[e], 3, 40
    layer = LlamaDecoderLayer(cfg, None, 0, dtype=dtype)
    x = torch.randn(b, s, cfg.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(s), cfg.head_dim, cfg.rope_theta, dtype)
    got = saved_bytes(lambda: layer(x, cos, sin), layer)
    want = b * llama_layer(cfg, s, e).saved.at(1)
    assert got == pytest.approx(want, rel=0.03)


def test_grouped_query_attention_keeps_smaller_keys_and_values():
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=344, num_attention_heads=8,
        num_key_value_heads=2,
    )  # fmt: skip
    layer = LlamaDecoderLayer(cfg, None, 0)
    x = torch.randn(2, 24, 128, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(24), cfg.head_dim, cfg.rope_theta, torch.float32)
    got = saved_bytes(lambda: layer(x, cos, sin), layer)
    assert got == pytest.approx(2 * llama_layer(cfg, 24, 4).saved.at(1), rel=0.03)


@pytest.mark.parametrize("e", [4, 2])
@pytest.mark.parametrize(
    "options", [dict(layer_scale=0.1), dict(act="quick_gelu"), dict(act="gelu_tanh")]
)
def test_a_vit_block_keeps_what_the_estimate_says(e, options):
    cfg = replace(ViTConfig(width=96, depth=1, num_heads=4, mlp_hidden=384), **options)
    dtype, b, n = DTYPES[e], 3, 37
    block = ViTBlock(cfg, None, dtype=dtype)
    x = torch.randn(b, n, cfg.width, dtype=dtype, requires_grad=True)
    got = saved_bytes(lambda: block(x), block)
    assert got == pytest.approx(b * vit_blocks(cfg, n, e, 1, "vision").saved.at(1), rel=0.03)


def test_checkpointing_keeps_the_inputs_and_tp_divides_the_sharded_part():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4)
    part = llama_layer(cfg, 10, 2)
    assert part.keeps(True) == part.keeps("text") == Split(0.0, 10 * 64 * 2)
    assert part.keeps("vision") == part.keeps(False) == part.saved
    assert part.saved.at(2) == part.saved.sharded / 2 + part.saved.replicated
