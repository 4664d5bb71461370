"""What ``ZeroOptimizer``'s offload options mean for one optimizer: checked on every rank before
any collective, and, once the buckets are laid out, which of them go to the host, which of
those sum their gradients on the device and which keep their masters split
(:mod:`~parallax.optim.zero.offload.share` decides each from the buckets' sizes alone).

``offload`` (stages 2 and 3): the fp32 masters and the optimizer's state live in host memory
and each bucket is stepped there once its last pass is reduced; ``early`` (``step_in_backward``):
right then, during the backward (nothing may clip the gradients after it), else in ``step()``.
``fraction``: the share of the elements offloaded, the first buckets reduced (the last layers:
their host steps have the most backward left to hide under); the others stay on the device.
``gpu_accumulation``: the share of the offloaded elements whose gradients are summed over the
passes on the device, not the host (less host memory, one trip down instead of one a pass).
``host_adamw``: how a bucket is stepped in ``step()`` (``"torch"``: the optimizer's own step;
``"one-pass"``: torch's AdamW only, from the summed gradient to the new weights in one loop).
``host_masters``: ``"split"`` keeps the offloaded bf16 buckets' masters on the host as their low
16 bits alone (:mod:`~parallax.optim.zero.buffers.master_halves`; with ``host_adamw="one-pass"``,
stepped in ``step()``). See :mod:`~parallax.optim.zero.offload.host_steps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallax.optim.zero.buffers.packing import FlatLayout
from parallax.optim.zero.offload.host_adamw import check_supported
from parallax.optim.zero.offload.host_kernels import host_options
from parallax.optim.zero.offload.share import kept_buckets, offloaded_buckets, split_buckets
from parallax.optim.zero.stage import ZeroStage


@dataclass(frozen=True)
class OffloadOptions:
    """See the module docstring."""

    offload: bool = False
    fraction: float = 1.0
    gpu_accumulation: float = 0.0
    host_adamw: str = "torch"
    host_masters: str = "full"
    early: bool = False

    def checked(
        self, stage: ZeroStage, optimizer_class: type, optimizer_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Raise alike on every rank where these options cannot run (before any collective);
        the wrapped optimizer's options for host tensors where offloaded."""
        stage.check_offload(self.offload, self.fraction, self.gpu_accumulation, self.host_adamw)
        stage.check_host_masters(self.host_masters, self.offload, self.host_adamw, self.early)
        if not self.offload:
            return optimizer_kwargs
        if self.host_adamw == "one-pass":
            check_supported(optimizer_class, [optimizer_kwargs])
        return host_options(optimizer_class, optimizer_kwargs)

    def buckets(self, layout: FlatLayout) -> tuple[list[int], list[int], list[int]]:
        """``(hosted, kept, split)``: the buckets of ``layout`` offloaded, those of them summed
        on the device, and those whose masters the host keeps split."""
        numels = [b.numel for b in layout.buckets]
        hosted = offloaded_buckets(numels, self.fraction) if self.offload else []
        kept = kept_buckets(numels, hosted, self.gpu_accumulation)
        dtypes: list[torch.dtype] = [layout.dtypes[b.buffer] for b in layout.buckets]
        split = split_buckets(dtypes, hosted) if self.host_masters == "split" else []
        return hosted, kept, split
