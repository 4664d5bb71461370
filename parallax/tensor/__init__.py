"""Tensor parallelism: layers, their communication primitives, the vocab-parallel loss, LoRA."""

from parallax.tensor.functional import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from parallax.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    heads_per_rank,
    resolve_tp,
    sync_sequence_parallel_grads,
)
from parallax.tensor.lora import LoRAColumnParallelLinear, LoRARowParallelLinear
from parallax.tensor.lora_apply import LoRAReport, apply_lora, merge_lora
from parallax.tensor.loss import vocab_parallel_cross_entropy
from parallax.tensor.sharding import (
    TPShard,
    full_tensor,
    logical_shape,
    shard_tensor,
    unshard_tensor,
)

__all__ = [
    "ColumnParallelLinear",
    "LoRAColumnParallelLinear",
    "LoRAReport",
    "LoRARowParallelLinear",
    "RowParallelLinear",
    "TPShard",
    "VocabParallelEmbedding",
    "apply_lora",
    "copy_to_tp",
    "full_tensor",
    "gather_from_sp",
    "gather_from_tp",
    "heads_per_rank",
    "logical_shape",
    "merge_lora",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "resolve_tp",
    "scatter_to_tp",
    "shard_tensor",
    "sync_sequence_parallel_grads",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
]
