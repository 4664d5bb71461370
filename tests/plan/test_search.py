"""The search finds the best layout of small cases worked out by hand, on a hand-made profile
(tests/plan/toy.py: blocks of 1 GFLOP a sample, matmuls at 1 TFLOP/s x rows / (rows + 100))."""

import dataclasses

import pytest

from parallax.plan.cost import ONE_PASS_OVER_FUSED, step_time
from parallax.plan.host_memory import PINNED, SCRATCH
from parallax.plan.layout import Layout
from parallax.plan.machine import H200, Link
from parallax.plan.memory import GIB, plan_memory
from parallax.plan.search import FILL_RESERVE, MARGIN, search
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.recipe.flags import parse_args
from tests.plan.toy import FLOPS, machine, toy

MS = 1e-3


def efficiency(rows: int) -> float:
    return rows / (rows + 100)


def test_with_cheap_collectives_tp_keeps_the_matmuls_largest():
    """4 GPUs, memory to spare, collectives of 10 us and no bandwidth cost: tp4 runs the whole
    batch of 8 as one microbatch of 800 rows a matmul (dp4 would run 200: 2/3 of the rate)."""
    model = toy([1e5] * 4, [None] * 4, tp=True)
    result = search(model, machine(80.0, Link(busbw_gbs=1e9, latency_us=10.0)), 4)
    best = result.ranked[0]
    assert best.layout == Layout(tp=4, pp=1, dp=1, micro_batch_size=8)
    compute = 8 * 4 * 3 * FLOPS / 4 / (1e12 * efficiency(800))
    collectives = 4 * 4 * 10e-6  # two all-reduces a block forward, two backward
    assert best.time.seconds == pytest.approx(compute + collectives, rel=1e-3)
    dp4 = 2 * 4 * 3 * FLOPS / (1e12 * efficiency(200))  # 36 ms against 27
    assert best.time.seconds < dp4


def _need(model, layout, mach) -> float:
    return max(r.needed(mach) for r in plan_memory(model, layout))


def test_when_only_a_pipeline_fits_the_interleaved_schedule_wins():
    """2 GPUs that cannot hold the 4 blocks' weights and Adam state each, not even sharded by
    ZeRO over dp 2; no tp. At micro-batch 1 (8 microbatches) 1F1B over 2 stages of 2 blocks
    takes (8 + 1) x (4 + 8) ms = 108 ms, interleaved with 2 chunks a rank (16 + 1) x 6 = 102."""
    model = toy([1e5] * 4, [None] * 4)
    probe = machine(80.0)
    pipelines = [
        Layout(pp=2, micro_batch_size=1, schedule="1f1b"),
        Layout(pp=2, micro_batch_size=1, schedule="interleaved", chunks=2),
    ]
    fits = max(_need(model, lay, probe) for lay in pipelines)
    for zero in (1, 2, 3):  # nothing at dp 2 fits in it
        assert _need(model, Layout(dp=2, micro_batch_size=1, zero=zero), probe) > fits
    mach = machine(fits * 1.001 / (1 - MARGIN) / GIB)
    result = search(model, mach, 2, fixed={"micro_batch_size": 1, "offload": "none"})
    best = result.ranked[0]
    assert (best.layout.pp, best.layout.schedule, best.layout.chunks) == (2, "interleaved", 2)
    step = FLOPS / (1e12 * efficiency(100))  # one block's forward on one sample: 2 ms
    assert best.time.seconds == pytest.approx((2 * 8 + 1) * 3 * step, rel=1e-3)
    assert result.ranked[1].layout.schedule == "1f1b"
    assert result.ranked[1].time.seconds == pytest.approx((8 + 1) * 6 * step, rel=1e-3)
    assert all(c.layout.dp == 1 for c in result.ranked)


def test_checkpointing_recomputes_only_the_scope_that_is_needed():
    """One GPU, micro-batch 8: the three "text" blocks keep 100 MB a sample, the "vision" one
    1 MB. Recomputing the vision block saves too little; the text scope fits and costs one
    more forward of 3 blocks (27 + 3 x 36 ms), less than recomputing all four (4 x 36)."""
    model = toy([1e6, 1e8, 1e8, 1e8], ["vision", "text", "text", "text"])
    probe = machine(80.0)
    layouts = {c: Layout(micro_batch_size=8, checkpointing=c) for c in (False, "vision", "text")}
    needs = {c: _need(model, lay, probe) for c, lay in layouts.items()}
    assert needs["text"] < needs["vision"] < needs[False]
    mach = machine((needs["text"] + needs["vision"]) / 2 / (1 - MARGIN) / GIB)
    result = search(model, mach, 1, fixed={"micro_batch_size": 8, "offload": "none"})
    best = result.ranked[0]
    assert best.layout.checkpointing == "text"
    forward = 8 * FLOPS / (1e12 * efficiency(800))
    assert best.time.seconds == pytest.approx(3 * forward + 3 * 4 * forward, rel=1e-3)
    assert [c.layout.checkpointing for c in result.ranked] == ["text", True]


