"""``--fp8`` on a GPU: ``torch._scaled_mm`` against the emulation the CPU tests check (the
same codes and scales), the layers' FP8 products on the GPU against the same products
emulated on the CPU, a compiled (inductor) ViT block and Llama decoder layer in FP8 against
eager, and a tiny run with ``--fp8 --compile``. Skipped without a GPU with FP8 tensor cores
(CI has none); run on one with ``python3 -m pytest -q tests/tensor/test_fp8_cuda.py``."""

import pytest
import torch
from torch.testing import assert_close

from parallax.tensor.fp8 import E4M3, cast_rows, emulated_mm, fp8_linear, scaled_mm
from parallax.tensor.fp8 import support_problem as _support_problem
from parallax.tensor.fp8_apply import enable_fp8

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA or _support_problem(torch.device("cuda")) is not None,
    reason="needs a GPU with FP8 tensor cores and torch >= 2.5",
)
RTOL = 2.0**-8  # one bf16 rounding of the same fp32 sums (tests/tensor/test_fp8.py)
FAST = 2.0**-6  # use_fast_accum: Hopper's FP8 accumulation is not full fp32


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("m", [16, 2688, 1000])  # 2,688: OpenVLA-7B's decoder rows a sample
def test_scaled_mm_equals_the_emulation(m, fast):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    (qa, sa), (qb, sb) = cast_rows(a, E4M3), cast_rows(b, E4M3)
    real = scaled_mm(qa, qb.t(), sa, sb.t(), fast_accum=fast)
    ref = emulated_mm(qa, qb.t(), sa, sb.t())
    assert real.dtype == torch.bfloat16
    rtol = FAST if fast else RTOL
    assert_close(real.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().mean().item())


def test_the_function_on_the_gpu_equals_its_emulation_on_the_cpu():
    torch.manual_seed(0)
    x = torch.randn(4, 100, 512, dtype=torch.bfloat16)  # 400 rows: the weight grad pads
    w = torch.randn(768, 512, dtype=torch.bfloat16) * 0.05
    up = torch.randn(4, 100, 768, dtype=torch.bfloat16)
    outs = []
    for device in ("cpu", "cuda"):
        xi = x.to(device).clone().requires_grad_(True)
        wi = w.to(device).clone().requires_grad_(True)
        y = fp8_linear(xi, wi)
        y.backward(up.to(device))
        outs.append([t.detach().float().cpu() for t in (y, xi.grad, wi.grad)])
    for cpu, gpu in zip(*outs):  # the forward uses fast accumulation on the GPU
        assert_close(gpu, cpu, rtol=FAST, atol=FAST * cpu.abs().mean().item())


def _block(kind: str):
    """A SigLIP-so400m-wide ViT block, or a 1B-wide Llama decoder layer with its rotary
    tables."""
    from parallax.models.llama import LlamaDecoderLayer, rope_cos_sin
    from parallax.models.llama_config import LlamaConfig
    from parallax.models.vit import ViTBlock
    from parallax.models.vit_config import ViTConfig

    kw = dict(device="cuda", dtype=torch.bfloat16)
    if kind == "vit":
        vit = ViTConfig(width=1152, num_heads=16, mlp_hidden=4304, act="gelu_tanh")
        return ViTBlock(vit, None, **kw), (2, 256, vit.width), ()
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8)
    positions = torch.arange(256, device="cuda")
    rope = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.bfloat16)
    return LlamaDecoderLayer(cfg, None, 0, **kw), (2, 256, 1024), rope


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_a_compiled_fp8_block_runs_and_equals_eager(kind):
    torch.manual_seed(0)
    block, shape, extra = _block(kind)
    report = enable_fp8(block)
    assert report.layers >= 4 and not report.fallback, report.describe()
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    outs = []
    for module in (block, torch.compile(block)):
        xi = x.clone().requires_grad_(True)
        y = module(xi, *extra)
        y.float().square().mean().backward()
        outs.append((y.detach().float(), xi.grad.float()))
        block.zero_grad(set_to_none=True)
    for got, want in zip(*outs):  # fused casts may round the bf16 intermediates differently
        assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().mean().item())


def test_a_tiny_run_trains_with_fp8_compiled(tmp_path):
    from parallax import ParallelContext
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    args = ["--fp8", "--precision", "bf16", "--compile", "--steps", "3"]
    args += ["--global-batch-size", "2", "--micro-batch-size", "2", "--out", str(tmp_path)]
    last = run(resolve_run(parse_args(args)), ParallelContext.local(device=torch.device("cuda")))
    assert torch.isfinite(torch.tensor(last["loss"]))
