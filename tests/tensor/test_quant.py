"""The quantized base's formats and GEMM: the round trip within the error NF4 and int8
promise, the bytes they cost, row-sharded quantization equal to the whole weight's, and the
layer's forward and input gradient equal to a plain linear on the dequantized weight."""

import pytest
import torch
import torch.nn.functional as F

from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.lora import add_adapter
from parallax.tensor.quant import (
    KINDS,
    NF4_BLOCK,
    NF4_WIDEST_GAP,
    bytes_per_weight,
    dequantize,
    quantize,
    quantize_base,
    quantized_weights,
)


def _weight(rows=24, cols=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 17] = 0.3  # an outlier: its block's scale is large, its row's factor too
    w[5].zero_()  # an all-zero row (a zero scale must not divide by zero)
    return w


def test_nf4_round_trip_is_within_its_bound():
    w = _weight()
    p = quantize(w, "nf4")
    back = dequantize(p, torch.float32)
    blocks = -(-w.shape[1] // NF4_BLOCK)
    padded = F.pad(w, (0, blocks * NF4_BLOCK - w.shape[1])).view(w.shape[0], blocks, NF4_BLOCK)
    absmax = padded.abs().amax(-1, keepdim=True).expand_as(padded).reshape(w.shape[0], -1)
    rowmax = w.abs().amax(1, keepdim=True)
    bound = NF4_WIDEST_GAP / 2 * absmax[:, : w.shape[1]] + rowmax / 510  # formats' docstring
    assert ((back - w).abs() <= bound * (1 + 1e-5) + 1e-12).all()
    assert (back[5] == 0).all()
    # the levels are used: the error is far below the largest weight, and not all zero
    assert (back - w).abs().max() < 0.1 * w.abs().max() and back.abs().sum() > 0
    assert p.nbytes() == pytest.approx(bytes_per_weight("nf4", 200) * w.numel())


def test_int8_round_trip_is_within_half_a_step():
    w = _weight()
    p = quantize(w, "int8")
    back = dequantize(p, torch.float32)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((back - w).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert p.codes.dtype == torch.int8 and p.nbytes() == w.numel() + 4 * w.shape[0]


@pytest.mark.parametrize("kind", KINDS)
def test_shards_quantize_as_the_whole_weight(kind):
    """Whole rows (a column-parallel shard) need nothing; a row-parallel shard of whole blocks
    needs its rows' factor agreed over the shards (the layer's max over tp)."""
    w = _weight(rows=8, cols=4 * NF4_BLOCK)
    whole = dequantize(quantize(w, kind), torch.float32)
    rows = [dequantize(quantize(part, kind), torch.float32) for part in w.chunk(2, dim=0)]
    assert torch.equal(torch.cat(rows), whole)
    parts = w.chunk(2, dim=1)
    if kind == "nf4":
        local = [
            F.pad(p, (0, 0)).view(8, -1, NF4_BLOCK).abs().amax(-1).amax(-1, keepdim=True)
            for p in parts
        ]
    else:
        local = [p.abs().amax(1, keepdim=True) for p in parts]
    agreed = torch.maximum(*local)
    cols = [dequantize(quantize(p, kind, lambda _: agreed), torch.float32) for p in parts]
    assert torch.equal(torch.cat(cols, dim=1), whole)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_layer_equals_a_linear_on_the_dequantized_weight(kind, cls):
    torch.manual_seed(0)
    layer = cls(200, 24, bias=True, ctx=None)
    with torch.no_grad():
        layer.bias.normal_()
    add_adapter(layer, ("m",), rank=4, alpha=8, seed=1)
    with torch.no_grad():
        layer.lora_B.normal_()
    layer.weight.requires_grad_(False)
    plain = cls(200, 24, bias=True, ctx=None)
    add_adapter(plain, ("m",), rank=4, alpha=8, seed=1)
    report = quantize_base(layer, kind)
    assert report.layers == 1 and not any(n.endswith("weight") for n, _ in layer.named_parameters())
    ((name, q),) = quantized_weights(layer)
    with torch.no_grad():
        plain.weight.copy_(q.dequantize(torch.float32))
        plain.bias.copy_(layer.bias)
        plain.lora_B.copy_(layer.lora_B)
    plain.weight.requires_grad_(False)
    x = torch.randn(3, 5, 200, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, ref = layer(x), plain(x2)
    # the same products; a plain column layer adds its bias inside the GEMM (addmm), the
    # quantized one after it: one rounding apart
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.lora_A.grad, plain.lora_A.grad, rtol=1e-6, atol=1e-7)
    assert name == "weight" and q.codes.dtype in (torch.uint8, torch.int8)


def test_the_backward_keeps_no_dequantized_weight():
    """What autograd saves for a quantized layer is its codes (already held), not a weight."""
    layer = ColumnParallelLinear(256, 128, bias=False, ctx=None)
    layer.weight.requires_grad_(False)
    quantize_base(layer, "nf4")
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    assert not any(t.dtype.is_floating_point and t.numel() >= 128 * 256 for t in saved)


def test_a_trained_weight_is_refused():
    layer = ColumnParallelLinear(64, 8, ctx=None)
    with pytest.raises(ValueError, match="frozen"):
        from parallax.tensor.quant import quantize_layer

        quantize_layer(layer, "nf4")
    with pytest.raises(ValueError, match="nf4, int8"):
        quantize(torch.zeros(2, 2), "fp4")
