"""The smoke forms of the contrastive benchmarks: the SigLIP step table (parallax and the
torch-native baseline from the same weights, HF skipped or run) and the loss-memory table."""

import math

from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD


def test_contrastive_step_smoke_rows_start_from_the_same_loss():
    from benchmarks.step.siglip import batches_of, main, parse_args

    sizes = [f.stat().st_size for f in (RESULTS_MD, RESULTS_JSONL)]
    argv = ["--smoke", "--batch", "parallax=4,torch=4,hf=2", "--steps", "1", "--warmup", "1"]
    rows = {r["framework"]: r for r in main(argv)}
    for name in ("parallax", "torch"):
        assert rows[name]["status"] == "ok" and rows[name]["samples/s/GPU"] > 0, rows[name]
        assert rows[name]["MFU"] > 0 and math.isfinite(rows[name]["loss 1"])
    assert rows["torch"]["loss 1 rel diff"] < 1e-5  # the same weights, the same batch, fp32
    assert rows["hf"]["status"] == "ok" or rows["hf"]["status"].startswith("skipped")
    assert [f.stat().st_size for f in (RESULTS_MD, RESULTS_JSONL)] == sizes  # smoke: no writes
    assert batches_of(parse_args(["--batch", "8"]), "hf") == [8]
    assert batches_of(parse_args(["--batch", "parallax=4:8,torch=4"]), "parallax") == [4, 8]


def _memory(batches: str) -> list:
    from benchmarks.layers.contrastive_memory import main

    return main(["--smoke", "--batches", batches])


def test_loss_memory_grows_with_the_local_batch_only():
    """At dp 4 (gloo): the ring's largest logits block is b x b and what it saves for the
    backward does not grow with dp; the softmax rows are b x B."""
    from parallax.testing import run_ranks

    rows, *others = run_ranks(_memory, 4, "2,4")
    assert all(o == rows for o in others)  # every rank measures the max over ranks
    got = {(kind, dp, b): (largest, saved) for kind, dp, b, _, largest, saved, _ in rows}
    for b in (2, 4):
        ring = [got[("sigmoid", dp, b)] for dp in (1, 2, 4)]
        assert [largest for largest, _ in ring] == [b * b] * 3
        assert len({saved for _, saved in ring}) == 1  # the same bytes at dp 1, 2 and 4
        assert got[("softmax", 4, b)][0] == b * 4 * b
