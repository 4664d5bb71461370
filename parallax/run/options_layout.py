"""The ``TrainConfig`` options that say how a run is split over the GPUs: the ``dp x tp x pp``
layout (or ``--layout auto``, the planner's) and the pipeline schedule. None of them changes
what is computed; :mod:`parallax.run.config` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.pipeline import SCHEDULES
from parallax.run.option import ONE, at_most, opt, positive

LAYOUTS = ("manual", "auto")
INTERCONNECTS = ("nvlink", "pcie", "pcie-no-p2p")
LAYOUT, SCHEDULE = "layout", "schedule"
AUTO_ONLY = {"needs": ("layout", "auto", "what the planner plans for")}
# no GPU holds more than a few hundred GiB, no single node's host more than a few dozen TiB:
# a larger value is a typo (bytes for GiB), not a machine
MAX_GPU_GIB, MAX_HOST_GIB = 4096, 65536
GPU_GIB = (positive, at_most(MAX_GPU_GIB, " GiB (no GPU holds more)"))
HOST_GIB = (positive, at_most(MAX_HOST_GIB, " GiB (no node holds more)"))


@dataclass(frozen=True)
class LayoutOptions:
    """The ``layout`` group: the process grid, or what the planner plans for."""

    tp: int = opt(1, "tensor-parallel size", LAYOUT, check=ONE)
    pp: int = opt(1, "pipeline stages", LAYOUT, check=ONE)
    dp: int | None = opt(
        None, "data-parallel size", LAYOUT, check=ONE, default_text="world/(tp*pp)"
    )
    layout: str = opt(
        "manual",
        "auto: run the planner's fastest layout that fits the GPUs (python -m parallax.plan) and "
        "print it; --tp, --pp, --dp, --micro-batch-size, --schedule, --chunks, memory options "
        "given beside it constrain the search",
        LAYOUT,
        choices=LAYOUTS,
    )
    gpu_memory: float | None = opt(
        None,
        "GiB of each GPU that --layout auto plans for",
        LAYOUT,
        checks=GPU_GIB,
        metavar="GIB",
        default_text="the device's",
        **AUTO_ONLY,
    )
    host_memory: float | None = opt(
        None,
        "GiB of host memory per node that --layout auto plans for",
        LAYOUT,
        checks=HOST_GIB,
        metavar="GIB",
        default_text="this host's",
        **AUTO_ONLY,
    )
    interconnect: str | None = opt(
        None,
        "how a node's GPUs talk, for --layout auto",
        LAYOUT,
        choices=INTERCONNECTS,
        default_text="NVLink on data-centre GPUs, PCIe without peer-to-peer below 70 GiB",
        **AUTO_ONLY,
    )
    machine: str | None = opt(
        None,
        "the machine profile --layout auto plans with: a profile file (python -m parallax.plan "
        "calibrate --out FILE) or a shipped card's name (h200, h100, rtx4090, rtx5090)",
        LAYOUT,
        metavar="FILE",
        default_text="this GPU's own (its calibrated or shipped profile, by its name)",
        **AUTO_ONLY,
    )
    layout_given: str | None = opt(
        None,
        "the options given beside --layout auto (the command line fills it in)",
        LAYOUT,
        hidden=True,
    )


@dataclass(frozen=True)
class ScheduleOptions:
    """The ``schedule`` group: steps, batch sizes and the pipeline schedule."""

    steps: int = opt(150, "optimizer steps", SCHEDULE, check=ONE)
    global_batch_size: int = opt(32, "samples per step", SCHEDULE, check=ONE)
    micro_batch_size: int = opt(
        4,
        "samples per microbatch; each dp rank runs global / (micro x dp) microbatches a step",
        SCHEDULE,
        check=ONE,
    )
    schedule: str = opt("1f1b", "pipeline schedule", SCHEDULE, choices=SCHEDULES)
    chunks: int = opt(
        1,
        "model chunks per pipeline rank",
        SCHEDULE,
        check=ONE,
        needs=("schedule", "interleaved"),
    )
