"""How long the planner's search takes: ``python -m parallax.plan`` (and ``--layout auto``, which
runs the same search) for the presets users plan, at several GPU counts and memories. The search
runs on the host's CPU, so this is a CPU result; each case is timed in this process after one
untimed search of the same model (the blocks' parameter counts are built once per model and
cached, as in a real run).

    python -m benchmarks.plan.search_time [--models openvla-7b,llava-v1.6-vicuna-7b,pi0]
        [--gpus 1,8,64] [--gpu-memory 140,24] [--repeat 3] [--smoke] [--no-append]

Prints one table (seconds per search, median of ``--repeat``; the first layout printed, so two
commits' rows show the same plan) and appends it to RESULTS.md and results.jsonl; ``--smoke``
(tiny preset, two cases) writes nothing.
"""

from __future__ import annotations

import argparse
import io
import time

from rich.console import Console

from benchmarks.tools.common import append_results, env_info, median, print_table
from parallax.plan.cli import plan

COLUMNS = ["model", "GPUs", "GiB/GPU", "search s", "first layout"]


def _search(model: str, gpus: int, memory: str) -> str:
    argv = ["--model", model, "--gpus", str(gpus), "--gpu-memory", memory, "--top", "3"]
    result, _ = plan(argv, Console(file=io.StringIO(), width=300))
    return result.ranked[0].layout.describe() if result.ranked else "none fits"


def measure(model: str, gpus: int, memory: str, repeat: int) -> dict:
    times, first = [], ""
    for _ in range(repeat):
        start = time.perf_counter()
        first = _search(model, gpus, memory)
        times.append(time.perf_counter() - start)
    return dict(model=model, gpus=gpus, gpu_memory=memory, search_s=median(times), first=first)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="openvla-7b,llava-v1.6-vicuna-7b,pi0")
    p.add_argument("--gpus", default="1,8,64")
    p.add_argument("--gpu-memory", default="140,24")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny preset, two cases, no writing")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.gpus, args.gpu_memory, args.repeat = "tiny", "1,2", "1", 1
    info = env_info()
    records = []
    for model in args.models.split(","):
        _search(model, 1, args.gpu_memory.split(",")[0])  # its blocks counted, untimed
        for gpus in (int(g) for g in args.gpus.split(",")):
            for memory in args.gpu_memory.split(","):
                records.append(measure(model, gpus, memory, args.repeat))
    rows = [[r["model"], r["gpus"], r["gpu_memory"], r["search_s"], r["first"]] for r in records]
    print_table("planner search time (CPU)", COLUMNS, rows)
    if not (args.smoke or args.no_append):
        marked = [dict(benchmark="plan_search", **r) for r in records]
        append_results("planner search time (CPU)", COLUMNS, rows, records=marked, info=info)
    return records


if __name__ == "__main__":
    main()
