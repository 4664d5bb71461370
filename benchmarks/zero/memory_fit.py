"""Does a 7B model train on a 24 or 32 GB card? Each row caps this GPU's memory (torch's
per-process fraction, as ``--gpu-memory-limit`` does), asks ``parallax.plan`` for the fastest
layout that fits the cap, trains it and reports GPU peak, host peak RSS, samples/s, MFU and the
ratio to parallax's uncapped best on the same GPU and workload, beside the planner's prediction.

    python -m benchmarks.zero.memory_fit [--rows openvla-32,openvla-24,...] [--steps 1] [--compile]
    python -m benchmarks.zero.memory_fit --smoke     # tiny presets on the CPU, writes nothing

Rows (issue 26): OpenVLA-7B full fine-tuning at global batch 256 under 32 GiB (an RTX 5090) and
24 GiB (an RTX 4090), and under 32 GiB planned for at most 95 GiB of host memory
(``openvla-32-host95``: the planner then sums more of the gradient on the GPU; issue 42's host
target), with the peers: torch FSDP2 + ``CPUOffloadPolicy`` (activation
checkpointing, fused AdamW; :mod:`benchmarks.zero.fsdp2_offload`) under 32 GiB, and DeepSpeed
ZeRO-2 and ZeRO-3 with ``offload_optimizer: cpu`` (its CPU Adam; issue 42,
:mod:`benchmarks.zero.deepspeed_offload`) under 32 and 24 GiB, each at micro-batch
``--peer-micro-batch`` (a DeepSpeed row that cannot import or build records the error as its
status); LLaVA-NeXT-7B full fine-tuning under 24 GiB; OpenVLA-7B LoRA at batch 16 under 16 GiB.
A row runs ``--host-adamw auto`` (the default since 2026-12-06: one-pass on GPUs; before, torch's
kernel) unless its name ends in ``-torch`` or ``-one-pass``, and whole fp32 masters on the host
unless it ends in ``-split`` (``--host-masters split``: 2 bytes of host memory a parameter less);
each record says which ran.
Every row runs in a process of its own, watched: its host RSS over ``--host-limit`` GiB (the H200
host has 125) ends it, reported as not fitting the host; one past ``--row-timeout`` is ended too
and keeps the timed steps it finished (its status says how many of ``--steps``). The ratio's
reference is the same invocation's uncapped row of the workload (``openvla``, ``llava``,
``lora``: the same data) where it ran, else on an H200 parallax's uncapped best in RESULTS.md
(``UNCAPPED``, whose data may differ); on another card without an uncapped row, no ratio.
MFU: the family's model FLOPs (``Recipe.flops``: 6 x parameters x tokens for what trains, plus
attention) per step over the step time and 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import torch

from benchmarks.plan.accuracy import Row, described, measure, plan_row, steady_median
from benchmarks.tools.common import PEAK_BF16_TFLOPS, append_results, env_info, print_table
from parallax.plan.machine import GIB
from parallax.train.memory_limit import cap_gpu_memory, default_allocator
from parallax.train.monitor import host_memory_gib

ROWS = (
    Row("openvla-32", "openvla-7b", 256, limit=32.0),
    Row("openvla-24", "openvla-7b", 256, limit=24.0),
    Row("openvla-32-host95", "openvla-7b", 256, limit=32.0, host=95.0),  # host memory's target
    # ... under 24 GiB: whole masters fit no layout's host, the planner splits them (auto)
    Row("openvla-24-host92", "openvla-7b", 256, limit=24.0, host=92.0),
    # ... under 32 GiB: whole masters fit only slower layouts there, split ones win
    Row("openvla-32-host92", "openvla-7b", 256, limit=32.0, host=92.0),
    Row("openvla-32-one-pass", "openvla-7b", 256, limit=32.0, host_adamw="one-pass"),
    Row("openvla-24-one-pass", "openvla-7b", 256, limit=24.0, host_adamw="one-pass"),
    # the masters split on the host (--host-masters split: 2 bytes a parameter less)
    Row("openvla-32-split", "openvla-7b", 256, limit=32.0, host_masters="split"),
    Row("openvla-24-split", "openvla-7b", 256, limit=24.0, host_masters="split"),
    Row("openvla-32-torch", "openvla-7b", 256, limit=32.0, host_adamw="torch"),  # (the default
    Row("openvla-24-torch", "openvla-7b", 256, limit=24.0, host_adamw="torch"),  # to 2026-12-06)
    Row("fsdp2-offload-32", "openvla-7b", 256, limit=32.0),  # the peers
    Row("deepspeed-z2-offload-32", "openvla-7b", 256, limit=32.0),
    Row("deepspeed-z3-offload-32", "openvla-7b", 256, limit=32.0),
    Row("deepspeed-z2-offload-24", "openvla-7b", 256, limit=24.0),
    Row("deepspeed-z3-offload-24", "openvla-7b", 256, limit=24.0),
    Row("llava-24", "llava-v1.6-vicuna-7b", 32, limit=24.0),
    Row("lora-16", "openvla-7b", 16, finetune="lora", limit=16.0),
    # uncapped, planned: the same invocation's reference for its workload's ratio
    Row("openvla", "openvla-7b", 256),
    # planned with torch's host kernel, the uncapped choice is ZeRO-1 at micro-batch 8 (the
    # reference of the rows before 2026-12-06; with the one-pass kernel an offload-0.5 layout ties)
    Row("openvla-torch", "openvla-7b", 256, host_adamw="torch"),
    Row("llava", "llava-v1.6-vicuna-7b", 32),
    Row("lora", "openvla-7b", 16, finetune="lora"),
)
SMOKE = (
    Row("tiny-capped", "tiny", 8, limit=0.012),
    Row("tiny-lora", "tiny", 8, finetune="lora"),
    Row("tiny-deepspeed-z2", "tiny", 8),  # on the CPU (gloo) where deepspeed imports
    Row("tiny-deepspeed-z3", "tiny", 8),
)
PEER_MICRO_BATCH = 16
PEERS = ("fsdp2", "deepspeed")  # row-name prefixes of the peers: OpenVLA-7B's workload
# parallax's uncapped best on one H200 (RESULTS.md): samples/s, which row
UNCAPPED = {
    "openvla": (36.4, "openvla_step 1gpu micro 8 opt+compile/cudagraphs (run 9ae9773d9a40)"),
    "llava": (4.071, "llava_step micro 1 opt+compile (run 6a328dcff6d9)"),
    "lora": (56.2, "lora_step batch 16 compile+cudagraphs (session lora5)"),
}
COLUMNS = [
    "row",
    "global batch",
    "layout",
    "GPU GiB",
    "GiB predicted",
    "host GiB",
    "host predicted",
    "step s",
    "step s predicted",
    "samples/s",
    "tokens/s",
    "MFU",
    "x uncapped",
    "status",
]


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def child(row: Row, args) -> dict:
    """One row, in this process: plan under the cap, run, measure."""
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    rec: dict = {}
    if device.type == "cuda":
        cap_gpu_memory(row.limit, device)
    if "deepspeed-z" in row.name:
        got = deepspeed_row(row, args, device, rec)
        if "status" in got:  # it did not run: why, in place of a number
            return {**rec, **got, "host_gib": host_memory_gib()}
    elif row.name.startswith("fsdp2"):
        from benchmarks.zero.fsdp2_offload import measure as peer_measure
        from parallax.families.openvla import OpenVLAConfig

        rec["layout"] = f"fsdp2 cpu-offload, ckpt all, mb {PEER_MICRO_BATCH}"
        got = peer_measure(
            OpenVLAConfig.preset(row.model), row.batch, PEER_MICRO_BATCH, args.steps, args.warmup
        )
    else:
        got = planned_row(row, args, device, rec)
        if "status" in got:
            return got
    step = got["step_s"]
    rec.update(step_s=step, gpu_gib=got["peak_gib"], samples_per_s=row.batch / step)
    if got.get("flops"):
        rec.update(
            tokens_per_s=got["tokens"] / step, mfu=got["flops"] / step / PEAK_BF16_TFLOPS / 1e12
        )
    for key in (
        "step_times",
        "each_step",
        "host_phases",
        "host_adamw",
        "host_masters",
        "alloc_retries",
        "reserved_gib",
    ):
        if key in got:
            rec[key] = got[key]
    rec["host_gib"] = host_memory_gib()  # this row's process: its peak resident set
    return {**rec, "status": "ok"}


def planned_row(row: Row, args, device: torch.device, rec: dict) -> dict:
    """A parallax row: the planner's first choice under the row's cap (its plan kept in
    ``rec`` and said at once), run and measured, each step said as it ends."""
    plan_args = SimpleNamespace(
        compile=args.compile,
        out=args.out,
        machine=args.machine,
        pad_to_multiple_of=args.pad_to_multiple_of,
        grad_clip=None,  # the trainer's default for the row's finetune
    )
    run, best, fits = plan_row(row, plan_args, device, closest=True)
    if best is None:
        return {"status": "the planner found nothing that fits"}
    rec.update(
        layout=described(best, run) + (", compile" if args.compile else ""),
        flags=" ".join(best.layout.argv()),
        predicted_gib=max(r.gpu for r in best.memory) / GIB,
        predicted_host_gib=best.host / GIB,  # (a node of one process: its own memory too)
        predicted_s=best.time.seconds,
    )
    if not fits:  # does the planner's margin refuse a layout that runs? run the nearest
        rec["layout"] += f" (planner: needs {best.gpu / GIB:.1f} GiB, past its margin)"
    run = run.replace(**best.layout.options())
    print("PLAN " + json.dumps(rec), flush=True)  # what a row stopped mid-run still reports
    return measure(run, device, args.steps, args.warmup, on_step=_report_step)


def _report_step(i: int, seconds: float, counters: dict[str, float]) -> None:
    """Each step as it ends, to the watching parent (stdout) and the log (stderr)."""
    compiles = counters.get("compiles", 0.0)
    print("STEP " + json.dumps({"i": i, "s": seconds, "compiles": compiles}), flush=True)
    print(f"step {i}: {seconds:.2f} s, {compiles:g} frame(s) compiled", file=sys.stderr, flush=True)


def finished_steps(lines: list[str], row: Row, args) -> dict:
    """What a row stopped before its end had done: its plan (``PLAN``) and, where any timed
    step (past ``--warmup``) ended, the steady median of those (``STEP`` lines; see child)."""
    rec: dict = {}
    times, each = [], []
    for line in lines:
        if line.startswith("PLAN "):
            rec.update(json.loads(line[len("PLAN ") :]))
        elif line.startswith("STEP "):
            step = json.loads(line[len("STEP ") :])
            if step["i"] >= args.warmup:
                times.append(step["s"])
                each.append({"compiles": step["compiles"]})
    if times:
        step = steady_median(times, each)
        rec.update(step_s=step, step_times=times, samples_per_s=row.batch / step)
    return rec


def deepspeed_row(row: Row, args, device: torch.device, rec: dict) -> dict:
    """A DeepSpeed peer row (``...deepspeed-z2...``, ``...-z3...``): what it measured, its set-up
    kept in ``rec``; or, where it could not run, its ``status`` and the exact ``error`` text (the
    import's, the CPU Adam build's with the compiler's output, or DeepSpeed's own failure)."""
    from benchmarks.zero.deepspeed_offload import ERROR_CHARS, PeerUnavailable
    from benchmarks.zero.deepspeed_offload import measure as ds_measure
    from parallax.families.openvla import OpenVLAConfig

    stage = int(row.name.split("deepspeed-z")[1][0])
    micro = min(args.peer_micro_batch, row.batch)
    rec["layout"] = f"deepspeed zero {stage} offload_optimizer cpu, ckpt all, mb {micro}"
    config = OpenVLAConfig.preset(row.model)
    try:
        got = ds_measure(config, stage, row.batch, micro, args.steps, args.warmup, device)
    except torch.cuda.OutOfMemoryError:
        raise  # reported as every row's
    except PeerUnavailable as err:
        return {"status": f"deepspeed unavailable: {str(err)[:160]}", "error": str(err)}
    except Exception as err:  # DeepSpeed's assertions and the like: the row, not the table, ends
        first = (str(err).strip().splitlines() or [""])[0]
        status = f"deepspeed failed: {type(err).__name__}: {first[:140]}"
        return {"status": status, "error": traceback.format_exc()[-ERROR_CHARS:]}
    for key in ("deepspeed", "cpu_adam_build_s", "params", "ds_host_estimate_gib", "loss"):
        rec[key] = got[key]
    return got


def spawn(row: Row, args) -> dict:
    """Run ``row`` in a child process; end it when its host RSS passes ``--host-limit``."""
    cmd = [sys.executable, "-m", "benchmarks.zero.memory_fit", "--child", row.name]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", args.out]
    cmd += ["--smoke"] * args.smoke + ["--compile"] * args.compile
    cmd += ["--machine", args.machine] if args.machine else []
    cmd += ["--pad-to-multiple-of", str(args.pad_to_multiple_of)]
    cmd += ["--peer-micro-batch", str(args.peer_micro_batch)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # (SIGABRT: every thread's stack)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    lines: list[str] = []  # read as they come: a full pipe would stall the child
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    start, most, status = time.monotonic(), 0.0, None
    while proc.poll() is None:
        most = max(most, _rss_gib(proc.pid))
        if most > args.host_limit:
            status = f"host RSS over {args.host_limit:g} GiB after {time.monotonic() - start:.0f} s"
        elif time.monotonic() - start > args.row_timeout:
            status = f"stopped at --row-timeout {args.row_timeout:g} s"
        if status:
            if status.startswith("stopped"):  # where it was: the stacks into the log
                os.kill(proc.pid, signal.SIGABRT)
                time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(10)
            done = finished_steps(lines, row, args)
            if "step_times" in done:
                status += f"; {len(done['step_times'])} of {args.steps} timed steps done"
            return {**done, "status": status, "host_gib": most}
        time.sleep(0.2)
    reader.join(10)
    for line in lines:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"status": f"exit code {proc.returncode} (see the log)", "host_gib": most}


def workload(rec: dict) -> str:
    """The uncapped workload a row is measured against (the peer's: OpenVLA's)."""
    return "openvla" if rec["name"].startswith(PEERS) else rec["name"].split("-")[0]


def references(records: list[dict], hardware: str = "1x NVIDIA H200") -> dict[str, tuple]:
    """Each workload's uncapped samples/s: this invocation's uncapped row where it ran, else,
    on an H200 (``hardware``), parallax's best there in RESULTS.md (``UNCAPPED``, which may have
    had other data); on another card no ratio rather than one against another card."""
    refs = dict(UNCAPPED) if "H200" in hardware else {}
    for rec in records:
        if rec.get("limit") is None and rec.get("samples_per_s") and rec["name"] in UNCAPPED:
            refs[rec["name"]] = (rec["samples_per_s"], "this invocation's uncapped row")
    return refs


def table_row(rec: dict, refs: dict[str, tuple[float, str]] = UNCAPPED) -> list[object]:
    nan = float("nan")
    best = refs.get(workload(rec))
    ratio = rec["samples_per_s"] / best[0] if best and rec.get("samples_per_s") else nan
    cap = f" (cap {rec['limit']:g} GiB)" if rec.get("limit") else ""
    return [
        rec["name"] + cap,
        rec["batch"],
        rec.get("layout", "-"),
        rec.get("gpu_gib", nan),
        rec.get("predicted_gib", nan),
        rec.get("host_gib", nan),
        rec.get("predicted_host_gib", nan),
        rec.get("step_s", nan),
        rec.get("predicted_s", nan),
        rec.get("samples_per_s", nan),
        rec.get("tokens_per_s", nan),
        f"{100 * rec['mfu']:.1f} %" if rec.get("mfu") else "-",
        ratio,
        rec["status"],
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="(compiled: the second step recompiles)")
    p.add_argument("--host-limit", type=float, default=112.0, help="GiB of host RSS a row may use")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds a row may take")
    p.add_argument("--machine", help="plan with this profile (parallax.plan calibrate)")
    p.add_argument(
        "--pad-to-multiple-of", type=int, default=1, metavar="N", help="OpenVLA rows' text width"
    )
    p.add_argument("--compile", action="store_true", help="--compile in every parallax row")
    p.add_argument(
        "--peer-micro-batch",
        type=int,
        default=PEER_MICRO_BATCH,
        help="the DeepSpeed rows' micro-batch",
    )
    p.add_argument("--out", default="runs/memory_fit", help="the runs' --out")
    p.add_argument("--smoke", action="store_true", help="tiny presets on the CPU; no writes")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    default_allocator()  # as parallax.train runs, and as the planner assumes
    rows = SMOKE if args.smoke else ROWS
    if args.child:
        row = next(r for r in rows if r.name == args.child)
        try:
            rec = child(row, args)
        except torch.cuda.OutOfMemoryError as err:
            rec = {"status": f"out of memory: {str(err).splitlines()[0][:120]}"}
        except (ValueError, RuntimeError) as err:
            rec = {"status": f"error: {str(err).splitlines()[0][:120]}"}
        print("RESULT " + json.dumps(rec), flush=True)
        return []
    if args.rows:
        rows = tuple(r for r in rows if r.name in args.rows.split(","))
    info = env_info()
    records = []
    for row in rows:
        rec = {"benchmark": "memory_fit", **dataclasses.asdict(row), **spawn(row, args)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    title = "memory_fit: 7B training under a GPU memory cap on one GPU"
    refs = references(records, info["hardware"])
    table = [table_row(r, refs) for r in records]
    print_table(title, COLUMNS, table)
    if not (args.smoke or args.no_write):
        notes = (
            "GPU GiB = torch.cuda.max_memory_allocated; host GiB = the row process's peak RSS "
            f"(VmHWM; killed past --host-limit {args.host_limit:g}); step = median of the "
            f"{args.steps} timed step(s) after {args.warmup} warm-up that compiled nothing (a "
            "micro-batch of a text length first seen recompiles the blocks), back to back, the "
            "batches made a step ahead in a thread as parallax.train makes them; MFU against "
            f"{PEAK_BF16_TFLOPS:g} TFLOP/s; x uncapped = samples/s over parallax's uncapped "
            "samples/s of the workload: "
            + (
                "; ".join(f"{k}: {v[0]:.4g} samples/s, {v[1]}" for k, v in refs.items())
                or "none on this card (no uncapped row ran; the H200's figures are not this card's)"
            )
        )
        append_results(title, COLUMNS, table, notes, records, info)
    return records


if __name__ == "__main__":
    main()
