"""pi0 and pi0.5 under a pipeline (pp 2, and tp 2 pp 2) on gloo, float32: the chunk each stage
samples over its own layers' cache equals the one process's for the same noise (bit for bit at
pp 2, where every stage runs the one process's operations in its order; 1e-5 with tp's sums),
on every rank; and the policy folder written from the stages is the one process's, bit for
bit."""

import tempfile
from pathlib import Path

import torch
from torch.testing import assert_close

from parallax.families.pi0.checkpoint import save_policy
from parallax.families.pi0.predict import predict_action_chunk, sample_chunk
from parallax.testing import context, run_ranks
from tests.families.pi0.helpers import inputs, tiny_model

KEYS = ("images", "image_masks", "tokens", "token_mask", "state", "noise")


def _stages_case(root: str, tp: int) -> None:
    ctx = context(tp=tp, pp=2)
    blocks = range(0, 2) if ctx.pp_rank == 0 else range(2, 3)  # embed, layers.0 | layers.1
    for variant in ("pi0", "pi05"):
        whole, chunk = tiny_model(variant), tiny_model(variant, ctx, blocks=blocks)
        x = inputs(whole.config)
        args = [x[k] for k in KEYS]
        want, got = sample_chunk(whole, *args, num_steps=3), sample_chunk(chunk, *args, num_steps=3)
        if tp == 1:
            assert torch.equal(got, want), variant
        else:
            assert_close(got, want, rtol=1e-5, atol=1e-5, msg=variant)
        g = torch.Generator().manual_seed(0)  # the same inputs on every rank
        cams, state = list(x["images"][0]), torch.randn(whole.config.max_state_dim, generator=g)
        one = predict_action_chunk(whole, cams, "open the drawer", state, x["noise"][0])
        staged = predict_action_chunk(chunk, cams, "open the drawer", state, x["noise"][0])
        assert_close(staged, one, rtol=1e-5, atol=1e-5, msg=variant)

        out = Path(root) / f"{variant}-tp{tp}"
        if ctx.rank == 0:
            save_policy(whole, out / "one")
        save_policy(chunk, out / "stages", ctx)
        torch.distributed.barrier()
        if ctx.rank == 0:
            for f in ("model.safetensors", "config.json"):
                assert (out / "stages" / f).read_bytes() == (out / "one" / f).read_bytes(), f


def test_pp2_samples_and_exports_as_one_process():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_stages_case, 2, root, 1)


def test_tp2_pp2_samples_and_exports_as_one_process():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_stages_case, 4, root, 2)
