"""``--export-hf`` at the end of a run: the exported Hugging Face checkpoint holds the trained
weights (bf16) and the data's action statistics."""

from tests.train.test_cli import RUN


def _export_in_pool(out):
    from parallax.testing import context
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    ctx = context(pp=2)
    run(
        resolve_run(parse_args(["--pp", "2", "--out", out, *RUN, "--steps", "2", "--export-hf"])),
        ctx,
    )
    return True


def test_export_hf_matches_the_trained_weights(tmp_path):
    import torch

    from parallax.checkpoint import Checkpoint, latest_checkpoint, load_module
    from parallax.families.openvla.config import OpenVLAConfig
    from parallax.families.openvla.model import OpenVLA
    from parallax.testing import run_ranks

    out = tmp_path / "exp"
    run_ranks(_export_in_pool, 2, str(out))
    exported = OpenVLA.from_pretrained(out / "hf", None, dtype=torch.float32)
    assert "parallax_synthetic" in exported.config.norm_stats  # the data's action statistics
    trained = OpenVLA(OpenVLAConfig.preset("tiny"))
    load_module(trained, Checkpoint(latest_checkpoint(out / "checkpoints")))
    with torch.no_grad():  # the export is bf16: compare with the trained weights rounded so
        for p in trained.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    torch.manual_seed(0)
    px, ids = torch.randn(2, 6, 56, 56), torch.randint(3, 200, (2, 9))
    ids[:, 0] = 1
    torch.testing.assert_close(exported(px, ids), trained(px, ids), rtol=1e-5, atol=1e-5)
