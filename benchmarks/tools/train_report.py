"""Summarise training runs (their ``metrics.jsonl``) as one table in RESULTS.md.

    python -m benchmarks.tools.train_report --title "..." \\
        --run "tiny tp2 pp2 dp2=runs/tiny" --run "openvla-7b tp2=runs/7b-tp2" \\
        --command "torchrun --nproc-per-node 2 -m parallax.train ..."

Per run: steps, first and last loss, last action accuracy, and the medians after ``--skip``
warm-up steps of step time, tokens/s (whole job and per GPU), MFU, and rank 0's peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.tools.common import append_results, print_table


def summarise(path: Path, skip: int, gpus: int) -> list[object]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    if not rows:
        raise ValueError(f"{path}/metrics.jsonl is empty")
    timed = rows[skip:] or rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    return [
        len(rows),
        rows[0]["loss"],
        rows[-1]["loss"],
        rows[-1]["action_accuracy"],
        med("step_time_s"),
        med("tokens_per_s"),
        med("tokens_per_s") / gpus,
        med("mfu"),
        max(r["memory_gib"] for r in rows),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--title", required=True)
    p.add_argument("--run", action="append", required=True, help="'label=run dir'")
    p.add_argument("--gpus", type=int, default=1, help="devices per run, for per-GPU figures")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--notes", default="")
    p.add_argument("--command", default="", help="the exact commands that made the runs")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    columns = [
        "run",
        "steps",
        "first loss",
        "last loss",
        "last acc",
        "step s",
        "tokens/s",
        "tokens/s/GPU",
        "MFU",
        "rank-0 peak GiB",
    ]
    rows, records = [], []
    for spec in args.run:
        label, _, path = spec.partition("=")
        try:
            values = summarise(Path(path), args.skip, args.gpus)
        except (OSError, ValueError) as err:
            rows.append([label, f"missing: {err}"] + ["-"] * (len(columns) - 2))
            continue
        rows.append([label, *values])
        records.append(
            {
                "benchmark": "train",
                "framework": "parallax",
                "layout": label,
                "step_time_s": values[4],
                "tokens_per_s_per_gpu": values[6],
                "mfu": values[7],
                "peak_mem_gib": values[8],
            }
        )
    print_table(args.title, columns, rows)
    if not args.no_write:
        notes = args.notes + (f"; commands: `{args.command}`" if args.command else "")
        append_results(args.title, columns, rows, notes=notes.strip("; "), records=records)


if __name__ == "__main__":
    main()
