"""The third-party peer of ``memory_fit``: DeepSpeed ZeRO-2 and ZeRO-3 with ZeRO-Offload.

The same dense OpenVLA as :mod:`benchmarks.zero.fsdp2_offload` (parallax's model at tp=1 with
plain ``nn`` layers, the layout-free weights, activation checkpointing per ViT block and decoder
layer, the model's own) and the same synthetic batch (``openvla_step``'s: 40 text tokens, 8
labelled), one process at world size 1. DeepSpeed as its users run it:

- ``zero_optimization.stage`` 2 or 3 with ``offload_optimizer: {device: cpu, pin_memory: true}``:
  fp32 masters, fp32 AdamW moments and the gradients in host memory, the optimizer step on the
  CPU by ``DeepSpeedCPUAdam`` (AdamW mode, fp32 moments: exact AdamW), bf16 weights on the GPU;
- ``bf16.enabled``, ``gradient_clipping: 1.0`` and AdamW's lr 2e-5, betas (0.9, 0.999), eps 1e-8,
  weight decay 0.01 on matrices only: the hyper-parameters of parallax's 7B run and of the
  natives (:class:`benchmarks.step.native.base.Workload`); a constant lr (the schedule costs
  nothing);
- the global batch as ``train_batch_size`` with ``gradient_accumulation_steps`` micro-batches
  (``engine.backward`` scales each micro-batch's loss by their count, ``engine.step`` steps at
  the boundary).

The model is built on the GPU in bf16 (the layout-free init draws on the device), so the cap
(``--gpu-memory-limit``'s per-process fraction, set by ``memory_fit`` before the row starts) holds
from the first allocation; ZeRO makes its fp32 masters from these weights, as parallax does.

DeepSpeed is never a dependency of parallax: it is imported here, lazily. On the GPU machine it
travels as a ``pip install --target`` folder (``.peers/deepspeed``, on ``PYTHONPATH``), and
``DeepSpeedCPUAdam``'s C++ op is built just in time (``DS_BUILD_OPS=0``) with the host's
compiler and ninja. The row builds that op first, before the model: when the import or the
build fails, :class:`PeerUnavailable` carries the exact error text (the compiler's output
included) and ``memory_fit`` records it as the row's result instead of a number.

Host memory, by DeepSpeed's own arithmetic (``estimate_zero{2,3}_model_states_mem_needs``,
recorded per row as ``ds_host_estimate_gib``, without its 1.5x buffer factor): 16 bytes a
parameter, 112 GiB for OpenVLA-7B's 7.5B, before torch's pinned allocator rounds each pinned
buffer up to a power of two; ZeRO-2 with gradient accumulation also keeps a pinned bf16
accumulator per parameter (``accumulated_grads_in_cpu``: 2 bytes more). The H200 host has about
125 GiB and ``memory_fit`` ends a row past ``--host-limit`` (112 GiB): the rows may end there,
and then that is their result (the record keeps the RSS at which they ended).

What was verified where (2026-12-05), on a CPU machine with g++ 12 and ninja, no GPU:
- with the GPU host's versions, Python 3.12 and its torch wheel (2.11.0+cu130, here seeing no
  GPU), the folder on ``PYTHONPATH`` as the session puts it (its cp312 pydantic-core included):
  ``python -m benchmarks.zero.deepspeed_offload`` imported deepspeed 0.19.8 and JIT-built
  ``cpu_adam.so`` (71 s on two cores), and ``memory_fit --smoke --rows
  tiny-deepspeed-z2,tiny-deepspeed-z3 --peer-micro-batch 4`` ran both rows end to end (gloo,
  DeepSpeed's CPU accelerator: engine, ZeRO-2/3 offload, two accumulation passes, clipping, CPU
  Adam steps, a falling loss); the same with Python 3.11 and torch 2.13 CPU. DeepSpeed's CUDA
  accelerator maps ``CPUAdamBuilder`` to this same CPU builder (``op_builder/cpu``: plain C++
  through ``torch.utils.cpp_extension``, no nvcc), so the GPU host builds the same sources with
  the same flags;
- only on the GPU host: its compiler and Python headers (the image's), the CUDA accelerator,
  NCCL at world size 1, 7B memory under the cap, the host's pinned memory and the times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from benchmarks.step.native.base import (
    Workload,
    adamw,
    densify,
    loss_of,
    split_batch,
    synthetic_batch,
)
from benchmarks.tools.common import median, time_it
from parallax.families.openvla import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA

TEXT_TOKENS, LABELLED = 40, 8  # openvla_step's workload, as fsdp2_offload's
PORT = "29534"  # fsdp2_offload's is 29533
ERROR_CHARS = 4000  # of an import's or a build's error text kept in the record


class PeerUnavailable(RuntimeError):
    """DeepSpeed cannot run here: its import or its CPU Adam build failed. ``str()`` is the
    exact error text, the compiler's output included where the build failed."""


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    cause = err.__cause__ or err.__context__
    if cause is not None:
        text += f" (from {type(cause).__name__}: {cause})"
    return text[:ERROR_CHARS]


def load_deepspeed():
    """``import deepspeed`` (from ``.peers/deepspeed`` on ``PYTHONPATH``), or
    :class:`PeerUnavailable` with the import's error."""
    try:
        import deepspeed
    except Exception as err:  # ImportError, or anything its import-time probing raises
        raise PeerUnavailable(f"import deepspeed: {_error_text(err)}") from err
    return deepspeed


