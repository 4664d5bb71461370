"""benchmarks/zero/split_probe.py's smoke form, and its variants' arithmetic: the shipped split
and the exact probes step as the whole-master kernel does."""

import torch

from benchmarks.zero import split_probe
from parallax.optim.zero.buffers.master_halves import low_half, planes
from parallax.optim.zero.offload.host_adamw import _scalars, _step_in_place


def test_the_smoke_run_times_every_variant_and_writes_nothing():
    rows = split_probe.main(["--smoke", "--threads", "1"])
    assert [r[0] for r in rows] == list(split_probe.cases(2).keys())
    assert all(r[3] > 0 and r[4] > 0 for r in rows), rows


def test_the_exact_variants_step_as_whole_masters():
    """The shipped split, the uint8 form and the int32 one give the whole masters' weights
    bitwise (the same fp32 arithmetic an element; the split is exact)."""
    n = 1000
    master = torch.randn(n)  # (n,) fp32
    grad = (torch.randn(n) * 1e-2).bfloat16()
    h = _scalars(1e-2, 0.1, 0.9, 0.999, 1e-8, 1, 1.0)
    ref = grad.clone()
    _step_in_place(ref, master.clone(), torch.zeros(n), torch.zeros(n), h)
    w = master.bfloat16()
    low = low_half(master)  # (2, n) uint8
    for fn, halves in (
        (split_probe._split_shipped, planes(low.clone())),
        (split_probe._split_uint8, (low[0].clone(), low[1].clone().view(torch.int8))),
    ):
        g = grad.clone()
        fn(g, w, *halves, torch.zeros(n), torch.zeros(n), h)
        assert torch.equal(g, ref)
    low32 = master.view(torch.int32) - w.float().view(torch.int32)  # (n,) the signed low bits
    g = grad.clone()
    split_probe._split_int32(g, w, low32, torch.zeros(n), torch.zeros(n), h)
    assert torch.equal(g, ref)
