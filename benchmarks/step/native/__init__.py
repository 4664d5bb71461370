"""PyTorch-native baselines for the OpenVLA training step, on the very same model code.

``build_single`` (one device), ``build_ddp_zero`` (DDP + ZeroRedundancyOptimizer),
``build_fsdp2`` (FSDP2 ``fully_shard``), ``build_dtensor_tp`` (DTensor tensor parallel) and
``build_pipelining`` (``torch.distributed.pipelining`` 1F1B) each return a
:class:`~benchmarks.step.native.base.Runner` over every rank of the default process group, in the
framework's best form: blocks compiled when ``Workload.compile_backend`` is set, fused AdamW,
one gradient reduction per step (DDP ``no_sync``, FSDP2 without per-micro-batch sync),
loss-parallel cross-entropy on vocabulary-sharded logits (DTensor), bf16 stage activations
(pipelining). A torch without the API of a best form raises :class:`MissingAPI`.
"""

from benchmarks.step.native.base import (
    MissingAPI,
    Runner,
    Workload,
    clip_grad_norm,
    compile_blocks,
    densify,
    dp_share,
    split_batch,
    stage_ranges,
    synthetic_batch,
)
from benchmarks.step.native.data_parallel import (
    build_ddp_zero,
    build_fsdp2,
    build_single,
    fsdp_no_sync,
)
from benchmarks.step.native.pipelining import CastOutput, build_pipelining
from benchmarks.step.native.tensor_parallel import (
    build_dtensor_tp,
    interleave_qkv,
    parallel_loss,
)

__all__ = [
    "CastOutput",
    "MissingAPI",
    "Runner",
    "Workload",
    "build_ddp_zero",
    "build_dtensor_tp",
    "build_fsdp2",
    "build_pipelining",
    "build_single",
    "clip_grad_norm",
    "compile_blocks",
    "densify",
    "dp_share",
    "fsdp_no_sync",
    "interleave_qkv",
    "parallel_loss",
    "split_batch",
    "stage_ranges",
    "synthetic_batch",
]
