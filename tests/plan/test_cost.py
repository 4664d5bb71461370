"""The cost model's offload term, worked out by hand on the toy (tests/plan/toy.py): 4 blocks of
1e6 bf16 parameters, 8 microbatches of one sample, each block 2 ms forward and 4 ms backward."""

import pytest

from parallax.plan.cost import step_time
from parallax.plan.layout import Layout
from parallax.plan.memory import plan_memory
from tests.plan.toy import machine, toy

MS = 1e-3
# a host of 1 GB/s element-wise and AdamW at 0.5 s per 1e9 parameters: 4e6 elements cost 4 ms
# per byte moved per element, and 2 ms of AdamW
HOST = dict(host_gbs=1.0, host_adam_s=0.5)


def _offloaded(clip: float) -> tuple[float, float]:
    model = toy([1e5] * 4, [None] * 4)
    model.run.grad_clip = clip
    layout = Layout(dp=1, micro_batch_size=1, zero=2, offload=1.0)
    t = step_time(model, layout, machine(80.0).with_(**HOST), plan_memory(model, layout))
    return t.offload, t.compute


def test_offload_hides_the_accumulation_under_the_passes_up_to_their_compute():
    """Each pass adds 2-byte gradients (3 x 2 bytes moved: 24 ms), 8 passes, then each bucket's
    fp32 gradient (2 + 4 bytes: 24 ms): 216 ms of host work under 192 ms of compute, 24 ms
    shown. Clipped, the step follows: the fp32 gradient again (24), AdamW (2), the weights
    converted for the upload (4 + 2 bytes: 24): 50 ms."""
    offload, compute = _offloaded(clip=1.0)
    assert compute == pytest.approx(192 * MS)
    assert offload == pytest.approx((216 - 192) * MS + 50 * MS)


def test_without_clipping_the_step_hides_under_the_last_backward():
    """Not clipped, each bucket steps as its gradient completes: AdamW and the conversion (26
    ms) run under the last backward (4 blocks x 4 ms), 10 ms shown."""
    offload, _ = _offloaded(clip=0.0)
    assert offload == pytest.approx((216 - 192) * MS + (26 - 16) * MS)
