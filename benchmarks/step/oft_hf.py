"""The stack OpenVLA-OFT's own fine-tuning script runs, rebuilt offline: the benchmark's peer.

OFT (``moojink/openvla-oft``, ``vla-scripts/finetune.py``) runs the Hugging Face OpenVLA class
(remote code, a transformers fork) under DDP; here the same modules are put together from
their packages, as :mod:`benchmarks.lora_hf` does for OpenVLA: timm's two towers, each image
through both (read at the penultimate block), the fused MLP projector, transformers'
``LlamaForCausalLM`` (SDPA). OFT's forward, as its repository writes it: the proprio token
(``Linear -> GELU -> Linear``) after every image's patches, the action slots' input
embeddings multiplied by zero, bidirectional attention over the whole sequence with the
padding's keys masked (a custom 4D mask: OFT's fork sets ``is_causal=False``), the language
model run to the end (its logits over every position, which OFT's script reads for its
token metrics), the final-norm hidden states of the positions one before each slot
(``hidden_states[-1][:, num_patches:-1]`` at the action labels of ``labels[:, 1:]``) into the
MLP-ResNet L1 head, and the mean absolute error. PEFT's LoRA (r 32, alpha 16, dropout 0,
gaussian) on every linear of the VLA but ``lm_head``; the head and the projector are modules
of their own in bf16, trained whole by the same AdamW (5e-4); the step under
``torch.autocast(bfloat16)``. ``compile``: each ViT block and decoder layer compiled after
PEFT. Nothing here is imported by parallax; timm, transformers and peft are imported only
when the row runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.step.lora_hf import HFOpenVLA, linear_targets
from benchmarks.step.lora_hf import missing as _missing
from parallax.families.openvla.config import OpenVLAConfig


def missing() -> str | None:
    """Why the peer cannot be built here (a package missing), or ``None``."""
    return _missing()


class MLPResNet(nn.Module):
    """OFT's L1 head: LayerNorm, Linear, ReLU, ``blocks`` x (pre-norm residual Linear + ReLU),
    LayerNorm, Linear (``shared/oft.md``)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, blocks: int = 2) -> None:
        super().__init__()
        self.norm_in, self.fc_in = nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.ReLU())
            for _ in range(blocks)
        )
        self.norm_out, self.fc_out = nn.LayerNorm(hidden), nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc_in(self.norm_in(x)))
        for block in self.blocks:
            x = x + block(x)
        return self.fc_out(self.norm_out(x))


