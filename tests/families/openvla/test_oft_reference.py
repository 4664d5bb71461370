"""OpenVLA-OFT's model at tp 1 against a plain reference written here from ``shared/oft.md``.

The reference shares only the weights (the model's state dict, every parameter perturbed so
that each matters) and the input tensors: plain tensor ops for both towers per image with FiLM
after the attention residual (``x * (1 + gamma) + beta``, gamma and beta linear in the mean of
the input embeddings that are neither action slots nor padding: see oft_model.py for why the
padding is left out where OFT's code keeps it), the fused projector, the proprio token after
the patches, action slots with zero embeddings, Llama layers with bidirectional attention and
the padding's keys masked out, the final norm, and the MLP-ResNet head on the hidden states one
position before each slot (found from the action mask, not from the model's own rows). Float32:
agreement to 1e-5 of each tensor's scale."""

import math

import pytest
import torch
import torch.nn.functional as F

from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.oft.batches import OFTBatchBuilder
from parallax.families.openvla.oft.config import OFTConfig, head_rows
from parallax.families.openvla.prompt import TinyTokenizer, prompt_ids
from tests.families.openvla.helpers import (
    SEED,
    _layer_norm,
    _rms,
    _rotate,
    assert_rel_close,
    perturbed_init,
    tiny_config,
)

OFT = OFTConfig(chunk=2, action_dim=7, proprio_dim=3, num_images=2, film=True)


def _config(**oft):
    import dataclasses

    return dataclasses.replace(tiny_config(), oft=dataclasses.replace(OFT, **oft))


def _stats(config):
    stats = {k: dict(v) for k, v in config.norm_stats.items()}
    for entry in stats.values():
        entry["proprio"] = {
            "q01": [-1.0] * 3,
            "q99": [1.0] * 3,
            "min": [-2.0] * 3,
            "max": [2.0] * 3,
        }
    return stats


def _samples(config, instructions=("pick up the red block", "go left")):
    """Raw samples whose prompts differ in length (the second is padded in a batch)."""
    g = torch.Generator().manual_seed(7)
    oft, s = config.oft, 40
    samples = []
    for text in instructions:
        sample = {
            "instruction": text,
            "actions": torch.rand(oft.chunk, oft.action_dim, generator=g) * 0.8 - 0.4,
            "state": torch.rand(oft.proprio_dim, generator=g) * 2 - 1,
            "image": torch.randint(0, 256, (s, s, 3), generator=g, dtype=torch.uint8),
            "wrist_image": torch.randint(0, 256, (s, s, 3), generator=g, dtype=torch.uint8),
        }
        samples.append(sample)
    return samples


def _batch(config, samples=None):
    samples = _samples(config) if samples is None else samples
    return OFTBatchBuilder(config, _stats(config), TinyTokenizer())(samples)


# ----------------------------------------------------------------------------- the reference
def _attention(q, k, v, key_mask=None):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, nh, n, n)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v