def test_nothing_fits_says_the_nearest_and_what_would_help():
    from parallax.plan.report import nothing_fits

    model = toy([1e5] * 4, [None] * 4)
    result = search(model, machine(0.001), 2)
    assert not result.ranked and result.closest
    text = nothing_fits(result, 2)
    assert "nothing fits" in text and "GiB a GPU" in text and "more GPUs" in text


def test_offloaded_layouts_sum_on_the_gpu_what_fits():
    """OpenVLA-7B on one H200 capped at 24, 27 and 30 GiB, offloaded (fixed) at micro-batch 32:
    the search sums on the GPU as much of the gradient as the cap leaves room for beside its
    reserve (whole buckets), more with more memory, and the host holds that much less; a share
    given on the command line is kept."""
    argv = [
        "--model",
        "openvla-7b",
        "--global-batch-size",
        "256",
        "--precision",
        "bf16",
        "--compile",
    ]
    model = Workload(resolve(parse_args(argv)))
    fixed = {"micro_batch_size": 32, "offload": "optimizer", "zero": 3}
    fixed["activation_checkpointing"] = True
    got = []
    for cap in (24.0, 27.0, 30.0):
        mach = H200.with_(gpus_per_node=1, cuda_context_gib=0.0, gpu_memory_gib=cap)
        best = search(model, mach, 1, fixed=fixed, top=1).ranked[0]
        assert cap * GIB * (1 - MARGIN) - FILL_RESERVE - 0.2 * GIB < best.gpu, cap  # (a bucket)
        got.append(best)
    shares = [c.layout.accumulate for c in got]
    assert 0 < shares[0] < shares[1] < shares[2] < 1, shares
    assert got[0].host > got[1].host > got[2].host
    mach = H200.with_(gpus_per_node=1, gpu_memory_gib=30.0)
    given = search(model, mach, 1, fixed={**fixed, "gpu_accumulation": 0.25}, top=1)
    assert given.ranked[0].layout.accumulate == 0.25
    # at micro-batch 8 (32 passes) the passes' copies outlast the backwards: sums kept on the
    # GPU cross once, and the exposed offload time falls by the share's copies
    shown = []
    for share in (0.0, 0.5):
        lay = Layout(micro_batch_size=8, zero=3, offload=1.0, checkpointing="vision")
        lay = dataclasses.replace(lay, accumulate=share)
        shown.append(step_time(model, lay, mach, plan_memory(model, lay)).offload)
    assert shown[1] < shown[0] - 1.0, shown


def test_the_one_pass_host_adamw_costs_its_measured_share_of_the_fused_kernel():
    """A clipped offloaded step with ``--host-adamw one-pass`` costs torch's fused AdamW alone
    times their measured ratio, without the upcast and the conversion around it; an unclipped
    run steps in the backward with torch's kernel either way."""
    base = ["--model", "openvla-7b", "--global-batch-size", "256", "--precision", "bf16"]
    mach = H200.with_(gpus_per_node=1, gpu_memory_gib=32.0)
    lay = Layout(micro_batch_size=8, zero=2, offload=1.0, checkpointing=True)
    got = {}
    for extra in ([], ["--host-adamw", "torch"], ["--host-adamw", "one-pass"], ["--grad-clip", "0"],
                  ["--grad-clip", "0", "--host-adamw", "one-pass"]):  # fmt: skip
        model = Workload(resolve(parse_args(base + extra)))
        got[" ".join(extra)] = step_time(model, lay, mach, plan_memory(model, lay)).offload
    torch_s, one_s = got["--host-adamw torch"], got["--host-adamw one-pass"]
    assert 0 < one_s < torch_s
    assert got[""] == one_s  # the default (auto) plans the one-pass step a GPU run takes
    share = 7.5e9  # (about: every trainable element is stepped on the host)
    around = 2 * (4 + 2) * share / (mach.host_gbs * 1e9)  # the upcast and the conversion
    fused = mach.host_adam_s * share / 1e9
    saved = around - (ONE_PASS_OVER_FUSED - 1) * fused
    assert torch_s - one_s == pytest.approx(saved, rel=0.1)
    assert got["--grad-clip 0"] == got["--grad-clip 0 --host-adamw one-pass"]
    # a profile that measured the one-pass step (plan calibrate) is taken at its word
    model = Workload(resolve(parse_args([*base, "--host-adamw", "one-pass"])))
    slower = mach.with_(host_one_pass_s=ONE_PASS_OVER_FUSED * mach.host_adam_s + 0.1)
    extra = step_time(model, lay, slower, plan_memory(model, lay)).offload - one_s
    assert extra == pytest.approx(0.1 * share / 1e9, rel=0.1)


