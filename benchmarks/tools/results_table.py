"""The latest result per benchmark and configuration, as tables at the top of RESULTS.md.

``results.jsonl`` holds one record per measured row, appended by every run; ``RESULTS.md`` is the
log of those runs. This script groups the records by benchmark and configuration (the hardware
and the fields of :data:`SPECS` that say what ran: layout, framework, variant, batch sizes...),
keeps the newest record of each group (the last one in the file) and writes one table per
benchmark between the markers at the top of RESULTS.md, leaving the log below untouched::

    python -m benchmarks.tools.results_table           # rewrite the tables in RESULTS.md
    python -m benchmarks.tools.results_table --check   # exit 1 when they are not current

The scripts call :func:`refresh` after appending, so the tables follow every run;
``tests/benchmarks/test_results_table.py`` fails when they are stale.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
RESULTS_MD = BENCHMARKS / "RESULTS.md"
RESULTS_JSONL = BENCHMARKS / "results.jsonl"
BEGIN, END = "<!-- latest:begin -->", "<!-- latest:end -->"


@dataclass(frozen=True)
class Spec:
    """What tells two rows of a benchmark apart, and the values shown for each."""

    script: str  # the module that writes the records
    config: tuple[str, ...]  # record keys of the configuration (the hardware is always one)
    metrics: tuple[tuple[str, str, str], ...]  # (column, record key, format: g, pct, int)


STEP = ("step s", "step_time_s", "g")
PEAK = ("peak GiB", "peak_mem_gib", "g")
MFU = ("MFU", "mfu", "pct")
SPECS: dict[str, Spec] = {
    "tp_layers": Spec(
        "layers.tp",
        ("block", "framework", "layout"),
        (STEP, ("TFLOP/s/GPU", "tflops_per_gpu", "g"), ("x dense", "ratio_to_dense", "g")),
    ),
    "pipeline_bubble": Spec(
        "pipeline.bubble",
        ("schedule", "framework", "layout", "microbatches", "known_shapes"),
        (
            STEP,
            ("bubble measured", "bubble_measured", "g"),
            ("simulated", "bubble_simulated", "g"),
            ("theory", "bubble_theory", "g"),
        ),
    ),
    "zero_memory": Spec(
        "zero.memory",
        ("framework", "layout", "layers", "tokens"),
        (STEP, ("B/param", "bytes_per_param", "g"), ("formula", "formula_bytes_per_param", "g")),
    ),
    "openvla_step": Spec(
        "step.openvla",
        (
            "layout",
            "framework",
            "variant",
            "micro_batch",
            "global_batch",
            "activation_checkpointing",
        ),  # fmt: skip
        (STEP, ("tokens/s/GPU", "tokens_per_s_per_gpu", "int"), MFU, PEAK),
    ),
    "oft_step": Spec(
        "step.oft",
        ("model", "row", "stack", "batch"),
        (
            ("s per step/call", "step_s", "g"),
            ("samples/s", "samples_per_s", "g"),
            ("actions/s", "actions_per_s", "g"),
            MFU,
            ("peak GiB", "peak", "g"),
        ),
    ),
    "openvla_load": Spec(
        "checkpoint.load",
        ("preset", "dtype", "layout", "rank"),
        (
            ("save s", "save_s", "g"),
            ("load s", "load_s", "g"),
            ("read GiB", "read_gib", "g"),
            ("logits err", "logits_rel_err", "g"),
        ),
    ),
    "train": Spec(
        "tools.train_report",
        ("layout", "framework"),
        (STEP, ("tokens/s/GPU", "tokens_per_s_per_gpu", "int"), MFU, PEAK),
    ),
    "llava_step": Spec(
        "step.llava",
        ("framework", "variant", "global_batch", "micro_batch"),
        (STEP, ("samples/s", "samples_per_s", "g"), MFU, PEAK),
    ),
    "contrastive_step": Spec(
        "step.siglip",
        ("model", "framework", "batch", "cuda_graphs"),
        (
            ("step s", "step s", "g"),
            ("samples/s", "samples/s/GPU", "int"),
            ("MFU", "MFU", "pct"),
            ("peak GiB", "peak GiB", "g"),
        ),  # fmt: skip
    ),
    "contrastive_memory": Spec(
        "layers.contrastive_memory",
        ("loss", "dp", "local b"),
        (
            ("largest logits", "largest logits", "int"),
            ("B x B", "naive B x B", "int"),
            ("saved KiB", "saved KiB", "g"),
        ),  # fmt: skip
    ),
    "lora_step": Spec(
        "step.lora",
        ("stack", "variant", "batch", "micro"),
        (STEP, ("samples/s/GPU", "samples_per_s_per_gpu", "g"), MFU, PEAK),
    ),
    "plan_accuracy": Spec(
        "plan.accuracy",
        ("name", "batch", "limit", "layout"),
        (
            ("GiB predicted", "predicted_gib", "g"),
            ("GiB measured", "measured_gib", "g"),
            ("step s predicted", "predicted_s", "g"),
            ("step s measured", "measured_s", "g"),
        ),
    ),
    "zero_bytes": Spec(
        "zero.bytes_per_rank",
        ("model", "dp", "zero"),
        (
            ("counted MiB", "counted_mib", "g"),
            ("formula MiB", "formula_mib", "g"),
            ("plain AdamW MiB", "plain_adamw_mib", "g"),
        ),
    ),
    "memory_fit": Spec(
        "zero.memory_fit",
        ("name", "batch", "limit", "layout"),
        (
            ("GPU GiB", "gpu_gib", "g"),
            ("host GiB", "host_gib", "g"),
            ("step s", "step_s", "g"),
            ("samples/s", "samples_per_s", "g"),
            MFU,
        ),
    ),
    "data_throughput": Spec(
        "data.throughput",
        ("format", "workers", "batch", "image_size"),
        (("samples/s", "samples_per_s", "g"), ("wait ms/step", "wait_ms_per_step", "g")),
    ),
    "data_wait": Spec(
        "data.wait",
        ("source", "prefetch", "train_flags"),
        (STEP, ("wait s", "data_wait_s", "g"), ("wait %", "wait_pct", "g")),
    ),
}
META = ("run_id", "date", "commit", "hardware", "torch", "benchmark", "status")


def benchmark_of(record: dict) -> str:
    """The record's benchmark (records of ``openvla_step`` before 2026-12-03 carried none)."""
    if "benchmark" in record:
        return record["benchmark"]
    return "openvla_step" if {"variant", "gpus", "global_batch"} <= set(record) else "unknown"


