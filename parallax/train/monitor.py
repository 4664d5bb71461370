"""What a person watches and what a script reads: a live rich display and ``metrics.jsonl``.

Step values come from the last pipeline stage (the trainer reduces them onto every rank), and
they are read one step late, after the next step has been launched, so logging never stalls
the GPU. Rank 0 writes and displays. A loss or gradient norm that is not finite raises
:class:`NonFiniteError` on every rank at the same step (the values are reduced over all ranks,
so they all see it); the step's row is still written.

In a terminal, the live bar row and the printed lines fit the terminal's width (80 columns
included): the bar, step count and time remaining keep their place and the metrics fill what is
left, most useful first, leaving out those that do not fit (``metrics.jsonl`` has them all).
Output that is not a terminal (a log file) gets every field. MFU is measured against a GPU's
peak: on a CPU it shows ``-`` and is ``null`` in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from parallax.recipe.objective import Objective, metric_values
from parallax.train.sinks import Sink
from parallax.train.trainer import StepOutput

log = logging.getLogger("parallax.train")
PEAK_TFLOPS = 989.0  # dense bf16 of an H100/H200 SXM: the MFU denominator
# metrics.jsonl keys of every family; the objective's own metrics come right after "loss"
METRIC_FIELDS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "memory_gib",
    "host_memory_gib",
    "offload_host_gib",
    "offload_host_ratio",
    "step_time_s",
    "data_wait_s",
)


class NonFiniteError(ValueError):
    """A step's loss or gradient norm is NaN or infinite: training diverged or the data (or a
    checkpoint) holds non-finite values."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"step {step}: loss {loss}, gradient norm {grad_norm} (not finite)")


BAR_WIDTH = 20
ETA_WIDTH = 8  # rich's "h:mm:ss" up to 9 h, "mm:ss" below one


def fields(row: dict[str, Any], objective: Objective | None = None) -> list[str]:
    """The metrics of a step as short texts, most useful first (the objective's after the
    loss)."""
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    own = [f"{m.label} {row[m.key]:{m.fmt}}" for m in (objective.metrics if objective else ())]
    return [
        f"loss {row['loss']:.4f}",
        *own,
        f"{row['tokens_per_s']:,.0f} tok/s",
        f"mfu {mfu}",
        f"lr {row['lr']:.2e}",
        f"gnorm {row['grad_norm']:.2f}",
        f"mem {row['memory_gib']:.2f} GiB",
    ]


def fit(parts: list[str], width: int | None, sep: str = "  ") -> str:
    """``parts`` joined, stopping before the first that would pass ``width`` (None: all)."""
    out = ""
    for part in parts:
        joined = f"{out}{sep}{part}" if out else part
        if width is not None and len(joined) > width:
            break
        out = joined
    return out


