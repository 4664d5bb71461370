"""Hugging Face checkpoint I/O: a tiny checkpoint in the exact OpenVLA layout (names, shapes,
three bf16 shards with an index, the unused tensors included), written here with plain
``safetensors.torch.save_file``, loaded at several layouts, saved back and reloaded."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallax import comm
from parallax.families.openvla.model import OpenVLA
from parallax.tensor import unshard_tensor
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import (
    SEED,
    assert_rel_close,
    make_batch,
    perturbed_init,
    tiny_config,
)

DINO, SIGLIP = "vision_backbone.featurizer.", "vision_backbone.fused_featurizer."


def _unused_tensors(cfg) -> dict[str, tuple]:
    """The checkpoint-only tensors of the tiny towers, listed from the checkpoint description:
    the last block of each tower (the features come from the penultimate one), each tower's
    final norm, and SigLIP's attention-pool head."""
    out = {}
    for prefix, v, layer_scale in ((DINO, cfg.vision[0], True), (SIGLIP, cfg.vision[1], False)):
        w, f, b = v.width, v.mlp_hidden, f"{prefix}blocks.{v.depth - 1}."
        block = {
            "norm1.weight": (w,),
            "norm1.bias": (w,),
            "attn.qkv.weight": (3 * w, w),
            "attn.qkv.bias": (3 * w,),
            "attn.proj.weight": (w, w),
            "attn.proj.bias": (w,),
            "norm2.weight": (w,),
            "norm2.bias": (w,),
            "mlp.fc1.weight": (f, w),
            "mlp.fc1.bias": (f,),
            "mlp.fc2.weight": (w, f),
            "mlp.fc2.bias": (w,),
        }
        if layer_scale:
            block.update({"ls1.scale_factor": (w,), "ls2.scale_factor": (w,)})
        out.update({b + k: s for k, s in block.items()})
        out.update({prefix + "norm.weight": (w,), prefix + "norm.bias": (w,)})
    w, f = cfg.vision[1].width, cfg.vision[1].mlp_hidden
    pool = {
        "latent": (1, 1, w),
        "q.weight": (w, w),
        "q.bias": (w,),
        "kv.weight": (2 * w, w),
        "kv.bias": (2 * w,),
        "proj.weight": (w, w),
        "proj.bias": (w,),
        "norm.weight": (w,),
        "norm.bias": (w,),
        "mlp.fc1.weight": (f, w),
        "mlp.fc1.bias": (f,),
        "mlp.fc2.weight": (w, f),
        "mlp.fc2.bias": (w,),
    }
    out.update({f"{SIGLIP}attn_pool.{k}": s for k, s in pool.items()})
    return out


def write_hf_checkpoint(directory: Path, cfg) -> dict[str, torch.Tensor]:
    """Write the checkpoint; return every tensor written (bf16), by name."""
    model = OpenVLA(cfg)
    model.init_weights(SEED, perturbed_init)
    tensors = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    for name, shape in _unused_tensors(cfg).items():
        tensors[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
    shards = [{}, {}, {}]
    for name, t in tensors.items():
        late_layer = (
            name.startswith("language_model.model.layers.") and int(name.split(".")[3]) >= 2
        )
        i = (
            0
            if name.startswith("vision_backbone.")
            else 2
            if late_layer or "lm_head" in name
            else 1
        )
        shards[i][name] = t
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * 2 for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(cfg.to_dict()))
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return tensors


def expected_logits(cfg, tensors, px, ids) -> torch.Tensor:
    """Logits of a tp=1 float32 model holding the checkpoint's values (set by plain
    ``load_state_dict``, independent of the loader under test)."""
    model = OpenVLA(cfg)
    model.load_state_dict(
        {n: t.float() for n, t in tensors.items() if n in dict(model.named_parameters())}
    )
    with torch.no_grad():
        return model(px, ids)


def _checkpoint(directory, cfg):
    tensors = write_hf_checkpoint(directory, cfg)
    px, ids, labels = make_batch(cfg)
    return directory, cfg, tensors, (px, ids, labels), expected_logits(cfg, tensors, px, ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("openvla-tiny-hf"), tiny_config())


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """The tiny model with a 128-wide language model: like OpenVLA-7B, where the language model
    is 90% of the weights, the two halves of a 2-stage split then hold similar byte counts (the
    tiny preset's towers and embeddings are a third of its weights)."""
    cfg = tiny_config()
    cfg = replace(cfg, text=replace(cfg.text, hidden_size=128, intermediate_size=352))
    return _checkpoint(tmp_path_factory.mktemp("openvla-wide-hf"), cfg)


def test_checkpoint_matches_the_described_layout(checkpoint):
    directory, cfg, tensors, _, _ = checkpoint
    from parallax.families.openvla.checkpoint import expected_tensors, unused_tensors

    want = {**expected_tensors(OpenVLA(cfg, None, device="meta")), **unused_tensors(cfg)}
    assert {n: tuple(t.shape) for n, t in tensors.items()} == want
    assert unused_tensors(cfg) == _unused_tensors(cfg)


