"""How long does a training step wait for its batch, with the next batches made ahead in a
thread (``--prefetch 1``, the default) and without (``--prefetch 0``)?

On the synthetic task and on a LIBERO-format dataset written here (HDF5, two cameras of
``--size`` px smooth colour fields, upside down as LIBERO stores them). One H200, the issue's
OpenVLA-7B run::

    python -m benchmarks.data.wait --write -- --model openvla-7b --precision bf16 --compile \\
        --layout auto --global-batch-size 256

Everything after ``--`` goes to every ``python -m parallax.train`` run (one process per data
source and ``--prefetch`` value). Per run: the median step time and ``data_wait_s`` after
``--skip`` warm-up steps, the largest wait, the wait's share of the step (issue 39 asks for at
most 1 %), and whether the losses equal the ``--prefetch 0`` run's (they must, bit for bit).
``--smoke``: a tiny CPU run that writes no results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.data.writers import make_episodes, write_libero
from benchmarks.tools.common import append_results, env_info, print_table

COLUMNS = ["data", "prefetch", "steps", "step s", "wait s", "max wait s", "wait %", "same losses"]


def write_libero_data(root: Path, episodes: int, length: int, size: int) -> Path:
    """A LIBERO-format dataset of ``episodes`` episodes over two tasks."""
    eps = make_episodes(episodes, length=length, size=size)
    half = max(episodes // 2, 1)
    return write_libero(root / "libero_wait", {"task_a": eps[:half], "task_b": eps[half:]})


def train(out: Path, data: str, prefetch: int, steps: int, extra: list[str]) -> None:
    """One ``python -m parallax.train`` run, a process of its own."""
    cmd = [sys.executable, "-m", "parallax.train", "--out", str(out), "--overwrite"]
    cmd += ["--steps", str(steps), "--save-interval", "0", "--data", data]
    cmd += ["--prefetch", str(prefetch), *extra]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def summarise(out: Path, skip: int) -> dict:
    """The medians after ``skip`` warm-up steps, and the losses."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[skip:] or rows
    step = statistics.median(r["step_time_s"] for r in timed)
    wait = statistics.median(r["data_wait_s"] for r in timed)
    return {
        "steps": len(rows),
        "step_time_s": step,
        "data_wait_s": wait,
        "max_data_wait_s": max(r["data_wait_s"] for r in timed),
        "wait_pct": 100.0 * wait / step,
        "losses": [r["loss"] for r in rows],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", default="synthetic,libero", help="comma list: synthetic, libero")
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--length", type=int, default=60, help="steps per episode")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--root", help="write the runs and the dataset here (kept)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run; writes no results")
    p.add_argument("--write", action="store_true", help="append to RESULTS.md")
    args = p.parse_args(ours)
    if args.smoke:
        args.steps, args.skip, args.episodes, args.length, args.size = 3, 1, 4, 6, 32
        extra = extra or ["--global-batch-size", "4", "--micro-batch-size", "2", "--workers", "0"]
    info = env_info()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        rows, records = measure(args, root, extra)
    title = "Data wait per step with and without --prefetch"
    print_table(title, COLUMNS, rows)
    if args.write and not args.smoke:
        notes = "train flags: " + (" ".join(extra) or "(defaults)")
        append_results(title, COLUMNS, rows, notes, records, info)
    return records


def measure(args, root: Path, extra: list[str]) -> tuple[list[list], list[dict]]:
    """Every source at every ``--prefetch``: a table row and a record each."""
    rows, records = [], []
    for source in args.sources.split(","):
        data = source
        if source == "libero":
            data = f"libero:{write_libero_data(root, args.episodes, args.length, args.size)}"
        first = None
        for depth in args.prefetch:
            out = root / f"{source}_prefetch{depth}"
            train(out, data, depth, args.steps, extra)
            got = summarise(out, args.skip)
            first = first or got["losses"]
            same = got["losses"] == first
            rows.append([source, depth, got["steps"], got["step_time_s"], got["data_wait_s"]])
            rows[-1] += [got["max_data_wait_s"], got["wait_pct"], "yes" if same else "NO"]
            records.append(
                {
                    "benchmark": "data_wait",
                    "source": source,
                    "prefetch": depth,
                    "train_flags": " ".join(extra),
                    **{k: v for k, v in got.items() if k != "losses"},
                    "same_losses": same,
                }
            )
    return rows, records


if __name__ == "__main__":
    main()
