"""LLaVA-NeXT checkpoints: tiny checkpoints written here with plain safetensors in the llava-hf,
transformers 5.x and original LLaVA naming schemes (../shared/models.md 1.4), loaded at tp=1 and
tp=2 (same logits, each rank reading only its slices), an unknown layout refused, and export as
llava-hf followed by a reload."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallax import comm
from parallax.families.llava_next.model import LlavaNext
from parallax.testing import context, run_ranks
from tests.families.llava_next.helpers import LM, V, hf_tensors, make_batch, ref_llava, tiny_config
from tests.families.openvla.helpers import assert_rel_close

EMBED, HEAD = LM + "embed_tokens.weight", "language_model.lm_head.weight"
RENAMES = {  # llava-hf name prefix -> the other layouts' (models.md 1.4)
    "transformers-5": [
        (V, "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("image_newline", "model.image_newline"),
        (LM, "model.language_model."),
        (HEAD, "lm_head.weight"),
    ],
    "original": [
        (V, "model.vision_tower.vision_tower.vision_model."),
        ("multi_modal_projector.linear_1.", "model.mm_projector.0."),
        ("multi_modal_projector.linear_2.", "model.mm_projector.2."),
        ("image_newline", "model.image_newline"),
        (LM, "model."),
        (HEAD, "lm_head.weight"),
    ],
}
RENAMES["transformers-5-flat"] = [(V, "model.vision_tower.")] + RENAMES["transformers-5"][1:]


def _rename(name, layout):
    for old, new in RENAMES.get(layout, []):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _original_config(cfg):
    v, t = cfg.vision, cfg.text
    return {
        "architectures": ["LlavaLlamaForCausalLM"],
        "model_type": "llava_llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_attention_heads,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": 128,
        "mm_vision_tower": "parallax-tiny-clip",
        "parallax_vision_config": {
            "hidden_size": v.width,
            "intermediate_size": v.mlp_hidden,
            "num_hidden_layers": v.depth,
            "num_attention_heads": v.num_heads,
            "image_size": v.image_size,
            "patch_size": v.patch_size,
        },
        "mm_projector_type": "mlp2x_gelu",
        "mm_patch_merge_type": "spatial_unpad",
        "image_aspect_ratio": "anyres",
        "image_grid_pinpoints": [[w, h] for h, w in cfg.image_grid_pinpoints],  # (width, height)
        "mm_vision_select_layer": -2,
        "mm_vision_select_feature": "patch",
        "tokenizer_model_max_length": 512,
        "parallax_tokenizer": "tiny",
    }


def write_checkpoint(directory, cfg, sd, layout):
    """``sd`` (llava-hf names) in ``layout``, bf16, two shards with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in sd.items():
        if layout == "original" and name in (EMBED, HEAD):
            t = t[:128]  # the original vocabulary has no <image>, <pad> or padding rows
        tensors[_rename(name, layout)] = t.to(torch.bfloat16)
    shards = [{}, {}]
    for name, t in tensors.items():
        shards["layers.1." in name or "lm_head" in name][name] = t
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = _original_config(cfg) if layout == "original" else cfg.to_dict()
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


LAYOUTS = ["llava-hf", "transformers-5", "transformers-5-flat", "original"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cfg = tiny_config(vocab=192)
    sd = hf_tensors(cfg)
    root = tmp_path_factory.mktemp("llava-ckpt")
    written = {lay: write_checkpoint(root / lay, cfg, sd, lay) for lay in LAYOUTS}
    batch = make_batch(cfg)
    args = batch["pixel_values"], batch["input_ids"], batch["image_sizes"]
    return root, cfg, sd, written, args


def _param_bytes(model):
    return sum(p.numel() * 2 for p in model.parameters())


def test_each_layout_loads_at_tp1(checkpoints):
    root, cfg, sd, written, args = checkpoints
    ref = ref_llava(sd, cfg, *args)
    for layout in LAYOUTS:
        model = LlavaNext.from_pretrained(root / layout, dtype=torch.float32)
        assert model.config.vocab_size == 192 and model.config.image_token_index == 128
        with torch.no_grad():
            logits = model(*args)
        added = 2 * 64 * cfg.text.hidden_size * 2 if layout == "original" else 0
        assert model.load_stats.bytes_read == _param_bytes(model) - added, layout
        unused = [f"{V}encoder.layers.2.self_attn.q_proj.weight", f"{V}post_layernorm.weight"]
        assert all(n in model.hf_unused for n in unused)  # under llava-hf names, to write back
        if layout != "original":
            assert_rel_close(logits, ref, msg=layout)
            continue
        # the added rows: deterministic, a draw around the embedding's mean (models.md 1.4)
        embed = model.language_model.model.embed_tokens.weight.detach()
        head = model.language_model.lm_head.weight.detach()
        assert torch.equal(embed[:128], sd[EMBED][:128]) and torch.equal(head[:128], sd[HEAD][:128])
        mu, spread = sd[EMBED][:128].mean(0), sd[EMBED][:128].std(0)
        for new in (embed[128:], head[128:]):
            dev = (new - mu).abs() / spread  # about sqrt(1e-5) of the rows' own spread
            assert 1e-4 < dev.mean().item() < 1e-2
        assert not torch.equal(embed[128:], head[128:])
        again = LlavaNext.from_pretrained(root / layout, dtype=torch.float32)
        assert torch.equal(again.language_model.lm_head.weight, model.language_model.lm_head.weight)
        sd_full = {**sd, EMBED: embed, HEAD: head}
        assert_rel_close(logits, ref_llava(sd_full, cfg, *args), msg=layout)


def _tp2_load(root, ref_by_layout, args):
    ctx = context(tp=2)
    out = {}
    for layout, ref in ref_by_layout.items():
        model = LlavaNext.from_pretrained(root / layout, ctx, dtype=torch.float32)
        shard = ref.shape[-1] // 2
        with torch.no_grad():
            logits = model(*args)
        assert_rel_close(
            logits, ref[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard], msg=layout
        )
        out[layout] = (model.load_stats.bytes_read, _param_bytes(model))
    return out


def test_each_layout_loads_at_tp2_reading_its_half(checkpoints):
    root, cfg, sd, written, args = checkpoints
    refs = {}
    for layout in LAYOUTS:
        with torch.no_grad():
            refs[layout] = LlavaNext.from_pretrained(root / layout, dtype=torch.float32)(*args)
    results = run_ranks(_tp2_load, 2, root, refs, args)
    total = sum(t.numel() * 2 for t in written["llava-hf"].values())
    h = cfg.text.hidden_size
    for rank, result in enumerate(results):
        for layout, (read, local) in result.items():
            # rank 1 holds rows 96..191: the 64 added rows of embedding and lm_head are made
            added = 2 * 64 * h * 2 if layout == "original" and rank == 1 else 0
            assert read == local - added, (rank, layout)
            assert 0.4 < read / total < 0.75  # about half: norms and biases are read whole


def test_unknown_or_inconsistent_layout_fails(checkpoints, tmp_path):
    root, cfg, sd, written, args = checkpoints
    save_file(
        {"encoder." + k: v.to(torch.bfloat16) for k, v in sd.items()},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(ValueError, match="unknown LLaVA-NeXT layout"):
        LlavaNext.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_original_config(cfg)))
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match="the original LLaVA config but the tensors are in the llava-hf layout"
    ):
        LlavaNext.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in sd.items() if "model.layers.1.mlp" not in k},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="3 missing tensors: language_model.model.layers.1.mlp"):
        LlavaNext.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="neither a llava-hf LLaVA-NeXT config"):
        LlavaNext.from_pretrained(tmp_path)


