"""How good are the planner's predictions? Each row asks ``parallax.plan`` for the fastest layout
of a workload on this one GPU (under a memory cap where the row has one), then runs that layout
and measures its peak GPU memory (``torch.cuda.max_memory_allocated``) and step time.

    python -m benchmarks.plan.accuracy [--rows openvla,openvla-32,...] [--compile]
        [--cuda-graphs]   # with --compile: each first choice replayed where the trainer allows
        [--machine FILE] [--steps 4 --warmup 2]
    python -m benchmarks.plan.accuracy --smoke    # tiny presets on the CPU, writes nothing

Rows: OpenVLA-7B full fine-tuning uncapped and under 32 and 24 GiB (``--gpu-memory-limit``:
torch's per-process fraction; the plan is made for that much and no CUDA context); LoRA at batch
16 and 64; LLaVA-NeXT-7B (every image the largest canvas: 5 tiles, 2,928 image tokens, the case
the planner plans for); SigLIP-large at batch 512. Targets (issue 27): peak memory within 10 %,
step time within 15 %, and the first choice at least as fast as the best found by hand
(``HAND``: RESULTS.md's fastest row of the same workload on one H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from benchmarks.tools.common import append_results, env_info, median, print_table
from parallax.context import ParallelContext
from parallax.families.llava_next.synthetic import SyntheticVQA
from parallax.plan.device import detect, device_profile
from parallax.plan.host_fallback import search_run
from parallax.plan.machine import GIB, load
from parallax.plan.machine import default_for as default_machine
from parallax.plan.search import Searcher, option_problems
from parallax.recipe import registry, resolve
from parallax.run import TrainConfig
from parallax.train.memory_limit import cap_gpu_memory, default_allocator
from parallax.train.step_batches import StepBatches
from parallax.train.trainer import Trainer


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    batch: int
    finetune: str = "full"
    limit: float | None = None  # GiB: --gpu-memory-limit
    host: float | None = None  # GiB of host memory the planner may use (--host-memory)
    host_adamw: str = "auto"  # --host-adamw: the offloaded clipped step's kernel
    host_masters: str = "auto"  # --host-masters: the offloaded bf16 masters whole or split


ROWS = (
    Row("openvla", "openvla-7b", 32),
    Row("openvla-32", "openvla-7b", 32, limit=32.0),
    Row("openvla-24", "openvla-7b", 32, limit=24.0),
    Row("lora-16", "openvla-7b", 16, finetune="lora"),
    Row("lora-64", "openvla-7b", 64, finetune="lora"),
    Row("llava", "llava-v1.6-vicuna-7b", 8),
    Row("siglip", "siglip-large-patch16-256", 512),
)
SMOKE = (
    Row("tiny", "tiny", 8),
    Row("tiny-capped", "tiny", 8, limit=0.012),
    Row("tiny-lora", "tiny", 8, finetune="lora"),
    Row("llava-tiny", "llava-tiny", 4),
    Row("siglip-tiny", "siglip-tiny", 8),
)
# the fastest one-H200 rows of RESULTS.md for the same model and batch: (rate, unit, which row).
# OpenVLA's hand rows ran openvla_step's 297-token samples where the trainer's synthetic robot
# task makes about 340, so they compare tokens/s; SigLIP's ran the same images, so samples/s.
HAND = {
    "openvla": (9487.0, "tokens/s", "openvla_step b16 micro 8 compile+cudagraphs (fa6172bbbe39)"),
    "lora-16": (16690.0, "tokens/s", "lora_step batch 16 compile+cudagraphs (585bc4700e5c)"),
    "lora-64": (15119.0, "tokens/s", "lora_step b64 micro 16 ac-vision budget0.8 (661b5fcdb84a)"),
    "siglip": (759.0, "samples/s", "contrastive_step batch 512 (3c219825f612)"),
}  # fmt: skip


def against_hand(rec: dict) -> float:
    """The row's rate over the hand-tuned row's, in that row's unit (nan where there is none)."""
    hand = HAND.get(rec["name"])
    key = {"tokens/s": "tokens_per_s", "samples/s": "samples_per_s"}[hand[1]] if hand else ""
    return rec[key] / hand[0] if hand and rec.get(key) else float("nan")


