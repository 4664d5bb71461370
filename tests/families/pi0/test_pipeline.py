"""pi0 and pi0.5 under a pipeline (pp 2, and tp 2 pp 2) on gloo, float32: the chunk each stage
samples over its own layers' cache equals the one process's for the same noise (bit for bit at
pp 2, where every stage runs the one process's operations in its order; 1e-5 with tp's sums),
on every rank; and the policy folder written from the stages is the one process's, bit for
bit, also as the trainer's ``--export-hf`` writes it (LoRA merged, the adapter beside it)."""

import tempfile
from pathlib import Path

import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.families.pi0.checkpoint import save_policy
from parallax.families.pi0.predict import predict_action_chunk, sample_chunk
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.testing import context, one_thread, run_ranks
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


def _export_hf(ctx, root: str, **kw) -> None:
    from parallax.train.session import export_hf  # the trainer imports every layer below it
    from parallax.train.trainer import Trainer

    base = dict(model="pi05-tiny", data="synthetic", steps=1, global_batch_size=2, seed=5)
    config = TrainConfig.of(**base, micro_batch_size=1, finetune="lora", lora_rank=2, **kw)
    export_hf(Trainer(resolve(config), ctx), Path(root))


def _pp2_export(root: str) -> None:
    _export_hf(context(pp=2), root, pp=2)


def test_export_hf_from_a_pp2_run_is_the_one_process_folder():
    with tempfile.TemporaryDirectory() as root:
        one, stages = Path(root) / "one", Path(root) / "stages"
        with one_thread():
            _export_hf(ParallelContext.local(), str(one))
        run_ranks(_pp2_export, 2, str(stages))
        files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
        assert Path("adapter/adapter_model.safetensors") in files
        assert files == sorted(p.relative_to(stages) for p in stages.rglob("*") if p.is_file())
        for f in files:
            assert (stages / f).read_bytes() == (one / f).read_bytes(), f
