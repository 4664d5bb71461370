"""Shared pieces of the model tests: an init that makes every parameter matter, inputs, and a
straightforward single-process OpenVLA written from the architecture description (plain tensor
ops on a dict of Hugging Face-named weights, manual softmax attention, no parallax code)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from parallax.families.openvla.action_tokenizer import ActionTokenizer
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.prompt import TinyTokenizer, training_example

SEED = 1234
NORM_STATS = {
    "toy_dataset": {
        "action": {
            "mask": [True] * 6 + [False],
            "q01": [-0.5, -0.4, -0.3, -1.0, -1.0, -1.0, 0.0],
            "q99": [0.5, 0.4, 0.3, 1.0, 1.0, 1.0, 1.0],
            "min": [-0.6, -0.5, -0.4, -1.2, -1.2, -1.2, 0.0],
            "max": [0.6, 0.5, 0.4, 1.2, 1.2, 1.2, 1.0],
            "mean": [0.0] * 7,
            "std": [0.1] * 7,
        },
        "num_trajectories": 3,
        "num_transitions": 30,
    }
}


def tiny_config(**text_options) -> OpenVLAConfig:
    cfg = OpenVLAConfig.preset("tiny")
    cfg.norm_stats = NORM_STATS
    return cfg.with_options(**text_options) if text_options else cfg


def perturbed_init(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
    """Random values everywhere (norms and LayerScale around 1, biases non-zero), so that a
    wrong bias, norm or scale shows up in the logits."""
    x = torch.empty(shape, device=device).normal_(0.0, 1.0, generator=gen)
    if name.endswith("bias"):
        return 0.05 * x
    if len(shape) == 1:  # norm weights, LayerScale
        return 1.0 + 0.1 * x
    fan_in = math.prod(shape[1:]) if len(shape) == 2 or "patch_embed" in name else shape[-1]
    return x / math.sqrt(fan_in)


def make_batch(config: OpenVLAConfig, batch: int = 2, seed: int = 0):
    """``pixel_values (b, 6, S, S)``, ``input_ids (b, t)``, ``labels (b, t)`` built with the tiny
    tokenizer and real action tokens (equal lengths: the instructions have equal length)."""
    g = torch.Generator().manual_seed(seed)
    tok, act = TinyTokenizer(), ActionTokenizer.from_config(config)
    words = ["pick up the red block", "move the red block up"]
    ids, labels = [], []
    for i in range(batch):
        action = torch.rand(7, generator=g).numpy() * 2 - 1
        x, y = training_example(tok, act, words[i % len(words)], action)
        ids.append(x)
        labels.append(y)
    s = config.image_size
    px = torch.randn(batch, 6, s, s, generator=g)
    return px, torch.tensor(ids), torch.tensor(labels)


def assert_rel_close(actual, expected, rel: float = 1e-5, msg: str = "") -> None:
    """``max |actual - expected| <= rel * max |expected|``: float32 results that differ only in
    the order of their sums (tp splits matmuls and reductions) agree to about 1e-6 of the
    tensor's scale, while a wrong element, shard or scale is off by far more."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= rel * scale + 1e-12, f"{msg}: max error {err:.3g} vs scale {scale:.3g}"


def greedy_margin(model, pixel_values, prompt, tokens) -> float:
    """The smallest gap between the best and the second-best logit over the greedy steps that
    gave ``tokens (b, n)`` after ``prompt (b, t)``, over the logits' scale (a whole tp=1 model).

    Two computations of the same logits in a different order (tp, a KV cache) agree to about
    1e-6 of their scale; their greedy tokens can differ only at a step whose gap is that small.
    A test that compares such tokens exactly first checks that the gap is far larger, so the
    comparison holds on any CPU."""
    with torch.no_grad():
        ids = torch.cat([prompt, tokens[:, :-1]], dim=1)
        logits = model(pixel_values, ids)[:, -tokens.shape[1] :].float()  # (b, n, V)
        top = logits.topk(2, dim=-1).values  # (b, n, 2)
        assert torch.equal(logits.argmax(-1), tokens), "tokens are not the greedy ones"
        return ((top[..., 0] - top[..., 1]).min() / logits.abs().max()).item()


# ---------------------------------------------------------------------------- the reference


def _layer_norm(x, sd, p, eps):
    return F.layer_norm(x, (x.shape[-1],), sd[p + ".weight"], sd[p + ".bias"], eps)