COLUMNS = [
    "row",
    "batch",
    "planned layout",
    "GiB predicted",
    "GiB measured",
    "memory ratio",
    "step s predicted",
    "step s measured",
    "time ratio",
    "samples/s",
    "x hand",
    "status",
]


def plan_row(row: Row, args, device: torch.device, closest: bool = False):
    """The row's run (resolved), the planner's first choice for one GPU and whether it fits the
    planner's margin: when nothing does, None, or with ``closest`` the layout that comes
    nearest (timed)."""
    precision = "bf16" if device.type == "cuda" else "fp32"
    flags = dict(model=row.model, global_batch_size=row.batch, finetune=row.finetune)
    if args.pad_to_multiple_of > 1 and registry.find(row.model).data.pads_text:
        flags["pad_to_multiple_of"] = args.pad_to_multiple_of  # (the others' text is fixed)
    if args.grad_clip is not None:
        flags["grad_clip"] = args.grad_clip
    if row.host_adamw != "auto":
        flags["host_adamw"] = row.host_adamw
    if row.host_masters != "auto":
        flags["host_masters"] = row.host_masters
    cfg = TrainConfig(precision=precision, compile=args.compile, out=args.out, **flags)
    run = resolve(cfg)
    card = 1.0  # GiB: the CPU smoke plans the tiny presets for a small card
    machine = default_machine(card, None)
    if device.type == "cuda":  # this GPU's own profile, as --layout auto takes it
        gpu = detect(device.index or 0)
        machine, card = device_profile(gpu).machine, gpu.memory_gib
    machine = load(args.machine) if args.machine else machine
    machine = machine.with_(gpus_per_node=1, nodes=1, gpu_memory_gib=card)
    if row.limit is not None:  # torch's fraction caps the allocator, not the CUDA context
        machine = machine.with_(gpu_memory_gib=row.limit, cuda_context_gib=0.0)
    if row.host is not None:
        machine = machine.with_(host_memory_gib=row.host)
    run, model, result, _ = search_run(run, machine, 1, {}, top=1)  # (as --layout auto searches)
    if result.ranked:
        return run, result.ranked[0], True
    if not (closest and result.closest):
        return run, None, False
    return run, Searcher(model, machine).timed(result.closest[0]), False  # (it was untimed)


def described(best, run) -> str:
    """The layout in words, the text padding where the run pads, and no clipping where a full
    fine-tuning run (clipped by default) turned it off."""
    pad = run.pad_to_multiple_of
    words = best.layout.describe() + (f", text padded to {pad}" if pad > 1 else "")
    if best.layout.offload and getattr(run, "host_adamw", "auto") != "auto":
        words += f", host AdamW {run.host_adamw}"
    if best.layout.offload and getattr(run, "host_masters", "auto") == "split":
        words += f", host masters {run.host_masters}"
    return words + (", no clipping" if run.grad_clip == 0 and run.finetune == "full" else "")


def batch_source(run, ctx):
    """A callable giving one global batch of ``run``'s synthetic data (its microbatches)."""
    loader, builder = _loader_and_builder(run, ctx)
    return lambda: [builder(s) for s in loader.next_batch()]


