"""What a ZeRO stage means, asked of one object built once from 1, 2 or 3.

Each stage shards one more thing over the data-parallel group: the optimizer's state (1), the
reduced gradients (2), the weights (3). That decides where the gradients live, which reducer
takes them, how the weights are held and what one element of the model costs a rank. The
optimizer branches on these answers and the planner's memory model (:mod:`parallax.plan.memory`)
counts with the same terms, so a change to what a stage holds is made once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from torch import nn

ADAMW_STATE_BYTES = 8  # AdamW's two fp32 moments per element
# the least an offloaded element costs the host: its fp32 master and AdamW's moments (the floor
# that offload's host memory is reported against: --dry-run, metrics.jsonl)
HOST_FLOOR_BYTES = 4 + ADAMW_STATE_BYTES
ACCUMULATION = "accumulation"  # the host part above that floor: the passes' gradient sums
# the offloaded clipped step's AdamW: torch's fused CPU kernel between an upcast and a conversion
# (40 bytes an element), or one pass from the summed gradient to the new weights (28)
HOST_ADAMWS = ("torch", "one-pass")
# --host-adamw's choices: "auto" is one-pass on GPUs (compiled for the host's CPU at start;
# measured faster in the run, docs/zero.md) and torch's kernel in a CPU run (eager there)
HOST_ADAMW_CHOICES = ("auto", *HOST_ADAMWS)


# where the host keeps an offloaded bf16 master: whole (fp32), or split, its low 16 bits alone
# beside the model's bf16 weight (buffers/master_halves.py; 2 bytes an element less, a slower
# host step: docs/zero.md), which the one-pass kernel alone steps; --host-masters auto: whole,
# unless the host's memory leaves them no layout, or only slower ones (plan/host_fallback.py)
HOST_MASTERS = ("full", "split")
HOST_MASTERS_CHOICES = ("auto", *HOST_MASTERS)


def host_adamw_kernel(choice: str, device_type: str) -> str:
    """The host AdamW that ``--host-adamw choice`` runs on a ``device_type`` run."""
    if choice != "auto":
        return choice
    return "one-pass" if device_type == "cuda" else "torch"


# Where a bucket's fp32 reduced gradient (this rank's chunk) lives between the reduction and the
# optimizer step (:meth:`ZeroStage.grad_home`)
OWN = "own"  # fp32 gradients: the rank's own chunk of the gradient buffer, reduced in place
SHARD = "shard"  # a persistent fp32 slice: the reduction may finish during backward (overlap)
INPLACE = "inplace"  # fp32 over the bucket's own 16-bit gradient bytes, reduced inside step()
STAGED = "staged"  # dp=1: made in a reused staging buffer right before the bucket is stepped
HOMES = (OWN, SHARD, INPLACE, STAGED)


@dataclass(frozen=True)
class ElementBytes:
    """Bytes one element of the model costs one rank between steps: on the device its weight,
    its gradient (the model's-dtype buffer and the fp32 reduced slice), its fp32 master and
    optimizer state; on the host what offload keeps there. Per-bucket buffers (staging, pass
    buffers, the host's scratch) are not per element and not counted here."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0

    # spelled out, not over fields(): the planner adds these some 10^6 times a search
    def __add__(self, other: ElementBytes) -> ElementBytes:
        return ElementBytes(
            self.weights + other.weights,
            self.gradients + other.gradients,
            self.optimizer + other.optimizer,
            self.host + other.host,
        )

    def __mul__(self, k: float) -> ElementBytes:
        return ElementBytes(self.weights * k, self.gradients * k, self.optimizer * k, self.host * k)


class ZeroStage(IntEnum):
    """A ZeRO stage: an int (``stage < 3`` reads as before) that says what the stage means."""

    SHARD_STATE = 1  # the optimizer's state and fp32 masters, 1/dp per rank
    SHARD_GRADIENTS = 2  # also the reduced gradients
    SHARD_WEIGHTS = 3  # also the weights, trainable and frozen, gathered around each use

    def __str__(self) -> str:  # "3", as the int it replaces (3.10's IntEnum says the name)
        return str(self.value)

    @property
    def full_grad_buffer(self) -> bool:
        """Gradients: a full buffer in the model's dtype that every rank accumulates into
        (stage 1), or none: each rank keeps only its fp32 shard of the reduced gradients."""
        return self is ZeroStage.SHARD_STATE

    @property
    def reduces_each_pass(self) -> bool:
        """The reducer: every backward pass reduce-scattered as it ends, into the shard
        (stages 2, 3: :mod:`~parallax.optim.zero.reduction.pass_reducer`), or bucket by bucket
        once per step, during the backward with overlap or in ``step()`` (stage 1:
        :mod:`~parallax.optim.zero.reduction.bucket_reducer`)."""
        return not self.full_grad_buffer

    @property
    def launches_in_order(self) -> bool:
        """Stage 2 launches a bucket from the gradient hooks once its unit's earlier buckets
        are out; stage 3 launches a block's buckets when the block's backward ends."""
        return self is ZeroStage.SHARD_GRADIENTS

    @property
    def shards_weights(self) -> bool:
        """Weights: whole on every rank (stages 1, 2), or sharded over dp and gathered block by
        block around each use (stage 3: :mod:`~parallax.optim.zero.weights`)."""
        return self is ZeroStage.SHARD_WEIGHTS

    @property
    def can_offload(self) -> bool:
        """Offload steps each bucket on the host once its last pass is reduced: a per-pass
        reducer's shard is what goes there."""
        return self.reduces_each_pass

    def grad_home(self, itemsize: int, fp32: bool, dp: int, *, partial: bool, overlap: bool) -> str:
        """The cheapest correct home of one bucket's fp32 reduced gradient.

        Without a full gradient buffer (stages 2 and 3) every bucket accumulates its reduced
        gradient in a persistent fp32 slice (4/dp bytes per parameter), whatever its dtype.
        ``fp32`` buckets are reduced in place. Otherwise, at dp=1 there is nothing to reduce
        (only the tp sum of buckets ``partial`` over tp, which are small and keep a slice): the
        fp32 gradient is made in a reused staging buffer when the optimizer steps the bucket. At
        dp >= 2, a bucket reduced inside ``step()`` (``overlap`` off, or partial buckets, which
        always wait for ``step()``) writes its fp32 chunk over its own gradient bytes, which hold
        ``dp * itemsize >= 4`` bytes per chunk element and are dead once copied into the fp32
        staging buffer; a bucket that overlap may reduce during backward keeps a persistent
        slice.
        """
        if not self.full_grad_buffer:
            return SHARD
        if fp32:
            return OWN
        if dp == 1:
            return SHARD if partial else STAGED
        if (partial or not overlap) and dp * itemsize >= 4:
            return INPLACE
        return SHARD

    def check_modules(self, modules: Iterable[nn.Module] | nn.Module | None) -> list[nn.Module]:
        """The model chunks given as a list: needed at stage 3 (the weights it shards), optional
        at stage 2 (each pass then reduces only the chunks it ran), unused at stage 1."""
        if modules is None:
            if self.shards_weights:
                raise ValueError("ZeRO-3 needs the modules whose weights it shards (modules=...)")
            return []
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError("modules must be nn.Modules")
        return modules

    def check_offload(
        self, offload: bool, fraction: float, on_gpu: float = 0.0, host_adamw: str = "torch"
    ) -> None:
        if offload and not self.can_offload:
            raise ValueError(f"offloading the optimizer needs ZeRO stage 2 or 3, got {self}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in (0, 1], got {fraction}")
        if not 0.0 <= on_gpu <= 1.0:
            raise ValueError(f"gpu_accumulation must be in [0, 1], got {on_gpu}")
        if on_gpu and not offload:
            raise ValueError("gpu_accumulation sums offloaded gradients: it needs offload")
        if host_adamw not in HOST_ADAMWS:
            raise ValueError(f"host_adamw must be one of {HOST_ADAMWS}, got {host_adamw!r}")

    @staticmethod
    def check_host_masters(host_masters: str, offload: bool, host_adamw: str, early: bool) -> None:
        """Split masters need what steps them: the offload's one-pass AdamW, in ``step()``."""
        if host_masters not in HOST_MASTERS:
            raise ValueError(f"host_masters must be one of {HOST_MASTERS}, got {host_masters!r}")
        if host_masters == "split" and (not offload or host_adamw != "one-pass" or early):
            raise ValueError(
                "host_masters='split' keeps offloaded masters that the one-pass host AdamW "
                "steps in step(): it needs offload, host_adamw='one-pass' and no "
                "step_in_backward (clipping on)"
            )

    def trainable_bytes(
        self,
        dp: int,
        element_size: int,
        *,
        overlap: bool = True,
        offloaded: bool = False,
        partial: bool = False,
        state_bytes: float = ADAMW_STATE_BYTES,
    ) -> ElementBytes:
        """What one trainable element of ``element_size`` bytes (4: fp32) costs a rank of ``dp``.

        The gradient buffer (stage 1) is in the model's dtype; the fp32 reduced slice is there
        where :meth:`grad_home` keeps one (``overlap``: stage 1 may reduce during the backward;
        ``partial``: a gradient partial over tp). A 16-bit element has a separate fp32 master;
        fp32 ones are their own. ``offloaded``: the master (fp32 for every dtype), the
        ``state_bytes`` of optimizer state and the gradient's accumulator in the model's dtype
        are on the host, and no reduced slice on the device.
        """
        if offloaded and not self.can_offload:
            raise ValueError(f"offloading the optimizer needs ZeRO stage 2 or 3, got {self}")
        fp32 = element_size == 4
        home = self.grad_home(element_size, fp32, dp, partial=partial, overlap=overlap)
        gradients = float(element_size) if self.full_grad_buffer else 0.0
        if home == SHARD and not offloaded:
            gradients += 4 / dp  # this rank's fp32 slice of the reduced gradient
        weights = self.frozen_bytes(dp, element_size).weights
        if offloaded:  # fp32 master, state, accumulator
            host = sum(self.host_parts(dp, element_size, state_bytes).values())
            return ElementBytes(weights, gradients, host=host)
        master = 0.0 if fp32 else 4 / dp
        return ElementBytes(weights, gradients, optimizer=master + state_bytes / dp)

    def host_parts(
        self,
        dp: int,
        element_size: int,
        state_bytes: float = ADAMW_STATE_BYTES,
        split: bool = False,
    ) -> dict[str, float]:
        """What one offloaded element of ``element_size`` bytes costs the host of a rank of
        ``dp``, by what it is: the fp32 master and the optimizer's state (the floor), and the
        gradient's accumulator in the model's dtype (its passes summed there). ``split``
        (``--host-masters split``): a 16-bit element's master is its low half, 2 bytes."""
        master = 2 if split and element_size == 2 else 4
        return {"masters and moments": (master + state_bytes) / dp, ACCUMULATION: element_size / dp}

    def frozen_bytes(self, dp: int, element_size: int) -> ElementBytes:
        """What one frozen element costs a rank: its weight, 1/dp of it at stage 3."""
        return ElementBytes(
            weights=element_size / dp if self.shards_weights else float(element_size)
        )


def stage_of(stage: object) -> ZeroStage:
    """The :class:`ZeroStage` of ``stage`` (1, 2 or 3; a ZeroStage is returned as it is)."""
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
    return ZeroStage(stage)
