"""One configuration (layout x framework) of the OpenVLA training-step benchmark: build the
trainer, warm it up, time its steps, and read memory, loss and (pipelines) the bubble.

Every function here runs on every rank of the configuration and returns this rank's
:class:`Measured`; the caller merges them across ranks.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from benchmarks.common import peak_memory_gib, sync
from benchmarks.native import (
    Workload,
    build_ddp_zero,
    build_dtensor_tp,
    build_fsdp2,
    build_pipelining,
    build_single,
    dp_share,
)
from parallax.context import ParallelContext, init_parallel

Batch = dict[str, torch.Tensor]
NATIVE = ("torch-single", "torch-ddp-zero", "torch-fsdp2", "torch-dtensor-tp", "torch-pipelining")
FRAMEWORKS = ("parallax", *NATIVE)
# parallax's speed options per variant (TrainConfig fields); "opt" is the Trainer's defaults
BASE = dict(
    logits="all",
    fused_projections=False,
    compile=False,
    pipeline_syncs=True,
    overlap_param_gather=False,
)
VARIANTS = {
    "opt": {},
    "base": BASE,
    "opt+compile": dict(compile=True),
    # the all-gather waited for inside step(), to measure the overlap
    "opt/gather-sync": dict(overlap_param_gather=False),
    "opt+compile/gather-sync": dict(compile=True, overlap_param_gather=False),
    # the compiled blocks replayed as CUDA graphs (--cuda-graphs: torch.compile's
    # reduce-overhead mode); the second name is the one run 9ae9773d9a40 recorded
    "opt+compile+cudagraphs": dict(compile=True, cuda_graphs=True),
    "opt+compile/cudagraphs": dict(compile=True, cuda_graphs=True),
}


@dataclass(frozen=True)
class Layout:
    """A ``tp x pp x dp`` layout; ``1gpu`` is the single-device one."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        parts = [f"{a}{n}" for a, n in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)) if n > 1]
        return "".join(parts) or "1gpu"

    @classmethod
    def parse(cls, text: str) -> Layout:
        text = text.strip().lower()
        if text in ("1gpu", "1", "single"):
            return cls()
        pairs = re.findall(r"(tp|pp|dp)(\d+)", text)
        axes = [a for a, _ in pairs]
        if not pairs or "".join(a + n for a, n in pairs) != text or len(set(axes)) != len(axes):
            raise ValueError(f"layout {text!r}: write e.g. 1gpu, tp2, pp2, dp2, tp2pp2dp2")
        return cls(**{a: int(n) for a, n in pairs})

    def supports(self, framework: str) -> bool:
        """Whether ``framework`` can run this layout (the natives cover one axis each)."""
        if framework == "parallax":
            return True
        return {
            "torch-single": self.gpus == 1,
            "torch-ddp-zero": self.dp == self.gpus > 1,
            "torch-fsdp2": self.dp == self.gpus > 1,
            "torch-dtensor-tp": self.tp == self.gpus > 1,
            "torch-pipelining": self.pp == self.gpus > 1,
        }[framework]


@dataclass
class Measured:
    """This rank's view of one configuration (bubbles only on rank 0 of a pipeline)."""

    step_times: list[float]
    peak_gib: float
    loss: float
    extra: dict[str, float] = field(default_factory=dict)


def time_steps(
    step: Callable[[], object], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], float]:
    """Seconds per step after ``warmup`` steps, and the last loss (read once, after timing).

    On a GPU a step's time is the interval between its start and the next step's start on the
    compute stream (CUDA events, one synchronisation at the end): the steady-state time per
    step, which counts work a step leaves in flight for the next one (parallax's deferred
    all-gathers, FSDP2's prefetches) where it really lands. Elsewhere, wall time with a
    synchronisation after each step."""
    out = None
    for _ in range(warmup):
        out = step()
    sync(device)
    times = []
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        for k in range(steps):
            marks[k].record()
            out = step()
        marks[steps].record()
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        for _ in range(steps):
            start = time.perf_counter()
            out = step()
            sync(device)
            times.append(time.perf_counter() - start)
    return times, math.nan if out is None else float(_loss(out).detach())


def _loss(out) -> torch.Tensor:
    """The loss of a step's output: a dict (natives) or parallax's ``StepOutput``."""
    return out["loss"] if isinstance(out, dict) else out.loss


def run_native(
    framework: str,
    wl: Workload,
    device: torch.device,
    microbatches: Sequence[Batch],
    warmup: int,
    steps: int,
) -> Measured:
    """Build ``framework`` over every rank of the default group and time its steps."""
    builders = {
        "torch-single": build_single,
        "torch-ddp-zero": build_ddp_zero,
        "torch-fsdp2": build_fsdp2,
        "torch-dtensor-tp": build_dtensor_tp,
    }
    if framework == "torch-pipelining":
        runner = build_pipelining(wl, device, len(microbatches), microbatches[0])
    else:
        runner = builders[framework](wl, device)
    times, loss = time_steps(lambda: runner.step(microbatches), device, warmup, steps)
    return Measured(times, peak_memory_gib(device), loss)


