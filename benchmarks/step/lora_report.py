"""The table of one ``benchmarks.step.lora`` session: its rows (each command appends its own to
``results.jsonl``) as one table in ``RESULTS.md``, with the targets' ratios against the faster
HF row of the same batch (``max`` rows against HF's largest batch)."""

from __future__ import annotations

import json
import math

from benchmarks.tools.common import RESULTS_JSONL, append_results, env_info

COLUMNS = [
    "stack",
    "variant",
    "batch",
    "micro",
    "step s",
    "samples/s/GPU",
    "tokens/s/GPU",
    "TFLOP/s/GPU",
    "MFU",
    "peak GiB",
    "x HF samples/s",
    "x HF peak mem",
    "loss 1",
    "status",
]
NOTES = (
    "OpenVLA's LoRA recipe (r 32, alpha 16, dropout 0, every linear but lm_head, AdamW 5e-4, no "
    "clipping; bf16 base) on synthetic batches of BOS + 256 patches + 40 text tokens, loss on "
    "the last 8; random base weights (speed and memory do not depend on them). parallax: the "
    "Trainer with --finetune lora; hf: timm towers + projector + transformers LlamaForCausalLM "
    "(SDPA) + PEFT under bf16 autocast, as vla-scripts/finetune.py runs it (eager) and with each "
    "block torch.compile'd. MFU = LoRA model FLOPs (parallax.models.lora_flops: 2NT forward, 2NT "
    "input gradient where needed, 2NT weight gradient only for trained weights, ~4 x params x "
    "tokens for the frozen base; lm_head over the positions the row computes: 8 for parallax, "
    "297 for HF) / (step x 989 TFLOP/s). x HF: against the faster HF row of the same batch "
    "(targets: >= 1.6x samples/s, <= 0.75x peak memory)"
)


def _group(rec: dict) -> str:
    return "max" if str(rec.get("batch_label", "")).startswith("max") else str(rec["batch"])


def session_rows(session: str, path=RESULTS_JSONL) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("benchmark") == "lora_step" and rec.get("session") == session:
                out.append(rec)
    return out


def table(records: list[dict]) -> list[list]:
    """Rows of :data:`COLUMNS`, parallax first, each with its ratios to the faster HF row."""
    best: dict[str, dict] = {}
    for rec in records:
        ok = rec["stack"] == "hf" and rec["status"] == "ok"
        g = _group(rec)
        if ok and rec["samples_per_s_per_gpu"] > best.get(g, {}).get("samples_per_s_per_gpu", 0):
            best[g] = rec
    rows = []
    order = sorted(records, key=lambda r: (r["stack"] != "parallax", r["variant"], r["batch"]))
    for rec in order:
        ref = best.get(_group(rec))
        speed = mem = math.nan
        if ref is not None and rec["status"] == "ok":
            speed = rec["samples_per_s_per_gpu"] / ref["samples_per_s_per_gpu"]
            mem = rec["peak_mem_gib"] / ref["peak_mem_gib"]
        rows.append(
            [
                rec["stack"],
                rec["variant"],
                rec["batch_label"],
                rec["micro"],
                rec["step_time_s"],
                rec["samples_per_s_per_gpu"],
                rec["tokens_per_s_per_gpu"],
                rec["tflops_per_gpu"],
                rec["mfu"],
                rec["peak_mem_gib"],
                speed,
                mem,
                rec["first_loss"],
                rec["status"],
            ]
        )
    return rows


def report(session: str, path=RESULTS_JSONL, write: bool = True) -> list[list]:
    """Append the session's table to RESULTS.md (and print it); returns its rows."""
    from benchmarks.tools.common import print_table

    records = session_rows(session, path)
    if not records:
        raise SystemExit(f"no lora_step rows of session {session!r} in {path}")
    rows = table(records)
    model = records[0].get("model", "openvla-7b")
    title = f"lora_step: {model}, OpenVLA's LoRA recipe on one GPU, session {session}"
    print_table(title, COLUMNS, rows)
    if write:
        first = records[0]  # where the rows ran, not where the report is written
        info = {**env_info(), "hardware": first["hardware"], "commit": first["commit"]}
        info["torch"] = first.get("torch", "as in the rows' runs")
        info["run_id"] = ", ".join(sorted({r["run_id"] for r in records}))
        append_results(title, COLUMNS, rows, NOTES, info=info)
    return rows
