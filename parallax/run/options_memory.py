"""The ``TrainConfig`` options that change what a step costs, not what it computes: where the
memory goes (ZeRO, offload, recomputation) and how fast it runs (fusion, compilation, overlap);
:mod:`parallax.run.config` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.models.compile import CHECKPOINT_SCOPES
from parallax.optim.zero.stage import HOST_ADAMW_CHOICES, HOST_MASTERS_CHOICES
from parallax.run.option import opt, within
from parallax.run.options_layout import GPU_GIB

ZERO_STAGES = (1, 2, 3)
OFFLOADS = ("none", "optimizer")
LOGITS = ("labelled", "all")
MEMORY, SPEED = "memory", "speed (same results either way)"


def _zero_stage(stage: int) -> str | None:
    return None if stage in ZERO_STAGES else f"must be 1, 2 or 3, got {stage}"


@dataclass(frozen=True)
class MemoryOptions:
    """The ``memory`` group: ZeRO stage, offload, memory cap and recomputation."""

    zero: int = opt(
        1,
        "ZeRO stage over each dp group: 1 shards the optimizer state and fp32 masters, 2 also "
        "the reduced gradients, 3 also the weights (each block gathered just before its use)",
        MEMORY,
        check=_zero_stage,
        metavar="{1,2,3}",
    )
    reshard_after_forward: bool = opt(
        True,
        "at --zero 3: free each block's gathered weights after its forward and gather them "
        "again for the backward; off: keep them from the first forward to the step (one "
        "gather per block per step, the stage's whole weights held)",
        MEMORY,
        switch="both",
        needs=("zero", 3),
    )
    offload: str = opt(
        "none",
        "optimizer: this rank's fp32 masters and AdamW moments in (pinned) host memory, each "
        "bucket stepped on the host as its gradients arrive (needs --zero 2 or 3)",
        MEMORY,
        choices=OFFLOADS,
    )
    offload_fraction: float = opt(
        1.0,
        "the share of the optimizer state (the last layers' buckets first) on the host",
        MEMORY,
        check=within(0, 1, "(]"),
        needs=("offload", "optimizer"),
        metavar="F",
    )
    gpu_accumulation: float = opt(
        0.0,
        "with --offload optimizer: the share of the offloaded gradients summed over the "
        "micro-batches in GPU memory (the first layers' buckets first) rather than in host "
        "memory: less host memory and one trip over the link instead of one a micro-batch "
        "(--layout auto fills what the GPU has free)",
        MEMORY,
        check=within(0, 1),
        needs=("offload", "optimizer"),
        metavar="F",
    )
    host_adamw: str = opt(
        "auto",
        "where --offload optimizer steps a clipped run on the host, its AdamW. torch: torch's "
        "fused CPU kernel between an upcast of the summed gradients and a conversion of the new "
        "weights (40 bytes an element); one-pass: one loop from the sums to the new weights (28 "
        "bytes; on GPUs compiled for the CPU at start); auto: one-pass on GPUs, torch on the CPU",
        MEMORY,
        choices=HOST_ADAMW_CHOICES,
    )
    host_masters: str = opt(
        "auto",
        "where --offload optimizer keeps an offloaded bf16 weight's fp32 master: full (4 bytes "
        "an element in host memory), or split: its low 16 bits alone (2 bytes; OpenVLA-7B: 14 "
        "GiB less), joined each step with the bf16 weight brought down from the GPU, which is "
        "the master's top half (exact, but that a master halfway between two bf16 values may "
        "move one fp32 ulp), at the price of a slower host step. split needs the one-pass host "
        "AdamW (a clipped run on a GPU, or --host-adamw one-pass). auto: full, unless the "
        "planner (--layout auto, parallax.plan) finds a faster layout with split masters where the "
        "host's memory turns whole ones away",
        MEMORY,
        choices=HOST_MASTERS_CHOICES,
    )
    gpu_memory_limit: float | None = opt(
        None,
        "cap this process's GPU memory at GIB (torch's per-process memory fraction): emulates "
        "a smaller card on a large one and protects a shared GPU",
        MEMORY,
        checks=GPU_GIB,
        metavar="GIB",
    )
    activation_checkpointing: bool = opt(
        False, "recompute each block's activations in the backward pass", MEMORY, switch="on"
    )
    checkpoint_scope: str = opt(
        "all",
        "which blocks --activation-checkpointing recomputes: all, vision (the towers alone: under "
        "LoRA much of the memory for little of the compute) or text",
        MEMORY,
        choices=CHECKPOINT_SCOPES,
        needs=("activation_checkpointing", True, "it says which blocks recompute"),
    )
    activation_memory_budget: float = opt(
        1.0,
        "the share of a compiled block's saved activations the compiler keeps; below 1 it "
        "recomputes the cheapest of the rest in the backward",
        MEMORY,
        check=within(0, 1, "(]"),
        metavar="FRACTION",
        needs=("compile", True, "it tells the compiler what to recompute"),
    )


@dataclass(frozen=True)
class SpeedOptions:
    """The ``speed`` group: each choice gives the same results, at another speed."""

    logits: str = opt(
        "labelled",
        "where the last stage applies the final norm and lm_head: at the labelled positions, "
        "inside the loss, or at every position",
        SPEED,
        choices=LOGITS,
    )
    fused_projections: bool = opt(
        True,
        "q/k/v and gate/up as one weight each (checkpoints keep the separate tensors)",
        SPEED,
        switch="both",
    )
    compile: bool = opt(False, "torch.compile each ViT block and decoder layer", SPEED, switch="on")
    cuda_graphs: bool = opt(
        False,
        "with --compile on GPUs: replay each compiled block as a CUDA graph (reduce-overhead)",
        SPEED,
        switch="on",
        needs=("compile", True, "it replays the compiled blocks"),
    )
    pipeline_syncs: bool = opt(
        False,
        "agree on the pipeline program every step and size received activations from their "
        "metadata (host syncs); default: agree once, sizes from the batch",
        SPEED,
        switch="on",
    )
    prefetch: int = opt(
        1,
        "make the next N steps' batches (read, collate, pin, copy to the GPU on a side stream) "
        "in a background thread while the step runs (0: between steps, in the training thread)",
        SPEED,
        check=within(0, 4),
        metavar="N",
    )
    overlap_param_gather: bool = opt(
        True,
        "at dp > 1, all-gather the updated weights under the next forward, each block waiting "
        "for its own",
        SPEED,
        switch="both",
    )
