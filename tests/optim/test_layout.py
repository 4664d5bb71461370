"""The flat layout (pure arithmetic) and single-process behaviour that needs no ranks."""

import pytest
import torch
import torch.nn.functional as F

import parallax
from parallax.optim import ZeroOptimizer
from parallax.optim.zero.buffers.packing import ALIGN, build_layout
from tests.optim.common import batch, build, groups

SHAPES = [(5,), (64, 3), (7, 7), (100,), (3,), (33, 2), (1,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16] + [
    torch.float32
] * 2
SP = [False, False, True, False, False, True, False]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [1, 40, 10_000])
def test_every_element_owned_once_and_balanced(dp, bucket_numel):
    layout = build_layout(SHAPES, DTYPES, SP, dp, bucket_numel)
    owned = [torch.zeros(torch.Size(s).numel(), dtype=torch.int) for s in SHAPES]
    for r in range(dp):
        for pc in layout.pieces(r):
            owned[pc.param][pc.start : pc.start + pc.numel] += 1
            assert 0 <= pc.chunk_offset <= layout.buckets[pc.bucket].chunk - pc.numel
    assert all(torch.equal(o, torch.ones_like(o)) for o in owned)
    for b in layout.buckets:
        assert b.numel % (dp * ALIGN) == 0 and b.chunk * dp == b.numel
        assert all(layout.slots[i].bucket == b.index for i in b.params)  # never straddles
        assert all(DTYPES[i] == layout.dtypes[b.buffer] and SP[i] == b.sequence_parallel
                   for i in b.params)  # fmt: skip
    sp_flags = [b.sequence_parallel for b in layout.buckets]
    assert sp_flags == sorted(sp_flags)  # partial-over-tp buckets go last
    assert all(slot.offset % ALIGN == 0 for slot in layout.slots)


def test_order_reverses_the_forward_order():
    layout = build_layout([(4,)] * 4, [torch.float32] * 4, [False] * 4, 2, 1, order=[2, 0, 3, 1])
    assert [b.params for b in layout.buckets] == [(1,), (3,), (0,), (2,)]
    with pytest.raises(ValueError, match="permutation"):
        build_layout([(4,)] * 2, [torch.float32] * 2, [False] * 2, 2, 1, order=[0, 0])


def test_zero_grad_mid_step_discards_and_frozen_only_is_fine():
    """zero_grad() between backward passes throws the first away (also with overlap and
    launched buckets); a second optimizer over the same parameters takes them over; an
    optimizer whose parameters are all frozen steps as a no-op. Bitwise against torch: at dp=1
    without clipping no reduction enters the update (the same autograd gradients, the same
    adds, elementwise AdamW)."""
    ctx = parallax.ParallelContext.local()
    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(groups(ref, named=False), lr=1e-2)
    opt = ZeroOptimizer(groups(model), torch.optim.AdamW, ctx, bucket_numel=50, lr=1e-2)
    x, y, use = batch(1, 0)
    opt.zero_grad()  # opens the step: the hooks launch buckets
    F.mse_loss(model(x * 3, use), y).backward()  # launches buckets, then is discarded
    assert opt.reducer.launched > 0
    opt.zero_grad()
    for m, o in ((ref, ref_opt), (model, opt)):
        F.mse_loss(m(x, use), y).backward()
        o.step()
    for (n, want), got in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(got, want), n

    ref_opt = torch.optim.AdamW(groups(ref, named=False), lr=1e-2)  # both start afresh
    again = ZeroOptimizer(
        groups(model), torch.optim.AdamW, ctx, lr=1e-2, backward_passes_per_step=2
    )
    for m, o in ((ref, ref_opt), (model, again)):
        o.zero_grad()
        for _ in range(2):  # the first optimizer's hooks must not interfere
            F.mse_loss(m(x, use), y).backward()
        o.step()
    for (n, want), got in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(got, want), n

    frozen = build().requires_grad_(False)
    opt = ZeroOptimizer(frozen.named_parameters(), torch.optim.AdamW, ctx)
    assert opt.memory_report().total_bytes == 0
    assert opt.grad_norm().item() == 0.0
    opt.step()
