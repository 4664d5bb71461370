"""A quantized frozen base for LoRA (``--quantize-base nf4|int8``): the formats
(:mod:`.formats`), the layer's quantized weight and its GEMM (:mod:`.weight`) and the model-wide
pass (:mod:`.base`)."""

from parallax.tensor.quant.base import QuantReport, frozen_linears, quantize_base, quantized_weights
from parallax.tensor.quant.formats import (
    KINDS,
    NF4_BLOCK,
    NF4_LEVELS,
    NF4_WIDEST_GAP,
    Packed,
    bytes_per_weight,
    dequantize,
    quantize,
)
from parallax.tensor.quant.weight import QuantizedWeight, is_quantized, quantize_layer

__all__ = [
    "KINDS",
    "NF4_BLOCK",
    "NF4_LEVELS",
    "NF4_WIDEST_GAP",
    "Packed",
    "QuantReport",
    "QuantizedWeight",
    "bytes_per_weight",
    "dequantize",
    "frozen_linears",
    "is_quantized",
    "quantize",
    "quantize_base",
    "quantize_layer",
    "quantized_weights",
]
