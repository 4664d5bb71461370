"""The OFT benchmark's smoke form: the tiny model on the CPU, every row runs (the HF peer's
rows say what they need where timm, transformers or peft are missing) and nothing is
written; the 7B recipe's FLOP formula on its own."""

import math

from benchmarks.step.oft import main, oft_config, parse_args
from benchmarks.tools.common import RESULTS_JSONL, RESULTS_MD
from parallax.families.openvla.oft.objective import forward_parts, oft_flops_per_sample


def _size(path) -> int:
    return path.stat().st_size if path.exists() else 0


def test_tiny_rows_run_and_write_nothing():
    before = (_size(RESULTS_JSONL), _size(RESULTS_MD))
    argv = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--memory"]
    rows = {r["row"]: r for r in main(argv)}
    train = rows["parallax train"]
    assert train["status"] == "ok" and train["mfu"] > 0 and math.isfinite(train["first_loss"])
    for form in ("offload", "ckpt-vision"):  # the same model and batch: the same first loss
        saved = rows[f"parallax+{form} train"]
        assert saved["status"] == "ok" and saved["first_loss"] == train["first_loss"], form
    chunk, autoregressive = (
        rows["parallax predict_action_chunk"],
        rows["parallax OpenVLA autoregressive"],
    )
    assert chunk["actions_per_s"] > 0 and autoregressive["actions_per_s"] > 0
    hf = rows["hf train"]
    assert hf["status"] == "ok" or hf["status"].startswith("skipped: needs"), hf
    assert (_size(RESULTS_JSONL), _size(RESULTS_MD)) == before


def test_the_7b_recipes_flops():
    """600 positions (1 + 512 + 1 + 29 + 56 + 1); LoRA counts 2/3 of full fine-tuning's
    FLOPs for the base (no weight gradient) and the head at 3x; the LLM dominates."""
    config = oft_config(parse_args([]))
    text = 30 + config.oft.slots + 1
    assert config.prefix_tokens + text == 600
    parts = forward_parts(config, text)
    lora = oft_flops_per_sample(config, text, lora=True)
    full = 3 * sum(parts.values())
    assert 0.66 < lora / full < 0.68, lora / full
    params = 6.74e9  # Llama-2-7B's layers: 2 N T forward dominates the LLM part
    assert 0.95 < parts["llm"] / (2 * params * 600) < 1.15


def test_every_memory_form_is_a_valid_run_where_the_plan_asks_for_it():
    """Each saving form the plan lists makes a TrainConfig that passes its checks (the budget
    needs --compile, so it has no eager row)."""
    from benchmarks.step.oft import SAVING, _train_plan
    from parallax.run import TrainConfig

    plan = _train_plan(parse_args(["--compile", "--memory", "--rows", "parallax"]))
    assert {f for *_, f in plan} == {"", *SAVING}
    assert ("parallax+budget", "parallax", False, "budget") not in plan
    for _, _, compile, form in plan:
        TrainConfig.of(model="tiny", finetune="lora", compile=compile, **SAVING.get(form, {}))
