"""A plain-PyTorch SigLIP (``nn.Linear``, ``nn.LayerNorm``, ``scaled_dot_product_attention``,
``nn.MultiheadAttention`` for the MAP head) with the Hugging Face ``SiglipModel`` parameter
names, so ``load_state_dict`` takes a parallax export as it is: the torch-native baseline of
``benchmarks/step/siglip.py``. Blocks are separate modules so ``torch.compile`` can take
them one at a time (as the other natives do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, w // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # (b, h, n, w/h)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(width, eps), nn.LayerNorm(width, eps)
        self.self_attn, self.mlp = Attention(width, heads), MLP(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg, checkpointing: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(cfg.width, cfg.num_heads, cfg.mlp_hidden, cfg.ln_eps) for _ in range(cfg.depth)
        )
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        return x


class Head(nn.Module):
    """The MAP head: a learned probe attends over the patches, then an MLP block."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.attention = nn.MultiheadAttention(cfg.width, cfg.num_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(cfg.width, cfg.ln_eps)
        self.mlp = MLP(cfg.width, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.probe.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0]
        return (h + self.mlp(self.layernorm(h)))[:, 0]


class Embeddings(nn.Module):
    def __init__(self, num: int, width: int, vocab: int | None = None, patch: int = 0) -> None:
        super().__init__()
        if vocab is None:
            self.patch_embedding = nn.Conv2d(3, width, patch, stride=patch)
        else:
            self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(num, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "patch_embedding"):
            x = self.patch_embedding(x).flatten(2).transpose(1, 2)  # (b, n, w)
        else:
            x = self.token_embedding(x)
        return x + self.position_embedding.weight[: x.shape[1]]


class VisionModel(nn.Module):
    def __init__(self, cfg, checkpointing: bool) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg.num_patches, cfg.width, patch=cfg.patch_size)
        self.encoder = Encoder(cfg, checkpointing)
        self.post_layernorm = nn.LayerNorm(cfg.width, cfg.ln_eps)
        self.head = Head(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.post_layernorm(self.encoder(self.embeddings(pixel_values))))


class TextModel(nn.Module):
    def __init__(self, cfg, embed_dim: int, checkpointing: bool) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg.max_length, cfg.width, vocab=cfg.vocab_size)
        self.encoder = Encoder(cfg, checkpointing)
        self.final_layer_norm = nn.LayerNorm(cfg.width, cfg.ln_eps)
        self.head = nn.Linear(cfg.width, embed_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.final_layer_norm(self.encoder(self.embeddings(input_ids)))
        return self.head(x[:, -1])  # SigLIP pools the last position


class TorchSiglip(nn.Module):
    """Both towers and the sigmoid loss over the batch, in plain torch."""

    def __init__(self, config, checkpointing: bool = False) -> None:
        super().__init__()
        if config.family != "siglip":
            raise ValueError("the torch-native baseline is written for SigLIP")
        self.vision_model = VisionModel(config.vision, checkpointing)
        self.text_model = TextModel(config.text, config.embed_dim, checkpointing)
        self.logit_scale = nn.Parameter(torch.zeros(1))
        self.logit_bias = nn.Parameter(torch.zeros(1))

    def blocks(self) -> list[nn.Module]:
        """What ``torch.compile`` takes one at a time."""
        return [*self.vision_model.encoder.layers, *self.text_model.encoder.layers]

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.vision_model(pixel_values).float(), dim=-1)
        y = F.normalize(self.text_model(input_ids).float(), dim=-1)
        logits = self.logit_scale.exp() * x @ y.T + self.logit_bias  # (b, b)
        z = 2 * torch.eye(len(x), device=x.device) - 1
        return -F.logsigmoid(z * logits).sum() / len(x)
