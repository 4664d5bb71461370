"""The cost model: a step's predicted time on a machine profile, and where it goes.

Per microbatch and block (from :meth:`Recipe.block_estimates`, per sample times the
micro-batch): matmul FLOPs at the profile's GEMM rate (lower for few rows,
``gemm_half_tokens``), attention FLOPs at its attention rate, element-wise traffic (about
``ELEMENTWISE`` bytes per byte kept for the backward) at its memory bandwidth, and the tp
all-reduces of the block over the tp link. The backward costs the forward's matmuls once for
the input gradients (where anything before needs them) and once more for the share of weights
that train, twice its attention and element-wise work, and a whole forward again where the
block recomputes. The pipeline's time is :func:`parallax.pipeline.simulate` of the schedule with
each stage's forward and backward and the activations' transfer between stages. Beside it:
data parallelism's reductions and gathers (hidden behind the backward and the next forward as
far as they fit), ZeRO-3's gathers of every unit per use, offload's copies (hidden behind the
passes as far as they fit) and host step (behind the last backward only when nothing clips), and
the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallax.models.estimate import Part
from parallax.pipeline import make_schedule, simulate
from parallax.plan.layout import Layout
from parallax.plan.machine import Link, Machine
from parallax.plan.workload import Workload

# element-wise bytes moved in an eager forward per byte kept for the backward, and the share
# --compile leaves of them (fused kernels): fitted to OpenVLA-7B full fine-tuning, LoRA and
# SigLIP-large steps on one H200 (benchmarks/RESULTS.md, profile_rows)
ELEMENTWISE = 6.2
COMPILED = 0.35
ADAMW_BYTES = 36.0  # bytes a fused AdamW step moves per fp32 element (master, grad, moments)
# what hidden collectives still cost, as a share of their time (OpenVLA-7B dp2 on two H200s)
OVERLAP_TAX = 0.3
# --host-adamw one-pass against torch's fused CPU AdamW alone, the same 28 bytes an element: 0.399
# against 0.338 s per 1e9 on the H200 host, 15 threads (benchmarks/RESULTS.md, run 5c30c5c4c420)
ONE_PASS_OVER_FUSED = 0.399 / 0.338
# --host-masters split's host step against the same step with whole masters, in the run (the
# worker's seconds a step on one H100 host, OpenVLA-7B under 24 GiB, both byte planes written
# as int8: 3.50 against 2.45 s; benchmarks/RESULTS.md, run cc6261da434c. Before, with the low
# byte written as uint8, which torch 2.11 narrows one element at a time: 8.28 against 4.64 s)
SPLIT_OVER_WHOLE = 3.50 / 2.45
HOOK_S = 30e-6  # ZeRO-3's Python hooks around one unit's use (gather, release, reduce)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds and their parts (``pipeline`` includes ``tp`` and
    ``recompute``; ``bubble`` is the pipeline's idle share)."""

    seconds: float
    pipeline: float
    compute: float  # forward and backward on the busiest rank, without idling
    recompute: float
    tp: float
    bubble: float
    dp: float
    zero3: float
    offload: float
    optimizer: float

    def parts(self) -> dict[str, float]:
        """Seconds by cause, for saying why one layout is slower than another."""
        idle = self.pipeline - self.compute
        return {
            "bubble": idle,
            "recomputation": self.recompute,
            "tp all-reduces": self.tp,
            "compute": self.compute - self.recompute - self.tp,
            "dp reduction": self.dp,
            "zero-3 gathers": self.zero3,
            "offload": self.offload,
            "optimizer": self.optimizer,
        }


@dataclass(frozen=True)
class _Stage:
    forward: float
    backward: float
    recompute: float
    tp: float


def _link(machine: Machine, span: int) -> Link:
    """The link of a group whose ranks span ``span`` consecutive ranks."""
    return machine.intra if span <= machine.gpus_per_node else machine.inter


