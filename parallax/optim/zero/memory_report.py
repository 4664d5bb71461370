"""What the optimizer holds on this rank, measured from its tensors, against plain AdamW.

Device bytes and host bytes are counted apart (``--offload optimizer`` keeps the fp32 masters,
the optimizer's state and the gradient accumulators of the offloaded buckets in host memory,
counted as the host's even on a CPU-only run); at ZeRO-3 the weights are this rank's shards plus the
blocks gathered at the moment of the report (none between uses), and the largest amount gathered
at once so far.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from parallax.optim.zero.buffers.flat_buffers import FlatBuffers
from parallax.optim.zero.offload.host_steps import HostSteps
from parallax.optim.zero.reduction.bucket_reducer import GradReducer
from parallax.optim.zero.reduction.pass_reducer import PassReducer
from parallax.optim.zero.stage import HOST_FLOOR_BYTES, ZeroStage
from parallax.optim.zero.weights.sharded_weights import ShardedWeights

GiB = 2**30


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storage behind ``tensors`` (views of one buffer are counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes on this rank. ``numel`` counts this rank's trainable elements (its tp/pp share,
    whole over dp); frozen parameters are outside the optimizer and not counted, except at
    ZeRO-3, which shards them too (``frozen_bytes``)."""

    numel: int
    dp: int
    param_bytes: int  # flat parameter buffers (ZeRO-1/2: every dp rank holds all; 3: its shard)
    grad_bytes: int  # flat gradient buffers (ZeRO-1 only: 2 and 3 have none)
    master_bytes: int  # fp32 master slice kept apart from the parameters (none for fp32 params)
    grad_shard_bytes: int  # persistent fp32 reduced-gradient slice (see buckets.grad_homes)
    state_bytes: int  # the wrapped optimizer's state tensors (its 1/dp slice)
    plain_adamw_bytes: int  # unsharded AdamW on the same parameters, see plain_adamw_bytes()
    staging_bytes: int = 0  # fp32 buffers of about one bucket each, whatever the model's size
    stage: int = 1
    frozen_bytes: int = 0  # ZeRO-3: this rank's shard of the frozen weights
    gathered_bytes: int = 0  # ZeRO-3: whole blocks gathered at the time of the report
    peak_gathered_bytes: int = 0  # ZeRO-3: the most gathered at once so far
    pass_peak_bytes: int = 0  # ZeRO-2/3: the most pass buffers (one bucket each) alive so far
    host_bytes: int = 0  # --offload optimizer: masters and state in host memory (not in total)
    host_numel: int = 0  # --offload optimizer: the elements this rank steps on the host
    kept_bytes: int = 0  # --gpu-accumulation: offloaded gradients' sums held on the device

    @property
    def host_floor_bytes(self) -> int:
        """The least the offloaded elements need on the host: fp32 masters and AdamW's moments
        (:data:`~parallax.optim.zero.stage.HOST_FLOOR_BYTES` each)."""
        return self.host_numel * HOST_FLOOR_BYTES

    @property
    def host_ratio(self) -> float | None:
        """Host bytes over that floor (accumulation, scratch and staging are above it);
        ``None`` without offload."""
        return self.host_bytes / self.host_floor_bytes if self.host_numel else None

    @property
    def optimizer_bytes(self) -> int:
        """fp32 masters and reduced gradients plus the optimizer's state on the device."""
        return self.master_bytes + self.grad_shard_bytes + self.state_bytes

    @property
    def total_bytes(self) -> int:
        """Device bytes held between steps (the gathered blocks as of now)."""
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.staging_bytes
            + self.frozen_bytes
            + self.gathered_bytes
            + self.kept_bytes
        )

    def bytes_per_param(self) -> dict[str, float]:
        n = max(self.numel, 1)
        return {
            "params": self.param_bytes / n,
            "grads": self.grad_bytes / n,
            "optimizer": self.optimizer_bytes / n,
            "staging": self.staging_bytes / n,
            "frozen": self.frozen_bytes / n,
            "host": self.host_bytes / n,
            "total": self.total_bytes / n,
            "plain_adamw": self.plain_adamw_bytes / n,
        }

    def __str__(self) -> str:
        rows = [
            ("parameters", self.param_bytes),
            ("gradients", self.grad_bytes),
            ("fp32 master slice", self.master_bytes),
            ("fp32 reduced-grad slice", self.grad_shard_bytes),
            ("optimizer state slice", self.state_bytes),
            ("fp32 staging buffers", self.staging_bytes),
            ("frozen weight shard", self.frozen_bytes),
            ("gathered blocks (now)", self.gathered_bytes),
            ("gradient sums kept on device", self.kept_bytes),
            ("total on the device", self.total_bytes),
            ("gathered blocks (peak)", self.peak_gathered_bytes),
            ("gradient pass buffers (peak)", self.pass_peak_bytes),
            ("host (offloaded)", self.host_bytes),
            ("host floor (masters, moments)", self.host_floor_bytes),
            ("plain AdamW would need", self.plain_adamw_bytes),
        ]
        n = max(self.numel, 1)
        lines = [
            f"ZeRO-{self.stage} memory on this rank ({self.numel:,} trainable elements, "
            f"dp={self.dp}):"
        ]
        lines += [f"  {k:<30} {v / GiB:10.3f} GiB  {v / n:6.2f} B/param" for k, v in rows]
        return "\n".join(lines)