def spec_of(name: str, records: list[dict]) -> Spec:
    """The benchmark's :class:`Spec`, or one read off its records: text and whole numbers say
    what ran, other numbers what was measured."""
    if name in SPECS:
        return SPECS[name]
    keys = dict.fromkeys(k for r in records for k in r if k not in META)
    config = tuple(k for k in keys if all(not isinstance(r.get(k), float) for r in records))
    metrics = tuple((k, k, "g") for k in keys if k not in config)
    return Spec("", config, metrics)


def latest(records: list[dict]) -> dict[str, list[dict]]:
    """Per benchmark, the newest record of each configuration, in the order configurations
    last appeared (GPU hardware before CPU)."""
    out = {}
    for name, recs in by_benchmark(records).items():
        spec, group = spec_of(name, recs), {}
        for r in recs:
            key = (r.get("hardware"), *(_text(r.get(k)) for k in spec.config))
            group.pop(key, None)  # a newer record moves its configuration to where it is now
            group[key] = r
        rows = list(group.values())
        out[name] = sorted(rows, key=lambda r: str(r.get("hardware", "")).startswith("CPU"))
    return out


def by_benchmark(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(benchmark_of(r), []).append(r)
    return out


def _text(value: object) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _number(value: object, fmt: str) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    if fmt == "pct":
        return f"{100 * value:.1f} %"
    if fmt == "int":
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _status(r: dict, spec: Spec) -> str:
    """The record's status; a record without one whose measurements are all missing (a row
    that failed before the scripts wrote a status) says so."""
    measured = any(_number(r.get(key), fmt) != "-" for _, key, fmt in spec.metrics)
    status = str(r.get("status") or ("ok" if measured else "no measurement (see the log)"))
    return status if len(status) <= 40 else status[:37] + "..."


def table(name: str, rows: list[dict], spec: Spec) -> list[str]:
    """The markdown lines of one benchmark's table."""
    cols = ["hardware", *spec.config, *(m[0] for m in spec.metrics), "status", "date", "run id"]
    title = f"### {name}" + (f" (`python -m benchmarks.{spec.script}`)" if spec.script else "")
    lines = [
        title,
        "",
        "| " + " | ".join(c.replace("_", " ") for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [_text(r.get("hardware"))] + [_text(r.get(k)) for k in spec.config]
        cells += [_number(r.get(key), fmt) for _, key, fmt in spec.metrics]
        cells += [_status(r, spec), str(r.get("date", "-"))[:10], str(r.get("run_id", "-"))]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def render(records: list[dict]) -> str:
    """Everything between the markers: a short preface and one table per benchmark."""
    groups, recs = latest(records), by_benchmark(records)
    order = [n for n in SPECS if n in groups] + sorted(n for n in groups if n not in SPECS)
    lines = [
        BEGIN,
        "## Latest results",
        "",
        "The newest row of each benchmark and configuration in `results.jsonl`, written by "
        "`python -m benchmarks.tools.results_table` (do not edit by hand). CPU rows are smoke runs "
        "that prove a script works, except `contrastive_memory` and `data_throughput`, whose "
        "measurements are CPU ones. The run id finds the row's entry in the log below.",
    ]
    for name in order:
        lines += ["", *table(name, groups[name], spec_of(name, recs[name]))]
    return "\n".join([*lines, END])


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def with_table(markdown: str, block: str) -> str:
    """``markdown`` with the text between the markers replaced by ``block``."""
    start, end = markdown.find(BEGIN), markdown.find(END)
    if start < 0 or end < start:
        raise ValueError(f"RESULTS.md has no {BEGIN} ... {END} block to write the tables into")
    return markdown[:start] + block + markdown[end + len(END) :]


def refresh(jsonl: Path = RESULTS_JSONL, md: Path = RESULTS_MD) -> bool:
    """Rewrite the tables of ``md`` from ``jsonl``; True when they changed."""
    text = md.read_text()
    new = with_table(text, render(read_records(jsonl)))
    if new != text:
        md.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the tables are not current")
    p.add_argument("--jsonl", type=Path, default=RESULTS_JSONL)
    p.add_argument("--md", type=Path, default=RESULTS_MD)
    args = p.parse_args(argv)
    if args.check:
        text = args.md.read_text()
        current = with_table(text, render(read_records(args.jsonl))) == text
        print("current" if current else "stale: run python -m benchmarks.tools.results_table")
        return 0 if current else 1
    print("updated" if refresh(args.jsonl, args.md) else "already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
