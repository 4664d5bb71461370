"""ZeroOptimizer's GPU paths (side stream, gradient copies there, fused grad_scale), on one GPU.

Two gloo ranks share the one GPU, so the stream ordering that NCCL would see on two GPUs runs
for real: the side-stream staging copies, reduce-scatters and all-gathers must give the same
weights as plain torch on one process, and bit for bit those of the same optimizer with no side
stream. Skipped without a GPU (CI has none); run on a GPU machine with
``python3 -m pytest -q tests/optim/test_zero_cuda.py``.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from parallax.optim import ZeroOptimizer
from parallax.testing import context, run_ranks
from tests.optim.common import (
    OPTIMIZERS,
    batch,
    build,
    groups,
    local_rows,
    logical_weights,
    train_reference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
STEPS = 4
TOL = dict(rtol=1e-5, atol=1e-6)  # TF32-free fp32 GEMMs, but GPU reduction orders differ from CPU


def _train(ctx, name: str, dtype, accum: int, side: bool):
    """STEPS steps of ``name`` at dp=2 on the GPU (clip 0.5); the clip norms and weights."""
    cls, kwargs = OPTIMIZERS[name]
    model = build(ctx, dtype=dtype).to(ctx.device)
    opt = ZeroOptimizer(
        groups(model),
        cls,
        ctx,
        overlap=True,
        backward_passes_per_step=accum,
        bucket_numel=100,
        param_order=model.parameters(),
        **kwargs,
    )
    if not side:
        opt._stream = opt.grads.copy_stream = opt.reducer.stream = None
    assert (opt._stream is not None) == side and opt._fold == name.endswith("-fused")
    opt.overlap_param_gather(model)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            x, y, use = (local_rows(t, ctx).to(ctx.device) for t in batch(step, micro))
            out = model(x.to(dtype or torch.float32), use)
            (F.mse_loss(out.float(), y) / accum).backward()
        norms.append(opt.clip_grad_norm_(0.5).item())
        opt.step()
    opt.wait_params()
    return norms, {n: w.cpu() for n, w in logical_weights(model, ctx).items()}


def _gpu_equivalence() -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx = context()
    ctx = replace(ctx, device=torch.device("cuda", 0))
    done = []
    for name, dtype, accum in (
        ("adamw-fused", None, 1),
        ("adamw-fused", None, 2),
        ("adamw", torch.bfloat16, 1),
        ("adamw-fused", torch.bfloat16, 2),
    ):
        case = f"{name} {dtype} accum={accum}"
        norms, got = _train(ctx, name, dtype, accum, side=True)
        norms_sync, got_sync = _train(ctx, name, dtype, accum, side=False)
        assert norms == norms_sync, case
        for n in got:
            assert torch.equal(got[n], got_sync[n]), f"{case}: {n}"
        if dtype is None:  # fp32: plain torch on one process, on the CPU
            ref, _, ref_norms = train_reference(name, STEPS, accum, 0.5)
            assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL, msg=case)
            for n, want in ref.named_parameters():
                assert_close(got[n], want.detach(), **TOL, msg=f"{case}: {n}")
        done.append(case)
    return done


def test_side_stream_on_one_gpu():
    results = run_ranks(_gpu_equivalence, 2, timeout=300)
    assert len(results[0]) == 4
