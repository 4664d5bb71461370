"""What a person watches: the live bar row and printed lines fit an 80-column terminal."""

import io
import json
import re

import torch
from rich.console import Console

from parallax.recipe import registry
from parallax.train.monitor import Monitor
from parallax.train.trainer import StepOutput


def _step(loss: float = 1.23456) -> StepOutput:
    # metrics: loss sum, correct action tokens, L1 sum, action tokens (over the global batch)
    return StepOutput(torch.tensor(loss), torch.tensor(93.1), torch.tensor([0, 7, 0.5, 8]), 5e-5)


def _run(tmp_path, console, steps=12, total=5000):
    monitor = Monitor(
        tmp_path,
        rank=0,
        world=8,
        device=torch.device("cpu"),
        log_interval=5,
        total_steps=total,
        console=console,
        objective=registry.recipe("openvla").objective,
    )
    rows = []
    for step in range(1, steps + 1):
        monitor.record(step, _step(), tokens=1.2e6, flops=1e15)
        if monitor._progress is not None and step > 2:
            view = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
            view.print(monitor._progress.get_renderable())
            rows.append(view.export_text().rstrip("\n"))
    monitor.close()
    return rows


def test_bar_and_lines_fit_80_columns(tmp_path):
    console = Console(file=io.StringIO(), width=80, force_terminal=True, record=True)
    rows = _run(tmp_path, console)
    assert rows
    for row in rows:  # the bar, the step count and the time remaining, then what fits
        assert len(row) <= 80, row
        assert re.match(r"^[━╸╺]{20} +\d+/5000 (--:--|\d\d:\d\d) +loss 1\.2346  acc 0\.875", row)
    printed = re.findall(r"step +\d+/5000[^\n]*", console.export_text())
    assert [int(re.match(r"step +(\d+)", p).group(1)) for p in printed] == [1, 5, 10]
    for line in printed:
        assert len(line) <= 80 and "loss 1.2346  acc 0.875  l1 0.062" in line, line
        assert "mfu -" in line  # a CPU: no MFU against a GPU peak


def test_logs_get_every_field_and_cpu_mfu_is_null(tmp_path):
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    _run(tmp_path, console, steps=5)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 2 and len(lines[0]) > 80  # not a terminal: nothing left out
    assert "mfu -" in lines[0] and "gnorm 93.10" in lines[0] and "GiB" in lines[0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all("mfu" in r and r["mfu"] is None for r in rows)
