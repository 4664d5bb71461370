"""The stack OpenVLA's own LoRA script (``vla-scripts/finetune.py``) runs, rebuilt offline.

OpenVLA's Hugging Face class is remote code, so the same modules are put together from their
packages: timm's two towers (``timm.create_model(id, pretrained=False, num_classes=0,
img_size=224)`` for the 7B's DINOv2 ViT-L/14 reg4 and SigLIP so400m, each read at its
penultimate block through ``get_intermediate_layers``, features fused per patch), the fused MLP
projector (``fc1``, GELU, ``fc2``, GELU, ``fc3``) and transformers' ``LlamaForCausalLM`` (SDPA
attention), weights in bf16; the patches go in right after BOS and the loss is the model's own
cross-entropy over every position (labels -100 but the last few). PEFT's LoRA with the
script's ``LoraConfig`` (r 32, alpha min(r, 16), dropout 0, gaussian init) on every
``nn.Linear`` but ``lm_head`` (PEFT's ``all-linear`` rule, spelled out as module names because
the container is no ``PreTrainedModel``), the step under ``torch.autocast(bfloat16)``, AdamW
(5e-4) over the trainable parameters, no clipping. ``compile``: each ViT block and decoder
layer ``torch.compile``'d after PEFT wrapped its linears. Nothing here is imported by parallax;
timm, transformers and peft are the benchmark's peers, imported only when the row runs.
"""

from __future__ import annotations

import torch
from torch import nn

from parallax.families.openvla.config import OpenVLAConfig
from parallax.models.vit import ViTConfig


def missing(quantize: bool = False) -> str | None:
    """Why the stack cannot be built here (a package missing), or ``None``."""
    for name in ("timm", "transformers", "peft", *(("bitsandbytes",) if quantize else ())):
        try:
            __import__(name)
        except ImportError:
            return f"skipped: needs {name} (pip install timm transformers peft)"
    return None


def _tower(v: ViTConfig, timm_id: str | None) -> nn.Module:
    import timm
    from timm.models.vision_transformer import VisionTransformer

    if timm_id is not None:  # OpenVLA's own call (the 7B's towers)
        return timm.create_model(timm_id, pretrained=False, num_classes=0, img_size=v.image_size)
    return VisionTransformer(  # a preset timm does not know (the smoke run's tiny one)
        img_size=v.image_size,
        patch_size=v.patch_size,
        embed_dim=v.width,
        depth=v.depth,
        num_heads=v.num_heads,
        mlp_ratio=v.mlp_hidden / v.width,
        qkv_bias=v.qkv_bias,
        class_token=v.class_token,
        reg_tokens=v.reg_tokens,
        no_embed_class=v.no_embed_class,
        init_values=v.layer_scale,
        global_pool="map" if v.pool == "map" else "token",
        num_classes=0,
    )


class HFOpenVLA(nn.Module):
    """OpenVLA's ``PrismaticForConditionalGeneration`` forward on timm + transformers modules."""

    def __init__(self, config: OpenVLAConfig, use_timm_ids: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        ids = config.timm_model_ids if use_timm_ids else (None, None)
        self.featurizer = _tower(config.vision[0], ids[0])
        self.fused_featurizer = _tower(config.vision[1], ids[1])
        self.layers = [v.feature_layer % v.depth for v in config.vision]
        d, t = config.vision_dim, config.text
        self.projector = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, t.hidden_size), nn.GELU()
        )
        self.projector.append(nn.Linear(t.hidden_size, t.hidden_size))
        llama = LlamaConfig(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.kv_heads,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta,
            max_position_embeddings=t.max_position_embeddings,
        )
        llama._attn_implementation = "sdpa"
        self.language_model = LlamaForCausalLM(llama)
        self.num_patches = config.num_patches

    def forward(self, pixel_values, input_ids, labels) -> torch.Tensor:
        img, fused = torch.split(pixel_values, [3, 3], dim=1)
        a = self.featurizer.get_intermediate_layers(img, n=[self.layers[0]])[0]
        b = self.fused_featurizer.get_intermediate_layers(fused, n=[self.layers[1]])[0]
        patches = self.projector(torch.cat([a, b], dim=2))  # (b, P, h)
        emb = self.language_model.get_input_embeddings()(input_ids)
        x = torch.cat([emb[:, :1], patches, emb[:, 1:]], dim=1)
        ignore = torch.full((labels.shape[0], self.num_patches), -100, device=labels.device)
        labels = torch.cat([labels[:, :1], ignore, labels[:, 1:]], dim=1)
        return self.language_model(inputs_embeds=x, labels=labels, use_cache=False).loss