def _softmax_attention(q, k, v, causal: bool):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, nh, n, n)
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def ref_vit(sd: dict, prefix: str, cfg, images: torch.Tensor) -> torch.Tensor:
    p = cfg.patch_size
    x = F.conv2d(
        images,
        sd[prefix + "patch_embed.proj.weight"],
        sd[prefix + "patch_embed.proj.bias"],
        stride=p,
    )
    x = x.flatten(2).transpose(1, 2)  # (b, patches, w)
    b = x.shape[0]
    prefix_tokens = []
    if cfg.class_token:
        prefix_tokens.append(sd[prefix + "cls_token"].expand(b, -1, -1))
    if cfg.reg_tokens:
        prefix_tokens.append(sd[prefix + "reg_token"].expand(b, -1, -1))
    if cfg.no_embed_class:
        x = torch.cat(prefix_tokens + [x + sd[prefix + "pos_embed"]], dim=1)
    else:
        x = torch.cat(prefix_tokens + [x], dim=1) + sd[prefix + "pos_embed"]
    heads, hd = cfg.num_heads, cfg.width // cfg.num_heads
    last = cfg.feature_layer + cfg.depth if cfg.feature_layer < 0 else cfg.feature_layer
    for i in range(last + 1):
        bp = f"{prefix}blocks.{i}."
        h = _layer_norm(x, sd, bp + "norm1", cfg.ln_eps)
        qkv = F.linear(h, sd[bp + "attn.qkv.weight"], sd[bp + "attn.qkv.bias"])
        q, k, v = qkv.reshape(b, -1, 3, heads, hd).permute(2, 0, 3, 1, 4)
        o = _softmax_attention(q, k, v, causal=False).transpose(1, 2).reshape(b, -1, cfg.width)
        o = F.linear(o, sd[bp + "attn.proj.weight"], sd[bp + "attn.proj.bias"])
        x = x + (o * sd[bp + "ls1.scale_factor"] if cfg.layer_scale else o)
        h = _layer_norm(x, sd, bp + "norm2", cfg.ln_eps)
        h = F.gelu(F.linear(h, sd[bp + "mlp.fc1.weight"], sd[bp + "mlp.fc1.bias"]))
        h = F.linear(h, sd[bp + "mlp.fc2.weight"], sd[bp + "mlp.fc2.bias"])
        x = x + (h * sd[bp + "ls2.scale_factor"] if cfg.layer_scale else h)
    return x[:, cfg.num_prefix_tokens :]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_openvla(sd: dict, config: OpenVLAConfig, pixel_values, input_ids) -> torch.Tensor:
    """Full logits ``(b, P + t, V)`` of OpenVLA, as the architecture description defines them."""
    dino = ref_vit(sd, "vision_backbone.featurizer.", config.vision[0], pixel_values[:, :3])
    sig = ref_vit(sd, "vision_backbone.fused_featurizer.", config.vision[1], pixel_values[:, 3:])
    x = torch.cat([dino, sig], dim=2)
    for i, act in ((1, True), (2, True), (3, False)):
        x = F.linear(x, sd[f"projector.fc{i}.weight"], sd[f"projector.fc{i}.bias"])
        x = F.gelu(x) if act else x
    emb = sd["language_model.model.embed_tokens.weight"][input_ids]
    h = torch.cat([emb[:, :1], x, emb[:, 1:]], dim=1)
    t = config.text
    b, s, _ = h.shape
    pos = torch.arange(s)
    for i in range(t.num_hidden_layers):
        lp = f"language_model.model.layers.{i}."
        a = _rms(h, sd[lp + "input_layernorm.weight"], t.rms_norm_eps)
        q, k, v = (
            F.linear(a, sd[lp + f"self_attn.{n}_proj.weight"])
            .view(b, s, -1, t.head_dim)
            .transpose(1, 2)
            for n in "qkv"
        )
        q, k = _rotate(q, pos, t.rope_theta), _rotate(k, pos, t.rope_theta)
        group = t.num_attention_heads // k.shape[1]  # grouped-query attention: share kv heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = _softmax_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, -1)
        h = h + F.linear(o, sd[lp + "self_attn.o_proj.weight"])
        a = _rms(h, sd[lp + "post_attention_layernorm.weight"], t.rms_norm_eps)
        gate, up = (
            F.linear(a, sd[lp + "mlp.gate_proj.weight"]),
            F.linear(a, sd[lp + "mlp.up_proj.weight"]),
        )
        h = h + F.linear(F.silu(gate) * up, sd[lp + "mlp.down_proj.weight"])
    h = _rms(h, sd["language_model.model.norm.weight"], t.rms_norm_eps)
    return F.linear(h, sd["language_model.lm_head.weight"])


def ref_loss_and_metrics(logits, labels, config: OpenVLAConfig):
    """HF's shifted cross-entropy and OpenVLA's finetune.py accuracy / L1 on full logits."""
    p = config.num_patches
    full = torch.cat([labels[:, :1], torch.full((labels.shape[0], p), -100), labels[:, 1:]], 1)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), full[:, 1:].flatten(), ignore_index=-100)
    pred = logits[:, p:-1].argmax(-1)
    gt = labels[:, 1:]
    act = ActionTokenizer.from_config(config)
    mask = gt > act.action_token_begin_idx
    correct = ((pred == gt) & mask).sum().item()
    l1 = np.abs(act.decode(pred[mask].numpy()) - act.decode(gt[mask].numpy())).sum()
    return loss, correct, float(l1), int(mask.sum())
