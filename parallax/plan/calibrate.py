"""``python -m parallax.plan calibrate [--out FILE]``: measure this machine once, write its profile
(on a GPU also to the device's cache, which the planner then takes there by default:
:mod:`parallax.plan.device`).

In well under two minutes: the GEMM rate at the model's decoder shapes and dtype (at two row
counts, which gives ``gemm_half_tokens``), causal attention's rate, eager element-wise
bandwidth, pinned host-device copies, the host's element-wise bandwidth and AdamW rate (fused
on the CPU where this torch has it), on a GPU with FP8 tensor cores the rowwise-scaled FP8
GEMM's speed-up over bf16 at the same shapes (``--fp8``), and under ``torchrun`` the
collectives' bandwidth and latency within a node (and across nodes, with one rank per node) at
a few sizes. On a machine
without a GPU every size is tiny and the collectives run on gloo, so tests can run it; what
it could not measure stays at the nearest shipped default, and the profile's ``notes`` say so.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallax.context import shutdown
from parallax.optim.zero.offload.host_adamw import HostAdamW
from parallax.optim.zero.offload.host_kernels import host_threads
from parallax.plan.device import Detect, cache_path
from parallax.plan.device import detect as detect_device
from parallax.plan.machine import GIB, LINKS, Link, Machine, default_for, save
from parallax.plan.options import parse_calibrate
from parallax.recipe import registry
from parallax.tensor.fp8 import E4M3, cast_rows, scaled_mm, support_problem

log = logging.getLogger(__name__)


def _timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemm(device, dtype, hidden: int, inner: int, rows: int, iters: int) -> float:
    """TFLOP/s of a ``(rows, hidden) @ (hidden, inner)`` product."""
    a = torch.randn(rows, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, inner, device=device, dtype=dtype)
    s = _timed(lambda: a @ b, device, iters)
    return 2.0 * rows * hidden * inner / s / 1e12


def fp8_speedup(device, hidden: int, inner: int, rows: int, iters: int) -> float | None:
    """How many times faster ``torch._scaled_mm`` (rowwise, operands already cast) runs a
    ``(rows, hidden) @ (hidden, inner)`` product than bf16; None where FP8 cannot run."""
    if device.type != "cuda" or support_problem(device) or hidden % 16 or inner % 16:
        return None
    a = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    b = torch.randn(inner, hidden, device=device, dtype=torch.bfloat16)
    (qa, sa), (qb, sb) = cast_rows(a, E4M3), cast_rows(b, E4M3)
    fp8 = _timed(lambda: scaled_mm(qa, qb.t(), sa, sb.t(), fast_accum=True), device, iters)
    return _timed(lambda: a @ b.t(), device, iters) / fp8


def half_rows(rate_many: float, many: int, rate_few: float, few: int) -> float:
    """The rows at which ``rate(r) = R r / (r + half)`` is half its peak, from two points."""
    denominator = rate_few / few - rate_many / many
    if denominator <= 0:
        return 1.0
    return max((rate_many - rate_few) / denominator, 1.0)


def attention(device, dtype, heads: int, head_dim: int, seq: int, iters: int) -> float:
    """TFLOP/s of causal scaled-dot-product attention (half the scores masked)."""
    q, k, v = (torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype) for _ in "qkv")
    s = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, iters)
    return 2.0 * 2 * heads * seq * seq * head_dim / s / 1e12


def elementwise(device, dtype, numel: int, iters: int) -> float:
    """GB/s of eager element-wise kernels: ``x * sigmoid(x)`` reads and writes 5 tensors."""
    x = torch.randn(numel, device=device, dtype=dtype)
    s = _timed(lambda: x * torch.sigmoid(x), device, iters)
    return 5.0 * x.numel() * x.element_size() / s / 1e9


def copies(device, numel: int, iters: int) -> float:
    """GB/s of pinned copies each way (the slower direction)."""
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    gpu = torch.empty(numel, dtype=torch.bfloat16, device=device)
    up = _timed(lambda: gpu.copy_(host, non_blocking=True), device, iters)
    down = _timed(lambda: host.copy_(gpu, non_blocking=True), device, iters)
    return host.numel() * 2 / max(up, down) / 1e9


def host_add(numel: int, iters: int) -> float:
    """GB/s of the host's bf16 accumulation (offload's ``acc += part``: 3 passes)."""
    acc, part = torch.zeros(numel, dtype=torch.bfloat16), torch.ones(numel, dtype=torch.bfloat16)
    s = _timed(lambda: acc.add_(part), torch.device("cpu"), iters)
    return 3.0 * numel * 2 / s / 1e9


def host_adam(numel: int, iters: int) -> float:
    """Seconds per 1e9 parameters of AdamW on the host (fused where this torch has it)."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    s = _timed(opt.step, torch.device("cpu"), iters)
    return s * 1e9 / numel


