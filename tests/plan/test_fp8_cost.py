"""``--fp8`` in the planner: the linears' GEMM time divided by the profile's
``fp8_gemm_speedup`` (1.6 on the shipped H100/H200 nodes, 1 where unknown), the LM head's and
the patch embedding's left alone; a step gets faster, by less than the speed-up."""

from dataclasses import replace

from parallax.models.estimate import Part
from parallax.plan.cost import part_times, step_time
from parallax.plan.layout import Layout
from parallax.plan.machine import DEFAULTS, H200, RTX4090
from parallax.plan.memory import plan_memory
from tests.plan.toy import machine, toy


def test_the_shipped_profiles_speed_up():
    assert H200.fp8_gemm_speedup == DEFAULTS["h100"].fp8_gemm_speedup == 1.6
    assert RTX4090.fp8_gemm_speedup == 1.0  # unknown: no speed-up assumed


def test_only_fp8_parts_gemms_get_faster():
    layout = Layout(dp=1, tp=1, pp=1, micro_batch_size=2)
    layer = Part("decoder layer", gemm_flops=1e12, tokens=1024)
    head = replace(layer, name="head", fp8=False)
    _, _, plain = part_times(layer, layout, H200, compiled=True)
    _, _, fast = part_times(layer, layout, H200, compiled=True, fp8=True)
    assert abs(plain / fast - H200.fp8_gemm_speedup) < 1e-9
    assert part_times(head, layout, H200, True, fp8=True) == part_times(head, layout, H200, True)


def test_a_steps_compute_follows_the_speed_up():
    """The toy's blocks are all GEMM time (everything else is free on its machine): their
    compute halves at a speed-up of 2."""
    model, fast_model = toy([1e5] * 4, [None] * 4), toy([1e5] * 4, [None] * 4)
    fast_model.run = fast_model.run.replace(fp8=True)
    layout = Layout(dp=1, micro_batch_size=1)
    profile = machine(80.0).with_(fp8_gemm_speedup=2.0)
    plain = step_time(model, layout, profile, plan_memory(model, layout))
    fast = step_time(fast_model, layout, profile, plan_memory(fast_model, layout))
    assert abs(plain.compute / fast.compute - 2.0) < 1e-9