def part_times(part: Part, layout: Layout, machine: Machine, compiled: bool, fp8: bool = False):
    """(forward seconds without tp, tp seconds, matmul seconds) of a part's ``count`` pieces on
    one microbatch; with ``fp8`` (``--fp8``) its linears' GEMMs ``fp8_gemm_speedup`` faster."""
    tp, mb = layout.tp, layout.micro_batch_size
    rows = part.tokens * mb
    rate = machine.gemm_tflops * 1e12 * rows / (rows + machine.gemm_half_tokens)
    if fp8 and part.fp8:
        rate *= machine.fp8_gemm_speedup
    gemm = part.gemm_flops * mb / tp / rate
    seq = part.seq or part.tokens  # short sequences leave attention kernels underused
    rate = machine.attention_tflops * 1e12 * seq / (seq + machine.attention_half_tokens)
    attention = part.attention_flops * mb / tp / rate
    moved = ELEMENTWISE * (COMPILED if compiled else 1.0) * part.saved.at(tp) * mb
    elementwise = moved / (machine.hbm_gbs * 1e9)
    comm = 0.0
    if tp > 1 and part.tp_reduces:
        each = part.tp_bytes * mb / part.tp_reduces
        comm = part.tp_reduces * machine.intra.seconds("all_reduce", each, tp)
    n = part.count
    return n * (gemm + attention + elementwise), n * comm, n * gemm


def _stage(model: Workload, layout: Layout, machine: Machine, blocks: range, grads) -> _Stage:
    """One virtual stage's forward and backward per microbatch."""
    compiled, fp8 = bool(model.run.compile), bool(model.run.fp8)
    forward = backward = recompute = tp = 0.0
    # each pass's gradients: written by autograd, then added into ZeRO-1's buffer (read both,
    # write one) or copied to fp32 pass buffers and added into the shard (ZeRO-2/3)
    per_element = 4 * model.e if layout.zero == 1 else 2 * model.e + 12
    params = model.params(layout.tp)
    for i in blocks:
        inputs, weights = grads[i]
        backward += per_element * params[i].trainable_params / (machine.hbm_gbs * 1e9)
        # --quantize-base: each GEMM's weight rebuilt from its codes (read them, write bf16),
        # once in the forward, once in the backward and once more when recomputed
        held, parts = params[i], model.estimates[i].parts
        rebuild = (held.quantized + 2 * held.quantized_params) / (machine.hbm_gbs * 1e9)
        recomputed = any(part.recomputes(layout.checkpointing) for part in parts)
        forward += rebuild
        backward += rebuild * (2 if recomputed else 1)
        for part in parts:
            f, comm, gemm = part_times(part, layout, machine, compiled, fp8)
            again = part.recomputes(layout.checkpointing)
            forward += f + comm
            b = 2 * (f - gemm) + (inputs + weights) * gemm + comm
            if again:
                b += f + comm
                recompute += f
            backward += b
            tp += comm * (3 if again else 2)
    return _Stage(forward, backward, recompute, tp)


def _grad_factors(model: Workload, tp: int) -> list[tuple[float, float]]:
    """Per block: (1 when input gradients are needed there, the share of weights that train)."""
    out, seen = [], False
    for b in model.params(tp):
        seen = seen or b.trainable_params > 0
        out.append((1.0 if seen else 0.0, b.trainable_params / max(b.params, 1)))
    return out


def _stages(model: Workload, layout: Layout, machine: Machine, ranges: list) -> list[_Stage]:
    """Every virtual stage's times, computed once per shape: :func:`_stage` reads only the
    layout's tp, micro-batch size, recompute and whether it is ZeRO-1 (a search times the same
    stages under many dp sizes, offloads and schedules)."""
    key = ("stages", layout.tp, layout.pp, layout.chunks, layout.micro_batch_size)
    key += (layout.checkpointing, layout.zero == 1, machine)
    if key not in model.cache:
        grads = _grad_factors(model, layout.tp)
        model.cache[key] = [_stage(model, layout, machine, r, grads) for r in ranges]
    return model.cache[key]  # type: ignore[return-value]


@lru_cache(maxsize=4096)
def _pipeline(schedule: str, pp: int, m: int, chunks: int, fwd: tuple, bwd: tuple, comm: float):
    result = simulate(make_schedule(schedule, pp, m, chunks), list(fwd), list(bwd), comm)
    return result.makespan, max(result.busy)


