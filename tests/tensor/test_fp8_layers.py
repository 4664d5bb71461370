"""The parallel linears under ``--fp8`` (emulated on the CPU): a layer's product is the FP8
function's, a LoRA layer's base runs in FP8 while its adapter's gradients are the bf16 path's,
:func:`enable_fp8` leaves the head and shapes ``_scaled_mm`` cannot take in bf16, and tp = 2
equals tp = 1 where the scales are the same and within FP8's rounding where a shard splits a
reduction (each rank scales its own part of a row: ``parallax/tensor/fp8/linear.py``)."""

import torch
from torch import nn
from torch.testing import assert_close

from parallax.tensor import ColumnParallelLinear, RowParallelLinear, unshard_tensor
from parallax.tensor.fp8 import fp8_linear
from parallax.tensor.fp8_apply import enable_fp8
from parallax.tensor.lora import add_adapter
from parallax.tensor.quant import quantize_layer
from parallax.testing import context, run_ranks

RTOL = 2.0**-8  # bf16 results of the same FP8 operands (tests/tensor/test_fp8.py)
SPLIT = 2.0**-6  # relative (norm) difference when a shard splits a reduction (measured 0.25 %)


def test_a_layers_product_is_the_fp8_function_plus_its_bias():
    torch.manual_seed(0)
    for layer in (ColumnParallelLinear(32, 48, ctx=None), RowParallelLinear(32, 48, ctx=None)):
        with torch.no_grad():
            layer.bias.normal_()
        layer.fp8 = True
        x = torch.randn(2, 8, 32)
        assert torch.equal(layer(x), fp8_linear(x, layer.weight) + layer.bias)


def test_a_lora_layers_base_runs_in_fp8_and_its_adapter_as_before():
    torch.manual_seed(0)
    x, up = torch.randn(2, 8, 32), torch.randn(2, 8, 48)
    grads = []
    for fp8 in (False, True):
        torch.manual_seed(1)
        layer = ColumnParallelLinear(32, 48, bias=False, ctx=None)
        layer.weight.requires_grad_(False)
        add_adapter(layer, ("m",), rank=4, alpha=8, seed=1)
        with torch.no_grad():
            layer.lora_B.normal_()
        layer.fp8 = fp8
        y = layer(x)
        if fp8:
            assert_close(y, fp8_linear(x, layer.weight) + layer._adapter(x))
        (y * up).sum().backward()
        grads.append((layer.lora_A.grad, layer.lora_B.grad))
    for bf16, fp8 in zip(*grads):  # the adapter's gradients never read the base's product
        assert_close(fp8, bf16, rtol=1e-6, atol=1e-6)


def test_enable_fp8_leaves_the_head_odd_shapes_and_quantized_bases_alone():
    model = nn.ModuleDict(
        {
            "qkv": ColumnParallelLinear(32, 96, ctx=None),
            "fc1": ColumnParallelLinear(48, 184, ctx=None),  # SigLIP-tiny's MLP: 184 % 16 != 0
            "frozen": RowParallelLinear(64, 32, ctx=None),
            "lm_head": ColumnParallelLinear(32, 64, ctx=None),
        }
    )
    model["frozen"].weight.requires_grad_(False)
    quantize_layer(model["frozen"], "int8")
    report = enable_fp8(model)
    assert report.layers == 1 and model["qkv"].fp8
    assert not any(model[n].fp8 for n in ("fc1", "frozen", "lm_head"))
    assert report.fallback == [("fc1", (184, 48)), ("frozen", (32, 64))]
    assert "1 linears in FP8; 2 stay in bf16" in report.describe()


def _layers(ctx) -> dict[str, tuple[torch.Tensor, ...]]:
    """A column-parallel (output gathered) and a row-parallel (input split here) FP8 layer:
    their outputs, input gradients and whole weight gradients, fp32."""
    torch.manual_seed(0)
    dense = {"column": nn.Linear(32, 64), "row": nn.Linear(64, 32)}
    data = {
        k: (torch.randn(2, 8, d.in_features), torch.randn(2, 8, d.out_features))
        for k, d in dense.items()
    }
    layers = {
        "column": ColumnParallelLinear.from_dense(dense["column"], ctx, gather_output=True),
        "row": RowParallelLinear.from_dense(dense["row"], ctx, input_is_parallel=False),
    }
    out = {}
    for name, layer in layers.items():
        layer.fp8 = True
        x, up = data[name]
        x = x.clone().requires_grad_(True)
        y = layer(x)
        (y * up).sum().backward()
        w = layer.weight
        dw = w.grad if ctx is None else unshard_tensor(w.grad, w.tp_shard, layer.group)
        out[name] = (y.detach(), x.grad, dw)
    return out


def _tp2():
    return _layers(context(tp=2))


def _close(got, want, exact: bool) -> None:
    if exact:
        assert_close(got, want, rtol=RTOL, atol=1e-6)
    else:
        assert (got - want).norm() <= SPLIT * want.norm(), (got - want).norm() / want.norm()


def test_tp2_equals_tp1_where_the_scales_agree_and_within_fp8_where_a_shard_splits_a_sum():
    one = _layers(None)
    two, again = run_ranks(_tp2, 2)
    # column: the forward and the weight gradient keep whole rows (same scales); the input
    # gradient sums over the split output features. Row: the forward sums over the split input.
    exact = {"column": (True, False, True), "row": (False, True, True)}
    for name, flags in exact.items():
        for got, other, want, is_exact in zip(two[name], again[name], one[name], flags):
            assert torch.equal(got, other)  # every tp rank holds the same result
            _close(got, want, is_exact)


def test_the_fp8_product_traces_into_one_graph():
    """Dynamo takes a layer's whole FP8 product, casts and both gradients, without a break:
    what lets the compiler fuse the casts into the neighbouring kernels on a GPU (where
    ``tests/tensor/test_fp8_cuda.py`` runs the inductor)."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(32, 48, ctx=None)
    layer.fp8 = True
    x = torch.randn(2, 8, 32)
    outs = []
    for module in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.sum().backward()
        outs.append((y.detach(), xi.grad, layer.weight.grad.clone()))
        layer.zero_grad(set_to_none=True)
    for got, want in zip(*outs):
        assert torch.equal(got, want)