def host_memory_gib() -> float:
    """This process's peak resident host memory (what ``--offload optimizer`` adds to)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory, or the CPU process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_memory_gib()


def offload_fields(optimizer: object) -> dict[str, float | None]:
    """``metrics.jsonl``'s offload host memory: the bytes this rank's optimizer holds on the
    host (fp32 masters, moments, accumulators, scratch, pinned staging: measured from its
    tensors, :meth:`~parallax.optim.zero.optimizer.ZeroOptimizer.memory_report`) and their
    ratio to the floor of 12 bytes an offloaded parameter; ``None`` without offload. Asked once,
    after the first step (the report waits for its host steps, which may run under the next
    forward: the moments are made then)."""
    report = getattr(optimizer, "memory_report", None)
    measured = report() if callable(report) else None
    if measured is None or not measured.host_numel:
        return {"offload_host_gib": None, "offload_host_ratio": None}
    return {
        "offload_host_gib": measured.host_bytes / 2**30,
        "offload_host_ratio": measured.host_ratio,
    }


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines after ``last_step`` (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


class Monitor:
    """Collects each step's outputs; rank 0 prints and appends to ``metrics.jsonl``."""

    def __init__(
        self,
        out: Path,
        *,
        rank: int,
        world: int,
        device: torch.device,
        log_interval: int,
        total_steps: int,
        console=None,
        objective: Objective | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        """``console``: where rank 0 displays (a ``rich.console.Console``; default: stdout);
        ``objective``: the family's, whose metrics join the row; ``sinks``: dashboards that
        get every row too (rank 0's; :mod:`parallax.train.sinks`), closed by :meth:`close`."""
        self.active = rank == 0
        self.sinks = list(sinks)
        self.objective = objective
        self.world, self.device = world, device
        self.log_interval, self.total_steps = log_interval, total_steps
        self.path = out / "metrics.jsonl"
        self.pending: tuple[int, StepOutput, float, float, float, float] | None = None
        self.last: dict[str, float] = {}
        self.offload = offload_fields(None)  # set once the optimizer has stepped (session)
        self._t = time.perf_counter()
        self._console = self._progress = None
        if self.active:
            self._console = console or Console()
            if self._console.is_terminal:  # a live bar for people; plain lines for logs
                self._progress = Progress(
                    BarColumn(bar_width=BAR_WIDTH),
                    MofNCompleteColumn(),
                    TimeRemainingColumn(compact=True),
                    TextColumn("{task.description}"),
                    console=self._console,
                )
                self._task = self._progress.add_task("", total=total_steps)
                self._progress.start()

    def record(
        self, step: int, output: StepOutput, tokens: float, flops: float, data_wait_s: float = 0.0
    ) -> None:
        """Register step ``step`` (its tokens and model FLOPs over the global batch, and the
        seconds the slowest rank waited for its batch); report the previous one (its tensors are
        ready by now)."""
        now = time.perf_counter()
        elapsed, self._t = now - self._t, now
        self.flush()
        self.pending = (step, output, tokens, flops, elapsed, data_wait_s)

    def flush(self) -> None:
        """Report the pending step now (before a checkpoint: a non-finite step raises here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._report(*pending)

    def log_eval(self, row: dict[str, Any]) -> None:
        """An ``eval.jsonl`` row (the Evaluator writes the file) for the dashboards."""
        self._to_sinks(row)

    def _to_sinks(self, row: dict[str, Any]) -> None:
        """A dashboard that fails (its service died, a full disk) is dropped with a warning:
        it must not stop the run, whose rows ``metrics.jsonl`` keeps."""
        for sink in list(self.sinks):
            try:
                sink.log(row)
            except Exception as err:  # noqa: BLE001 - any package's own error
                log.warning("--log-to: %s failed (%s); it gets no more rows", type(sink), err)
                self.sinks.remove(sink)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            sinks, self.sinks = self.sinks, []
            for sink in sinks:
                sink.close()

    def _report(
        self,
        step: int,
        out: StepOutput,
        tokens: float,
        flops: float,
        seconds: float,
        data_wait_s: float = 0.0,
    ) -> None:
        m = out.metrics.tolist()  # the one host sync, a step late
        mfu = None  # measured against a GPU's peak; null on a CPU
        if self.device.type == "cuda":
            mfu = flops / seconds / (self.world * PEAK_TFLOPS * 1e12)
        row = {
            "step": step,
            "loss": float(out.loss),
            **(metric_values(self.objective, m) if self.objective else {}),
            "lr": out.lr,
            "grad_norm": float(out.grad_norm),
            "tokens_per_s": tokens / seconds,
            "mfu": mfu,
            "memory_gib": peak_memory_gib(self.device),
            "host_memory_gib": host_memory_gib(),  # rank 0's peak RSS
            **self.offload,  # rank 0's optimizer's host bytes and their ratio to the floor
            "step_time_s": seconds,
            "data_wait_s": data_wait_s,  # the slowest rank's wait for its batch
        }
        self.last = row
        if self.active:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self._to_sinks(row)
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            raise NonFiniteError(step, row["loss"], row["grad_norm"])
        if not self.active:
            return
        width = self._console.width - 1 if self._console.is_terminal else None
        if self._progress is not None:
            steps = 2 * len(str(self.total_steps)) + 1
            room = width - (BAR_WIDTH + steps + ETA_WIDTH + 3)  # 3: spaces between columns
            self._progress.update(
                self._task, completed=step, description=fit(fields(row, self.objective), room)
            )
        if step % self.log_interval == 0 or step == self.total_steps or step == 1:
            head = f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"
            line = fit([head, *fields(row, self.objective)], width)
            self._console.print(line, highlight=False, soft_wrap=True)
