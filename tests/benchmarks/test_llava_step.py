"""benchmarks/step/llava.py in its smoke form: every row runs (or says why it is skipped), the
rows start from the same weights (same first-step loss), and nothing is written without
--write."""

import math

import pytest

from benchmarks.step.llava import main, parse_args
from benchmarks.step.llava_workload import microbatches, padding_fraction, samples
from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD
from parallax.families.llava_next.config import LlavaNextConfig


def test_smoke_rows_agree_and_write_nothing():
    sizes = [f.stat().st_size for f in (RESULTS_MD, RESULTS_JSONL)]
    argv = ["--smoke", "--steps", "1", "--warmup", "1", "--parallax-variant", "opt"]
    rows = main([*argv, "--native-variant", "eager"])
    assert [f.stat().st_size for f in (RESULTS_MD, RESULTS_JSONL)] == sizes
    by = {r["framework"]: r for r in rows}
    assert set(by) == {"parallax", "torch", "hf"}
    for fw in ("parallax", "torch"):
        r = by[fw]
        assert r["status"] == "ok", r
        assert r["step s"] > 0 and r["MFU"] > 0 and math.isfinite(r["loss"])
        assert 0 < r["padding"] < 0.5
    assert by["torch"]["loss 1"] == pytest.approx(by["parallax"]["loss 1"], rel=1e-5)
    hf = by["hf"]
    if hf["status"] == "ok":
        assert hf["loss 1"] == pytest.approx(by["parallax"]["loss 1"], rel=1e-5)
    else:
        assert hf["status"].startswith("skipped: transformers"), hf


def test_workload_is_the_realistic_mix():
    config = LlavaNextConfig.preset("llava-v1.6-vicuna-7b")
    plans = samples(config, 400)
    image = sum(p["image_tokens"] for p in plans) / len(plans)
    assert 2200 < image < 2400  # ~2.3k image tokens per sample
    mbs = microbatches(config, plans[:8], 2)
    text = (
        sum(int(mb["lengths"].sum()) for mb in mbs) / 8
        - sum(p["image_tokens"] for p in plans[:8]) / 8
    )
    assert 60 <= text <= 150
    assert padding_fraction(mbs) < 0.1  # grouped by length
    assert all((mb["labels"] != -100).sum() > 0 for mb in mbs)
    with pytest.raises(SystemExit):
        parse_args(["--frameworks", "deepspeed"])


def test_length_grouping_cuts_the_padding():
    from benchmarks.step.llava_padding import main as padding

    ((micro, rand_tokens, rand_flops, grouped_tokens, grouped_flops),) = padding(
        ["--samples", "256", "--global-batch", "64", "--micro", "4"]
    )
    assert micro == 4 and grouped_tokens < 0.25 * rand_tokens and 0 < grouped_flops < rand_flops
