"""LeRobot's policy folder: a tiny pi0 / pi0.5 written, read back (sizes from the tensors'
shapes, every parameter equal, the same velocity) and written again bit for bit; tp 2 reads
its slices of it and writes the same folder."""

import tempfile
from pathlib import Path

import torch

from parallax.families.pi0.checkpoint import config_from_folder, load_model, save_policy
from parallax.families.pi0.predict import load_policy
from parallax.testing import context, run_ranks
from tests.families.pi0.helpers import inputs, lora_model, tiny_model

KEYS = ("images", "image_masks", "tokens", "token_mask", "state", "noise", "time")


def _velocity(model, x):
    with torch.no_grad():
        return model.velocity(*(x[k] for k in KEYS))


def _round_trip(root: Path, ctx=None) -> None:
    rank0 = ctx is None or ctx.rank == 0
    for variant in ("pi0", "pi05"):
        model = tiny_model(variant)
        first, second, third = (root / f"{variant}-{i}" for i in range(3))
        if rank0:
            save_policy(model, first)
        if ctx is not None:
            torch.distributed.barrier()
        config = config_from_folder(first)
        assert (config.vision, config.prefix, config.expert) == (
            model.config.vision,
            model.config.prefix,
            model.config.expert,
        )
        loaded = load_model(first, ctx)
        x = inputs(model.config)
        torch.testing.assert_close(_velocity(loaded, x), _velocity(model, x), rtol=1e-5, atol=1e-5)
        save_policy(loaded, second if ctx is None else third, ctx)
        if ctx is not None:
            torch.distributed.barrier()
        if rank0:
            out = second if ctx is None else third
            for f in ("model.safetensors", "config.json"):
                assert (out / f).read_bytes() == (first / f).read_bytes(), (variant, f)


def test_round_trip_bit_for_bit():
    with tempfile.TemporaryDirectory() as root:
        _round_trip(Path(root))
        policy = load_policy(Path(root) / "pi0-0")
        assert not policy.training


def _tp2(root: str) -> None:
    _round_trip(Path(root), context(tp=2))


def test_tp2_reads_its_slices_and_writes_the_same_folder():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_tp2, 2, root)


def test_the_export_merges_every_adapter():
    """LoRA on every linear, the key/value projections' included: the folder holds the merged
    weights (the adapted model's velocity)."""
    model = lora_model("pi0")
    x = inputs(model.config)
    with tempfile.TemporaryDirectory() as root:
        save_policy(model, Path(root))
        loaded = load_model(root)
    k = "layers.1.expert.self_attn.k_proj.weight"
    layer = model.get_submodule(k.removesuffix(".weight"))
    want = layer.weight.detach() + layer.lora_delta()
    torch.testing.assert_close(loaded.get_parameter(k).detach(), want, rtol=0, atol=0)
    torch.testing.assert_close(_velocity(loaded, x), _velocity(model, x), rtol=1e-5, atol=1e-5)
