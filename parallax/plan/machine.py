"""What a machine can do, as the planner needs it: memory, compute rates, links.

A profile is measured once on the machine (``python -m parallax.plan calibrate --out FILE``,
:mod:`parallax.plan.calibrate`) and read with ``--machine FILE``; without one the planner takes a
shipped default, marked as such (``measured: false``): an H100/H200 node with NVLink, or a PCIe
consumer card (RTX 4090 24 GB, RTX 5090 32 GB), with the link named by ``--interconnect``.

Rates are what code achieves at a model's shapes, not datasheet peaks: ``gemm_tflops`` for bf16
matrix products of transformer-block size, ``attention_tflops`` for fused attention,
``hbm_gbs`` for element-wise work (bytes read plus written per second), ``h2d_gbs`` for pinned
host-device copies each way, ``host_adam_s`` for the host's fused AdamW per 1e9 parameters
(``host_one_pass_s`` for ``--host-adamw one-pass``'s),
``host_gbs`` for the host's element-wise work (the offloaded gradient accumulation), and for
collectives a :class:`Link` per scope: the bus bandwidth a ring achieves per GPU and a latency
per collective. ``gemm_half_tokens``: the rows at which a block's matmuls run at half
``gemm_tflops`` (small micro-batches of short sequences leave the GPU idle).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from parallax.atomic import atomic_write_json
from parallax.run.option import ONE, Check, at_least, positive, within
from parallax.run.options_layout import GPU_GIB, HOST_GIB
from parallax.run.values import convert, field_kinds, show

GIB = 2**30


@dataclass(frozen=True)
class Link:
    """Collectives over one scope: ``busbw_gbs`` GB/s of bus bandwidth per GPU (a ring all-
    reduce of ``n`` bytes over ``p`` GPUs moves ``2 (p-1)/p n`` bytes at that rate) and a fixed
    ``latency_us`` per collective."""

    busbw_gbs: float
    latency_us: float = 20.0

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """Time of one collective of ``nbytes`` (the full tensor) over ``ranks`` GPUs:
        all-reduce moves ``2 (p-1)/p``, reduce-scatter, all-gather and all-to-all ``(p-1)/p`` of
        it per GPU, a point-to-point send all of it."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        share = {"all_reduce": 2.0 * (ranks - 1) / ranks, "send": 1.0}.get(
            kind, (ranks - 1) / ranks
        )
        return self.latency_us * 1e-6 + share * nbytes / (self.busbw_gbs * 1e9)


# Shipped links (defaults, not measurements): NVLink 4 within an H100/H200 node as parallax's
# tp all-reduces of a 7B step achieve it (openvla_step tp2 on two H200s: about 100 GB/s, not
# the 360 of a large all-reduce in isolation); PCIe 4 x16 with and without peer-to-peer (through
# host memory); 8 x 400 Gb/s InfiniBand across nodes.
LINKS = {
    "nvlink": Link(busbw_gbs=100.0, latency_us=25.0),
    "pcie": Link(busbw_gbs=22.0, latency_us=25.0),
    "pcie-no-p2p": Link(busbw_gbs=11.0, latency_us=40.0),
    "infiniband": Link(busbw_gbs=45.0, latency_us=30.0),
    "ethernet": Link(busbw_gbs=10.0, latency_us=60.0),
}


