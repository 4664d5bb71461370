"""ZeRO 1-3 over the data-parallel group and optimizer offload (:mod:`parallax.optim.zero`)."""

from parallax.optim.zero import STATE_FORMAT, MemoryReport, ZeroOptimizer, ZeroStage, stage_of

__all__ = ["STATE_FORMAT", "MemoryReport", "ZeroOptimizer", "ZeroStage", "stage_of"]
