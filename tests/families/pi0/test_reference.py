"""pi0 and pi0.5 at tp 1 against a plain reference written here from ``shared/pi0.md``.

The reference shares only the weights (the model's state dict, every parameter perturbed so
that each matters) and the inputs: SigLIP per camera with plain tensor ops, the projector, the
token embeddings times sqrt(width), one joint sequence of both streams' tokens with the mask
built entry by entry from the block flags and the padding (the finite mask value added), the
positions counted by hand, Gemma's norms ``rms(x) (1 + w)`` (pi0.5's expert: adaptive, with
gated residuals), GeGLU MLPs, multi-query attention in one softmax over both streams, and the
expert's last H outputs through the output head. Float32: agreement to about 1e-5."""

import math

import pytest
import torch
import torch.nn.functional as F

from parallax.families.pi0.objective import flow_matching_loss, flow_terms
from tests.families.pi0.helpers import inputs, tiny_model

MASK = -2.3819763e38


def _ln(x, sd, name, eps=1e-6):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def _lin(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd.get(f"{name}.bias", 0)


def _siglip(sd, cfg, img):
    """One camera ``(b, 3, S, S)`` -> ``(b, patches, w)``: SigLIP, post-layernorm, no pool."""
    x = F.conv2d(
        img,
        sd["vision.patch_embed.proj.weight"],
        sd["vision.patch_embed.proj.bias"],
        stride=cfg.patch_size,
    )
    x = x.flatten(2).transpose(1, 2) + sd["vision.pos_embed"]
    b, n, w = x.shape
    nh, hd = cfg.num_heads, w // cfg.num_heads
    for i in range(cfg.depth):
        p = f"vision.blocks.{i}"
        h = _ln(x, sd, f"{p}.norm1")
        q, k, v = _lin(h, sd, f"{p}.attn.qkv").view(b, n, 3, nh, hd).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = x + _lin(a.transpose(1, 2).reshape(b, n, w), sd, f"{p}.attn.proj")
        h = F.gelu(_lin(_ln(x, sd, f"{p}.norm2"), sd, f"{p}.mlp.fc1"), approximate="tanh")
        x = x + _lin(h, sd, f"{p}.mlp.fc2")
    return _ln(x, sd, "vision.norm")


def _norm(x, sd, name, cond):
    """Gemma's RMSNorm, or pi0.5's adaptive one: ``(out, gate)``."""
    r = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    if f"{name}.weight" in sd:
        return r * (1 + sd[f"{name}.weight"]), None
    scale, shift, gate = _lin(cond, sd, f"{name}.dense").chunk(3, -1)
    return r * (1 + scale[:, None]) + shift[:, None], gate[:, None]


def _rotary(x, pos, hd):
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos[:, None, :, None].float() * inv  # (b, 1, s, hd/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _temb(t, w):
    frac = torch.linspace(0, 1, w // 2, dtype=torch.float64)
    period = 4e-3 * (4.0 / 4e-3) ** frac
    ang = t.double()[:, None] * 2 * math.pi / period
    return torch.cat([ang.sin(), ang.cos()], -1).float()


def _mask_and_positions(pad, flags):
    """Entry by entry: query i sees key j when cum[j] <= cum[i] and both real."""
    b, n = pad.shape
    cum = torch.cumsum(flags, 0)
    bias = torch.full((b, 1, n, n), MASK)
    pos = torch.zeros(b, n, dtype=torch.long)
    for s in range(b):
        count = 0
        for i in range(n):
            count += int(pad[s, i])
            pos[s, i] = count - 1
            for j in range(n):
                if cum[j] <= cum[i] and pad[s, i] and pad[s, j]:
                    bias[s, 0, i, j] = 0.0
    return bias, pos


def reference_velocity(model, x, x_t, t):
    c, sd = model.config, {k: v.detach() for k, v in model.state_dict().items()}
    b, n = x["images"].shape[:2]
    cams = [_lin(_siglip(sd, c.vision, x["images"][:, i]), sd, "projector") for i in range(n)]
    text = sd["embed_tokens.weight"][x["tokens"]] * math.sqrt(c.prefix.width)
    prefix = torch.cat([*cams, text], 1)
    p = cams[0].shape[1]
    pad = torch.cat([x["image_masks"].repeat_interleave(p, 1), x["token_mask"]], 1)
    temb = _temb(t, c.expert.width)
    acts = _lin(x_t, sd, "action_in_proj")
    if c.pi05:
        cond = F.silu(_lin(F.silu(_lin(temb, sd, "time_mlp_in")), sd, "time_mlp_out"))
        suffix, flags = acts, [1] + [0] * (c.chunk - 1)
    else:
        cond = None
        mix = torch.cat([acts, temb[:, None].expand_as(acts)], -1)
        acts = _lin(F.silu(_lin(mix, sd, "action_time_mlp_in")), sd, "action_time_mlp_out")
        suffix = torch.cat([_lin(x["state"], sd, "state_proj")[:, None], acts], 1)
        flags = [1, 1] + [0] * (c.chunk - 1)
    np_ = prefix.shape[1]
    flags = torch.tensor([0] * np_ + flags)
    pad = torch.cat([pad, torch.ones(b, suffix.shape[1], dtype=torch.bool)], 1)
    bias, pos = _mask_and_positions(pad, flags)
    hd, nh = c.prefix.head_dim, c.prefix.heads
    streams = [("prefix", prefix, None), ("expert", suffix, cond)]
    for i in range(c.depth):
        qs, ks, vs, gates = [], [], [], []
        for name, h, cnd in streams:
            pre = f"layers.{i}.{name}"
            y, g = _norm(h, sd, f"{pre}.input_layernorm", cnd)
            s = y.shape[1]
            qs.append(_lin(y, sd, f"{pre}.self_attn.q_proj").view(b, s, nh, hd).transpose(1, 2))
            ks.append(_lin(y, sd, f"{pre}.self_attn.k_proj").view(b, s, 1, hd).transpose(1, 2))
            vs.append(_lin(y, sd, f"{pre}.self_attn.v_proj").view(b, s, 1, hd).transpose(1, 2))
            gates.append(g)
        q, k = _rotary(torch.cat(qs, 2), pos, hd), _rotary(torch.cat(ks, 2), pos, hd)
        v = torch.cat(vs, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) * hd**-0.5 + bias, -1) @ v
        att = att.transpose(1, 2).reshape(b, att.shape[2], nh * hd)
        out, start = [], 0
        for (name, h, cnd), g in zip(streams, gates):
            pre, s = f"layers.{i}.{name}", h.shape[1]
            o = _lin(att[:, start : start + s], sd, f"{pre}.self_attn.o_proj")
            h = h + (o if g is None else o * g)
            y, g2 = _norm(h, sd, f"{pre}.post_attention_layernorm", cnd)
            gate = F.gelu(_lin(y, sd, f"{pre}.mlp.gate_proj"), approximate="tanh")
            m = _lin(gate * _lin(y, sd, f"{pre}.mlp.up_proj"), sd, f"{pre}.mlp.down_proj")
            out.append((name, h + (m if g2 is None else m * g2), cnd))
            start += s
        streams = out
    y, _ = _norm(streams[1][1], sd, "expert_norm", cond)
    return _lin(y[:, -c.chunk :], sd, "action_out_proj")


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_forward_and_objective_match_the_plain_reference(variant):
    model = tiny_model(variant)
    x = inputs(model.config)
    terms = flow_terms(x["actions"], x["noise"], x["time"])
    with torch.no_grad():
        got = model.velocity(
            x["images"],
            x["image_masks"],
            x["tokens"],
            x["token_mask"],
            x["state"],
            terms.x_t,
            terms.time,
        )
        want = reference_velocity(model, x, terms.x_t, terms.time)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        # the objective by hand: x_t, u = noise - actions, MSE over the 6 real dims
        t = x["time"][:, None, None]
        x_t = t * x["noise"] + (1 - t) * x["actions"]
        torch.testing.assert_close(terms.x_t, x_t)
        u = x["noise"] - x["actions"]
        by_hand = ((reference_velocity(model, x, x_t, x["time"]) - u)[..., :6] ** 2).mean()
        loss = flow_matching_loss(model, x, noise=x["noise"], time=x["time"])
        torch.testing.assert_close(loss, by_hand, rtol=1e-5, atol=0)


def test_objective_leaves_the_padded_chunk_steps_out():
    """``action_pad`` (LeRobot's ``action_is_pad``): the loss, its unit count and the sampled
    chunks' error count only the real steps' elements (6 real dims), against a hand sum."""
    from types import SimpleNamespace

    from parallax.families.pi0.objective import FlowMatchingObjective
    from parallax.families.pi0.predict import sample_chunk

    model = tiny_model("pi0")
    x = inputs(model.config)  # b = 2, H = 4
    pad = torch.tensor([[False, False, True, True], [False, False, False, True]])
    mb = {**x, "action_pad": pad, "mean_action": torch.zeros(2, model.config.max_action_dim)}
    obj = FlowMatchingObjective()
    assert obj.loss_units(mb) == (2 + 3) * 6
    velocity = torch.randn(
        2, 4, model.config.max_action_dim, generator=torch.Generator().manual_seed(0)
    )
    u = x["noise"] - x["actions"]
    keep = (~pad)[..., None].float()  # (b, H, 1)
    by_hand = (((velocity - u)[..., :6] ** 2) * keep).sum()
    total, _ = obj.loss(None, velocity, obj.loss_target(None, mb), None, None)
    torch.testing.assert_close(total, by_hand, rtol=1e-6, atol=0)
    with torch.no_grad():
        sums = obj.sampled_sums([model], [mb], SimpleNamespace(device=torch.device("cpu")), None)
        chunk = sample_chunk(model, *(x[k] for k in ("images", "image_masks", "tokens")),
                             x["token_mask"], x["state"], x["noise"])  # fmt: skip
    err = ((chunk - x["actions"])[..., :6].double() ** 2) * keep.double()
    mean_err = (x["actions"][..., :6].double() ** 2) * keep.double()
    torch.testing.assert_close(
        sums, torch.stack([err.sum(), mean_err.sum(), torch.tensor(30.0).double()])
    )