@dataclass(frozen=True)
class Machine:
    """One node type, the same for every node (see the module docstring)."""

    name: str
    gpu_memory_gib: float
    host_memory_gib: float  # per node, shared by its GPUs' processes
    gpus_per_node: int
    gemm_tflops: float
    attention_tflops: float
    hbm_gbs: float
    h2d_gbs: float
    host_adam_s: float  # fused AdamW on the host, seconds per 1e9 parameters (all cores)
    intra: Link = field(default_factory=lambda: LINKS["nvlink"])
    inter: Link = field(default_factory=lambda: LINKS["infiniband"])
    host_gbs: float = 25.0  # host element-wise bandwidth (read + written), all cores
    # --host-adamw one-pass on the host, seconds per 1e9 parameters (0: not measured, taken as
    # the fused kernel's times their ratio on the H200 host, plan.cost.ONE_PASS_OVER_FUSED)
    host_one_pass_s: float = 0.0
    gemm_half_tokens: float = 384.0
    attention_half_tokens: float = 512.0  # the sequence at which attention runs at half rate
    # --fp8: a linear's GEMMs run this many times faster (1: no FP8 tensor cores, or unknown)
    fp8_gemm_speedup: float = 1.0
    cuda_context_gib: float = 0.6  # the CUDA context and the kernels' workspaces per process
    # share of the peak the caching allocator cannot reuse. parallax.train runs with expandable
    # segments (memory_limit.default_allocator), which leave little: on an H200 the planner's
    # five uncapped first choices reserved 0.14-0.33 GiB past peaks of 47-128 GiB (0.1-0.4 %;
    # benchmarks/plan/accuracy.py, 2026-12-04). 1 % covers them; the search's margin
    # (3 %) is what covers the memory model's errors.
    allocator_reserve: float = 0.01
    nodes: int = 1
    measured: bool = False  # False: a shipped default
    notes: str = ""  # what calibration measured and what it left at the defaults

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_(self, **changes: Any) -> Machine:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Machine:
        """The profile of ``data`` (a JSON object); one ``ValueError`` naming every missing,
        unknown or bad field (:func:`profile_problems`)."""
        found = profile_problems(data)
        if found:
            raise ValueError("; ".join(found))
        data = dict(data)
        for key in ("intra", "inter"):
            if key in data:
                data[key] = Link(**data[key])
        return cls(**data)


# the fields whose range is not "a positive number" (every other number's is)
RANGES: dict[str, tuple[Check, ...]] = {
    "gpu_memory_gib": GPU_GIB,
    "host_memory_gib": HOST_GIB,
    "gpus_per_node": (ONE,),
    "nodes": (ONE,),
    "cuda_context_gib": (at_least(0),),
    "host_one_pass_s": (at_least(0),),
    "allocator_reserve": (within(0, 1, "[)"),),
    "latency_us": (at_least(0),),
}


def _fields_problems(cls: type, data: Any, where: str) -> list[str]:
    """What is missing, unknown or bad in ``data``, the JSON object of dataclass ``cls``."""
    if not isinstance(data, dict):
        what = where.rstrip(".") or "a profile"
        return [f"{what} must be a JSON object of fields, got {show(data)}"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    need = [k for k, f in fields.items() if f.default is MISSING and f.default_factory is MISSING]
    found = []
    for word, keys in (
        ("missing", [k for k in need if k not in data]),
        ("unknown", sorted(set(data) - set(fields))),
    ):
        if keys:
            found.append(f"{word} field(s) " + ", ".join(where + k for k in keys))
    kinds = field_kinds(cls)
    for key, value in data.items():
        if key in ("intra", "inter") and key in fields:
            found += _fields_problems(Link, value, f"{key}.")
        if key not in kinds:
            continue
        try:
            value = convert(f"{where}{key} = {show(value)}", value, kinds[key], text=False)
        except ValueError as err:
            found.append(str(err))
            continue
        numeric = kinds[key][0] in (int, float)
        for check in RANGES.get(key, (positive,) if numeric else ()):
            if problem := check(value):
                found.append(f"{where}{key} {problem}")
    return found


def profile_problems(data: Any) -> list[str]:
    """Every missing, unknown or bad field of a profile's JSON (``{}`` names each field it
    lacks), checked as the options of the same meaning are (``gpu_memory_gib`` as
    ``--gpu-memory``)."""
    return _fields_problems(Machine, data, "")


def load(path: str | Path) -> Machine:
    """A profile written by ``python -m parallax.plan calibrate --out FILE``; one
    ``ValueError`` naming the file and every problem of it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--machine {path}: cannot read the profile ({err}); --machine takes a profile "
            f"file or a shipped card's name: {', '.join(DEFAULTS)}"
        ) from None
    try:
        return Machine.from_json(data)
    except ValueError as err:
        raise ValueError(
            f"--machine {path} is not a machine profile ({err}); python -m parallax.plan "
            "calibrate --out FILE writes one"
        ) from None


def save(machine: Machine, path: str | Path) -> None:
    """Write the profile whole (its missing folders made: ``calibrate`` checked they can be)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(path), machine.to_json())


