"""The ``TrainConfig`` options that say what is trained on what: the model and its data, and
LoRA adapters; :mod:`parallax.run.config` gathers them (a family's own options, such as
OpenVLA-OFT's action head, live in the family's package).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.run.option import ONE, at_least, opt, positive, within

PRECISIONS = ("fp32", "bf16")
FINETUNES = ("full", "lora")
QUANTIZED_BASES = ("nf4", "int8")
DATA, LORA = "model and data", "LoRA"
LORA_ONLY = {"needs": ("finetune", "lora")}  # the LoRA options mean nothing without it


def _adapter_dir(path: str) -> str | None:
    return None if Path(path).is_dir() else "no such adapter directory"


def _nonempty_globs(text: str) -> str | None:
    return None if text.strip(", ") else "must be 'all-linear' or module-name globs"


@dataclass(frozen=True)
class DataOptions:
    """The ``model and data`` group: the model, its data, what is frozen, the precision."""

    model: str = opt(
        "tiny",
        "a preset ({presets}), a checkpoint directory (its family found from its config.json), "
        "or FAMILY:SPEC",
        DATA,
    )
    data: Any = opt(
        "synthetic",
        "synthetic, a dataset directory (format detected), FORMAT:PATH (rlds, lerobot, libero, "
        "parallax) or a mixture FORMAT:A@0.7,FORMAT:B@0.3 (in --config, a [[data]] list)",
        DATA,
        table=True,
    )
    data_config: str | None = opt(
        None,
        "TOML of per-dataset key configs ([name] tables: cameras, state, action keys, "
        "transforms) for datasets the built-in configs do not know",
        DATA,
        metavar="FILE",
    )
    workers: int | None = opt(
        None,
        "processes per rank that decode and augment robot data (0: in the training process)",
        DATA,
        check=at_least(0, " (0: decode in the training process)"),
        default_text="what the host's cores allow, at most 8",
    )
    augment: bool | None = opt(
        None,
        "OpenVLA's training-time image augmentation (random 90% crop, brightness, contrast, "
        "saturation, hue)",
        DATA,
        switch="both",
        default_text="on for robot data, off for the synthetic task",
    )
    pad_to_multiple_of: int = opt(
        1,
        "round each microbatch's text up to a multiple of N tokens (masked out of the loss), "
        "so that compiled blocks and CUDA graphs see few sequence lengths (OpenVLA)",
        DATA,
        check=ONE,
        metavar="N",
    )
    freeze: str | None = opt(
        None,
        "GLOB,...: freeze the parameters whose global names match (or a family's alias, such as "
        "'vision'): no gradients, no optimizer state, no reduction",
        DATA,
        params=True,
    )
    freeze_vision: bool = opt(
        False, "freeze the vision tower(s): --freeze vision", DATA, switch="on", params=True
    )
    lr_groups: Any = opt(
        None,
        "GLOB=LR,... or a TOML file of glob = lr (or an [lr_groups] table in --config): peak "
        "learning rates by parameter name; the first match wins, the rest get --lr",
        DATA,
        table=True,
        default_text="the family's (LLaVA-NeXT: the vision tower at lr/10)",
        params=True,  # the parameters of each optimizer group
    )
    precision: str = opt(
        "fp32",
        "bf16: bf16 weights and compute, fp32 masters",
        DATA,
        choices=PRECISIONS,
        params=True,
    )


@dataclass(frozen=True)
class LoraOptions:
    """The ``LoRA`` group: full fine-tuning or low-rank adapters on the frozen base."""

    finetune: str = opt(
        "full",
        "full: train every parameter not frozen; lora: low-rank adapters on the frozen base "
        "(lr 5e-4 constant, no warm-up, no clipping unless given)",
        LORA,
        choices=FINETUNES,
        params=True,
    )
    lora_rank: int = opt(32, "adapter rank r", LORA, check=ONE, params=True, **LORA_ONLY)
    lora_alpha: float = opt(16.0, "adapter scale alpha / r", LORA, check=positive, **LORA_ONLY)
    lora_dropout: float = opt(
        0.0, "dropout on the adapters' input", LORA, check=within(0, 1, "[)"), **LORA_ONLY
    )
    lora_targets: str = opt(
        "all-linear",
        "'all-linear' (every linear but the output head) or GLOB,... of module names, parallax's "
        "or the HF checkpoint's, whole or as a dotted tail",
        LORA,
        check=_nonempty_globs,
        params=True,
        **LORA_ONLY,
    )
    train: str | None = opt(
        None,
        "GLOB,...: modules (or parameters) trained fully beside the adapters, e.g. "
        "projector,*norm (PEFT's modules_to_save)",
        LORA,
        params=True,
        **LORA_ONLY,
    )
    lora_init: str | None = opt(
        None,
        "DIR: start from this PEFT adapter (adapter_config.json)",
        LORA,
        check=_adapter_dir,
        **LORA_ONLY,
    )
    quantize_base: str | None = opt(
        None,
        "nf4|int8: hold the frozen base's linears quantized (QLoRA: NF4 with double-quantized "
        "block scales, about 0.52 bytes a weight; int8 with per-row scales), dequantized into "
        "each GEMM; adapters, trained modules and the output head stay as they are",
        LORA,
        choices=QUANTIZED_BASES,
        metavar="KIND",
        default_text="off",
        params=True,  # the base's linear weights become buffers of another size
        **LORA_ONLY,
    )
