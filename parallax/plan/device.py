"""The GPU a run is on and its own machine profile: the planner ranks layouts with the rates of
the card that will run them, whatever memory a cap leaves it.

A card's profile is, in order: the one ``python -m parallax.plan calibrate`` measured on a
device of this name and cached (:func:`cache_path`, under the user's cache folder), else the
shipped profile its CUDA name matches (:data:`MATCHES`), else the shipped default nearest its
memory, said as such. Its memory is then what the command line gives (``--gpu-memory``,
``--gpu-memory-limit``), the device's otherwise. The device is found by a function the callers
take as an argument (:data:`Detect`), so tests on a CPU can be "an NVIDIA H200".
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from parallax.plan.machine import DEFAULTS, GIB, Machine, default_for, load

# a shipped profile for each CUDA device name that holds one of these words (lower case)
MATCHES = (("h200", "h200"), ("h100", "h100"), ("4090", "rtx4090"), ("5090", "rtx5090"))
CALIBRATE = "python -m parallax.plan calibrate"


@dataclass(frozen=True)
class Device:
    """A CUDA device as the planner needs it: the name CUDA gives it and its memory."""

    name: str  # torch.cuda.get_device_name: "NVIDIA H200", "NVIDIA GeForce RTX 4090"
    memory_gib: float


Detect = Callable[[int], "Device | None"]


def detect(index: int = 0) -> Device | None:
    """CUDA device ``index`` of this process, ``None`` without a GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    return Device(props.name, props.total_memory / GIB)


def cache_dir() -> Path:
    """Where measured profiles are cached: ``$PARALLAX_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, under ``parallax/machines``."""
    if root := os.environ.get("PARALLAX_CACHE_DIR"):
        return Path(root) / "machines"
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "parallax" / "machines"


def cache_path(device_name: str) -> Path:
    """The cached profile of a device of this name ("NVIDIA H200": ``nvidia-h200.json``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return cache_dir() / f"{slug}.json"


def shipped_for(device_name: str) -> str | None:
    """The name of the shipped profile (:data:`parallax.plan.machine.DEFAULTS`) of a device of
    this CUDA name, ``None`` for a card none matches."""
    lowered = device_name.lower()
    return next((name for word, name in MATCHES if word in lowered), None)


@dataclass(frozen=True)
class Profile:
    """The profile a plan starts from (before the command line's memory and links) and the
    sentence the run says about it."""

    machine: Machine | None  # None: no GPU and no --machine (the caller's default by memory)
    why: str


def device_profile(device: Device) -> Profile:
    """This device's own profile (see the module docstring), its memory the device's."""
    cached = cache_path(device.name)
    if cached.is_file():
        machine = _cached(cached)
        why = f"measured on this {device.name} by {CALIBRATE} (cached at {cached})"
    elif name := shipped_for(device.name):
        machine = DEFAULTS[name]
        why = (
            f"the shipped profile of this GPU's kind, matched by its CUDA name {device.name!r} "
            f"(not measured: {CALIBRATE} measures this one once and caches it at {cached})"
        )
    else:
        machine = default_for(device.memory_gib, None)
        why = (
            f"no shipped or cached profile for this {device.name}: the shipped default nearest "
            f"its {device.memory_gib:.0f} GiB ({CALIBRATE} measures it once and caches it at "
            f"{cached})"
        )
    return Profile(machine.with_(gpu_memory_gib=device.memory_gib), why)


def _cached(path: Path) -> Machine:
    """The cached profile at ``path``; a ``ValueError`` naming it and how to mend it."""
    try:
        return load(path)
    except ValueError as err:
        raise ValueError(
            f"the cached profile of this GPU, {path}, cannot be used ({err}); run {CALIBRATE} "
            "again to measure it, or delete the file to plan with the shipped profile"
        ) from None


def base_profile(machine: str | None, device: Device | None) -> Profile:
    """What to plan with: the ``--machine`` the user named (a profile file or a shipped name),
    else this device's own, else nothing (no GPU: the caller's default)."""
    if machine:
        kind = "a shipped profile" if machine in DEFAULTS and not Path(machine).exists() else None
        return Profile(None, f"--machine {machine} ({kind or 'a profile file'}, as named)")
    if device is None:
        return Profile(None, "")
    return device_profile(device)


def memory_words(gib: float, limit: float | None, given: float | None, device: bool) -> str:
    """How the plan's memory was decided (``device``: the device's memory was the default), for
    the run's sentence."""
    if limit is not None and gib == limit:
        return f"--gpu-memory-limit {limit:g} GiB as its memory"
    if given is not None:
        return f"--gpu-memory {given:g} GiB as its memory"
    return f"{gib:.1f} GiB, the {'device' if device else 'profile'}'s memory"