# The shipped defaults. H200: 788 TFLOP/s on an 8192^3 bf16 product, about 650 at a 7B block's
# shapes (the GEMM share of a profiled step); 4.3 TB/s device copies; 55 GB/s pinned copies.
# Its 16-core host, as the offload's worker runs there in a training step (memory_fit's host
# phases of OpenVLA-7B under 24 and 32 GiB, commit f274ac8, 7.54e9 elements a step): the
# upcast and torch's fused AdamW 1.87-1.99 s a step, the conversion for the upload 0.53-0.60 s,
# so element-wise work at 79 GB/s and the fused AdamW at 0.18 s per 1e9 parameters (the earlier
# fit, 55 GB/s and 0.24, came from rows whose timed step held, we infer, the first host step,
# which writes the moments for the first time).
H200 = Machine(
    name="h200-node (default)",
    gpu_memory_gib=139.8,
    host_memory_gib=125.0,
    gpus_per_node=8,
    gemm_tflops=700.0,
    attention_tflops=420.0,
    hbm_gbs=4300.0,
    h2d_gbs=55.0,
    host_adam_s=0.18,
    host_gbs=79.0,
    # torch._scaled_mm rowwise at OpenVLA-7B's decoder shapes ran 1.6-1.9x the bf16 GEMM on
    # the lent H200 (issue 39); 1.6, as the casts around it are not free. Not yet measured as
    # a whole step: see docs/fp8.md
    fp8_gemm_speedup=1.6,
)
H100 = H200.with_(name="h100-node (default)", gpu_memory_gib=79.1, hbm_gbs=3000.0)
# Consumer cards: dense bf16 at about 165 (4090) and 210 (5090) TFLOP/s, of which a 7B block
# reaches about 70 %; PCIe 4 (4090) or 5 (5090) host copies; a workstation host.
RTX4090 = Machine(
    name="rtx4090 (default)",
    gpu_memory_gib=23.6,
    host_memory_gib=128.0,
    gpus_per_node=1,
    gemm_tflops=115.0,
    attention_tflops=80.0,
    hbm_gbs=900.0,
    h2d_gbs=20.0,
    host_adam_s=0.6,
    intra=LINKS["pcie-no-p2p"],
    inter=LINKS["ethernet"],
    cuda_context_gib=0.5,
)
RTX5090 = RTX4090.with_(
    name="rtx5090 (default)", gpu_memory_gib=31.4, gemm_tflops=150.0, hbm_gbs=1500.0, h2d_gbs=40.0
)
DEFAULTS = {"h200": H200, "h100": H100, "rtx4090": RTX4090, "rtx5090": RTX5090}


def default_for(gpu_memory_gib: float | None, interconnect: str | None) -> Machine:
    """The shipped default nearest to ``--gpu-memory`` and ``--interconnect``: a data-centre
    node with NVLink, else a consumer card on PCIe (its memory set to what was given)."""
    link = LINKS[interconnect] if interconnect else None
    if gpu_memory_gib is None or gpu_memory_gib >= 70:
        base = H200 if gpu_memory_gib is None or gpu_memory_gib > 100 else H100
    else:
        base = RTX5090 if gpu_memory_gib > 26 else RTX4090
    if gpu_memory_gib is not None:
        base = base.with_(gpu_memory_gib=float(gpu_memory_gib))
    return base.with_(intra=link) if link is not None else base


def named(spec: str) -> Machine:
    """``--machine``'s profile: a file (``calibrate --out FILE``), else a shipped card's name
    (``rtx4090``: :data:`DEFAULTS`)."""
    if spec in DEFAULTS and not Path(spec).exists():
        return DEFAULTS[spec]
    return load(spec)


def target(
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
    interconnect: str | None = None,
    machine_file: str | None = None,
    profile: Machine | None = None,
) -> Machine:
    """The profile to plan for: ``profile`` (the device's own,
    :func:`parallax.plan.device.device_profile`), a measured or named one (``--machine``), or
    the nearest shipped default, with what was given on the command line overriding it."""
    if profile is not None or machine_file:
        base = profile if profile is not None else named(str(machine_file))
        if gpu_memory_gib is not None:
            base = base.with_(gpu_memory_gib=float(gpu_memory_gib))
        if interconnect:
            base = base.with_(intra=LINKS[interconnect])
    else:
        base = default_for(gpu_memory_gib, interconnect)
    if host_memory_gib is not None:
        base = base.with_(host_memory_gib=float(host_memory_gib))
    return base.with_(gpus_per_node=gpus_per_node, nodes=nodes)
