"""Pure rank <-> (pp, dp, tp) coordinate math for a ``dp x tp x pp`` layout.

No processes are involved: this is what every rank computes identically before it makes a single
collective, so layout errors surface everywhere at once and never as a hang.

Ranks are laid out with tp innermost, then dp, then pp::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so a tensor-parallel group is a block of neighbouring ranks (one NVLink island) and pipeline
stages span the slowest links.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel axes. Frozen and hashable."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ParallelDims: {axis} must be a positive integer, got {value!r} "
                    f"(tp={self.tp!r}, pp={self.pp!r}, dp={self.dp!r})"
                )

    @classmethod
    def from_world(
        cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None
    ) -> ParallelDims:
        """Build the layout for ``world_size`` ranks, inferring ``dp`` when it is omitted.

        Raises ``ValueError`` naming every number when the product does not match.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if tp < 1 or pp < 1 or (dp is not None and dp < 1):
            raise ValueError(f"parallel sizes must be >= 1, got tp={tp} pp={pp} dp={dp}")
        if dp is None:
            if world_size % (tp * pp) != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                    f"choose tp and pp whose product divides {world_size}"
                )
            dp = world_size // (tp * pp)
        if tp * pp * dp != world_size:
            raise ValueError(
                f"layout tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} ranks does not match "
                f"world size {world_size}"
            )
        return cls(tp=tp, pp=pp, dp=dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank."""
        self._check_rank(rank)
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank of the coordinates; the inverse of :meth:`coords`."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside [0, {size})")
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        """Rank lists of every tensor-parallel group, in a fixed order."""
        return [
            [self.rank(p, d, t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Rank lists of every data-parallel group, in a fixed order."""
        return [
            [self.rank(p, d, t) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Rank lists of every pipeline group (stage order), in a fixed order."""
        return [
            [self.rank(p, d, t) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for {self}")

    def __str__(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp}"
