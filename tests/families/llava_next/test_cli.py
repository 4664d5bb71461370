"""``python -m parallax.train --model llava-tiny``: the default command learns the synthetic task,
and bad LLaVA inputs stop every rank before training with one clear message."""

import json
from pathlib import Path

import pytest

from parallax.testing import run_ranks

LEARN = (
    "--model", "llava-tiny", "--steps", "24", "--global-batch-size", "16",
    "--micro-batch-size", "4", "--warmup-steps", "3", "--log-interval", "6",
    "--save-interval", "0",
)  # fmt: skip


def _cli(out: str, *args: str, tp: int = 1, stop_after: int | None = None) -> str | None:
    from parallax.testing import context
    from parallax.train import parse_args
    from parallax.train.cli import UserError, resolve_run, run

    dp = 2 // tp
    ctx = context(tp=tp, dp=dp)
    try:  # a run is resolved before it starts (every rank alike), then trains
        cfg = parse_args(["--tp", str(tp), "--dp", str(dp), "--out", out, *args])
        run(resolve_run(cfg), ctx, stop_after=stop_after)
    except (UserError, ValueError) as err:
        return str(err)
    return None


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_default_command_learns_exports_and_trains_on_from_the_export(tmp_path):
    out = tmp_path / "run"
    assert run_ranks(_cli, 2, str(out), *LEARN, "--export-hf") == [None, None]
    rows = _metrics(out)
    assert {"loss", "answer_accuracy", "token_accuracy", "tokens_per_s"} <= set(rows[-1])
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], rows
    assert rows[-1]["token_accuracy"] > 0.7, rows
    # the export is the llava-hf layout as published, and --model reads it back
    from safetensors import safe_open

    with safe_open(str(out / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    assert "vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight" in names  # unused layer
    again = tmp_path / "again"
    args = [*LEARN[2:], "--model", str(out / "hf"), "--steps", "1", "--lr", "1e-9"]
    assert run_ranks(_cli, 2, str(again), *args) == [None, None]
    assert _metrics(again)[0]["loss"] < 0.5 * rows[0]["loss"]  # it starts where the run ended


def _conversations(path: Path, samples: list[dict]) -> str:
    path.write_text(json.dumps(samples))
    return str(path)


def _sample(q: str, a: str | None, image: str | None = "a.png", **kw) -> dict:
    turns = [{"from": "human", "value": q}] + ([{"from": "gpt", "value": a}] if a else [])
    return {"id": "s1", **({"image": image} if image else {}), "conversations": turns, **kw}


def _bad_checkpoint(root: Path) -> str:
    from safetensors.torch import save_file

    from parallax.families.llava_next.config import LlavaNextConfig

    root.mkdir()
    cfg = LlavaNextConfig.preset("llava-tiny").to_dict()
    (root / "config.json").write_text(json.dumps(cfg))
    import torch

    save_file({"transformer.h.0.weight": torch.zeros(2, 2)}, str(root / "model.safetensors"))
    return str(root)


@pytest.fixture
def image(tmp_path):
    pil = pytest.importorskip("PIL.Image")
    pil.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "a.png")
    return tmp_path


def test_bad_inputs_fail_on_every_rank_before_training(image):
    d = image
    long_first = [
        {"from": "human", "value": "x" * 600},
        {"from": "gpt", "value": "ok"},
        {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "red"},
    ]
    cases = [
        (_sample("<image>\nWhat?", None), "has no answer"),
        (_sample("What?", "red"), "no <image> tags"),
        (_sample("<image>\nWhat?", "red", image=None), "<image> tag but no image"),
        ({"id": "s1", "image": "a.png", "conversations": long_first}, "maximum length 512"),
    ]
    for k, (sample, message) in enumerate(cases):
        data = _conversations(d / f"c{k}.json", [sample] * 16)
        args = ["--model", "llava-tiny", "--data", data, "--steps", "1"]
        got = run_ranks(_cli, 2, str(d / f"o{k}"), *args)
        assert got[0] == got[1] and got[0] and message in got[0], (message, got)
        assert "s1" in got[0] and not (d / f"o{k}" / "metrics.jsonl").exists()
    got = run_ranks(_cli, 2, str(d / "o"), "--model", _bad_checkpoint(d / "ckpt"))
    assert got[0] == got[1] and "unknown LLaVA-NeXT layout" in got[0], got


@pytest.mark.parametrize("layout", [("2", "2", "2")])
def test_dry_run_plans_the_7b_at_any_layout(layout, capsys):
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run
    from parallax.train.dry_run import print_plan

    tp, pp, dp = layout
    argv = ["--model", "llava-v1.6-vicuna-7b", "--precision", "bf16", "--dry-run"]
    print_plan(resolve_run(parse_args([*argv, "--tp", tp, "--pp", pp, "--dp", dp])))
    out = capsys.readouterr().out
    assert f"tp{tp} pp{pp} dp{dp}" in out and "vision_tower.* (decay)" in out, out
    assert "2e-06" in out and "2e-05" in out


def test_resume_at_another_layout_matches_the_uninterrupted_run(tmp_path):
    """The length-grouped loader's position and the model travel through the checkpoint."""
    args = [*LEARN[:3], "4", *LEARN[4:-1], "2", "--log-interval", "1"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_ranks(_cli, 2, str(whole), *args) == [None, None]
    assert run_ranks(_cli, 2, str(part), *args, stop_after=2) == [None, None]
    assert run_ranks(_cli, 2, str(part), *args, "--resume", tp=2) == [None, None]
    want = [r["loss"] for r in _metrics(whole)]
    got = [r["loss"] for r in _metrics(part)]
    assert got == pytest.approx(want, rel=1e-5) and len(got) == 4


def test_trains_on_a_conversation_file_with_an_image_folder(image):
    pil = pytest.importorskip("PIL.Image")
    folder = image / "images"
    folder.mkdir()
    pil.new("RGB", (80, 20), (30, 30, 200)).save(folder / "wide.png")
    pil.new("RGB", (40, 30), (200, 30, 30)).save(folder / "red.png")
    samples = [
        _sample("<image>\nWhat colour?", "blue", image="wide.png"),
        _sample("What is it?\n<image>", "red", image="red.png"),  # the tag moves to the start
        _sample("Say hi.", "hi", image=None),
    ]
    data = image / "train.jsonl"  # JSONL: one sample per line
    data.write_text("\n".join(json.dumps(s) for s in samples * 6))
    args = ["--model", "llava-tiny", "--data", f"{data}:{folder}", "--steps", "2"]
    args += ["--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]
    assert run_ranks(_cli, 2, str(image / "out"), *args) == [None, None]
    rows = _metrics(image / "out")
    assert len(rows) == 2 and all(r["loss"] > 0 for r in rows)