class Proprio(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class HFOpenVLAOFT(HFOpenVLA):
    """OFT's multimodal forward on the timm + transformers modules (module doc)."""

    def __init__(self, config: OpenVLAConfig, use_timm_ids: bool) -> None:
        super().__init__(config, use_timm_ids)
        self.oft = config.oft

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = []
        for image in pixel_values.split(6, dim=1):  # each image through both towers
            img, fused = torch.split(image, [3, 3], dim=1)
            a = self.featurizer.get_intermediate_layers(img, n=[self.layers[0]])[0]
            b = self.fused_featurizer.get_intermediate_layers(fused, n=[self.layers[1]])[0]
            out.append(torch.cat([a, b], dim=2))
        return self.projector(torch.cat(out, dim=1))  # (b, n P, h)

    def forward(self, pixel_values, input_ids, attention_mask, action_mask, proprio, projector):
        emb = self.language_model.get_input_embeddings()(input_ids)  # (b, t, h)
        patches = self.patches(pixel_values)
        if projector is not None:
            patches = torch.cat([patches, projector(proprio)[:, None]], dim=1)
        emb = emb * ~action_mask[..., None]  # empty action slots
        x = torch.cat([emb[:, :1], patches, emb[:, 1:]], dim=1)
        b, s = x.shape[:2]
        inserted = torch.ones(b, patches.shape[1], dtype=torch.bool, device=x.device)
        keys = torch.cat([attention_mask[:, :1], inserted, attention_mask[:, 1:]], dim=1)
        low = torch.finfo(x.dtype).min  # bidirectional, the padding's keys masked (max 0)
        mask = torch.zeros(b, 1, s, s, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(~keys[:, None, None, :], low)
        out = self.language_model(
            inputs_embeds=x, attention_mask=mask, output_hidden_states=True, use_cache=False
        )
        return out.hidden_states[-1], patches.shape[1]  # final-norm states, tokens after BOS


def head_input(hidden: torch.Tensor, prefix: int, action_mask: torch.Tensor, oft) -> torch.Tensor:
    """OFT's rows: ``hidden[:, prefix:-1]`` where ``labels[:, 1:]`` are action tokens (the
    position before each slot), one chunk step a row ``(b, K, D h)``."""
    text = hidden[:, prefix:-1]  # (b, t - 1, h)
    rows = text[action_mask[:, 1:]]  # (b K D, h)
    return rows.reshape(hidden.shape[0], oft.chunk, -1)


def build(config: OpenVLAConfig, device, dtype, rank: int, alpha: float, compile: bool):
    """The PEFT-wrapped VLA, the head, the proprio projector and their AdamW (random base)."""
    from peft import LoraConfig, get_peft_model

    oft, h = config.oft, config.text.hidden_size
    with torch.device(device):
        model = HFOpenVLAOFT(config, use_timm_ids=config.text.num_hidden_layers >= 32)
        head = MLPResNet(oft.action_dim * h, h, oft.action_dim, oft.head_blocks)
        projector = Proprio(oft.proprio_dim, h) if oft.proprio_dim else None
    model = model.to(dtype)
    head = head.to(dtype)
    projector = None if projector is None else projector.to(dtype)
    lora = LoraConfig(
        r=rank,
        lora_alpha=min(rank, alpha),
        lora_dropout=0.0,
        target_modules=linear_targets(model),
        init_lora_weights="gaussian",
    )
    model = get_peft_model(model, lora)
    if compile:
        inner = model.base_model.model
        for tower in (inner.featurizer, inner.fused_featurizer):
            for blk in tower.blocks:
                blk.compile()
        for layer in inner.language_model.model.layers:
            layer.compile()
    params = [p for m in (model, head, projector) if m is not None for p in m.parameters()]
    trainable = [p for p in params if p.requires_grad]
    return (model, head, projector), torch.optim.AdamW(trainable, lr=5e-4)


def loss_of(parts, mb: dict, autocast: torch.dtype | None) -> torch.Tensor:
    """One forward and OFT's L1 loss of a batch."""
    model, head, projector = parts
    dev = mb["input_ids"].device.type
    with torch.autocast(dev, dtype=autocast or torch.float32, enabled=bool(autocast)):
        hidden, prefix = model(
            mb["pixel_values"], mb["input_ids"], mb["attention_mask"], mb["action_mask"],
            mb.get("proprio"), projector,
        )  # fmt: skip
        pred = head(head_input(hidden, prefix, mb["action_mask"], model.base_model.model.oft))
        return F.l1_loss(pred.float(), mb["actions"])


def step_fn(parts, optimizer, mb: dict, autocast: torch.dtype | None):
    def step() -> dict:
        loss = loss_of(parts, mb, autocast)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach()}

    return step


def predict_fn(parts, mb: dict, autocast: torch.dtype | None):
    """One inference forward of a batch of one: the chunk ``(K, D)``, as OFT's
    ``predict_action`` (the prompt, the slots and the stop token; the L1 head)."""
    model, head, projector = parts

    @torch.no_grad()
    def predict() -> torch.Tensor:
        dev = mb["input_ids"].device.type
        with torch.autocast(dev, dtype=autocast or torch.float32, enabled=bool(autocast)):
            hidden, prefix = model(
                mb["pixel_values"], mb["input_ids"], mb["attention_mask"], mb["action_mask"],
                mb.get("proprio"), projector,
            )  # fmt: skip
            oft = model.base_model.model.oft
            return head(head_input(hidden, prefix, mb["action_mask"], oft))[0]

    return predict
