"""Loading OpenVLA-OFT: OFT's own released folders, refusals, batched prediction, the objective.

A tiny OFT folder is written here in OFT's own layout, from a tiny parallax OFT model: the HF
OpenVLA files of parallax's export, a config.json without the ``parallax_oft`` section,
``action_head--N_checkpoint.pt`` / ``proprio_projector--N_checkpoint.pt`` (``torch.save`` of
state dicts under OFT's key names with DDP's ``module.``, written by this test from OFT's names,
not by parallax's writer), with FiLM ``vision_backbone--N_checkpoint.pt`` (the FiLM- and
PEFT-wrapped backbone's keys, every tower linear split into ``base_layer`` + LoRA as OFT's
training leaves it) and ``dataset_statistics.json``.

Without FiLM the release predicts **bitwise** what the export predicts: both read the same HF
files, and the head and projector are the same float32 tensors (``.pt`` against safetensors).
With FiLM the towers come from the backbone file as ``base + alpha / r * B @ A``, which equals
the export's tower only to float32 rounding (the base was written as ``W - alpha / r * B @ A``),
so there the chunks agree to 1e-5 of their scale.
"""

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from parallax.families.openvla import load_policy, oft_loss
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.oft.config import OFTConfig
from parallax.families.openvla.oft.export import save_oft_modules
from tests.families.openvla.helpers import SEED, perturbed_init, tiny_config
from tests.families.openvla.test_oft_predict import close
from tests.families.openvla.test_oft_reference import _samples, _stats

OFT = OFTConfig(chunk=2, action_dim=7, proprio_dim=3, num_images=2)
STEP = 3
HEAD = {"norm_in": "layer_norm1", "proj_in": "fc1", "norm_out": "layer_norm2", "proj_out": "fc2"}
LORA_RANK = 32  # OFT's; its evaluation merges with alpha 16: scale 0.5


def _model(film: bool) -> OpenVLA:
    import dataclasses

    cfg = dataclasses.replace(tiny_config(), oft=dataclasses.replace(OFT, film=film))
    model = OpenVLA(dataclasses.replace(cfg, norm_stats=_stats(cfg)))
    model.init_weights(SEED, perturbed_init)
    return model.eval()


def _export(model: OpenVLA, path) -> None:
    model.save_pretrained(path)  # HF layout, config.json with parallax_oft, statistics
    save_oft_modules(model, path, step=STEP)


def _oft_key(name: str) -> str:
    """OFT's key of a head or projector parameter (its L1RegressionActionHead's MLPResNet)."""
    module, rest = name.split(".", 1)
    if module == "proprio_projector":
        return rest
    parts = rest.split(".")
    if parts[0] == "blocks":
        return f"model.mlp_resnet_blocks.{parts[1]}.ffn.{0 if parts[2] == 'norm' else 1}.{parts[3]}"
    return f"model.{HEAD[parts[0]]}.{parts[1]}"


def _backbone_state(model: OpenVLA, gen: torch.Generator) -> dict:
    """The FiLM- and PEFT-wrapped vision backbone's state dict, as OFT's training saves it
    (``vla.module.vision_backbone``: the FiLM wrapper, whose ``vision_backbone`` is OpenVLA's):
    ``vision_backbone.{tower}.blocks.{i}.block.{timm}``, ``...blocks.{i}.scale|shift``, every
    tower linear as PEFT's ``base_layer`` + ``lora_A/B.default``."""
    tensors = {n: p.detach() for n, p in model.named_parameters() if n.startswith("vision_b")}
    tensors.update(model.hf_unused)  # the blocks, norms and pool the towers never run
    for tower, cfg in zip(("featurizer", "fused_featurizer"), model.config.vision):
        for leaf, shape in (("weight", (cfg.width, 64)), ("bias", (cfg.width,))):
            for film in ("scale", "shift"):  # FiLM of the unused last block: OFT has one too
                name = f"vision_backbone.{tower}.blocks.{cfg.depth - 1}.film_{film}.{leaf}"
                tensors[name] = torch.randn(shape, generator=gen)
    linears = {  # PEFT wraps every nn.Linear (not the patch convolution; FiLM came after it)
        n.removesuffix(".weight")
        for n, v in tensors.items()
        if v.dim() == 2 and n.endswith(".weight") and ".film_" not in n
    }
    state = {}
    for name, value in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in linears and leaf == "weight":
            a = torch.randn(LORA_RANK, value.shape[1], generator=gen) * 0.1  # (r, in)
            b = torch.randn(value.shape[0], LORA_RANK, generator=gen) * 0.1  # (out, r)
            state[_wrapped(f"{module}.base_layer.weight")] = value.float() - 0.5 * (b @ a)
            state[_wrapped(f"{module}.lora_A.default.weight")] = a
            state[_wrapped(f"{module}.lora_B.default.weight")] = b
        elif module in linears:
            state[_wrapped(f"{module}.base_layer.{leaf}")] = value
        else:
            state[_wrapped(name)] = value
    return state