def linear_targets(model: nn.Module) -> list[str]:
    """PEFT's ``all-linear``: every ``nn.Linear`` but the output head."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not n.endswith("lm_head")
    ]


def build(
    config: OpenVLAConfig,
    device,
    dtype,
    rank: int,
    alpha: float,
    compile: bool,
    cuda_graphs: bool = False,
    quantize: bool = False,
):
    """The PEFT-wrapped model and its AdamW, as the script builds them (random base);
    ``cuda_graphs``: the compiled blocks in inductor's reduce-overhead mode; ``quantize``: the
    base's linears (all but ``lm_head``) in bitsandbytes' 4-bit NF4 with double quantization
    and bf16 compute, what the script's ``--use_quantization`` loads (its
    ``prepare_model_for_kbit_training`` is left out: it would add gradient checkpointing and
    fp32 norms, both slower)."""
    from peft import LoraConfig, get_peft_model

    with torch.device(device):
        model = HFOpenVLA(config, use_timm_ids=config.text.num_hidden_layers >= 32)
    model = model.to(dtype)
    if quantize:
        to_4bit(model, dtype)
    lora = LoraConfig(
        r=rank,
        lora_alpha=min(rank, alpha),
        lora_dropout=0.0,
        target_modules=linear_targets(model),
        init_lora_weights="gaussian",
    )
    model = get_peft_model(model, lora)
    if compile:
        options = {"mode": "reduce-overhead"} if cuda_graphs else {}
        inner = model.base_model.model
        for tower in (inner.featurizer, inner.fused_featurizer):
            for blk in tower.blocks:
                blk.compile(**options)
        for layer in inner.language_model.model.layers:
            layer.compile(**options)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=5e-4)


@torch.no_grad()
def to_4bit(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Every ``nn.Linear`` but ``lm_head`` replaced by bitsandbytes' ``Linear4bit`` (NF4, double
    quantization), one at a time: each bf16 weight is freed once quantized."""
    import bitsandbytes as bnb

    for name in linear_targets(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = bnb.nn.Linear4bit(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        weight = bnb.nn.Params4bit(
            old.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
        new.weight = weight.to(old.weight.device)  # quantized on the way to the GPU
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        setattr(parent, child, new)
        del old
    torch.cuda.empty_cache()


def step_fn(
    model,
    optimizer,
    microbatches: list[dict],
    autocast: torch.dtype | None,
    cuda_graphs: bool = False,
):
    """One step as the script runs it: per micro-batch a forward under autocast and a backward
    of ``loss / accumulation steps`` (its ``grad_accumulation_steps``), then AdamW. With
    ``cuda_graphs`` each micro-batch starts a new replay round (the last one's graph outputs
    are dead by then: its backward has run)."""
    dev = microbatches[0]["input_ids"].device.type
    n = len(microbatches)

    def step() -> dict:
        total = 0.0
        for mb in microbatches:
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(dev, dtype=autocast or torch.float32, enabled=bool(autocast)):
                loss = model(mb["pixel_values"], mb["input_ids"], mb["labels"])
            (loss / n).backward()
            total = total + loss.detach() / n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": total}

    return step
