"""Timeline: what each rank did during a pipeline step and when, as a Chrome trace.

Pass a :class:`Timeline` to :func:`parallax.pipeline.run_schedule`; it records compute spans
(``1F3``), communication posts (``send`` / ``recv`` / ``send+recv``) and the waits for them. On
CUDA the times come from events on the compute stream (what the GPU did, not when Python queued
it); on CPU from ``perf_counter``. Each step's clock starts right after the executor's opening
agreement collective, which every rank of the pipeline leaves at about the same moment, so the
per-rank tracks line up and the measured bubble compares like with like.

Write the trace with :func:`write_chrome_trace` after :func:`gather_events` (one file) or per rank
and :func:`merge_traces`; open it in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from parallax import comm
from parallax.atomic import as_created
from parallax.context import ParallelContext

COMPUTE = "compute"


class Timeline:
    """Per-rank recorder of pipeline steps; events accumulate over steps in :attr:`events`."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.steps = 0
        self._marks: list[tuple[str, str, object, object, dict]] = []
        self._pid = 0
        self._label = "rank 0"

    # -- recording (called by the executor) -------------------------------------------------------
    def begin_step(self, ctx: ParallelContext) -> None:
        self._pid = ctx.rank
        self._label = f"rank {ctx.rank} (pp {ctx.pp_rank}, dp {ctx.dp_rank}, tp {ctx.tp_rank})"
        self._cuda = ctx.device.type == "cuda"
        self._wall0_us = time.time_ns() / 1e3
        self._marks = []
        self._origin = self._mark()

    def _mark(self) -> object:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextmanager
    def span(self, name: str, cat: str, **args: object) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self._marks.append((name, cat, start, self._mark(), args))

    def _elapsed_us(self, mark: object) -> float:
        if self._cuda:
            return self._origin.elapsed_time(mark) * 1e3
        return (mark - self._origin) * 1e6

    def end_step(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        step, end = self.steps, 0.0
        for name, cat, start, stop, args in self._marks:
            rel, rel_end = self._elapsed_us(start), self._elapsed_us(stop)
            end = max(end, rel_end)
            self.events.append(self._event(name, cat, rel, rel_end - rel, {**args, "step": step}))
        self.events.append(self._event(f"step {step}", "step", 0.0, end, {"step": step}))
        self._marks = []
        self.steps += 1

    def _event(self, name: str, cat: str, rel: float, dur: float, args: dict) -> dict:
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": self._wall0_us + rel,
            "dur": dur,
            "pid": self._pid,
            "tid": 0,
            "args": {**args, "rel": rel, "label": self._label},
        }

    # -- reading ---------------------------------------------------------------------------------
    def bubble_fraction(self, step: int | None = None) -> float:
        """This rank's idle fraction (use :func:`measured_bubble` on gathered events for all)."""
        return measured_bubble(self.events, step)


def measured_bubble(events: Iterable[dict], step: int | None = None) -> float:
    """``1 - compute / (ranks x makespan)`` over the given events (every step, or one).

    Each step's makespan is the latest span end on any rank, measured from that rank's step
    start; steps are pooled by summing both sides.
    """
    compute: dict[int, float] = defaultdict(float)
    span: dict[int, float] = defaultdict(float)
    ranks: dict[int, set] = defaultdict(set)
    for e in events:
        s = e.get("args", {}).get("step")
        if e.get("ph") != "X" or s is None or (step is not None and s != step):
            continue
        ranks[s].add(e["pid"])
        span[s] = max(span[s], e["args"]["rel"] + e["dur"])
        if e["cat"] == COMPUTE:
            compute[s] += e["dur"]
    total = sum(len(ranks[s]) * span[s] for s in ranks)
    if total <= 0:
        raise ValueError("measured_bubble: no recorded steps in these events")
    return 1.0 - sum(compute.values()) / total


def gather_events(timeline: Timeline, ctx: ParallelContext) -> list[dict] | None:
    """Every rank's events, on global rank 0 (``None`` elsewhere). A collective: call it on
    every rank."""
    gathered = comm.all_gather_object(timeline.events, ctx.world_group)
    if ctx.rank != 0:
        return None
    return [e for rank_events in gathered for e in rank_events]


def _atomic_write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        as_created(tmp)  # mkstemp creates it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_chrome_trace(path: str | os.PathLike, events: Iterable[dict]) -> Path:
    """Write Chrome trace-event JSON (one track per rank), atomically. Returns the path.

    Timestamps stay on the wall clock (microseconds), so files written per rank can be merged.
    """
    out, labels = [], {}
    for e in events:
        if e.get("ph") == "M":
            continue
        out.append(e)
        labels[e["pid"]] = e.get("args", {}).get("label", f"rank {e['pid']}")
    for pid, label in labels.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
    path = Path(path)
    _atomic_write_json(path, {"traceEvents": out, "displayTimeUnit": "ms"})
    return path


def read_trace(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def merge_traces(paths: Iterable[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Merge per-rank trace files (written with the same wall clock) into one."""
    events = [e for p in paths for e in read_trace(p) if e.get("ph") != "M"]
    return write_chrome_trace(out, events)