def _wrapped(name: str) -> str:
    """A parallax tower name -> OFT's: the timm block inside FiLM's block wrapper, whose own
    linears are ``scale`` and ``shift``."""
    parts = name.split(".")
    if parts[2] != "blocks":
        return name
    if parts[4] in ("film_scale", "film_shift"):
        return ".".join([*parts[:4], parts[4].removeprefix("film_"), *parts[5:]])
    return ".".join([*parts[:4], "block", *parts[4:]])


def _release(exported: OpenVLA, export_dir, out, steps=(1, STEP)) -> None:
    """OFT's folder: the export's HF files, config.json without parallax's section (and its
    norm_stats emptied: OFT reads dataset_statistics.json), OFT's .pt files of ``steps``
    (the older ones zero: only the newest may be read)."""
    shutil.copytree(export_dir, out)
    for f in [*out.glob("*--*_checkpoint.pt"), *out.glob("action_head.safetensors")]:
        f.unlink()
    for name in ("proprio_projector", "film"):
        (out / f"{name}.safetensors").unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("parallax_oft")
    config["norm_stats"] = {}
    (out / "config.json").write_text(json.dumps(config))
    params = dict(exported.named_parameters())
    gen = torch.Generator().manual_seed(11)
    for step in steps:
        keep = 1.0 if step == STEP else 0.0
        for module in ("action_head", "proprio_projector"):
            state = {
                "module." + _oft_key(n): p.detach() * keep
                for n, p in params.items()
                if n.startswith(module + ".")
            }
            torch.save(state, out / f"{module}--{step}_checkpoint.pt")
        if exported.config.oft.film:
            state = {k: v * keep for k, v in _backbone_state(exported, gen).items()}
            torch.save(state, out / f"vision_backbone--{step}_checkpoint.pt")


def _predict(policy, samples) -> np.ndarray:
    images = [[s["image"], s["wrist_image"]] for s in samples]
    states = torch.stack([s["state"] for s in samples])  # (b, P)
    return policy.predict_action_chunk(images, [s["instruction"] for s in samples], states)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "film"])
