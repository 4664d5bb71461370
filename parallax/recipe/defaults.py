"""What a recipe inherits: every hook of :class:`~parallax.recipe.protocol.Recipe` that has a
sensible default, grouped as the protocol is. A family overrides only what differs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from parallax.context import ParallelContext
from parallax.data import BatchLoader
from parallax.dims import ParallelDims
from parallax.models.estimate import BlockEstimate, Part

Microbatch = dict[str, Any]  # host tensors (and anything else the recipe puts there)


def batch_args(cfg, ctx: ParallelContext) -> dict[str, int]:
    """The batch sizes, this rank's dp share and the seed: what every loader of a run takes."""
    return dict(
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        seed=cfg.seed,
    )


class RecipeDefaults:
    """The optional hooks, with the defaults of a next-token model whose microbatches carry
    ``labels``."""

    name: str = ""

    # -- model -----------------------------------------------------------------------------------
    def reads_checkpoint(self, config_json: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this ``config.json`` belongs to the family."""
        return False

    def default_lr(self, spec: str) -> float:
        """The peak learning rate when ``--lr`` is not given."""
        return 2e-5

    def default_lr_groups(self, spec: str, lr: float) -> Any:
        """The ``--lr-groups`` of a run that gives none (``None``: every parameter at ``lr``)."""
        return None

    def default_lora_lr(self, spec: str) -> float:
        """The peak learning rate of ``--finetune lora`` when ``--lr`` is not given: OpenVLA's
        LoRA recipe (AdamW 5e-4, constant)."""
        return 5e-4

    def fully_trained(self, cfg) -> tuple[str, ...]:
        """Module globs of this run's new modules that train whole beside LoRA's adapters
        (``--train`` without being asked; OpenVLA-OFT's head) and that the family's export
        writes apart from the PEFT adapter; none by default."""
        return ()

    def configure(self, config: Any, cfg) -> Any:
        """The model config with the run's options applied (e.g. fused projections)."""
        return config

    def check_layout(self, config: Any, cfg, dims: ParallelDims) -> None:
        """Raise ``ValueError`` for a layout the family cannot run (same verdict on every rank:
        it sees only the config and the dims)."""

    def export(self, chunk: nn.Module, path: Path, statistics: Mapping | None) -> None:
        """Write the chunk's part of the HF checkpoint (collective over the whole world)."""
        raise ValueError(f"--export-hf: the {self.name} recipe has no export")

    # -- data ------------------------------------------------------------------------------------
    def eval_dataset(self, spec: str | None, cfg) -> Any:
        """The held-out split for ``--eval-interval``: ``--eval-data spec``, or with ``None`` the
        family's own held-out part of ``cfg.data`` (a ``ValueError`` when it has none)."""
        if spec is None:
            raise ValueError("--eval-interval: give the held-out data with --eval-data")
        return self.dataset(spec, cfg)

    def loader(self, dataset: Any, cfg, ctx: ParallelContext) -> Any:
        """What yields this dp rank's raw samples per step: ``next_batch()`` -> a list of
        ``num_microbatches`` lists of samples, and a JSON ``state_dict()`` /
        ``load_state_dict()`` (saved in checkpoints; a resume at any layout continues it).
        The sample order of each global batch must depend on ``cfg.seed`` and the position
        only, never on dp. Default: the random-access :class:`~parallax.data.BatchLoader`;
        a family whose data streams returns its own (``close()`` is called at the end)."""

        return BatchLoader(
            dataset,
            **batch_args(cfg, ctx),
        )

    def input_problem(self, config: Any, mb: Microbatch, cfg) -> str | None:
        """What is wrong with one microbatch (shapes, sizes), or ``None``: checked on every rank
        before a training step's first collective, so a bad one raises on all ranks."""
        return None

    # -- objective and reporting -----------------------------------------------------------------
    def backward_passes(self, num_microbatches: int) -> int:
        """Backward passes one step runs per parameter (ZeRO-1 reduces a bucket after the last
        one): one per microbatch for a pipeline, what ``forward_backward`` runs otherwise."""
        return num_microbatches

    def flops(
        self, config: Any, microbatches: Sequence[Microbatch], cfg, model: nn.Module | None = None
    ) -> float:
        """Model FLOPs of these microbatches' training step (formula in the family's docs).
        ``model``: the whole model on the meta device as the run adapts it (LoRA adapters,
        frozen parameters: ``requires_grad``), for what trains and what does not."""
        return 0.0

    def block_estimates(self, config: Any, cfg) -> list[BlockEstimate]:
        """Per pipeline block (in ``blocks()`` order), what one sample keeps for the backward
        and computes (:mod:`parallax.models.estimate`): ``--dry-run`` and the planner
        (:mod:`parallax.plan`) build their activation memory and step time from it. Default:
        each block's cost as matmul FLOPs and no activations (a family should say more)."""
        blocks = self.blocks(config)  # type: ignore[attr-defined]  # the Recipe's
        return [BlockEstimate((Part(b.name, gemm_flops=b.cost),)) for b in blocks]

    def tokens(self, config: Any, microbatches: Sequence[Microbatch]) -> int:
        """Tokens these microbatches process (for tokens/s): image and text tokens."""
        return 0