def _loader_and_builder(run, ctx):
    """``run``'s synthetic data: its loader and its collator."""
    recipe = run.recipe
    if recipe.name == "llava":  # every image the largest canvas (2 x 2 tiles): the planner's case
        scale = max(1, run.model_config.tile_size // 56)  # 112 x 112 times 6: 672 x 672 pixels
        data = SyntheticVQA(num_samples=4 * run.global_batch_size, image_scale=scale,
                            image_sizes=((112, 112),), text_only_fraction=0.0)  # fmt: skip
    else:
        data = recipe.data.dataset("synthetic", run)
    return recipe.data.loader(data, run, ctx), recipe.data.collator(run, data)


def steady_median(times: list[float], each: list[dict[str, float]]) -> float:
    """The median of the timed steps that compiled nothing (``each[i]["compiles"]``), or of all
    of them where each did: a recompile is seconds once, not the steady step."""
    steady = [t for t, e in zip(times, each) if not e.get("compiles")]
    return median(steady or times)


def _frames_compiled() -> int:
    """Frames torch's compiler has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _counters(host, device: torch.device) -> dict[str, float]:
    """Running totals read after each step: the offload's phase seconds, the frames torch's
    compiler has compiled (a micro-batch whose text is a new length recompiles the blocks,
    seconds once) and, on a GPU, the allocator's retries (a capped allocator that frees its
    cache and retries waits for the device)."""
    got = dict(host.seconds) if host is not None else {}
    got["compiles"] = float(_frames_compiled())  # a new shape's recompile is not steady state
    if device.type == "cuda":
        got["alloc_retries"] = float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    return got


def measure(run, device: torch.device, steps: int, warmup: int, on_step=None) -> dict:
    """``run`` on this device: median step seconds of the steps that compiled nothing (all of
    them where each did), peak allocated GiB (``step_s``,
    ``peak_gib``), one step's model FLOPs and tokens (``flops``, ``tokens``) and, offloaded,
    the seconds per step of each host phase (``host_phases``).

    The batches come as ``parallax.train`` takes them (:class:`StepBatches`, made a step ahead
    in a thread) and the timed steps run back to back, each from the end of the one before:
    a deferred host step gets no untimed gap to run on in (``step_times``: each one).
    ``on_step(i, seconds, counters)``, where given, hears of each step (warm-ups too) as it ends:
    a watcher that must stop a slow run keeps the steps it finished."""
    ctx = ParallelContext.local(device=device)
    trainer = Trainer(run, ctx)
    loader, builder = _loader_and_builder(run, ctx)
    batches = StepBatches(loader, builder, trainer, 0, warmup + steps, depth=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    times: list[float] = []
    host = getattr(trainer.optimizer, "host", None)  # --offload optimizer: its phase timers
    each: list[dict[str, float]] = []  # per timed step: host phases, compiles, retries
    try:
        start, last = time.perf_counter(), _counters(host, device)
        for i in range(warmup + steps):
            batch = batches.next()
            out = trainer.train_step(batch.microbatches, problem=batch.problem, staged=batch.staged)
            out.loss.item()
            sync(device)
            end, now = time.perf_counter(), _counters(host, device)
            delta = {k: v - last.get(k, 0.0) for k, v in now.items()}
            if i >= warmup:
                times.append(end - start)
                each.append(delta)
            if on_step is not None:
                on_step(i, end - start, delta)
            start, last = end, now
    finally:
        batches.close()
    batch = batch.microbatches
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    flops, tokens = trainer.model_flops(batch), trainer.tokens(batch)
    step = steady_median(times, each)
    out = dict(step_s=step, step_times=times, peak_gib=peak, flops=flops, tokens=tokens)
    # what a long step spent its time on
    out["each_step"] = [{k: round(v, 4) for k, v in e.items()} for e in each]
    if device.type == "cuda":  # a capped allocator that frees its cache and retries is slow;
        # what it reserved past the peak it handed out is the planner's allocator reserve
        out["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        out["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    if host is not None:  # seconds per step in each host phase of the offloaded optimizer
        out["host_phases"] = {k: sum(e.get(k, 0.0) for e in each) / steps for k in host.seconds}
        out["host_adamw"] = "one-pass" if host.one_pass is not None else "torch"  # (as it ran)
        out["host_masters"] = "split" if host.flat.split else "full"
        one = host.one_pass  # compiled for the CPU, or eager where torch could not compile it
        out["host_kernel_compiled"] = bool(one is not None and one.compiled and one.ok)
    return out


def run_row(row: Row, args, device: torch.device) -> dict:
    """Plan, run, and compare one row (its status says what went wrong, if anything)."""
    rec: dict = {"benchmark": "plan_accuracy", **dataclasses.asdict(row)}
    cuda = device.type == "cuda"
    try:
        run, best, _ = plan_row(row, args, device)
        if best is None:
            return {**rec, "status": "nothing fits"}
        rec.update(
            layout=described(best, run),
            flags=" ".join(best.layout.argv()),
            predicted_gib=max(r.gpu for r in best.memory) / GIB,
            predicted_s=best.time.seconds,
        )
        if cuda:
            cap_gpu_memory(row.limit, device)
            torch.cuda.reset_peak_memory_stats(device)
        run = run.replace(**best.layout.options())
        if cuda and args.cuda_graphs and not option_problems(run.replace(cuda_graphs=True)):
            run = run.replace(cuda_graphs=True)  # as the hand-tuned rows ran; not in the model
            rec["layout"] += ", cuda graphs"
        got = measure(run, device, args.steps, args.warmup)
        step = got["step_s"]
        rec.update(measured_s=step, measured_gib=got["peak_gib"], samples_per_s=row.batch / step)
        rec["tokens_per_s"] = got["tokens"] / step if got.get("tokens") else None
        kept = ("step_times", "each_step", "alloc_retries", "reserved_gib", "host_phases")
        rec.update({k: got[k] for k in kept if k in got})
        rec["status"] = "ok"
    except torch.cuda.OutOfMemoryError as err:
        rec["status"] = f"out of memory: {str(err).splitlines()[0][:100]}"
    except (ValueError, RuntimeError) as err:
        rec["status"] = f"error: {str(err).splitlines()[0][:100]}"
    finally:
        gc.collect()
        if cuda:
            cap_gpu_memory(None, device)
            torch.cuda.empty_cache()
    return rec


def table_row(rec: dict) -> list[object]:
    def ratio(a: str, b: str) -> float:
        return rec[a] / rec[b] if rec.get(a) and rec.get(b) else float("nan")

    limit = f" (cap {rec['limit']:g} GiB)" if rec["limit"] else ""
    return [
        rec["name"] + limit,
        rec["batch"],
        rec.get("layout", "-"),
        rec.get("predicted_gib", float("nan")),
        rec.get("measured_gib", float("nan")),
        ratio("predicted_gib", "measured_gib"),
        rec.get("predicted_s", float("nan")),
        rec.get("measured_s", float("nan")),
        ratio("predicted_s", "measured_s"),
        rec.get("samples_per_s", float("nan")),
        against_hand(rec),
        rec["status"],
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="--compile in every row")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile: also --cuda-graphs where the first choice allows it",
    )
    p.add_argument("--machine", help="plan with this profile (parallax.plan calibrate)")
    p.add_argument(
        "--pad-to-multiple-of", type=int, default=1, metavar="N", help="OpenVLA rows' text width"
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        help="every run's --grad-clip (default: the trainer's for its finetune); SigLIP's hand row "
        "ran without clipping",
    )
    p.add_argument("--out", default="runs/plan_accuracy", help="the runs' --out")
    p.add_argument("--smoke", action="store_true", help="tiny presets on the CPU; no writes")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    default_allocator()  # as parallax.train runs, and as the planner assumes
    info = env_info()
    rows = SMOKE if args.smoke else ROWS
    if args.rows:
        wanted = args.rows.split(",")
        rows = tuple(r for r in rows if r.name in wanted)
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    records = [run_row(row, args, device) for row in rows]
    title = "plan_accuracy: the planner's first choice on one GPU, predicted against measured"
    print_table(title, COLUMNS, [table_row(r) for r in records])
    if not (args.smoke or args.no_write):
        notes = (
            "peak = torch.cuda.max_memory_allocated (results.jsonl also keeps the reserved peak "
            "and the allocator's retries); step = median of the timed steps; "
            "targets: memory ratio within 0.9-1.1, time ratio within 0.85-1.15; x hand = "
            "the rate against the fastest RESULTS.md row of the model and batch: "
            + "; ".join(f"{k}: {v[0]:g} {v[1]}, {v[2]}" for k, v in HAND.items())
        )
        append_results(title, COLUMNS, [table_row(r) for r in records], notes, records, info)
    return records


if __name__ == "__main__":
    main()