def folders(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("oft-film" if request.param else "oft")
    _export(_model(request.param), root / "export")
    exported = load_policy(root / "export")
    _release(exported, root / "export", root / "release")
    return root, exported


def test_oft_release_loads_and_predicts_as_the_export(folders, caplog):
    root, exported = folders
    with caplog.at_level(logging.INFO):
        policy = load_policy(root / "release", chunk=2, num_images=2)
    assert "reading the newest, 3" in caplog.text
    assert policy.config.oft == exported.config.oft
    given = {"chunk": 2, "num_images": 2}
    direct = OpenVLA.from_pretrained(root / "release", dtype=torch.float32, oft=given)
    assert direct.config.oft == exported.config.oft
    assert policy.config.norm_stats == exported.config.norm_stats  # dataset_statistics.json
    samples = _samples(exported.config, ("pick up the red block", "go left", "push it"))
    got, want = _predict(policy, samples), _predict(exported, samples)
    assert got.shape == (3, OFT.chunk, OFT.action_dim)
    if not exported.config.oft.film:
        np.testing.assert_array_equal(got, want)  # the same float32 weights
        for name, p in exported.named_parameters():
            assert torch.equal(policy.get_parameter(name), p), name
    else:
        close(got, want, "FiLM: the LoRA merged in float32")
        with pytest.raises(ValueError, match="film=False given, but .*vision_backbone--3"):
            load_policy(root / "release", chunk=2, num_images=2, film=False)


def test_a_release_takes_what_its_files_cannot_tell_and_refuses_contradictions(folders):
    root, _ = folders
    with pytest.raises(ValueError, match="chunk= to load_policy"):
        load_policy(root / "release", num_images=2)
    with pytest.raises(ValueError, match="chunk=, num_images="):
        load_policy(root / "release")
    with pytest.raises(ValueError, match="action_dim=6 given, but action_head--3.* 7-dim"):
        load_policy(root / "release", chunk=2, num_images=2, action_dim=6)
    with pytest.raises(ValueError, match="proprio_dim=8 given, but proprio_projector--3.* 3-dim"):
        load_policy(root / "release", chunk=2, num_images=2, proprio_dim=8)
    with pytest.raises(ValueError, match="chunk=4 given, but .*export says chunk 2"):
        load_policy(root / "export", chunk=4)


def test_a_missing_head_or_projector_is_refused_naming_the_file(folders, tmp_path):
    root, _ = folders
    release = tmp_path / "release"
    shutil.copytree(root / "release", release)
    (release / "proprio_projector--3_checkpoint.pt").unlink()
    with pytest.raises(FileNotFoundError, match="expected proprio_projector--3_checkpoint.pt"):
        load_policy(release, chunk=2, num_images=2)
    for f in release.glob("action_head--*"):
        f.unlink()
    expected = r"expected the action head \(OFT's action_head--\{step\}_checkpoint.pt or"
    with pytest.raises(FileNotFoundError, match=expected):
        load_policy(release, chunk=2, num_images=2)
    export = tmp_path / "export"
    shutil.copytree(root / "export", export)
    for f in [*export.glob("action_head--*"), export / "action_head.safetensors"]:
        f.unlink()
    with pytest.raises(FileNotFoundError, match=f"{export}: {expected}"):
        load_policy(export)  # OFT's projector file is still there
    for f in export.glob("*--*_checkpoint.pt"):
        f.unlink()
    expected = r"expected action_head.safetensors or action_head--\{step\}_checkpoint.pt"
    for load in (load_policy, OpenVLA.from_pretrained):
        with pytest.raises(FileNotFoundError, match=f"{export}: {expected}"):
            load(export)
    plain = tmp_path / "plain"  # an OpenVLA without any OFT file: loads plain, unless asked
    shutil.copytree(export, plain, ignore=shutil.ignore_patterns("*--*", "*_projector*", "film*"))
    config = json.loads((plain / "config.json").read_text())
    config.pop("parallax_oft")
    (plain / "config.json").write_text(json.dumps(config))
    assert load_policy(plain).config.oft is None
    with pytest.raises(FileNotFoundError, match="holds no OpenVLA-OFT model.*action_head--"):
        load_policy(plain, chunk=2, num_images=2)


def test_a_batch_predicts_each_sample():
    model = _model(film=True)
    samples = _samples(model.config, ("pick up the red block", "go left", "open the top drawer"))
    one_by_one = np.stack(
        [
            model.predict_action_chunk([s["image"], s["wrist_image"]], s["instruction"], s["state"])
            for s in samples
        ]
    )
    assert one_by_one.shape == (3, OFT.chunk, OFT.action_dim)
    close(_predict(model, samples), one_by_one, "a list of samples")
    images = torch.stack([torch.stack([s["image"], s["wrist_image"]]) for s in samples])
    batched = model.predict_action_chunk(  # (b, n, H, W, 3) uint8, states as a list
        images, [s["instruction"] for s in samples], [s["state"] for s in samples]
    )
    close(batched, one_by_one, "a batched tensor")
    with pytest.raises(ValueError, match="2 samples of images for 3 instructions"):
        model.predict_action_chunk(images[:2], [s["instruction"] for s in samples])


def test_oft_loss_equals_the_trainers_loss():
    from parallax import ParallelContext
    from parallax.data import SyntheticTask
    from parallax.families.openvla.oft.data import synthetic_task
    from parallax.recipe import resolve
    from parallax.run import TrainConfig
    from parallax.train.trainer import Trainer

    cfg = TrainConfig.of(
        action_head="l1", action_chunk=2, film=True, steps=1, global_batch_size=2,
        micro_batch_size=2, seed=5, lr=1e-3,
    )  # fmt: skip
    run = resolve(cfg)
    trainer = Trainer(run, ParallelContext.local())
    data = SyntheticTask(
        synthetic_task(run.family_options, 5).config, num_episodes=2, image_size=32
    )
    build = trainer.recipe.data.collator(trainer.run, data)
    samples = [data[0], data[7]]
    mb = build(samples)
    model = trainer.chunks[0]
    with torch.no_grad():
        ours = oft_loss(model, mb)
        from_samples = oft_loss(
            model, samples, statistics=data.statistics, tokenizer=build.tokenizer
        )
    out = trainer.train_step([mb])
    assert torch.equal(ours.loss, out.loss), (ours.loss, out.loss)
    assert torch.equal(from_samples.loss, ours.loss)
    sums = out.metrics[1:]  # current sum, count, next sum, count
    torch.testing.assert_close(ours.metrics["l1_current"], sums[0] / sums[1], rtol=0, atol=0)
    torch.testing.assert_close(ours.metrics["l1_next"], sums[2] / sums[3], rtol=0, atol=0)
