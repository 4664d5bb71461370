"""The one-pass host AdamW measured as an alternative (``benchmarks/zero/one_pass_adamw.py``)
steps as torch's AdamW does: three steps from the same start on the same bf16 gradients, two
parameter groups (one without weight decay), the dp average and a clip coefficient folded in, in
place and into a separate buffer; fp32 rounding apart (its scalars and order differ)."""

import torch
from torch.testing import assert_close

from benchmarks.zero.one_pass_adamw import HostAdamW, supports


def test_it_steps_as_torchs_adamw():
    torch.manual_seed(0)
    start = [torch.randn(301), torch.randn(64)]
    ref = [p.clone().requires_grad_() for p in start]
    mine = [p.clone().requires_grad_() for p in start]
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    torch_opt = torch.optim.AdamW([{"params": ref[:1], "weight_decay": 0.1},
                                   {"params": ref[1:], "weight_decay": 0.0}], **hyper)  # fmt: skip
    inner = torch.optim.AdamW([{"params": mine[:1], "weight_decay": 0.1},
                               {"params": mine[1:], "weight_decay": 0.0}], **hyper)  # fmt: skip
    assert supports(inner) and not supports(torch.optim.AdamW(ref, amsgrad=True))
    kernel = HostAdamW(compiled=False)
    scale = 0.5 * 0.7  # the dp average of 2 ranks and a clip coefficient
    for _ in range(3):
        grads = [torch.randn_like(p).bfloat16() for p in start]
        for p, g in zip(ref, grads):
            p.grad = g.float() * scale
        torch_opt.step()
        out = torch.empty(64, dtype=torch.bfloat16)
        in_place = grads[0].clone()
        with torch.no_grad():
            kernel.step(inner, [(mine[0], in_place, None, 0), (mine[1], grads[1], out, 1)], scale)
        for a, b in zip(mine, ref):
            assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(in_place, mine[0].detach().bfloat16())  # the new weights, in place
        assert torch.equal(out, mine[1].detach().bfloat16())
    for a, b in zip(mine, ref):
        ours, theirs = inner.state[a], torch_opt.state[b]
        assert float(ours["step"]) == float(theirs["step"]) == 3
        assert_close(ours["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-6, atol=1e-9)
