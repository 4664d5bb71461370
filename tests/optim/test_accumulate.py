"""The offload's accumulators: each bucket a view of its dtype's one flat buffer; the first
pass of a step overwrites, later ones add in fp32 and round once to the accumulator's dtype."""

import torch

from parallax.optim.zero.offload.accumulators import Accumulators


def test_passes_add_in_fp32_and_round_once_per_pass():
    dtypes = {0: torch.bfloat16, 2: torch.float32, 3: torch.bfloat16}
    sums = Accumulators([0, 2, 3], [4, 0, 3, 5], dtypes, torch.device("cpu"))
    assert sums.flats[torch.bfloat16].numel() == 9 and sums.flats[torch.float32].numel() == 3
    assert sums.landed() is None  # the CPU adds in place
    g = torch.Generator().manual_seed(0)
    for step in range(2):  # a new step's first pass forgets the last step's sum
        want = {}
        for p in range(3):
            for b, dt in dtypes.items():
                grad = torch.randn(sums.acc[b].numel(), generator=g)  # (chunk,) fp32
                total = grad if p == 0 else grad + want[b].float()
                want[b] = total.to(dt)
                sums.add(b, grad, first=p == 0)
        for b in dtypes:
            assert sums.acc[b].dtype == dtypes[b]
            assert torch.equal(sums.acc[b], want[b]), (step, b)


def test_the_host_waits_for_the_oldest_adds_past_the_bound(monkeypatch):
    """On GPUs at most ``IN_FLIGHT`` adds wait for the link: the host synchronizes with the
    oldest before it queues another (the events here stand in for the copies stream's)."""
    from collections import deque

    from parallax.optim.zero.offload import accumulators as accumulate

    waited = []

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            waited.append(self.name)

    monkeypatch.setattr(accumulate, "IN_FLIGHT", 2)
    sums = Accumulators([0], [3], {0: torch.float32}, torch.device("cpu"))
    sums.queued = deque(Event(n) for n in ("a", "b", "c"))
    sums.add(0, torch.ones(3), first=True)
    assert waited == ["a", "b"] and [e.name for e in sums.queued] == ["c"]
    assert torch.equal(sums.acc[0], torch.ones(3))
