"""The host-overhead diagnostic runs one offloaded ZeRO-2 configuration, times parallax's hooks
apart from the step, and leaves the classes it timed as they were."""

from benchmarks.plan.host_overhead import TIMED, main


def test_one_configuration_times_the_hooks_and_restores_the_classes():
    before = {key: getattr(*key) for key in TIMED}
    (row,) = main(["--configs", "z2off", "--batch", "2", "--steps", "1", "--warmup", "0"])
    name, tensors, microbatches, step_ms, per_mb, hooks, pass_end, add = row
    assert name == "z2off" and tensors == 654 and microbatches == 2  # OpenVLA-7B's LoRA count
    assert step_ms > 0 and 0 < hooks < per_mb and pass_end > 0 and add > 0
    assert {key: getattr(*key) for key in TIMED} == before
