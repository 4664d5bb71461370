"""ZeRO 1-3 over the data-parallel group and optimizer offload (:mod:`parallax.optim.zero`)."""

from parallax.optim.memory import MemoryReport
from parallax.optim.state import FORMAT as STATE_FORMAT
from parallax.optim.zero import ZeroOptimizer

__all__ = ["STATE_FORMAT", "MemoryReport", "ZeroOptimizer"]