def step_time(
    model: Workload, layout: Layout, machine: Machine, memory, exact: bool = True
) -> StepTime:
    """The predicted step at ``layout`` (``memory``: its :class:`RankMemory` per pp rank);
    without ``exact``, a lower bound: the pipeline's idling not simulated."""
    m = model.microbatches(layout)
    ranges = model.ranges(layout.pp, layout.chunks)
    stages = _stages(model, layout, machine, ranges)
    per_rank = [[stages[s] for s in model.stages_of(layout, p)] for p in range(layout.pp)]
    busiest = max(per_rank, key=lambda st: sum(s.forward + s.backward for s in st))
    compute = m * sum(s.forward + s.backward for s in busiest)
    if model.step_objective and m > 1:  # GradCache embeds every microbatch once more
        compute += m * sum(s.forward for s in busiest)
    if layout.pp == 1 or not exact:
        pipeline = compute
    else:
        boundary = max(e.output_bytes for e in model.estimates) * layout.micro_batch_size
        span = layout.tp * layout.dp + 1  # neighbouring stages' ranks are tp x dp apart
        comm = _link(machine, span).seconds("send", boundary, 2)
        pipeline, compute = _pipeline(
            layout.schedule,
            layout.pp,
            m,
            layout.chunks,
            tuple(round(s.forward, 9) for s in stages),
            tuple(round(s.backward, 9) for s in stages),
            round(comm, 9),
        )
    last_backward = max(sum(s.backward for s in st) for st in per_rank)
    first_forward = max(sum(s.forward for s in st) for st in per_rank)
    dp, zero3 = _data_parallel(layout, machine, memory, m, first_forward, last_backward)
    passes = (m, first_forward, last_backward)
    offload = _offload(model, layout, machine, memory, passes, compute)
    busy = max(memory, key=lambda r: r.trainable)
    optimizer = (
        (1 - layout.offload) * ADAMW_BYTES * _elements(busy, layout) / (machine.hbm_gbs * 1e9)
    )
    recompute = m * sum(s.recompute for s in busiest)
    tp = m * sum(s.tp for s in busiest)
    bubble = 1 - compute / pipeline if pipeline > 0 else 0.0
    total = pipeline + dp + zero3 + offload + optimizer
    return StepTime(total, pipeline, compute, recompute, tp, bubble, dp, zero3, offload, optimizer)


def _elements(rank, layout: Layout) -> float:
    """Trainable elements this rank steps (its 1/dp share)."""
    return rank.trainable / layout.dp


def _hidden(comm: float, window: float) -> float:
    """Exposed seconds of ``comm`` issued under ``window`` seconds of compute: what does not
    fit, and a tax on what does (the collectives' kernels take SMs and memory bandwidth from
    the compute they hide under)."""
    return max(0.0, comm - window) + OVERLAP_TAX * min(comm, window)


def _data_parallel(layout, machine, memory, m, first_forward, last_backward):
    """(exposed dp reduction and parameter gathers, exposed ZeRO-3 gathers) per step."""
    if layout.dp == 1:
        return 0.0, 0.0
    link = _link(machine, layout.tp * layout.dp)
    rank = max(memory, key=lambda r: r.trainable)
    reduce = link.seconds("reduce_scatter", 4.0 * rank.trainable, layout.dp)
    weights = rank.weights * (layout.dp if layout.zero == 3 else 1)
    trained = weights * rank.trainable / max(rank.params, 1)  # the weights the step changes
    gather = link.seconds("all_gather", trained, layout.dp)
    passes = 1 if layout.zero == 1 else m  # ZeRO-2/3 reduce every pass as its backward ends
    exposed = passes * _hidden(reduce, last_backward)
    zero3 = 0.0
    if layout.zero < 3:
        exposed += _hidden(gather, first_forward)  # under the next forward
    else:
        # each use gathers every unit (one collective each), prefetched under the compute
        every = link.seconds("all_gather", weights, layout.dp)
        every += (rank.units - 1) * link.latency_us * 1e-6
        hooks = rank.units * HOOK_S
        zero3 = m * (_hidden(every, first_forward) + hooks)
        if layout.reshard_after_forward:  # gathered again for the backward
            zero3 += m * (_hidden(every, last_backward) + hooks)
        else:  # once a step, kept
            zero3 = _hidden(every, first_forward) + m * 2 * hooks
    return exposed, zero3


