"""The PEFT-format adapter of the tiny OpenVLA: key names and shapes from the Hugging Face
layout (written out here), the same file at tp=1, tp=2 with fused projections and two pipeline
stages, a read-back at every layout, ``modules_to_save``, and the merged export against
``W + (alpha/r) B A`` computed from the adapter file."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallax.models.peft import save_adapter
from parallax.models.peft_load import load_adapter
from parallax.tensor import full_tensor
from parallax.tensor.lora_apply import adapter_parameters
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import assert_rel_close, tiny_config
from tests.families.openvla.test_lora_model import ALPHA, RANK, lora_model

P = "base_model.model."
TRAINED = ("language_model.model.norm.weight", "projector.fc1.bias")


def expected_keys(r: int = RANK) -> dict[str, tuple[int, int]]:
    """The HF OpenVLA module names (openvla.md 2.1) with adapters, for the tiny preset: DINOv2
    width 32 / MLP 128, SigLIP 48 / 184, both running blocks 0-1 of 3 (block 2 and SigLIP's
    attention pool are never built), projector 80 -> 320 -> 64 -> 64, Llama 64 / 176, 4 layers."""
    out = {}

    def add(module, fan_in, fan_out):
        out[f"{P}{module}.lora_A.weight"] = (r, fan_in)
        out[f"{P}{module}.lora_B.weight"] = (fan_out, r)

    for tower, w, f in (("featurizer", 32, 128), ("fused_featurizer", 48, 184)):
        for i in range(2):
            block = f"vision_backbone.{tower}.blocks.{i}."
            add(block + "attn.qkv", w, 3 * w)  # one fused adapter, as timm stores it
            add(block + "attn.proj", w, w)
            add(block + "mlp.fc1", w, f)
            add(block + "mlp.fc2", f, w)
    add("projector.fc1", 80, 320)
    add("projector.fc2", 320, 64)
    add("projector.fc3", 64, 64)
    for i in range(4):
        layer = f"language_model.model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add(f"{layer}self_attn.{proj}", 64, 64)
        add(layer + "mlp.gate_proj", 64, 176)
        add(layer + "mlp.up_proj", 64, 176)
        add(layer + "mlp.down_proj", 176, 64)
    return out


def _with_trained(cfg, ctx=None, **kw):
    model, report = lora_model(cfg, ctx, **kw)
    for name, p in model.named_parameters():
        if name in TRAINED:
            p.requires_grad_(True)  # modules_to_save
    return model, report


def _export(tp: int, pp: int, root: str, fused: bool):
    ctx = context(tp=tp, pp=pp) if tp * pp > 1 else None
    cfg = tiny_config(fused_projections=fused) if fused else tiny_config()
    model, report = _with_trained(cfg, ctx)
    out = Path(root)
    notes = {"not_adapted": list(report.skipped)}
    trained = list(TRAINED) if pp > 1 else None  # names of both stages, or found by requires_grad
    save_adapter(model, out / "adapter", trained=trained, notes=notes)
    model.save_pretrained(out / "merged", dtype=torch.float32)
    fresh, _ = lora_model(cfg, ctx)
    loaded = [*dict(adapter_parameters(fresh)), *(n for n in TRAINED if n in held_names(fresh))]
    params = dict(fresh.named_parameters())
    with torch.no_grad():
        for name in loaded:  # zeros: everything compared below must come from the file
            params[name].zero_()
    result = load_adapter(fresh, out / "adapter")
    group = None if ctx is None else ctx.tp_group
    held = dict(model.named_parameters())
    for name in loaded:
        assert torch.equal(full_tensor(params[name], group), full_tensor(held[name], group)), name
    return sorted(result["trained"]), result["ignored"]


def held_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters()}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle


def _merged(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(root.glob("model*.safetensors")):
        out.update(_tensors(file))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    tp1 = _export(1, 1, str(root / "tp1"), False)
    tp2 = run_ranks(_export, 2, 2, 1, str(root / "tp2"), True)
    pp2 = run_ranks(_export, 2, 1, 2, str(root / "pp2"), False)
    return root, [tp1, *tp2, *pp2]


def test_adapter_names_and_shapes_follow_the_hf_checkpoint(exports):
    root, _ = exports
    tensors = _tensors(root / "tp1" / "adapter" / "adapter_model.safetensors")
    adapters = {k: tuple(v.shape) for k, v in tensors.items() if ".lora_" in k}
    assert adapters == expected_keys()
    assert {k: tuple(v.shape) for k, v in tensors.items() if ".lora_" not in k} == {
        P + "language_model.model.norm.weight": (64,),
        P + "projector.fc1.bias": (320,),
    }
    config = json.loads((root / "tp1" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert (config["init_lora_weights"], config["bias"], config["lora_dropout"]) == (
        "gaussian",
        "none",
        0.0,
    )
    modules = sorted({k[len(P) :].rsplit(".", 2)[0] for k in expected_keys()})
    assert config["target_modules"] == modules
    assert config["modules_to_save"] == ["language_model.model.norm", "projector.fc1"]
    notes = json.loads((root / "tp1" / "adapter" / "parallax_adapter.json").read_text())
    assert "vision_backbone.fused_featurizer.attn_pool.kv" in notes["not_adapted"]
    assert "vision_backbone.featurizer.blocks.2.attn.qkv" in notes["not_adapted"]


def test_the_adapter_file_is_the_same_at_every_layout(exports):
    """tp=2 with fused q/k/v and gate/up, and two pipeline stages, write the very tensors of
    tp=1 (the adapters are drawn from their names, and gathering moves no bits)."""
    root, loads = exports
    ref = _tensors(root / "tp1" / "adapter" / "adapter_model.safetensors")
    for layout in ("tp2", "pp2"):
        got = _tensors(root / layout / "adapter" / "adapter_model.safetensors")
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), layout
    for trained, ignored in loads:  # every rank read back its slice of everything
        assert trained == sorted(TRAINED) or set(trained) <= set(TRAINED)
        assert ignored == []


def test_merged_export_is_the_dense_formula_at_every_layout(exports):
    """Merged in fp32 on each rank's slice: tp=2 (fused) and two stages against tp=1, and
    tp=1 against ``W + (alpha/r) B A`` from the adapter file and the unmerged base."""
    root, _ = exports
    ref = _merged(root / "tp1" / "merged")
    adapter = _tensors(root / "tp1" / "adapter" / "adapter_model.safetensors")
    base = {n: p.detach() for n, p in lora_model(tiny_config())[0].named_parameters()}
    for layout in ("tp2", "pp2"):
        got = _merged(root / layout / "merged")
        assert got.keys() == ref.keys()
        for k in ref:
            assert_rel_close(got[k], ref[k], rel=1e-6, msg=k)
    for module in {k[len(P) :].rsplit(".", 2)[0] for k in adapter if ".lora_" in k}:
        a, b = adapter[f"{P}{module}.lora_A.weight"], adapter[f"{P}{module}.lora_B.weight"]
        want = base[f"{module}.weight"] + ALPHA / RANK * b @ a
        assert_rel_close(ref[f"{module}.weight"], want, rel=1e-6, msg=module)
    assert torch.equal(ref["projector.fc1.bias"], base["projector.fc1.bias"])


def test_loading_ignores_unbuilt_modules_and_refuses_a_wrong_adapter(exports, tmp_path):
    root, _ = exports
    src = root / "tp1" / "adapter"
    tensors = _tensors(src / "adapter_model.safetensors")
    tensors[P + "vision_backbone.fused_featurizer.attn_pool.q.lora_A.weight"] = torch.zeros(4, 48)
    config = json.loads((src / "adapter_config.json").read_text())
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    model, _ = lora_model(tiny_config())
    result = load_adapter(model, tmp_path)
    assert result["ignored"] == [P + "vision_backbone.fused_featurizer.attn_pool.q.lora_A.weight"]
    tensors[P + "language_model.model.layers.9.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="match nothing"):
        load_adapter(model, tmp_path)
    other = lora_model(tiny_config())[0]
    for _, layer in list(other.named_modules()):
        if hasattr(layer, "lora_alpha"):
            layer.lora_alpha = 2 * ALPHA
    with pytest.raises(ValueError, match="lora_alpha"):
        load_adapter(other, src)