def plain_adamw_bytes(params: Iterable[torch.Tensor]) -> int:
    """Unsharded mixed-precision AdamW: parameter + gradient in the parameter's dtype, an fp32
    master copy when that dtype is not fp32, and two fp32 moments (8 bytes) per element."""
    total = 0
    for p in params:
        per = 2 * p.element_size() + 8 + (0 if p.dtype == torch.float32 else 4)
        total += p.numel() * per
    return total


def measure(
    flat: FlatBuffers,
    inner: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    stage: ZeroStage,
    reducer: GradReducer | PassReducer,
    host: HostSteps | None,
    weights: ShardedWeights | None,
) -> MemoryReport:
    """What a ZeroOptimizer holds on this rank, measured from its parts' tensors: ``flat``'s
    buffers, ``inner``'s state (on the host for offloaded pieces), the reducer's staging and
    pass buffers, the offload's ``host`` tensors and ZeRO-3's frozen and gathered ``weights``."""
    hosted = {id(t) for pc, t in zip(flat.pieces, flat.piece_params) if pc.bucket in flat.offload}
    states: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # on the host, or not
    for t, held in inner.state.items():
        states[id(t) in hosted] += [v for v in held.values() if isinstance(v, torch.Tensor)]
    masters, grads, store = flat.master_flat, flat.grad_shard_flat, flat.store
    whole, halves = flat.host_master_flat, flat.host_low_flat
    on_host = [t for t in (whole, halves) if t is not None]
    on_host += host.host_tensors() if host is not None else []
    return MemoryReport(
        numel=sum(p.numel() for p in params),
        dp=flat.layout.dp,
        param_bytes=tensor_bytes(flat.param_buffers if store is None else store.shards),
        grad_bytes=tensor_bytes(flat.grad_buffers),
        master_bytes=tensor_bytes([masters] if masters is not None else []),
        grad_shard_bytes=tensor_bytes([grads] if grads is not None else []),
        state_bytes=tensor_bytes(states[False]),
        plain_adamw_bytes=plain_adamw_bytes(params),
        staging_bytes=tensor_bytes([flat.staging, *reducer.staging]),
        stage=stage,
        frozen_bytes=weights.frozen.shard_bytes() if weights is not None and weights.frozen else 0,
        gathered_bytes=weights.gathers.gathered_bytes() if weights is not None else 0,
        peak_gathered_bytes=weights.gathers.peak_bytes if weights is not None else 0,
        pass_peak_bytes=getattr(reducer, "peak_bytes", 0),
        host_bytes=tensor_bytes(on_host) + tensor_bytes(states[True]),
        host_numel=flat.host_numel,
        kept_bytes=tensor_bytes(host.kept.values()) if host is not None else 0,
    )
