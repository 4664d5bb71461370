"""``python -m parallax.report``: each run's series on every panel, evaluations as points, a PNG
of the size asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="parallax.report draws with matplotlib (extra 'plots')")

from parallax.report import PANELS, draw, main, read_run  # noqa: E402


def _run(folder: Path, steps: int, metric: str, mfu: bool) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"step": s, "loss": 5 / s, metric: 1 - 1 / s, "lr": 1e-3 * s / steps, "grad_norm": 2.0 / s,
         "tokens_per_s": 1000.0 + s, "mfu": 0.3 if mfu else None, "memory_gib": 1.5,
         "step_time_s": 0.1, "data_wait_s": 0.0}
        for s in range(1, steps + 1)
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "eval_loss": 6 / s, f"eval_{metric}": 0.5} for s in (5, steps)]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return folder


def test_each_run_is_drawn_on_every_panel_with_its_evaluations(tmp_path):
    a = _run(tmp_path / "openvla-run", 10, "action_accuracy", mfu=True)
    b = _run(tmp_path / "llava-run", 8, "token_accuracy", mfu=False)
    runs = [read_run(a), read_run(b)]
    assert [r.metric for r in runs] == ["action_accuracy", "token_accuracy"]
    fig = draw(runs)
    axes = fig.axes[: len(PANELS)]
    for ax, (title, key, eval_key) in zip(axes, PANELS):
        labels = [line.get_label() for line in ax.lines]
        want = ["openvla-run", "llava-run"] if key != "mfu" else ["openvla-run"]  # CPU: no MFU
        if eval_key:
            want = ["openvla-run", "openvla-run (eval)", "llava-run", "llava-run (eval)"]
        assert labels == want, (title, labels)
        line = ax.lines[0]
        steps = list(line.get_xdata())
        assert steps == ([5, 10] if labels[0].endswith("(eval)") else list(range(1, 11)))
    loss = axes[0].lines
    assert list(loss[0].get_ydata()) == pytest.approx([5 / s for s in range(1, 11)])
    assert list(loss[1].get_ydata()) == pytest.approx([6 / 5, 6 / 10])  # eval points
    assert loss[1].get_linestyle() == "None" and loss[1].get_marker() == "o"
    assert axes[1].get_title() == "action_accuracy, token_accuracy"


def test_the_command_writes_the_png_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    a = _run(tmp_path / "a", 6, "action_accuracy", mfu=False)
    out = tmp_path / "pics" / "curves.png"
    assert main([str(a), "--out", str(out), "--dpi", "50"]) == 0
    assert "wrote" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 400)  # 16 x 8 inches at 50 dpi
    assert main([str(tmp_path / "nothing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parallax.report: error: ") and "no metrics.jsonl" in err


def test_a_metric_only_the_evaluation_measures_is_the_main_one(tmp_path):
    """pi0's training rows carry no family metric; its evaluation's sampled-chunk error is
    drawn as the main metric."""
    folder = _run(tmp_path / "pi0-run", 6, "unused", mfu=False)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        del r["unused"]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "eval_loss": 1.0, "eval_chunk_mse": 0.6 / s, "eval_mean_action_mse": 0.5}
             for s in (3, 6)]  # fmt: skip
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    run = read_run(folder)
    assert run.metric == "chunk_mse"
    assert run.series("metric") == ([], [])
    steps, values = run.series("eval_metric", evaluation=True)
    assert steps == [3, 6] and values == pytest.approx([0.2, 0.1])
