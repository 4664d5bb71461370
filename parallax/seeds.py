"""Seeds derived from a run's seed and a name: what makes initialisation and data order
independent of the layout (every rank derives the same number for the same name)."""

from __future__ import annotations

import hashlib


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's (or any stream's) name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
