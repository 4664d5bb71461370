"""ZeRO 1-3 over the data-parallel group and optimizer offload
(:mod:`parallax.optim.zero.optimizer`)."""

from parallax.optim.zero.memory_report import MemoryReport
from parallax.optim.zero.optimizer import ZeroOptimizer
from parallax.optim.zero.state_io import FORMAT as STATE_FORMAT

__all__ = ["STATE_FORMAT", "MemoryReport", "ZeroOptimizer"]