def parallax_config(
    layout: Layout, wl: Workload, model: str, global_batch: int, variant: str = "opt"
):
    """The :class:`~parallax.train.config.TrainConfig` of the parallax rows of ``variant``
    (:data:`VARIANTS`: ``base`` turns every speed option off)."""
    from parallax.train.config import TrainConfig

    cfg = TrainConfig(
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        model=model,
        precision="bf16" if wl.autocast is not None else "fp32",
        global_batch_size=global_batch,
        micro_batch_size=wl.micro_batch,
        schedule="1f1b",
        chunks=1,
        lr=wl.lr,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=wl.weight_decay,
        grad_clip=wl.grad_clip,
        overlap_grad_reduce=True,
        activation_checkpointing=wl.activation_checkpointing,
        seed=wl.seed,
        **VARIANTS[variant],
    )
    cfg.check()
    return cfg


def run_parallax(
    layout: Layout,
    wl: Workload,
    ctx: ParallelContext,
    model: str,
    microbatches: Sequence[Batch],
    warmup: int,
    steps: int,
    variant: str = "opt",
    compile_backend: str = "inductor",
) -> Measured:
    """parallax's Trainer on this layout; for pp, one more step recorded on a Timeline gives
    the measured bubble and the simulated one (the schedule fed the measured stage times).
    Labels stay on the host, as the data loader gives them: the Trainer reads the labelled
    positions from them without a device synchronisation."""
    from parallax.train.trainer import Trainer

    cfg = parallax_config(layout, wl, model, len(microbatches) * wl.micro_batch, variant)
    trainer = Trainer(cfg, ctx, compile_options={"backend": compile_backend})
    mine = dp_share(microbatches, trainer.ctx.dp_rank, trainer.ctx.dp_size)
    mine = [{**mb, "labels": mb["labels"].cpu()} for mb in mine]
    times, loss = time_steps(lambda: trainer.train_step(mine), ctx.device, warmup, steps)
    measured = Measured(times, peak_memory_gib(ctx.device), loss)
    if layout.pp > 1:
        measured.extra.update(pipeline_bubbles(trainer, mine))
    return measured


def pipeline_bubbles(trainer, microbatches: Sequence[Batch]) -> dict[str, float]:
    """Measured and simulated bubble of one recorded step (on global rank 0)."""
    from benchmarks.pipeline_bubble import measured_costs
    from parallax.pipeline import (
        Timeline,
        gather_events,
        measured_bubble,
        simulate,
    )

    timeline = Timeline()
    trainer.train_step(microbatches, timeline=timeline)
    sync(trainer.ctx.device)
    events = gather_events(timeline, trainer.ctx)
    if events is None:
        return {}
    schedule = trainer.schedule
    fwd, bwd = measured_costs(events, schedule.num_stages)
    return {
        "bubble_measured": measured_bubble(events),
        "bubble_simulated": simulate(schedule, fwd, bwd).bubble_fraction,
    }


def gather(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's ``obj`` over the gloo control group (``None``: one process). Control
    messages never share a communicator with the frameworks' own NCCL collectives, so a rank
    that failed mid-step cannot match them against a peer's pending gradient reduction."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def free_memory(device: torch.device, reset_peak: bool = False) -> None:
    gc.collect()
    if device.type == "cuda":
        # compiled code and its CUDA-graph trees keep the graphs' memory pools alive: after a
        # --cuda-graphs row the next configuration ran out of memory without this
        reset = getattr(torch.compiler, "reset", None)
        if reset is not None:
            reset()
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        except ImportError:
            pass
        else:
            reset_cudagraph_trees()
        gc.collect()
        torch.cuda.empty_cache()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)


def run_config(layout, framework, wl, args, device, microbatches, contexts, variant=None) -> dict:
    """This rank's outcome of one configuration (``variant``: parallax's, see
    :data:`VARIANTS`): measurements or the error, never raising."""
    try:
        if framework == "parallax":
            if layout.name not in contexts:
                contexts[layout.name] = (
                    ParallelContext.local(device)
                    if layout.gpus == 1
                    else init_parallel(
                        tp=layout.tp,
                        pp=layout.pp,
                        dp=layout.dp,
                        backend="gloo" if args.smoke else None,
                        timeout=args.timeout,
                    )
                )
            m = run_parallax(
                layout,
                wl,
                contexts[layout.name],
                args.model,
                microbatches,
                args.warmup,
                args.steps,
                variant or "opt",
                args.compile_backend,
            )
        else:
            m = run_native(framework, wl, device, microbatches, args.warmup, args.steps)
        return {"times": m.step_times, "peak": m.peak_gib, "loss": m.loss, **m.extra}
    except Exception as err:  # an OOM or a missing piece: record it, keep going
        print(
            f"[rank {dist.get_rank() if dist.is_initialized() else 0}] {layout.name} "
            f"{framework} {variant or ''} failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


def merge(results: list[dict]) -> dict:
    """One configuration across ranks: the slowest rank's median step, the largest peak."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    out = dict(results[0])
    out["step"] = max(statistics.median(r["times"]) for r in results)
    out["peak"] = max(r["peak"] for r in results)
    return out
