"""The quantized base on a GPU: bf16 compute equals a plain linear on the dequantized weight,
``torch.compile`` (which fuses the dequantization into the block) equals eager, and a tiny
QLoRA run from a checkpoint (read on the host, quantized on the GPU layer by layer) trains
compiled. Skipped without a GPU (CI has none); run on a GPU machine with
``python3 -m pytest -q tests/tensor/test_quant_cuda.py``."""

import pytest
import torch
from torch.testing import assert_close

from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.lora import add_adapter
from parallax.tensor.quant import KINDS, quantize_base, quantized_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _pair(cls, kind):
    torch.manual_seed(0)
    layer = cls(512, 384, bias=False, ctx=None, device="cuda", dtype=torch.bfloat16)
    add_adapter(layer, ("m",), rank=8, alpha=16, seed=1)
    layer.weight.requires_grad_(False)
    quantize_base(layer, kind)
    plain = cls(512, 384, bias=False, ctx=None, device="cuda", dtype=torch.bfloat16)
    add_adapter(plain, ("m",), rank=8, alpha=16, seed=1)
    ((_, q),) = quantized_weights(layer)
    with torch.no_grad():
        plain.weight.copy_(q.dequantize(torch.bfloat16))
        layer.lora_B.normal_()
        plain.lora_B.copy_(layer.lora_B)
    plain.weight.requires_grad_(False)
    return layer, plain


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_bf16_and_compiled_equal_a_plain_linear(kind, cls):
    layer, plain = _pair(cls, kind)
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer)
    outs = []
    for module in (plain, layer, compiled):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.float().square().mean().backward()
        outs.append((y.detach().float(), xi.grad.float(), module.lora_A.grad.float()))
        module.zero_grad(set_to_none=True)
    for got in outs[1:]:  # the same bf16 GEMMs; compiled kernels may round differently
        for a, b in zip(got, outs[0]):
            assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_a_tiny_qlora_run_from_a_checkpoint_trains_compiled(tmp_path):
    from benchmarks.tools.random_checkpoint import main as write
    from parallax import ParallelContext
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    write(["--model", "tiny", "--out", str(tmp_path / "ckpt")])
    args = ["--model", str(tmp_path / "ckpt"), "--finetune", "lora", "--quantize-base", "nf4"]
    args += ["--compile", "--precision", "bf16", "--steps", "3", "--out", str(tmp_path / "run")]
    run(resolve_run(parse_args(args)), ParallelContext.local(device=torch.device("cuda")))
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") >= 1
