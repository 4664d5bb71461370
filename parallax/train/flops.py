"""Model FLOPs utilisation: achieved model FLOP/s over the GPUs' dense bf16 peak.

MFU = model FLOPs per step / (step time x GPUs x 989 TFLOP/s, the dense bf16 peak of an
H100/H200 SXM). The model FLOPs come from the family's recipe (``Recipe.flops``); each family
states its formula (the ``*_flops`` modules of :mod:`parallax.models`).
"""

from __future__ import annotations

from parallax.models.flops import Component, llama_layer_params, vit_block_params, vit_components

PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16

__all__ = [
    "PEAK_TFLOPS",
    "Component",
    "llama_layer_params",
    "mfu",
    "model_tflops_per_gpu",
    "vit_block_params",
    "vit_components",
]


def model_tflops_per_gpu(flops_per_step: float, step_time_s: float, num_gpus: int) -> float:
    """Achieved model TFLOP/s per GPU."""
    if step_time_s <= 0 or num_gpus < 1:
        raise ValueError(f"need step_time_s > 0 and num_gpus >= 1, got {step_time_s}, {num_gpus}")
    return flops_per_step / step_time_s / num_gpus / 1e12


def mfu(
    flops_per_step: float, step_time_s: float, num_gpus: int, peak_tflops: float = PEAK_TFLOPS
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``num_gpus x peak_tflops``."""
    return model_tflops_per_gpu(flops_per_step, step_time_s, num_gpus) / peak_tflops