def test_export_writes_llava_hf_and_reloads(checkpoints, tmp_path):
    root, cfg, sd, written, args = checkpoints
    for layout in ("transformers-5", "original"):
        model = LlavaNext.from_pretrained(
            root / layout, dtype=torch.float32, fused_projections=True
        )
        with torch.no_grad():  # the added rows are float32 until written as bf16
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
        out = tmp_path / layout
        model.save_pretrained(out, max_shard_size=200_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        saved = {}
        for file in set(index["weight_map"].values()):
            saved.update(load_file(str(out / file)))
        assert saved.keys() == written["llava-hf"].keys()
        for name, t in saved.items():
            if layout == "original" and name in (EMBED, HEAD):
                assert torch.equal(t[:128], written["llava-hf"][name][:128])
                assert t.shape == (192, cfg.text.hidden_size)
            else:
                assert torch.equal(t, written["llava-hf"][name]), (layout, name)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "llava_next" and config["text_config"]["vocab_size"] == 192
        back = LlavaNext.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            assert_rel_close(back(*args), model(*args), msg=f"reload of {layout}")


def _tp2_pp2_run(model, ctx, ref, args):
    b, t = args[1].shape
    with torch.no_grad():
        if ctx.is_first_stage:
            comm.batch_send_recv([(model(*args).contiguous(), ctx.pp_next)], [], ctx.world_group)
        else:
            hidden = torch.empty(b, t, model.config.text.hidden_size)
            comm.batch_send_recv([], [(hidden, ctx.pp_prev)], ctx.world_group)
            shard = ref.shape[-1] // 2
            assert_rel_close(
                model(hidden), ref[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard]
            )


def _tp2_pp2_load_and_save(root, out, refs, args):
    ctx = context(tp=2, pp=2)
    blocks = range(0, 2) if ctx.is_first_stage else range(2, 4)
    read = {}
    for layout, ref in refs.items():
        model = LlavaNext.from_pretrained(root / layout, ctx, dtype=torch.float32, blocks=blocks)
        _tp2_pp2_run(model, ctx, ref, args)
        read[layout] = model.load_stats.bytes_read
    model.save_pretrained(out, max_shard_size=100_000)  # the llava-hf one, loaded last
    return read, _param_bytes(model), ctx.is_last_stage


def test_tp2_pp2_reads_its_slices_and_saves_the_same_checkpoint(checkpoints, tmp_path):
    root, cfg, sd, written, args = checkpoints
    refs = {}
    for layout in ("original", "llava-hf"):
        with torch.no_grad():
            refs[layout] = LlavaNext.from_pretrained(root / layout, dtype=torch.float32)(*args)
    results = run_ranks(_tp2_pp2_load_and_save, 4, root, tmp_path, refs, args)
    h = cfg.text.hidden_size
    for rank, (read, local, last) in enumerate(results):
        assert read["llava-hf"] == local
        # the last stage makes lm_head's added rows from the embedding's rows (its tp slice)
        tp_rank = rank % 2
        extra = 96 * h * 2 if last and tp_rank == 0 else 32 * h * 2 if last else 0
        made = 64 * h * 2 if tp_rank == 1 else 0
        assert read["original"] == local - made + extra, rank
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    saved = {}
    for file in set(index["weight_map"].values()):
        saved.update(load_file(str(tmp_path / file)))
    assert saved.keys() == written["llava-hf"].keys()
    for name, t in written["llava-hf"].items():
        assert torch.equal(saved[name], t), name
    assert index["metadata"]["total_size"] == sum(math.prod(t.shape) * 2 for t in saved.values())
