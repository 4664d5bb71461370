"""The planner-accuracy benchmark's smoke form: every tiny row is planned and run on the CPU,
a memory cap changes the plan, and nothing is written."""

import math
from types import SimpleNamespace

from benchmarks.plan.accuracy import main
from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD


def _sizes() -> list[int]:
    return [f.stat().st_size if f.exists() else 0 for f in (RESULTS_MD, RESULTS_JSONL)]


def test_smoke_rows_plan_run_and_write_nothing(tmp_path):
    before = _sizes()
    rows = main(["--smoke", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert [r["status"] for r in rows] == ["ok"] * len(rows), rows
    for r in rows:
        assert r["predicted_gib"] > 0 and r["predicted_s"] > 0 and math.isfinite(r["measured_s"])
    by_name = {r["name"]: r for r in rows}
    capped, free = by_name["tiny-capped"], by_name["tiny"]
    assert capped["layout"] != free["layout"]  # 12 MiB does not hold the uncapped choice
    assert capped["predicted_gib"] * 2**30 <= 0.012 * 2**30
    assert _sizes() == before


def test_where_nothing_fits_the_nearest_layout_is_planned_and_timed(tmp_path):
    """memory_fit runs the nearest layout when nothing fits the planner's margin: it comes
    timed, and only when asked for."""
    import torch

    from benchmarks.plan.accuracy import Row, plan_row

    row = Row("tiny-too-small", "tiny", 8, limit=1e-6)
    args = SimpleNamespace(
        compile=False, out=str(tmp_path), machine=None, pad_to_multiple_of=1, grad_clip=None
    )
    cpu = torch.device("cpu")
    assert plan_row(row, args, cpu)[1:] == (None, False)
    _, nearest, fits = plan_row(row, args, cpu, closest=True)
    assert not fits and nearest.gpu > 1e-6 * 2**30 and nearest.time.seconds > 0


def test_only_openvla_rows_pad_their_text(tmp_path):
    import torch

    from benchmarks.plan.accuracy import Row, plan_row

    args = SimpleNamespace(
        compile=False, out=str(tmp_path), machine=None, pad_to_multiple_of=16, grad_clip=None
    )
    cpu = torch.device("cpu")
    assert plan_row(Row("tiny", "tiny", 8), args, cpu)[0].pad_to_multiple_of == 16
    assert plan_row(Row("siglip-tiny", "siglip-tiny", 8), args, cpu)[0].pad_to_multiple_of == 1


def test_grad_clip_runs_as_a_hand_row_ran(tmp_path):
    """``--grad-clip 0`` reaches the planned run (the full fine-tuning default clips at 1)."""
    import torch

    from benchmarks.plan.accuracy import Row, plan_row

    args = SimpleNamespace(
        compile=False, out=str(tmp_path), machine=None, pad_to_multiple_of=1, grad_clip=None
    )
    cpu = torch.device("cpu")
    assert plan_row(Row("siglip-tiny", "siglip-tiny", 8), args, cpu)[0].grad_clip == 1.0
    args.grad_clip = 0.0
    assert plan_row(Row("siglip-tiny", "siglip-tiny", 8), args, cpu)[0].grad_clip == 0.0


def test_against_hand_compares_in_the_hand_rows_unit():
    from benchmarks.plan.accuracy import HAND, against_hand

    rec = {"name": "openvla", "samples_per_s": 1.0, "tokens_per_s": HAND["openvla"][0] / 2}
    assert against_hand(rec) == 0.5  # tokens/s: the hand row's samples were shorter
    rec = {"name": "siglip", "samples_per_s": HAND["siglip"][0] * 2, "tokens_per_s": 1.0}
    assert against_hand(rec) == 2.0
    assert math.isnan(against_hand({"name": "llava", "samples_per_s": 3.0}))


def test_the_timed_steps_include_the_making_of_their_batches(tmp_path, monkeypatch):
    """The batches come a step ahead from a thread, as ``parallax.train`` takes them, and the
    timed steps run back to back: a collator slower than the step shows in every step's time
    (made between untimed steps, it would not), so a deferred host step gets no gap to hide in."""
    import time

    import torch

    from benchmarks.plan import accuracy
    from parallax.recipe import resolve
    from parallax.run import TrainConfig

    made = accuracy._loader_and_builder

    def slow(run, ctx):
        loader, builder = made(run, ctx)
        return loader, lambda samples: (time.sleep(0.1), builder(samples))[1]

    monkeypatch.setattr(accuracy, "_loader_and_builder", slow)
    run = resolve(
        TrainConfig(model="tiny", global_batch_size=2, micro_batch_size=1, out=str(tmp_path))
    )
    got = accuracy.measure(run, torch.device("cpu"), steps=2, warmup=1)
    assert len(got["step_times"]) == 2
    # Four microbatches of 0.1 s each; the first may be made during the warm-up step, and the
    # timer's edges wander by a few ms, so the window holds at least three of them (made between
    # untimed steps it would hold none: the tiny step itself takes milliseconds).
    assert sum(got["step_times"]) >= 0.3
    assert min(got["step_times"]) >= 0.09


def test_each_timed_step_says_what_its_host_phases_took(tmp_path):
    """A long step among the timed ones can be read apart: one record a timed step, with the
    offload's phase seconds of that step alone (their sum over the steps is the phases' total)."""
    import torch

    from benchmarks.plan import accuracy
    from parallax.recipe import resolve
    from parallax.run import TrainConfig

    run = resolve(
        TrainConfig(
            model="tiny",
            global_batch_size=2,
            micro_batch_size=1,
            out=str(tmp_path),
            zero=2,
            offload="optimizer",
        )  # fmt: skip
    )
    got = accuracy.measure(run, torch.device("cpu"), steps=2, warmup=1)
    assert len(got["each_step"]) == 2
    for name, per_step in got["host_phases"].items():  # per_step: the mean over the timed steps
        summed = sum(step.get(name, 0.0) for step in got["each_step"])
        assert abs(summed / 2 - per_step) < 1e-3, (name, summed, per_step)
    assert any(v > 0 for v in got["each_step"][0].values())


def test_a_timed_step_that_recompiled_says_so():
    """A micro-batch of a text length not seen before recompiles the compiled blocks (seconds
    on a 7B model): the counters read after each step count the compiles, so the step that did
    it is marked and a long step is not taken for a slow one."""
    import torch

    from benchmarks.plan import accuracy

    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    before = accuracy._counters(None, torch.device("cpu"))["compiles"]
    fn(torch.ones(3))
    fn(torch.ones(3))  # (no new frame)
    assert accuracy._counters(None, torch.device("cpu"))["compiles"] == before + 1
    torch._dynamo.reset()


def test_the_step_is_the_median_of_the_steps_that_compiled_nothing():
    from benchmarks.plan.accuracy import steady_median

    each = [{"compiles": 0.0}, {"compiles": 0.0}, {"compiles": 3.0}]
    assert abs(steady_median([11.7, 11.6, 17.0], each) - 11.65) < 1e-12
    assert steady_median([11.7, 11.6, 17.0], [{"compiles": 1.0}] * 3) == 11.7
