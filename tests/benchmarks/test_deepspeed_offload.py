"""The DeepSpeed peer of memory_fit (issue 42) without DeepSpeed: its configuration, and a row
whose import fails records the exact error as its status instead of ending the table. The rows
themselves run on the GPU machine, where DeepSpeed travels as a folder (``.peers/deepspeed``)."""

import sys
from types import SimpleNamespace

import pytest

from benchmarks.plan.accuracy import Row
from benchmarks.step.native.base import Workload
from benchmarks.zero.deepspeed_offload import ds_config
from benchmarks.zero.memory_fit import child, workload
from parallax.families.openvla import OpenVLAConfig


def test_the_config_is_zero_offload_with_the_runs_hyper_parameters():
    wl = Workload(config=OpenVLAConfig.preset("tiny"), micro_batch=16)
    cfg = ds_config(3, 256, 16, wl)
    assert cfg["train_batch_size"] == 256 and cfg["gradient_accumulation_steps"] == 16
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True}
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(ValueError):
        ds_config(2, 256, 24, wl)
    with pytest.raises(ValueError):
        ds_config(1, 256, 16, wl)


def test_a_row_that_cannot_import_deepspeed_records_the_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed: ImportError
    args = SimpleNamespace(smoke=True, steps=1, warmup=0, peer_micro_batch=4, out=str(tmp_path))
    rec = child(Row("tiny-deepspeed-z2", "tiny", 8), args)
    assert rec["status"].startswith("deepspeed unavailable: import deepspeed: ModuleNotFoundError")
    assert "deepspeed" in rec["error"] and rec["layout"].startswith("deepspeed zero 2")
    assert "step_s" not in rec and rec["host_gib"] > 0
    assert workload({"name": "deepspeed-z3-offload-24"}) == "openvla"
