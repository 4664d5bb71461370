"""PyTorch-native baselines for the OpenVLA training step, on the very same model code.

``build_single`` (one device), ``build_ddp_zero`` (DDP + ZeroRedundancyOptimizer),
``build_fsdp2`` (FSDP2 ``fully_shard``), ``build_dtensor_tp`` (DTensor tensor parallel) and
``build_pipelining`` (``torch.distributed.pipelining`` 1F1B) each return a
:class:`~benchmarks.native.base.Runner` over every rank of the default process group.
"""

from benchmarks.native.base import (
    Runner,
    Workload,
    clip_grad_norm,
    densify,
    dp_share,
    split_batch,
    stage_ranges,
    synthetic_batch,
)
from benchmarks.native.data_parallel import build_ddp_zero, build_fsdp2, build_single
from benchmarks.native.pipelining import build_pipelining
from benchmarks.native.tensor_parallel import build_dtensor_tp, interleave_qkv

__all__ = [
    "Runner",
    "Workload",
    "build_ddp_zero",
    "build_dtensor_tp",
    "build_fsdp2",
    "build_pipelining",
    "build_single",
    "clip_grad_norm",
    "densify",
    "dp_share",
    "interleave_qkv",
    "split_batch",
    "stage_ranges",
    "synthetic_batch",
]