def build_cpu_adam() -> float:
    """Build (or load the cached build of) ``DeepSpeedCPUAdam``'s op; its seconds. Not verbose,
    so that torch's error on a failed build holds the compiler's output."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        start = time.perf_counter()
        CPUAdamBuilder().load(verbose=False)
    except Exception as err:
        raise PeerUnavailable(f"DeepSpeedCPUAdam's JIT build: {_error_text(err)}") from err
    return time.perf_counter() - start


def ds_config(stage: int, batch: int, micro_batch: int, wl: Workload) -> dict:
    """DeepSpeed's configuration of one row: ZeRO ``stage`` with its optimizer offloaded to
    pinned host memory, bf16, gradient clipping, ``batch`` samples a step in micro-batches."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO stage {stage}: the peer rows are stage 2 and 3")
    if batch % micro_batch:
        raise ValueError(f"a batch of {batch} does not split into micro-batches of {micro_batch}")
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": batch // micro_batch,
        "gradient_clipping": wl.grad_clip,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def host_estimate_gib(stage: int, params: int, largest: int) -> float:
    """DeepSpeed's own estimate of the host memory of its model states at one GPU (no buffer
    factor)."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, _ = estimate_zero2_model_states_mem_needs(params, additional_buffer_factor=1.0)
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, _, _ = estimate_zero3_model_states_mem_needs(
            params, largest, cpu_offload_params=False, additional_buffer_factor=1.0
        )
    return cpu / 2**30


def _init_single_rank(deepspeed, device: torch.device) -> None:
    """One rank of one: the environment DeepSpeed's launcher would set (so that it looks for no
    MPI), then its process group (NCCL on the GPU, gloo on the CPU)."""
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", PORT),
    ):
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def build(
    config: OpenVLAConfig, stage: int, batch: int, micro_batch: int, device: torch.device
) -> tuple[Callable, dict]:
    """The step function of DeepSpeed ZeRO-``stage`` + CPU offload on this one device, and what
    the row records of its set-up (the op's build seconds, parameters, DeepSpeed's host
    estimate)."""
    deepspeed = load_deepspeed()
    info = {"deepspeed": deepspeed.__version__, "cpu_adam_build_s": build_cpu_adam()}
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    _init_single_rank(deepspeed, device)
    wl = Workload(config=config, micro_batch=micro_batch, activation_checkpointing=True)
    model = OpenVLA(
        config,
        None,
        dtype=torch.bfloat16,
        device=device,
        activation_checkpointing=True,
        seed=wl.seed,
    )
    densify(model)
    sizes = [p.numel() for p in model.parameters()]
    info.update(
        params=sum(sizes), ds_host_estimate_gib=host_estimate_gib(stage, sum(sizes), max(sizes))
    )
    groups, kwargs = adamw(model.named_parameters(), wl)  # decay on matrices only
    opt = DeepSpeedCPUAdam(
        groups, lr=kwargs["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=wl.weight_decay,
        adamw_mode=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=ds_config(stage, batch, micro_batch, wl)
    )
    dtype = torch.bfloat16

    def step(microbatches) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for mb in microbatches:
            logits = engine(mb["pixel_values"].to(dtype), mb["input_ids"])
            loss = loss_of(config, logits, mb["labels"])
            engine.backward(loss)  # / gradient_accumulation_steps, inside
            engine.step()  # the optimizer steps (clipped, on the CPU) at the boundary
            total += loss.detach() / len(microbatches)
        return total

    return step, info


def measure(
    config: OpenVLAConfig,
    stage: int,
    batch: int,
    micro_batch: int,
    steps: int,
    warmup: int,
    device: torch.device | None = None,
) -> dict:
    """Median step seconds, peak allocated GPU GiB and the set-up's record of the peer at
    ``batch`` samples a step; :class:`PeerUnavailable` when DeepSpeed cannot run here."""
    device = device or torch.device("cuda", 0)
    step, info = build(config, stage, batch, micro_batch, device)
    data = synthetic_batch(config, batch, TEXT_TOKENS, LABELLED, device=device)
    microbatches = split_batch(data, micro_batch)
    losses = []
    times = time_it(lambda: losses.append(step(microbatches).item()), device, warmup, steps)
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    )
    return dict(step_s=median(times), peak_gib=peak, loss=losses[-1], **info)


def check() -> int:
    """What the GPU session runs first: the versions, the compiler, Python's headers, then the
    import and the CPU Adam build (cached under ``TORCH_EXTENSIONS_DIR`` for the rows that
    follow). Prints the exact error where either fails; exit code 1 then."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    include = sysconfig.get_paths()["include"]
    print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}")
    print(f"Python.h: {os.path.exists(os.path.join(include, 'Python.h'))} ({include})")
    for tool in ("c++", "g++", "ninja", "nvcc"):
        path = shutil.which(tool)
        version = ""
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            version = (out.strip().splitlines() or [""])[-1 if tool == "nvcc" else 0]
        print(f"{tool}: {path or 'not found'} {version}")
    for key in ("CUDA_HOME", "DS_BUILD_OPS", "TORCH_EXTENSIONS_DIR", "PYTHONPATH"):
        print(f"{key}={os.environ.get(key, '')}")
    try:
        deepspeed = load_deepspeed()
        from deepspeed.accelerator import get_accelerator

        print(f"deepspeed {deepspeed.__version__} ({deepspeed.__file__})")
        print(f"accelerator {get_accelerator().device_name()}")
        print(f"DeepSpeedCPUAdam's op built or loaded in {build_cpu_adam():.1f} s")
    except PeerUnavailable as err:
        print(f"deepspeed unavailable: {err}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(check())
