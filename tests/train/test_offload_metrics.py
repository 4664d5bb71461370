"""``metrics.jsonl`` says what the optimizer offload holds on the host: the bytes measured from
the optimizer's host tensors and their ratio to the floor of 12 bytes an offloaded parameter
(fp32 master, AdamW's moments); null without offload. The one-pass host AdamW holds only the
floor and the sums."""

import json

import pytest

from parallax import ParallelContext
from parallax.optim.zero.stage import host_adamw_kernel
from parallax.recipe import resolve
from parallax.train import parse_args
from parallax.train.cli import run
from parallax.train.trainer import Trainer

RUN = ["--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "1"]


def _rows(out, flags: list[str]) -> list[dict]:
    run(resolve(parse_args(["--out", str(out), *RUN, *flags])), ParallelContext.local())
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_offloads_host_bytes_and_their_ratio_to_the_floor_are_in_the_metrics(tmp_path, caplog):
    rows = _rows(tmp_path / "offload", ["--zero", "2", "--offload", "optimizer"])
    assert len(rows) == 2
    for r in rows:
        # masters and moments (12 B) and the fp32 accumulator (4 B: this run is fp32) at least
        assert r["offload_host_ratio"] == pytest.approx(rows[0]["offload_host_ratio"])
        assert 16 / 12 <= r["offload_host_ratio"] < 2, r
        assert 0 < r["offload_host_gib"] < r["host_memory_gib"], r
    # --host-adamw one-pass steps in place of the sums: no fp32 scratch (nor, on the CPU, any
    # staging), the same losses to fp32 rounding
    one = _rows(
        tmp_path / "one", ["--zero", "2", "--offload", "optimizer", "--host-adamw", "one-pass"]
    )
    for r, o in zip(rows, one):
        assert o["offload_host_ratio"] == pytest.approx(16 / 12, rel=1e-3), o
        assert o["offload_host_ratio"] < r["offload_host_ratio"]
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5)
    # without offload --host-adamw changes nothing, and the run says so
    plain = _rows(tmp_path / "plain", ["--zero", "2", "--host-adamw", "one-pass"])
    assert "--host-adamw one-pass changes nothing here: nothing is offloaded" in caplog.text
    assert all(r["offload_host_gib"] is None and r["offload_host_ratio"] is None for r in plain)


def test_auto_steps_the_host_in_one_pass_on_gpus_and_with_torchs_kernel_on_the_cpu():
    """``--host-adamw auto`` (the default) is the compiled one-pass kernel where a run is on
    GPUs (faster there, docs/zero.md) and torch's kernel in a CPU run, where the one-pass loop
    would run as eager ops; an explicit choice is kept either way."""
    assert parse_args([]).host_adamw == "auto"
    assert host_adamw_kernel("auto", "cuda") == "one-pass"
    assert host_adamw_kernel("auto", "cpu") == "torch"
    for choice in ("torch", "one-pass"):
        assert host_adamw_kernel(choice, "cuda") == host_adamw_kernel(choice, "cpu") == choice
    # what a run steps with: unclipped, torch's kernel in the backward whatever the choice
    clipped = parse_args(["--grad-clip", "1"])
    assert clipped.host_kernel("cuda") == "one-pass"
    assert clipped.host_kernel("cpu") == "torch"
    assert parse_args(["--grad-clip", "0", "--host-adamw", "one-pass"]).host_kernel() == "torch"


def test_an_unclipped_run_steps_with_torchs_kernel_and_a_clipped_one_with_its_choice():
    """Unclipped, each bucket steps in the backward with torch's kernel: the one-pass kernel is
    not built (on GPUs it would compile for nothing); clipped, ``one-pass`` is."""
    base = ["--zero", "2", "--offload", "optimizer", "--host-adamw", "one-pass", *RUN]
    for clip, built in (("0", False), ("1", True)):
        trainer = Trainer(
            resolve(parse_args([*base, "--grad-clip", clip])), ParallelContext.local()
        )
        assert (trainer.optimizer.host.one_pass is not None) is built, clip


def test_split_masters_hold_two_bytes_less_and_train_alike(tmp_path, caplog):
    """``--host-masters split`` (bf16 weights: the masters' top halves) holds 10 bytes of
    masters and moments an offloaded parameter, not 12, for the same losses (to a master moved
    by one fp32 ulp at a tie); it is asked for (full by default), and takes effect where the
    one-pass AdamW steps."""
    base = ["--zero", "2", "--offload", "optimizer", "--host-adamw", "one-pass"]
    base += ["--precision", "bf16"]
    whole = _rows(tmp_path / "full", [*base, "--host-masters", "full"])
    split = _rows(tmp_path / "split", [*base, "--host-masters", "split"])
    for w, s in zip(whole, split):
        # the sums (2 B, bf16) beside masters and moments: 14 B whole, 12 B split
        assert w["offload_host_ratio"] == pytest.approx(14 / 12, rel=1e-3), w
        assert s["offload_host_ratio"] == pytest.approx(12 / 12, rel=1e-3), s
        assert s["loss"] == pytest.approx(w["loss"], rel=1e-3)
    split = ["--host-masters", "split", "--grad-clip", "1"]
    assert parse_args(split).host_masters_kind("cuda") == "full"  # (nothing offloaded)
    offloaded = ["--offload", "optimizer", "--zero", "2", *split]
    assert parse_args(offloaded).host_masters_kind("cuda") == "split"
    assert parse_args(offloaded).host_masters_kind("cpu") == "full"  # (torch's kernel there)
    assert parse_args(offloaded[:4]).host_masters_kind("cuda") == "full"  # (the default)
    with pytest.raises(ValueError, match="--host-masters split .* --grad-clip above 0"):
        resolve(parse_args([*offloaded, "--precision", "bf16", "--grad-clip", "0"]))
    with pytest.raises(ValueError, match="--precision fp32 has no bf16 weights"):
        resolve(parse_args(offloaded))  # (fp32 weights: nothing to split)
