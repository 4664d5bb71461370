"""One profiled step as lanes: what each CUDA stream and each host thread did, in time bins.

Why: an offloaded step's time above its compute is made of waits (the host waiting for the
worker thread, the compute stream for the copies, the worker for the link), and a kernel table
does not show them. The lanes do: one line per CUDA stream (its kernels and copies) and per host
thread (its ``parallax.*`` ranges), each bin drawn by how busy the lane was in it, then each
lane's busy time and, for the threads, time per range name.

    text = lanes(prof, bins=80)   # prof: a finished torch.profiler.profile over ONE step or more
"""

from __future__ import annotations

from collections import defaultdict

from torch.autograd import DeviceType

SHADES = " .:-=+*#"  # busy share of a bin: 0, <1/7, ... full


def _events(prof) -> tuple[dict, dict]:
    """``(streams, threads)``: lane name -> [(start_ns, end_ns, name)]."""
    streams: dict[str, list] = defaultdict(list)
    threads: dict[str, list] = defaultdict(list)
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            if e.is_user_annotation():
                continue
            streams[f"stream {e.device_resource_id()}"].append((e.start_ns(), e.end_ns(), name))
        elif name.startswith("parallax."):
            threads[f"thread {e.start_thread_id()}"].append((e.start_ns(), e.end_ns(), name))
    return streams, threads


def _busy(spans: list, a: int, b: int) -> int:
    """Nanoseconds of [a, b) covered by the union of ``spans`` (top-level ranges may nest)."""
    cut = sorted((max(s, a), min(e, b)) for s, e, _ in spans if e > a and s < b)
    total, end = 0, a
    for s, e in cut:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _kind(name: str) -> str:
    low = name.lower()
    if low.startswith("memcpy"):
        return low.split("(")[0].strip()  # memcpy htod / dtoh / dtod
    if "gemm" in low or "nvjet" in low or "cutlass" in low or "sm90" in low:
        return "gemm"
    if "adam" in low:
        return "adam"
    return "other"


def lanes(prof, bins: int = 80) -> str:
    """The lane picture of everything ``prof`` recorded (see the module docstring)."""
    streams, threads = _events(prof)
    every = [s for lane in (*streams.values(), *threads.values()) for s in lane]
    if not every:
        return "no events recorded\n"
    t0, t1 = min(s for s, _, _ in every), max(e for _, e, _ in every)
    width = max(1, (t1 - t0) // bins)
    lines = [f"lanes: {(t1 - t0) / 1e6:.0f} ms, {bins} bins of {width / 1e6:.0f} ms"]
    for name, spans in [*sorted(streams.items()), *sorted(threads.items())]:
        cells = []
        for i in range(bins):
            a = t0 + i * width
            share = _busy(spans, a, a + width) / width
            cells.append(SHADES[min(len(SHADES) - 1, round(share * (len(SHADES) - 1)))])
        lines.append(f"{name:>16} |{''.join(cells)}|")
    for name, spans in sorted(streams.items()):
        by: dict[str, int] = defaultdict(int)
        for s, e, n in spans:
            by[_kind(n)] += e - s
        what = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(by.items(), key=lambda x: -x[1]))
        lines.append(f"{name}: busy {_busy(spans, t0, t1) / 1e6:.0f} ms ({what})")
    for name, spans in sorted(threads.items()):
        by = defaultdict(int)
        for s, e, n in spans:
            by[n] += e - s
        what = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(by.items(), key=lambda x: -x[1]))
        lines.append(f"{name}: busy {_busy(spans, t0, t1) / 1e6:.0f} ms ({what})")
    return "\n".join(lines) + "\n"
