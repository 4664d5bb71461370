"""What the optimizer holds on this rank, measured from its tensors, against plain AdamW."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallax.optim.zero import ZeroOptimizer

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
    whole over dp); frozen parameters are outside the optimizer and not counted."""

    numel: int
    dp: int
    param_bytes: int  # flat parameter buffers (every dp rank holds all of them)
    grad_bytes: int  # flat gradient buffers (same)
    master_bytes: int  # fp32 master slice kept apart from the parameters (none for fp32 params)
    grad_shard_bytes: int  # persistent fp32 reduced-gradient slice (see buckets.grad_homes)
    state_bytes: int  # the wrapped optimizer's state tensors (its 1/dp slice)
    plain_adamw_bytes: int  # unsharded AdamW on the same parameters, see plain_adamw_bytes()
    staging_bytes: int = 0  # fp32 buffers of about one bucket each, whatever the model's size

    @property
    def optimizer_bytes(self) -> int:
        """fp32 masters and reduced gradients plus the optimizer's state: what ZeRO-1 shards."""
        return self.master_bytes + self.grad_shard_bytes + self.state_bytes

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.staging_bytes

    def bytes_per_param(self) -> dict[str, float]:
        n = max(self.numel, 1)
        return {
            "params": self.param_bytes / n,
            "grads": self.grad_bytes / n,
            "optimizer": self.optimizer_bytes / n,
            "staging": self.staging_bytes / n,
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
            ("total", self.total_bytes),
            ("plain AdamW would need", self.plain_adamw_bytes),
        ]
        n = max(self.numel, 1)
        lines = [f"ZeRO-1 memory on this rank ({self.numel:,} trainable elements, dp={self.dp}):"]
        lines += [f"  {k:<24} {v / GiB:10.3f} GiB  {v / n:6.2f} B/param" for k, v in rows]
        return "\n".join(lines)


def plain_adamw_bytes(params: Iterable[torch.Tensor]) -> int:
    """Unsharded mixed-precision AdamW: parameter + gradient in the parameter's dtype, an fp32
    master copy when that dtype is not fp32, and two fp32 moments (8 bytes) per element."""
    total = 0
    for p in params:
        per = 2 * p.element_size() + 8 + (0 if p.dtype == torch.float32 else 4)
        total += p.numel() * per
    return total


def zero_memory(opt: ZeroOptimizer) -> MemoryReport:
    """What ``opt`` holds on this rank, measured from its tensors."""
    states = [
        v for s in opt.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    masters, grads = opt.flat.master_flat, opt.flat.grad_shard_flat
    return MemoryReport(
        numel=sum(p.numel() for p in opt.params),
        dp=opt.ctx.dp_size,
        param_bytes=tensor_bytes(opt.flat.param_buffers),
        grad_bytes=tensor_bytes(opt.flat.grad_buffers),
        master_bytes=tensor_bytes([masters] if masters is not None else []),
        grad_shard_bytes=tensor_bytes([grads] if grads is not None else []),
        state_bytes=tensor_bytes(states),
        plain_adamw_bytes=plain_adamw_bytes(opt.params),
        staging_bytes=tensor_bytes([opt.flat.staging, *opt.reducer.staging]),
    )
