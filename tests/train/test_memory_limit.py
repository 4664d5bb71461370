"""--gpu-memory-limit: the cap torch is given, a no-op on the CPU, and an out-of-memory step
named with the options that would help."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from parallax import ParallelContext
from parallax.run import TrainConfig
from parallax.train.memory_limit import (
    GiB,
    apply_gpu_memory_limit,
    cap_gpu_memory,
    out_of_memory_message,
)


def test_the_cap_is_a_fraction_of_the_device(monkeypatch):
    given = []
    props = SimpleNamespace(total_memory=int(141 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device: given.append(f)
    )
    gpu = SimpleNamespace(device=torch.device("cuda", 0), rank=0)
    apply_gpu_memory_limit(TrainConfig(gpu_memory_limit=24), gpu)
    assert given == [pytest.approx(24 / 141)]
    with pytest.raises(ValueError, match="more than this GPU's 141.0 GiB"):
        apply_gpu_memory_limit(TrainConfig(gpu_memory_limit=200), gpu)


def test_a_device_without_an_index_caps_the_current_one(monkeypatch):
    """``torch.device("cuda")`` (as the benchmarks build it) names the current device: torch's
    own cap refuses a device without an index."""
    given = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    props = SimpleNamespace(total_memory=int(100 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device: given.append((f, device))
    )
    cap_gpu_memory(16, torch.device("cuda"))
    cap_gpu_memory(None, torch.device("cuda", 1))
    assert given == [(pytest.approx(0.16), torch.device("cuda", 3)), (1.0, torch.device("cuda", 1))]


def test_on_the_cpu_it_only_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="parallax.train.memory_limit"):
        apply_gpu_memory_limit(TrainConfig(gpu_memory_limit=24), ParallelContext.local())
    assert "no GPU on this run" in caplog.text


def test_an_out_of_memory_step_names_the_cap_and_what_helps(monkeypatch, tmp_path):
    """The CLI turns torch's out-of-memory error in a step into a user error (exit status 2,
    one line): the cap, the step, and the options this run does not use yet."""
    from parallax.train import cli
    from parallax.train.trainer import Trainer

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(Trainer, "train_step", oom)
    cfg = TrainConfig(
        steps=2, global_batch_size=2, micro_batch_size=2, gpu_memory_limit=24, out=str(tmp_path)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(cli.UserError) as err:
            cli.run(cli.resolve_run(cfg), ParallelContext.local())
    finally:
        torch.set_num_threads(threads)
    message = str(err.value)
    assert message.startswith("step 1 ran out of GPU memory under --gpu-memory-limit 24 GiB")
    assert "Tried to allocate 2.00 GiB" in message and "more" not in message.split(")")[0]
    for option in ("--zero 3", "--offload optimizer", "--activation-checkpointing"):
        assert option in message
    assert "a smaller --micro-batch-size (now 2)" in message
    # only what this run does not use yet
    cfg = TrainConfig(zero=3, offload="optimizer", activation_checkpointing=True)
    assert out_of_memory_message(cfg, 7, RuntimeError()).endswith(
        "What would help: a smaller --micro-batch-size (now 4)"
    )


def test_runs_start_with_expandable_segments_unless_the_user_chose(monkeypatch):
    from parallax.train.memory_limit import ALLOCATOR, default_allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    default_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    default_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