def test_a_one_pass_step_holds_no_scratch_nor_ring_unless_sums_are_kept_on_the_gpu():
    base = ["--model", "openvla-7b", "--global-batch-size", "256", "--precision", "bf16"]
    lay = Layout(micro_batch_size=8, zero=2, offload=1.0, checkpointing=True)
    parts = {}
    for adamw in ("torch", "one-pass"):
        args = [*base, "--host-adamw", adamw, "--host-masters", "full"]
        model = Workload(resolve(parse_args(args)))
        for share in (0.0, 0.3):
            rank = plan_memory(model, dataclasses.replace(lay, accumulate=share))[0]
            parts[adamw, share] = dict(rank.host_parts)
    assert SCRATCH in parts["torch", 0.0] and PINNED in parts["torch", 0.0]
    assert SCRATCH not in parts["one-pass", 0.0] and PINNED not in parts["one-pass", 0.0]
    assert parts["one-pass", 0.3] == parts["torch", 0.3]  # (kept sums: scratch and ring again)


def test_split_masters_hold_two_bytes_a_bf16_element_less_and_two_landing_buffers():
    base = ["--model", "openvla-7b", "--global-batch-size", "256", "--precision", "bf16"]
    lay = Layout(micro_batch_size=8, zero=3, offload=1.0, checkpointing=True)
    ranks = {}
    for masters in ("full", "split"):
        model = Workload(resolve(parse_args([*base, "--host-masters", masters])))
        ranks[masters] = plan_memory(model, lay)[0]
    ranks["default"] = plan_memory(Workload(resolve(parse_args(base))), lay)[0]
    full, split = dict(ranks["full"].host_parts), dict(ranks["split"].host_parts)
    offloaded = ranks["split"].offloaded  # (this rank's offloaded elements, all bf16 here)
    key = "masters and moments"
    assert full[key] - split[key] == pytest.approx(2 * offloaded, rel=1e-9)
    assert PINNED in split and PINNED not in full  # (one pass: no ring; the landing buffers)
    assert ranks["default"].host_parts == ranks["full"].host_parts  # (split: asked for)
    assert ranks["split"].host < 92 * 2**30 < ranks["full"].host


def test_whole_masters_that_no_host_fits_are_planned_split_unless_the_run_says_full(caplog):
    """``--host-masters auto`` (the default): whole masters where the host has room, split
    where no layout's host memory fits them (OpenVLA-7B on one 24 GB card of a 92 GiB host) or
    only slower ones do (32 GB), said and in the command; ``--host-masters full`` keeps them
    whole and names the way out."""
    import io
    import logging

    from rich.console import Console

    from parallax.plan import auto, cli

    run = ["--model", "openvla-7b", "--global-batch-size", "256", "--compile", "--top", "1"]
    run += ["--machine", "h100", "--gpu-memory", "24", "--gpus", "1"]
    said = {}
    for host, masters in (("125", []), ("92", []), ("92", ["--host-masters", "full"])):
        out = io.StringIO()
        _, line = cli.plan([*run, "--host-memory", host, *masters], Console(file=out, width=300))
        said[host, bool(masters)] = (line, " ".join(out.getvalue().split()))
    assert "--host-masters" not in said["125", False][0]  # room for whole masters
    line, text = said["92", False]
    assert "--host-masters split" in line and "planned with --host-masters split" in text
    line, text = said["92", True]
    assert line is None and "What would help" in text and "--host-masters split" in text
    out = io.StringIO()  # under 32 GiB whole masters fit a few layouts, slower than split ones
    wider = [*run[:-4], "--gpu-memory", "32", "--gpus", "1", "--host-memory", "92"]
    _, line = cli.plan(wider, Console(file=out, width=300))
    text = " ".join(out.getvalue().split())
    assert "--host-masters split" in line and "--micro-batch-size 64" in line
    assert "with whole fp32 masters the host's memory leaves only slower layouts" in text
    flags = ["--layout", "auto", *run[:5], "--precision", "bf16", "--machine", "h100"]
    flags += ["--gpu-memory", "24"]
    cfg = resolve(parse_args([*flags, "--host-memory", "92"]))
    with caplog.at_level(logging.INFO, logger="parallax.train"):
        chosen = auto.choose(cfg)
    assert chosen.host_masters == "split" and chosen.host_masters_kind("cuda") == "split"
    assert "planned with --host-masters split" in caplog.text
