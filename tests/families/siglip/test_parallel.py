"""tp=2 against tp=1: the layout-free init, loading the Hugging Face layout (each rank reading
its slice) and exporting it again, for SigLIP and CLIP (float32, gloo)."""

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from parallax.families.siglip.model import Siglip
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import assert_rel_close
from tests.families.siglip.helpers import SEED, make_pairs, perturbed_init, tiny
from tests.families.siglip.test_model import write_checkpoint


def _embeds(model, cfg):
    px, ids = make_pairs(cfg, 3)
    with torch.no_grad():
        out = model(px, ids)
    return out.image_embeds, out.text_embeds


def _tp2_case(root: str) -> None:
    ctx = context(tp=2)
    for family in ("siglip", "clip"):
        cfg = tiny(family)
        # layout-free init: the same logical weights, the same embeddings, at tp 2 as at tp 1
        ref = Siglip(cfg)
        ref.init_weights(SEED, perturbed_init)
        model = Siglip(cfg, ctx)
        model.init_weights(SEED, perturbed_init)
        full = {n: p for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            assert torch.equal(full_tensor(p, ctx.tp_group), full[name]), name
        for a, b in zip(_embeds(model, cfg), _embeds(ref, cfg)):
            assert_rel_close(a, b, msg=f"{family} init")
        # the Hugging Face layout: tp 2 reads its slices and gives tp 1's embeddings
        src = Path(root) / family
        if ctx.rank == 0:
            write_checkpoint(src, cfg, seed=1)
        torch.distributed.barrier()
        one = Siglip.from_pretrained(src)
        two = Siglip.from_pretrained(src, ctx)
        assert two.load_stats.bytes_read < one.load_stats.bytes_read  # only its slices
        for a, b in zip(_embeds(two, cfg), _embeds(one, cfg)):
            assert_rel_close(a, b, msg=f"{family} loaded")
        # export from tp 2, reload at tp 1: the same tensors, the same embeddings
        out = Path(root) / f"{family}-export"
        two.save_pretrained(out)
        if ctx.rank == 0:
            saved, original = (
                load_file(str(out / "model.safetensors")),
                load_file(str(src / "model.safetensors")),
            )
            assert saved.keys() == original.keys()
            for k in saved:
                assert torch.equal(saved[k], original[k]), k
        again = Siglip.from_pretrained(out)
        for a, b in zip(_embeds(again, cfg), _embeds(one, cfg)):
            assert torch.equal(a, b)


def test_tp2_equals_tp1_and_hf_layout_round_trips():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_tp2_case, 2, root)