def test_load_tp1_whole_and_staged(checkpoint):
    directory, cfg, tensors, (px, ids, _), ref = checkpoint
    model = OpenVLA.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(px, ids), ref)
    assert model.config.norm_stats == cfg.norm_stats
    params_bytes = sum(p.numel() * 2 for p in model.parameters())
    assert model.load_stats.bytes_read == params_bytes
    unused = _unused_tensors(cfg)
    assert set(model.hf_unused) == set(unused)  # rank 0 keeps them to write them back

    fused = OpenVLA.from_pretrained(directory, dtype=torch.float32, fused_projections=True)
    assert hasattr(fused.language_model.model.layers["0"].self_attn, "qkv_proj")
    with torch.no_grad():
        assert_rel_close(fused(px, ids), ref, msg="fused logits")

    stages = [
        OpenVLA.from_pretrained(directory, dtype=torch.float32, blocks=r)
        for r in (range(0, 2), range(2, 6))
    ]
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](px, ids)), ref)
    assert sum(s.load_stats.bytes_read for s in stages) == params_bytes


def _load_tp2(directory, ref, px, ids, labels):
    ctx = context(tp=2)
    shard = ref.shape[-1] // 2
    mine = ref[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard]
    grads = {}
    for fused in (False, True):
        model = OpenVLA.from_pretrained(
            directory, ctx, dtype=torch.float32, fused_projections=fused
        )
        logits = model(px, ids)
        assert_rel_close(logits, mine, msg=f"fused={fused} logits")
        model.loss(logits, labels).backward()
        full = {}
        for name, p in model.named_parameters():
            g = (
                p.grad
                if not hasattr(p, "tp_shard")
                else unshard_tensor(p.grad, p.tp_shard, ctx.tp_group)
            )
            for part, piece in (
                zip(("q_proj", "k_proj", "v_proj"), g.chunk(3)) if "qkv_proj" in name else ()
            ):
                full[name.replace("qkv_proj", part)] = piece
            for part, piece in (
                zip(("gate_proj", "up_proj"), g.chunk(2)) if "gate_up_proj" in name else ()
            ):
                full[name.replace("gate_up_proj", part)] = piece
            if "qkv_proj" not in name and "gate_up_proj" not in name:
                full[name] = g
        grads[fused] = full
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        assert_rel_close(grads[True][name], g, msg=name)
    return model.load_stats.bytes_read


def test_load_at_tp2_fused_and_unfused(checkpoint):
    directory, cfg, tensors, (px, ids, labels), ref = checkpoint
    read = run_ranks(_load_tp2, 2, directory, ref, px, ids, labels)
    assert read[0] == read[1]


def _load_tp2_pp2_and_save(directory, out, ref, px, ids):
    ctx = context(tp=2, pp=2)
    blocks = range(0, 2) if ctx.is_first_stage else range(2, 6)  # split by bytes
    model = OpenVLA.from_pretrained(directory, ctx, dtype=torch.float32, blocks=blocks)
    local_bytes = sum(p.numel() * 2 for p in model.parameters())
    b, s, h = ref.shape[0], ref.shape[1], model.config.text.hidden_size
    with torch.no_grad():
        if ctx.is_first_stage:
            comm.batch_send_recv([(model(px, ids).contiguous(), ctx.pp_next)], [], ctx.world_group)
        else:
            hidden = torch.empty(b, s, h)
            comm.batch_send_recv([], [(hidden, ctx.pp_prev)], ctx.world_group)
            shard = ref.shape[-1] // 2
            mine = ref[..., ctx.tp_rank * shard : (ctx.tp_rank + 1) * shard]
            assert_rel_close(model(hidden), mine, msg="tp2 pp2 logits")
    model.save_pretrained(out, max_shard_size=300_000)
    return model.load_stats.bytes_read, local_bytes, model.block_names


def test_tp2_pp2_reads_a_quarter_and_saves_the_same_checkpoint(wide_checkpoint, tmp_path):
    directory, cfg, tensors, (px, ids, _), ref = wide_checkpoint
    results = run_ranks(_load_tp2_pp2_and_save, 4, directory, tmp_path, ref, px, ids)
    total = sum(t.numel() * 2 for t in tensors.values())  # every byte in the checkpoint
    for read, local, blocks in results:
        assert read == local, blocks  # exactly this rank's slices, nothing else
        # about a quarter each: tp halves a stage's matrices, pp halves the blocks (norms,
        # biases, position and patch embeddings are read whole by both tp ranks)
        assert 0.2 < read / total < 0.3, (read / total, blocks)
    assert results[0][2] == ["vision", "llm.0"] and results[2][2][-1] == "head"

    # the saved checkpoint holds exactly the original tensors, bit for bit
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    saved = {}
    for file in set(index["weight_map"].values()):
        saved.update(load_file(str(tmp_path / file)))
    assert saved.keys() == tensors.keys()
    for name, t in tensors.items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], t), name
    assert index["metadata"]["total_size"] == total
    assert json.loads((tmp_path / "config.json").read_text())["norm_stats"] == cfg.norm_stats
    assert (tmp_path / "generation_config.json").is_file()
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind

    reloaded = OpenVLA.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(px, ids), ref)