def host_one_pass(numel: int, iters: int, compiled: bool) -> float:
    """Seconds per 1e9 parameters of ``--host-adamw one-pass`` on the host, as the offload
    runs it: compiled for the CPU on GPU machines (0 where torch cannot compile it there),
    plain torch ops elsewhere."""
    kernel = HostAdamW(compiled=compiled)
    threads, before = host_threads(), torch.get_num_threads()
    if not kernel.prepare([torch.bfloat16], [], threads):
        return 0.0
    master = torch.zeros(numel, requires_grad=True)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)  # (numel,) the sums
    inner = torch.optim.AdamW([master], lr=1e-3)
    torch.set_num_threads(threads)  # (the count it was compiled for, as the worker runs it)
    try:
        pieces = [(master, grad, None, 0)]
        s = _timed(lambda: kernel.step(inner, pieces, 1.0), torch.device("cpu"), iters)
    finally:
        torch.set_num_threads(before)
    return s * 1e9 / numel


def link(group, device, sizes: list[int], iters: int) -> Link | None:
    """Bus bandwidth and latency of all-reduces over ``group`` (a fit of
    ``t = latency + 2 (p-1)/p n / busbw`` over ``sizes`` bytes)."""
    p = dist.get_world_size(group)
    if p < 2:
        return None
    points = []
    for n in sizes:
        x = torch.zeros(n // 4, device=device)
        s = _timed(lambda x=x: dist.all_reduce(x, group=group), device, iters)
        t = torch.tensor([s], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's
        points.append((2.0 * (p - 1) / p * n, t.item()))
    (n0, t0), (n1, t1) = points[0], points[-1]
    slope = max((t1 - t0) / (n1 - n0), 1e-15)
    latency = max(t0 - slope * n0, 1e-6)
    return Link(busbw_gbs=1.0 / slope / 1e9, latency_us=latency * 1e6)


def _shapes(model: str | None) -> tuple[int, int, int, int]:
    """(hidden, intermediate, heads, head dim) of ``--model``'s decoder (or its text tower)."""
    if model is None:
        return 4096, 11008, 32, 128
    recipe = registry.find(model)
    config = recipe.model.resolve(registry.strip_family(model, recipe)).config
    text = getattr(config, "text", config)
    hidden = getattr(text, "hidden_size", None) or text.width
    inner = getattr(text, "intermediate_size", None) or text.mlp_hidden
    heads = getattr(text, "num_attention_heads", None) or text.num_heads
    return hidden, inner, heads, hidden // heads


def measure(model: str | None, precision: str) -> tuple[dict, list[str]]:
    """This process's device and host rates (what :class:`Machine` calls them) and notes."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hidden, inner, heads, hd = _shapes(model)
    scale = 1 if cuda else 16  # tiny on a CPU: tests run it
    rows, few, iters = (4096, 256, 10) if cuda else (256, 32, 3)
    h, f = max(hidden // scale, 64), max(inner // scale, 64)
    many_rate = gemm(device, dtype, h, f, rows, iters)
    few_rate = gemm(device, dtype, h, f, few, iters)
    seq, short = (2048, 256) if cuda else (128, 32)
    long_rate = attention(device, dtype, max(heads // scale, 2), hd, seq, iters)
    short_rate = attention(device, dtype, max(heads // scale, 2), hd, short, iters)
    half = half_rows(many_rate, rows, few_rate, few)
    attention_half = half_rows(long_rate, seq, short_rate, short)
    rates = dict(
        gemm_tflops=many_rate * (rows + half) / rows,
        gemm_half_tokens=half,
        attention_tflops=long_rate * (seq + attention_half) / seq,
        attention_half_tokens=attention_half,
        hbm_gbs=elementwise(device, dtype, (256 if cuda else 1) * 2**20, iters),
        host_gbs=host_add((128 if cuda else 1) * 2**20, iters),
        host_adam_s=host_adam((64 if cuda else 1) * 2**20, iters),
        host_one_pass_s=host_one_pass((64 if cuda else 1) * 2**20, iters, compiled=cuda),
    )
    notes = [f"shapes of {model or 'a 7B Llama'} ({h} x {f}, {dtype})"]
    if cuda:
        rates["h2d_gbs"] = copies(device, 128 * 2**20, iters)
        free, total = torch.cuda.mem_get_info(device)
        rates["gpu_memory_gib"] = total / GIB
        used = total - free - torch.cuda.memory_reserved(device)
        rates["cuda_context_gib"] = max(used, 0) / GIB
        notes.append(f"GPU {torch.cuda.get_device_name(device)}")
        speedup = fp8_speedup(device, h, f, rows, iters)  # None: this GPU runs no FP8
        rates["fp8_gemm_speedup"] = 1.0 if speedup is None else speedup
    else:
        notes.append("no GPU: device rates are the CPU's, copies and GPU memory left at defaults")
    return rates, notes


def measure_links(nodes: int, per_node: int) -> tuple[dict, list[str]]:
    """Collectives within a node and across nodes (a collective over the world; every rank
    calls it)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    sizes = [2**20, 64 * 2**20, 256 * 2**20] if cuda else [2**14, 2**20]
    rank = dist.get_rank()
    intra = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    inter = dist.new_group([n * per_node for n in range(nodes)])
    out, notes = {}, []
    measured = link(intra[rank // per_node], device, sizes, 5)
    if measured is not None:
        out["intra"] = measured
        notes.append(f"all-reduce within a node over {per_node} ranks")
    if nodes > 1 and rank % per_node == 0:
        measured = link(inter, device, sizes, 5)
        if measured is not None:
            out["inter"] = measured
            notes.append(f"all-reduce across {nodes} nodes, one rank each")
    return out, notes


def main(argv: list[str] | None = None, detect: Detect = detect_device) -> int:
    """Measure and write the profile (to ``--out`` and, on a GPU, to the device's cache:
    :func:`parallax.plan.device.cache_path`); ``--out`` and ``--model`` are checked before
    anything is measured (one message, status 2)."""
    device = detect(int(os.environ.get("LOCAL_RANK", 0)))
    cache = str(cache_path(device.name)) if device is not None else None
    try:
        args = parse_calibrate(sys.argv[1:] if argv is None else argv, cache)
        _shapes(args.model)  # an unknown --model, said now
    except ValueError as err:
        print(f"parallax.plan calibrate: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    started = time.perf_counter()
    rates, notes = measure(args.model, args.precision)
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if world > 1:
        links, more = measure_links(world // per_node, per_node)
        rates.update(links)
        notes += more
    base = default_for(rates.get("gpu_memory_gib"), None)
    if "intra" not in rates:
        notes.append("one process: links left at the defaults (run under torchrun to measure)")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    machine = base.with_(
        name=f"measured ({notes[1] if len(notes) > 1 else 'this machine'})",
        host_memory_gib=host,
        gpus_per_node=per_node,
        nodes=max(world // per_node, 1),
        measured=True,
        notes="; ".join(notes + [f"{time.perf_counter() - started:.0f} s"]),
        **{k: v for k, v in rates.items() if k in Machine.__dataclass_fields__},
    )
    if int(os.environ.get("RANK", 0)) == 0:
        for path in [p for p in (args.out, cache) if p is not None]:
            save(machine, path)  # atomic: a planner reading the cache sees all of it or none
            log.info("wrote %s: %s", path, machine)
    if created:
        shutdown()  # (gloo: the ranks meet before the teardown)
    return 0


__all__ = ["LINKS", "main", "measure"]