def _vit(sd, prefix, cfg, images, film):
    p = cfg.patch_size
    w, b = sd[prefix + "patch_embed.proj.weight"], sd[prefix + "patch_embed.proj.bias"]
    x = F.conv2d(images, w, b, stride=p).flatten(2).transpose(1, 2)  # (b, patches, w)
    n = x.shape[0]
    front = []
    if cfg.class_token:
        front.append(sd[prefix + "cls_token"].expand(n, -1, -1))
    if cfg.reg_tokens:
        front.append(sd[prefix + "reg_token"].expand(n, -1, -1))
    if cfg.no_embed_class:
        x = torch.cat(front + [x + sd[prefix + "pos_embed"]], dim=1)
    else:
        x = torch.cat(front + [x], dim=1) + sd[prefix + "pos_embed"]
    heads, hd = cfg.num_heads, cfg.width // cfg.num_heads
    for i in range(cfg.feature_layer % cfg.depth + 1):
        bp = f"{prefix}blocks.{i}."
        h = _layer_norm(x, sd, bp + "norm1", cfg.ln_eps)
        qkv = F.linear(h, sd[bp + "attn.qkv.weight"], sd[bp + "attn.qkv.bias"])
        q, k, v = qkv.reshape(n, -1, 3, heads, hd).permute(2, 0, 3, 1, 4)
        o = _attention(q, k, v).transpose(1, 2).reshape(n, -1, cfg.width)
        o = F.linear(o, sd[bp + "attn.proj.weight"], sd[bp + "attn.proj.bias"])
        x = x + (o * sd[bp + "ls1.scale_factor"] if cfg.layer_scale else o)
        if film is not None:  # FiLM between attention and MLP
            gamma = F.linear(film, sd[bp + "film_scale.weight"], sd[bp + "film_scale.bias"])
            beta = F.linear(film, sd[bp + "film_shift.weight"], sd[bp + "film_shift.bias"])
            x = x * (1 + gamma[:, None]) + beta[:, None]
        h = _layer_norm(x, sd, bp + "norm2", cfg.ln_eps)
        h = F.gelu(F.linear(h, sd[bp + "mlp.fc1.weight"], sd[bp + "mlp.fc1.bias"]))
        h = F.linear(h, sd[bp + "mlp.fc2.weight"], sd[bp + "mlp.fc2.bias"])
        x = x + (h * sd[bp + "ls2.scale_factor"] if cfg.layer_scale else h)
    return x[:, cfg.num_prefix_tokens :]


def _head(sd, x):
    """OFT's MLP-ResNet (shared/oft.md) on one chunk step's concatenated hidden states."""

    def ln(t, name):
        return F.layer_norm(t, t.shape[-1:], sd[name + ".weight"], sd[name + ".bias"])

    def lin(t, name):
        return F.linear(t, sd[name + ".weight"], sd[name + ".bias"])

    x = F.relu(lin(ln(x, "action_head.norm_in"), "action_head.proj_in"))
    for i in range(OFT.head_blocks):
        block = f"action_head.blocks.{i}"
        x = x + F.relu(lin(ln(x, f"{block}.norm"), f"{block}.linear"))
    return lin(ln(x, "action_head.norm_out"), "action_head.proj_out")


def reference_actions(sd, config, mb):
    """Normalised chunks ``(b, K, D)`` of OFT's forward, written out."""
    oft, t = config.oft, config.text
    ids, attn, slots = mb["input_ids"], mb["attention_mask"], mb["action_mask"]
    b = ids.shape[0]
    emb = sd["language_model.model.embed_tokens.weight"][ids]  # (b, t, h)
    keep = ~slots
    film = None
    if oft.film:  # the mean embedding of the text: no action slot, no padding
        film = torch.stack([emb[i][keep[i] & attn[i]].mean(0) for i in range(b)])  # (b, h)
    patches = []
    for img in mb["pixel_values"].split(6, dim=1):  # each image through both towers
        a = _vit(sd, "vision_backbone.featurizer.", config.vision[0], img[:, :3], film)
        f = _vit(sd, "vision_backbone.fused_featurizer.", config.vision[1], img[:, 3:], film)
        patches.append(torch.cat([a, f], dim=2))
    x = torch.cat(patches, dim=1)  # (b, n P, w)
    for i, act in ((1, True), (2, True), (3, False)):
        x = F.linear(x, sd[f"projector.fc{i}.weight"], sd[f"projector.fc{i}.bias"])
        x = F.gelu(x) if act else x
    p = F.gelu(
        F.linear(
            mb["proprio"], sd["proprio_projector.fc1.weight"], sd["proprio_projector.fc1.bias"]
        )
    )
    p = F.linear(p, sd["proprio_projector.fc2.weight"], sd["proprio_projector.fc2.bias"])
    x = torch.cat([x, p[:, None]], dim=1)  # the proprio token after the patches
    emb = emb * keep[..., None]  # empty action slots
    h = torch.cat([emb[:, :1], x, emb[:, 1:]], dim=1)
    mask = torch.cat([attn[:, :1], torch.ones(b, x.shape[1], dtype=torch.bool), attn[:, 1:]], 1)
    s = h.shape[1]
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
        o = _attention(q, k, v, mask).transpose(1, 2).reshape(b, s, -1)  # bidirectional
        h = h + F.linear(o, sd[lp + "self_attn.o_proj.weight"])
        a = _rms(h, sd[lp + "post_attention_layernorm.weight"], t.rms_norm_eps)
        gate, up = (
            F.linear(a, sd[lp + "mlp.gate_proj.weight"]),
            F.linear(a, sd[lp + "mlp.up_proj.weight"]),
        )
        h = h + F.linear(F.silu(gate) * up, sd[lp + "mlp.down_proj.weight"])
    h = _rms(h, sd["language_model.model.norm.weight"], t.rms_norm_eps)
    prefix = x.shape[1]
    out = []
    for i in range(b):
        where = torch.nonzero(slots[i]).flatten() + prefix  # the slots in the sequence
        rows = h[i, where - 1]  # one position before each slot
        out.append(_head(sd, rows.reshape(oft.chunk, -1)))
    return torch.stack(out)  # (b, K, D)


