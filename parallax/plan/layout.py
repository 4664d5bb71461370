"""One candidate layout of a run: how the world is split (tp, pp, dp), how memory is saved
(ZeRO stage, offload, activation checkpointing) and how a step is cut (micro-batch, schedule,
chunks); and the training options and command-line flags that ask for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from parallax.run import TrainConfig

OPTION_NAMES = {f.name for f in dataclasses.fields(TrainConfig)}
# the options a layout decides (those of them this TrainConfig has)
LAYOUT_OPTIONS = (
    "tp",
    "pp",
    "dp",
    "micro_batch_size",
    "schedule",
    "chunks",
    "zero",
    "offload",
    "offload_fraction",
    "gpu_accumulation",
    "reshard_after_forward",
    "activation_checkpointing",
    "checkpoint_scope",
)


@dataclass(frozen=True)
class Layout:
    """See the module docstring. ``checkpointing``: ``False``, ``True`` (every block) or a
    scope (``"vision"``, ``"text"``); ``offload``: the share of the optimizer's fp32 state
    (masters, moments, the reduced gradients) on the host: 0 none, 1 ``--offload optimizer``,
    between ``--offload-fraction``; ``accumulate``: the share of the offloaded gradients summed on
    the GPU (``--gpu-accumulation``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    zero: int = 1
    offload: float = 0.0
    reshard_after_forward: bool = True
    checkpointing: bool | str = False
    accumulate: float = 0.0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def of(cls, cfg: TrainConfig, dp: int) -> Layout:
        """The layout ``cfg`` (a TrainConfig or a Run) asks for at data-parallel size ``dp``."""
        return cls(
            tp=cfg.tp,
            pp=cfg.pp,
            dp=dp,
            micro_batch_size=cfg.micro_batch_size,
            schedule=cfg.schedule,
            chunks=cfg.chunks,
            zero=getattr(cfg, "zero", 1),
            offload=_offloaded(cfg),
            accumulate=float(getattr(cfg, "gpu_accumulation", 0.0)) if _offloaded(cfg) else 0.0,
            reshard_after_forward=getattr(cfg, "reshard_after_forward", True),
            checkpointing=cfg.checkpointing,
        )

    def options(self) -> dict[str, Any]:
        """The training options of this layout (those this TrainConfig declares)."""
        scope = self.checkpointing if isinstance(self.checkpointing, str) else "all"
        values = dict(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            micro_batch_size=self.micro_batch_size,
            schedule=self.schedule,
            chunks=self.chunks,
            zero=self.zero,
            offload="optimizer" if self.offload else "none",
            offload_fraction=float(self.offload) if self.offload else 1.0,
            gpu_accumulation=round(self.accumulate, 3) if self.offload else 0.0,
            reshard_after_forward=self.reshard_after_forward,
            activation_checkpointing=bool(self.checkpointing),
            checkpoint_scope=scope,
        )
        return {k: v for k, v in values.items() if k in OPTION_NAMES}

    def argv(self) -> list[str]:
        """The flags of this layout (``--dp`` and ``--micro-batch-size`` always, the others
        where they differ from their defaults)."""
        out: list[str] = []
        defaults = TrainConfig()
        for name, value in self.options().items():
            if name not in ("dp", "micro_batch_size") and value == getattr(defaults, name):
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            else:
                out += [flag, str(value)]
        return out

    def describe(self) -> str:
        """``tp2 pp1 dp4, zero 3, offload, ckpt vision, mb 8, 1f1b``."""
        parts = [f"tp{self.tp} pp{self.pp} dp{self.dp}", f"zero {self.zero}"]
        if self.zero == 3 and not self.reshard_after_forward:
            parts[-1] += " (kept)"
        if self.offload:
            parts.append("offload" + (f" {self.offload:g}" if self.offload < 1 else ""))
            if self.accumulate:
                parts[-1] += f" (sums {self.accumulate:.2g} on GPU)"
        if self.checkpointing:
            scope = self.checkpointing if isinstance(self.checkpointing, str) else "all"
            parts.append(f"ckpt {scope}")
        parts.append(f"mb {self.micro_batch_size}")
        if self.pp > 1:
            parts.append(self.schedule + (f" x{self.chunks}" if self.chunks > 1 else ""))
        return ", ".join(parts)


def _offloaded(cfg: TrainConfig) -> float:
    """The share of the optimizer on the host that ``cfg`` asks for."""
    if getattr(cfg, "offload", "none") == "none":
        return 0.0
    return float(getattr(cfg, "offload_fraction", 1.0))
