"""``parallax.train --layout auto``: the planner's fastest layout that fits, for the world
torchrun started, chosen once the run is resolved (:func:`parallax.train.cli.resolve_run`).

Every rank plans alike from what it sees alone (the world and node size from torchrun's
environment, the GPU's name and memory, this host's memory, or a ``--machine`` profile), so all
choose the same layout before any process group exists. On a GPU the profile is the card's own
(:mod:`parallax.plan.device`: calibrated and cached, else shipped for its name) with the cap
(``--gpu-memory-limit``, ``--gpu-memory``) as its memory, so the ranking and the printed step
time are this card's; the run says which profile it used and why. Options given beside
``--layout auto`` are kept and constrain the search (:data:`parallax.plan.layout.LAYOUT_OPTIONS`);
a run that no layout fits fails with the planner's reasons.
"""

from __future__ import annotations

import logging
import os

from parallax.plan import report
from parallax.plan.device import Detect, Device, base_profile, memory_words
from parallax.plan.device import detect as detect_device
from parallax.plan.host_fallback import search_run
from parallax.plan.layout import LAYOUT_OPTIONS
from parallax.plan.machine import DEFAULTS, GIB, Machine, target
from parallax.plan.ruled_out import ruled_out
from parallax.run import Run, TrainConfig

log = logging.getLogger("parallax.train")


def given(flags: TrainConfig) -> set[str]:
    """The layout options given beside ``--layout auto``: as the command line recorded them,
    else (a config made in code) those that differ from their defaults."""
    if flags.layout_given is not None:
        names = set(flags.layout_given.split(","))
    else:
        defaults = TrainConfig()
        names = {k for k in LAYOUT_OPTIONS if getattr(flags, k) != getattr(defaults, k)}
    return {k for k in LAYOUT_OPTIONS if k in names}


def _gpu_memory(flags: TrainConfig, device: Device | None) -> tuple[float | None, bool]:
    """GiB to plan each GPU for (``--gpu-memory``, else this GPU's; ``None``: the
    ``--machine`` profile's), and whether ``--gpu-memory-limit`` is what bounds it (a cap the
    CUDA context is not part of)."""
    gib = flags.gpu_memory
    if gib is None and device is not None:
        gib = device.memory_gib
    limit = flags.gpu_memory_limit
    if gib is None and limit is None and flags.machine is None:
        raise ValueError(
            "--layout auto on a machine without GPUs needs --gpu-memory GIB (or --machine: a "
            f"profile file or a shipped card's name, {', '.join(DEFAULTS)})"
        )
    if limit is not None and (gib is None or limit < gib):
        return limit, True
    return gib, False


def machine_of(
    flags: TrainConfig, world: int, per_node: int, detect: Detect = detect_device
) -> tuple[Machine, str]:
    """The profile this run plans with (see the module docstring) and why, in words: this
    GPU's own (:mod:`parallax.plan.device`, found by ``detect``), with the cap as its memory."""
    device = detect(int(os.environ.get("LOCAL_RANK", 0)))
    host = flags.host_memory
    if host is None and flags.machine is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    gib, capped = _gpu_memory(flags, device)
    base = base_profile(flags.machine, device)
    machine = target(
        gpus_per_node=per_node,
        nodes=max(world // per_node, 1),
        gpu_memory_gib=gib,
        host_memory_gib=host,
        interconnect=flags.interconnect,
        machine_file=flags.machine,
        profile=base.machine,
    )
    why = base.why or f"no GPU here: the shipped default nearest {machine.gpu_memory_gib:g} GiB"
    said = memory_words(
        machine.gpu_memory_gib, flags.gpu_memory_limit, flags.gpu_memory, device is not None
    )
    why = f"{why}; {said}"
    return (machine.with_(cuda_context_gib=0.0) if capped else machine), why


def choose(run: Run, detect: Detect = detect_device) -> Run:
    """``run`` with the planner's first choice for this world filled in; says what it chose,
    with which profile and why, once."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    machine, chosen = machine_of(run, world, per_node, detect)
    fixed = {k: getattr(run, k) for k in given(run)}
    run, model, result, split = search_run(run, machine, world, fixed, top=1)
    if why := ruled_out(result, model, world, per_node, fixed):
        raise ValueError(f"--layout auto: {why}")
    if not result.ranked:
        why = report.nothing_fits(result, world, run.finetune == "lora", run.host_masters_split)
        raise ValueError(f"--layout auto: {why}")
    best = result.ranked[0]
    if int(os.environ.get("RANK", 0)) == 0:
        log.info("--layout auto: planning with the profile %s: %s", machine.name, chosen)
        if split:
            log.info("--layout auto: %s", split)
        log.info(
            "--layout auto: %s on %d GPU(s) of %.0f GiB (%s): predicted %.1f GiB a GPU, "
            "%.3f s a step, %.1f samples/s; flags %s",
            best.layout.describe(),
            world,
            machine.gpu_memory_gib,
            machine.name,
            best.gpu / GIB,
            best.time.seconds,
            best.samples_per_s,
            " ".join(best.layout.argv()),
        )
    return run.replace(**best.layout.options())