# -------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def setup():
    config = _config()
    model = OpenVLA(config.with_options(fused_projections=False))
    model.init_weights(SEED, perturbed_init)
    model.return_hidden = True
    return config, model, _batch(config)


def _model_actions(model, mb):
    from parallax.families.openvla.oft.batches import stage_inputs

    hidden = model(*stage_inputs(model.config, mb))  # (b, S, h)
    cfg = model.config
    rows = head_rows(mb["prompt_lengths"], hidden.shape[1], cfg.prefix_tokens, cfg.oft.slots)
    return model.oft_actions(hidden.flatten(0, 1)[rows])


def test_batch_layout_is_prompt_slots_stop_then_padding(setup):
    config, _, mb = setup
    tok = TinyTokenizer()
    lengths = [len(prompt_ids(tok, t)) for t in ("pick up the red block", "go left")]
    assert mb["prompt_lengths"].tolist() == lengths
    slots = config.oft.slots
    for i, n in enumerate(lengths):
        real = n + slots + 1
        assert mb["input_ids"][i, n + slots].item() == tok.eos_id  # the stop token
        assert mb["attention_mask"][i].tolist() == [True] * real + [False] * (
            mb["input_ids"].shape[1] - real
        )
        assert torch.nonzero(mb["action_mask"][i]).flatten().tolist() == list(range(n, n + slots))
    assert mb["pixel_values"].shape[1] == 12 and mb["proprio"].shape == (2, 3)


def test_actions_loss_and_gradients_match_the_reference(setup):
    config, model, mb = setup
    model.zero_grad()
    got = _model_actions(model, mb)
    loss = (got - mb["actions"]).abs().mean()
    loss.backward()
    sd = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    want = reference_actions(sd, config, mb)
    ref_loss = (want - mb["actions"]).abs().mean()
    ref_loss.backward()
    assert_rel_close(got, want, msg="actions")
    assert_rel_close(loss, ref_loss, msg="L1 loss")
    for name, p in model.named_parameters():
        if sd[name].grad is None:  # the lm_head and the unread parts
            assert p.grad is None or not p.grad.any(), name
            continue
        assert_rel_close(p.grad, sd[name].grad, rel=1e-4, msg=f"grad {name}")
    assert sd["language_model.lm_head.weight"].grad is None
    assert sd["action_head.proj_in.weight"].grad.abs().sum() > 0


@pytest.mark.parametrize("film", [False, True])
def test_padding_does_not_change_a_sample(film):
    """The short prompt, padded in the batch, gives the same actions alone: the padding's
    keys are masked, and FiLM's mean leaves the padding out."""
    cfg = _config(film=film)
    model = OpenVLA(cfg)
    model.init_weights(SEED, perturbed_init)
    model.return_hidden = True
    samples = _samples(cfg)
    both, alone = _batch(cfg, samples), _batch(cfg, samples[1:])
    assert not both["attention_mask"][1].all()  # the second sample is padded
    with torch.no_grad():
        in_batch = _model_actions(model, both)[1]
        single = _model_actions(model, alone)[0]
        ref = reference_actions(dict(model.state_dict()), cfg, both)[1]
    assert_rel_close(single, in_batch, msg="padded vs alone")
    assert_rel_close(in_batch, ref, msg="reference")