def _offload(model: Workload, layout, machine, memory, passes, compute) -> float:
    """Exposed seconds of offload's work per step (:mod:`parallax.optim.zero.offload.host_steps`).

    Under the passes: each pass's gradients go down to the host accumulator and, after the
    first, the accumulator comes up to be added to on the device (the model's bytes each way,
    concurrent; the last pass takes the norm there too); unclipped, once a bucket is whole the
    host's worker makes its fp32 gradient and steps it.
    After them: the fp32 gradient again, AdamW on the host and each bucket's new weights
    converted for the upload, whose copies run beside the next bucket's step; with
    ``--host-adamw one-pass`` one loop does all three (28 bytes an element, as many as torch's
    fused kernel moves alone; the profile's ``host_one_pass_s`` where calibrated, else
    :data:`ONE_PASS_OVER_FUSED` times the fused kernel's; with split masters
    :data:`SPLIT_OVER_WHOLE` times that, as measured). When nothing
    clips, the worker steps each bucket during the last backward, but there it shares the
    host's cores with the thread launching that backward: SigLIP-large at batch 512, fully
    offloaded and unclipped, waited 0.16-0.76 s a step for a host step of 0.23 s at the
    profile's rates (benchmarks/RESULTS.md, runs c7397a3c47fe and c82e361e1f2c), so none of it
    is counted as hidden.

    A pass's chunks come ready during its backward, so the copies hide under the backwards
    only (the host's adds under the whole passes); where they take longer the step waits for
    the link (a few adds queue at most, :mod:`parallax.optim.zero.offload.accumulators`).
    OpenVLA-7B under a 32 GiB cap at micro-batch 8, whose copies take about 1.5 times its
    backwards, ran 23.4 s a step against 12.5 s at micro-batch 32 (benchmarks/RESULTS.md, run
    6a8fd6ee2dca; the queue was not bounded then). Gradients summed on the GPU
    (``--gpu-accumulation``) cross once, in the step, each bucket's trip under the step of the
    one before: they leave the passes' copies and cost the step nothing more. Where no
    all-gather must follow the uploads (ZeRO-3, or dp 1) the step runs on under the next step's
    first forward, each block waiting for its own weights
    (:meth:`~parallax.optim.ZeroOptimizer.overlap_host_step`): up to that forward of it hides,
    at :data:`OVERLAP_TAX` of its time as a hidden collective (its threads share the host with
    the one launching that forward). Counted as free, it made offload the first choice where
    nothing needs it, by the GPU's optimizer step: OpenVLA-7B LoRA at batch 16 (0.313 s against
    0.314 without offload; offloaded LoRA has run host-bound) and SigLIP-large at batch 512
    on one H200 (0.713-0.716 against 0.718; unclipped, full offload ran 0.86-1.46 s against
    0.69-0.73).
    """
    if not layout.offload:
        return 0.0
    m, first_forward, last_backward = passes
    rank = max(memory, key=lambda r: r.trainable)
    share = layout.offload * rank.trainable / layout.dp  # elements stepped on the host
    passed = share - rank.kept  # ... whose sums cross the link every pass
    node = min(machine.gpus_per_node, layout.world)  # ranks sharing one host
    host = node * share / (machine.host_gbs * 1e9)  # seconds per byte moved per element
    copies = m * node * model.e * passed / (machine.h2d_gbs * 1e9)  # each way, per step
    gradient = (model.e + 4) * host  # the accumulator read, the fp32 gradient written
    window = m * last_backward  # the backwards, beside which the copies run
    clipped = bool(model.run.grad_clip)
    under = max(copies - window, 0.0 if clipped else gradient - compute)
    step = gradient * clipped + machine.host_adam_s * node * share / 1e9 + (4 + model.e) * host
    if model.run.host_step_one_pass:
        one_pass = machine.host_one_pass_s or ONE_PASS_OVER_FUSED * machine.host_adam_s
        step = one_pass * node * share / 1e9
        step *= SPLIT_OVER_WHOLE if model.run.host_masters_split else 1.0
    if layout.zero == 3 or layout.dp == 1:  # the step runs on under the next first forward
        step = _hidden(step, first_forward)
    return max(0.0, under) + step
