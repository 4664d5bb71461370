"""Shared plumbing for the benchmark scripts: environment, timing, the table, the results files.

Every script prints one table and appends it to ``benchmarks/RESULTS.md`` (with hardware, date,
commit and the exact command) and one JSON line per row to ``benchmarks/results.jsonl``, then
rewrites the latest-results tables at the top of RESULTS.md (``results_table``). Only rank 0
writes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.tools.results_table import refresh

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # benchmarks/: RESULTS.md and results.jsonl live at its top
ROOT = BENCHMARKS.parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
RESULTS_JSONL = BENCHMARKS / "results.jsonl"
PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, the MFU denominator used throughout
RUN_ID = uuid.uuid4().hex[:12]


def commit() -> str:
    """``PARALLAX_COMMIT`` when set (GPU machines may hold a copy of the tree whose git state
    is not the one that runs), else the checkout's short hash, ``-dirty`` with local changes."""
    if os.environ.get("PARALLAX_COMMIT"):
        return os.environ["PARALLAX_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=HERE,
            text=True,
            capture_output=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PARALLAX_COMMIT", "unknown")


def hardware() -> str:
    if torch.cuda.is_available():
        n = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
        return f"{n}x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def command() -> str:
    """The command that ran this script, as a user would type it again."""
    script = os.path.relpath(sys.argv[0], ROOT)
    if script.endswith(".py") and not script.startswith(".."):
        script = "-m " + script[:-3].replace(os.sep, ".")
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    world = os.environ.get("WORLD_SIZE")
    if world:
        return (
            f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} {script} {args}"
        )
    return f"python {script} {args}".strip()


def env_info() -> dict[str, str]:
    return {
        "run_id": RUN_ID,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "hardware": hardware(),
        "torch": torch.__version__,
        "command": command(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(
    fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10
) -> list[float]:
    """Seconds per call of ``fn`` for ``iters`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return float("nan")


def fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def print_table(
    title: str, columns: list[str], rows: list[list[object]], width: int | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(width=width or max(120, Console().width)).print(table)


def append_results(
    title: str,
    columns: list[str],
    rows: list[list[object]],
    notes: str = "",
    records: list[dict] | None = None,
    info: dict[str, str] | None = None,
) -> None:
    """Append the table to RESULTS.md and the records (one per row) to results.jsonl.
    ``info``: the :func:`env_info` taken when the run started (default: now)."""
    info = info or env_info()
    lines = [
        f"\n## {title}\n",
        f"- hardware: {info['hardware']}; torch {info['torch']}",
        f"- date: {info['date']}; commit: {info['commit']}; run id: {info['run_id']}",
        f"- command: `{info['command']}`",
    ]
    if notes:
        lines.append(f"- notes: {notes}")
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    with open(RESULTS_MD, "a") as f:
        f.write("\n".join(lines) + "\n")
    if records:
        append_records(records, info)


def append_records(records: list[dict], info: dict[str, str] | None = None) -> None:
    """Append one JSON line per record to results.jsonl, led by run id, date, commit, hardware
    and torch version (scripts that may not live to the end write each row as soon as it is
    measured)."""
    info = info or env_info()
    with open(RESULTS_JSONL, "a") as f:
        for rec in records:
            head = {
                k: info[k] for k in ("run_id", "date", "commit", "hardware", "torch") if k in info
            }
            f.write(json.dumps({**head, **rec}) + "\n")
    try:  # the latest-results tables at the top of RESULTS.md follow every write
        refresh(RESULTS_JSONL, RESULTS_MD)
    except (OSError, ValueError) as err:
        print(f"RESULTS.md's latest-results tables were not updated: {err}", file=sys.stderr)
