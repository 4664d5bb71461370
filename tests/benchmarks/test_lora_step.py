"""The LoRA benchmark's smoke form: the parallax row runs tiny on the CPU and writes nothing, the
HF row runs or says what it needs, and one session's rows become one table with the ratios."""

import json
import math

from benchmarks.step.lora import lora_flops_per_sample, main
from benchmarks.step.lora_report import COLUMNS, table
from benchmarks.tools.common import RESULTS_JSONL
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.flops import openvla_flops_per_sample

FAST = ["--smoke", "--batch", "2", "--steps", "1", "--warmup", "0"]


def _size() -> int:
    return RESULTS_JSONL.stat().st_size if RESULTS_JSONL.exists() else 0


def test_smoke_rows_run_and_write_nothing():
    before = _size()
    (row,) = main(FAST)
    assert row["status"] == "ok" and row["stack"] == "parallax" and row["batch"] == 2
    assert math.isfinite(row["step_time_s"]) and row["mfu"] > 0 and row["first_loss"] > 0
    assert row["flops_per_sample"] == lora_flops_per_sample(OpenVLAConfig.preset("tiny"), 41, 8)
    # the 7B's LoRA step: 0.68 of full fine-tuning's FLOPs (no weight gradient for the frozen
    # base, no input gradient for the towers' first layers); built on meta, no values
    seven = OpenVLAConfig.preset("openvla-7b")
    ratio = lora_flops_per_sample(seven, 41, 8) / openvla_flops_per_sample(
        seven, 41, logit_positions=8
    )
    assert 0.66 < ratio < 0.70, ratio
    (hf,) = main([*FAST, "--stack", "hf"])
    assert hf["status"] == "ok" or hf["status"].startswith("skipped: needs"), hf
    assert _size() == before


def _rec(stack, variant, batch, sps, mem, label=None):
    return {
        "stack": stack,
        "variant": variant,
        "batch": batch,
        "batch_label": label or str(batch),
        "micro": batch,
        "step_time_s": batch / sps,
        "samples_per_s_per_gpu": sps,
        "tokens_per_s_per_gpu": sps * 297,
        "tflops_per_gpu": 1.0,
        "mfu": 0.1,
        "peak_mem_gib": mem,
        "first_loss": 11.0,
        "status": "ok",
    }


def test_one_table_with_ratios_against_the_faster_hf_row(tmp_path):
    recs = [
        _rec("hf", "eager", 16, 10.0, 80.0),
        _rec("hf", "compile", 16, 12.0, 70.0),
        _rec("parallax", "opt", 16, 24.0, 35.0),
        _rec("parallax", "opt", 96, 30.0, 120.0, "max=96"),
        _rec("hf", "eager", 32, 11.0, 130.0, "max=32"),
    ]
    path = tmp_path / "r.jsonl"
    path.write_text(
        "".join(json.dumps({**r, "benchmark": "lora_step", "session": "s"}) + "\n" for r in recs)
    )
    rows = table([json.loads(line) for line in path.read_text().splitlines()])
    col = {c: i for i, c in enumerate(COLUMNS)}
    by = {(r[col["stack"]], r[col["batch"]]): r for r in rows}
    assert rows[0][col["stack"]] == "parallax"
    assert by["parallax", "16"][col["x HF samples/s"]] == 2.0  # against hf compile (faster)
    assert by["parallax", "16"][col["x HF peak mem"]] == 0.5
    assert by["parallax", "max=96"][col["x HF samples/s"]] == 30.0 / 11.0


def test_the_dp2_row_runs_under_torchrun(warm_server):
    """The multi-GPU row's code path (``torchrun --nproc-per-node 2``: dp 2 over ZeRO-1, the
    batch per GPU) runs on CPU, and its first loss is the one-process row's (the same samples
    on each rank, mean over the global batch). Its ranks are forked warm with torchrun's
    environment (``tests/warm.py``)."""
    import re
    import sys

    from tests import warm

    (one,) = main(FAST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "benchmarks.step.lora", *FAST]
    code, out = warm_server.run(warm.plan(cmd), warm.ROOT, warm.command_env(), 240)
    assert code == 0, out[-2000:]
    line = next(s for s in out.splitlines() if s.startswith("parallax opt dp2 batch 2"))
    assert "(ok," in line, line
    loss = float(re.search(r"loss 1 (\S+)", line).group(1))
    assert math.isclose(loss, one["first_loss"], rel_tol=1e-4), (loss, one["first_loss"])
