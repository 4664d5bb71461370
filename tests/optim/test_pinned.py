"""Page-locked host buffers of their exact size (:mod:`parallax.optim.zero.offload.pinned`):
without a GPU a plain tensor; with one, registered memory that copies asynchronously and holds
exactly the bytes asked for (torch's pinned allocator rounds each block up to a power of two)."""

import pytest
import torch

from parallax.optim.zero.offload.pinned import PinnedBuffer, pinned


def test_a_buffer_is_the_tensor_asked_for_and_its_owner_keeps_it():
    owner: list = []
    t = pinned(1000, torch.bfloat16, owner, zero=True)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.any()
    assert len(owner) == 1 and owner[0].tensor is t
    assert PinnedBuffer(0, torch.float32).tensor.numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a GPU")
def test_on_a_gpu_it_is_registered_exactly_and_copies_both_ways():
    n = 3 * 2**20 + 5  # (not a power of two, not a whole page)
    buf = PinnedBuffer(n, torch.bfloat16)
    host = buf.tensor
    assert buf.registered and host.is_pinned()
    assert host.untyped_storage().nbytes() < 2 * n * 2  # (its own bytes and a page, not 2**k)
    src = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)
    host.copy_(src)
    dev = host.to("cuda", non_blocking=True)
    back = PinnedBuffer(n, torch.bfloat16).tensor
    back.copy_(dev * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src * 2)
