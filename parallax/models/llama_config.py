"""LlamaConfig: the Llama decoder's architecture (:mod:`parallax.models.llama` builds it).

Plain data with the checks, derived sizes and FLOP counts that the planner, the families and the
checkpoint readers need without building a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from parallax.models.config_file import check_divisible


@dataclass(frozen=True)
class LlamaConfig:
    """Hugging Face ``LlamaConfig`` fields that shape the model (defaults: Llama-2-7B as
    ``LlamaConfig()`` builds it, which is what OpenVLA's config.json falls back on).

    ``fused_projections`` stores q/k/v as one column-parallel weight (``qkv_proj``) and
    gate/up as one (``gate_up_proj``): fewer, larger matmuls. Checkpoints keep the separate
    Hugging Face tensors either way.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    fused_projections: bool = False

    def __post_init__(self) -> None:
        check_divisible(self, "hidden_size", "num_attention_heads")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.kv_heads}"
            )
        if self.fused_projections and self.kv_heads != self.num_attention_heads:
            raise ValueError(
                "LlamaConfig: fused_projections needs as many key/value heads as query heads "
                f"({self.kv_heads} != {self.num_attention_heads}); use separate projections"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_flops(self, seq: int) -> float:
        """Forward FLOPs of one decoder layer on one sequence of ``seq`` tokens (causal)."""
        h, kv = self.hidden_size, self.kv_heads * self.head_dim
        params = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size
        return 2 * seq * params + 2 * seq * seq * h  # attention: QK^T and AV, half masked

    def head_flops(self, seq: int) -> float:
        return 2 * seq * self.hidden_size * self.vocab_size


# the tiny presets' language model (each family's test preset sets its vocabulary and depth)
TINY_LLAMA = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4)