def test_save_from_scratch_round_trips(tmp_path):
    cfg = tiny_config(fused_projections=True)
    model = OpenVLA(cfg, seed=3)
    px, ids, _ = make_batch(cfg)
    model.save_pretrained(tmp_path)  # one file: no index
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    back = OpenVLA.from_pretrained(tmp_path, dtype=torch.float32, fused_projections=True)
    with torch.no_grad():
        model_bf16 = OpenVLA(cfg)
        model_bf16.load_state_dict(
            {n: p.to(torch.bfloat16).float() for n, p in model.state_dict().items()}
        )
        assert torch.equal(back(px, ids), model_bf16(px, ids))
    # the unused tensors are written with neutral values so strict loaders accept the file
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(
        saved[SIGLIP + "norm.weight"], torch.ones(cfg.vision[1].width, dtype=torch.bfloat16)
    )


def _broken(checkpoint, tmp_path, how):
    directory = checkpoint[0]
    target = tmp_path / how
    shutil.copytree(directory, target)
    shard = target / "model-00002-of-00003.safetensors"
    if how == "missing":
        t = load_file(str(shard))
        del t["language_model.model.layers.1.mlp.up_proj.weight"]
        save_file(t, str(shard))
    elif how == "shape":
        t = load_file(str(shard))
        t["projector.fc2.weight"] = t["projector.fc2.weight"][:, :-1].contiguous()
        save_file(t, str(shard))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "no-shard":
        shard.unlink()
    return target


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", "missing tensors: language_model.model.layers.1.mlp.up_proj.weight"),
        ("shape", re.escape("projector.fc2.weight has shape [64, 319], expected [64, 320]")),
        ("truncated", "cannot read checkpoint shard .*model-00002-of-00003.safetensors"),
        ("no-shard", "checkpoint shard .*model-00002-of-00003.safetensors is missing"),
    ],
)
def test_bad_checkpoints_fail_clearly(checkpoint, tmp_path, how, message):
    with pytest.raises(ValueError, match=message):
        OpenVLA.from_pretrained(_broken(checkpoint, tmp_path, how), dtype=torch.float32)


def _load_error(directory):
    ctx = context(pp=2)  # stage 1 does not need layer 1, yet fails the same way
    try:
        OpenVLA.from_pretrained(directory, ctx)
    except ValueError as err:
        return str(err)
    return None


def test_bad_checkpoint_fails_on_every_rank(checkpoint, tmp_path):
    errors = run_ranks(_load_error, 2, _broken(checkpoint, tmp_path, "missing"), timeout=60)
    assert all(e and "layers.1.mlp.up_proj.weight" in e for e in errors)


def test_read_param_assembles_fused_and_padded_slices(tmp_path):
    from parallax.models.hf_io import CheckpointReader
    from parallax.models.hf_io import read_param as _read_param
    from parallax.tensor import TPShard, shard_tensor

    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(6, 4, generator=g) for n in ("q", "k", "v")}
    t["vocab"] = torch.randn(10, 4, generator=g)
    save_file(t, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    fused = torch.cat([t["q"], t["k"], t["v"]])
    sources = [(n, (6, 4)) for n in "qkv"]
    for rank in range(2):  # q, k, v stored apart, held fused: rank r takes its rows of each
        info = TPShard(0, 18, 18, rank, 2, partitions=3)
        assert torch.equal(_read_param(reader, sources, info), shard_tensor(fused, info))
        row = TPShard(1, 4, 4, rank, 2)  # a row-parallel slice of the columns
        assert torch.equal(_read_param(reader, [("q", (6, 4))], row), shard_tensor(t["q"], row))
    pad = TPShard(0, 10, 12, 1, 2)  # vocabulary padded to a multiple of tp: zero rows
    got = _read_param(reader, [("vocab", (10, 4))], pad)
    assert torch.equal(got, shard_tensor(t["vocab"], pad)) and got[-2:].abs().sum() == 0
    assert reader.stats.bytes_read == 4 * (2 * 3 * 12 + 2 * 12 + 4 * 4)  # slices only


def _save_incomplete(out):
    ctx = context(pp=2)
    model = OpenVLA(tiny_config(), ctx, blocks=range(0, 2))  # both ranks hold stage 0 only
    try:
        model.save_pretrained(out)
    except ValueError as err:
        return str(err)
    return None


def test_saving_stages_that_do_not_cover_the_model_fails_on_every_rank(tmp_path):
    errors = run_ranks(_save_incomplete, 2, tmp_path, timeout=60)
    assert all(e and "do not hold the whole model exactly once" in e for e in errors)
    assert not list(tmp_path.glob("*.safetensors"))
