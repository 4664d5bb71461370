"""``--dry-run`` prints the planner's memory model: the ZeRO stage, gathered weights, host
memory and what a card needs; under a cap it says whether the layout fits and what would."""

import io

import pytest

from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.train import parse_args
from parallax.train.cli import resolve_run
from parallax.train.dry_run import print_plan


def test_the_table_has_the_memory_columns(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = io.StringIO()
    print_plan(
        resolve_run(parse_args(["--dry-run", "--dp", "2", "--activation-checkpointing"])), file=out
    )
    text = " ".join(out.getvalue().split())
    for word in ("zero 1", "activation checkpointing (all)", "gathered", "card needs", "host"):
        assert word in text, text


def test_a_layout_over_its_cap_is_told_what_would_fit(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = resolve(TrainConfig(model="tiny", global_batch_size=32, micro_batch_size=32))
    out = io.StringIO()
    # a card of 0.52 GiB (its 0.5 GiB CUDA context and 20 MiB), asked of the run as resolved
    print_plan(run.replace(layout="auto", gpu_memory=0.52), file=out)
    text = " ".join(out.getvalue().split())
    assert "does not fit --gpu-memory 0.52 GiB" in text, text
    assert "These would fit:" in text and "--micro-batch-size" in text, text
    out = io.StringIO()
    print_plan(run.replace(layout="auto", gpu_memory=2.0), file=out)
    assert "fits --gpu-memory 2 GiB" in out.getvalue()


def test_the_offloads_host_memory_is_said_against_its_floor(monkeypatch):
    """OpenVLA-7B at ZeRO-3 with the optimizer offloaded: the host bytes by what they hold (the
    memory model's, which are the optimizer's terms) add up, and are said against 12 bytes a
    trainable parameter."""
    from parallax.dims import ParallelDims
    from parallax.train.dry_run import memory_plan

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--model", "openvla-7b", "--precision", "bf16", "--global-batch-size", "256"]
    argv += ["--micro-batch-size", "32", "--zero", "3", "--offload", "optimizer"]
    argv += ["--host-adamw", "torch"]  # (its scratch and staging; auto's one pass has neither)
    run = resolve_run(parse_args([*argv, "--activation-checkpointing", "--dry-run"]))
    (rank,) = memory_plan(run, ParallelDims())
    parts = dict(rank.host_parts)
    assert rank.host == pytest.approx(sum(parts.values()))
    assert parts["masters and moments"] == pytest.approx(12 * rank.offloaded)
    assert rank.offloaded == rank.trainable  # all of it, at dp 1
    assert rank.host_ratio == pytest.approx(rank.host / (12 * rank.trainable))
    assert 14 / 12 <= rank.host_ratio < 1.25  # + a bf16 accumulator, scratch and staging
    out = io.StringIO()
    print_plan(run, file=out)
    text = " ".join(out.getvalue().split())
    assert f"{rank.host_ratio:.2f}x the floor of 12 B" in text, text
    assert "masters and moments" in text and "pinned staging" in text
