"""Pipeline parallelism: schedules as data, one executor, a simulator and a timeline.

A schedule (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`; by name,
:func:`make_schedule`) is a pure value: per
pipeline rank, the ordered compute actions. :func:`lower` adds the sends and receives,
:func:`validate` and :func:`simulate` check it without processes, and :func:`run_schedule` runs
any schedule with this rank's :class:`PipelineStage` chunks. :func:`split` balances a list of
blocks into chunks; :class:`Timeline` records what each rank did, as a Chrome trace.
"""

from parallax.pipeline.blocks import BlockChunk, build_stages
from parallax.pipeline.executor import run_schedule
from parallax.pipeline.lower import Batch, Program, lower
from parallax.pipeline.p2p import TensorMeta
from parallax.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    theoretical_bubble,
)
from parallax.pipeline.simulate import DeadlockError, SimResult, format_timeline, simulate
from parallax.pipeline.split import split
from parallax.pipeline.stage import PipelineStage
from parallax.pipeline.timeline import (
    Timeline,
    gather_events,
    measured_bubble,
    merge_traces,
    write_chrome_trace,
)
from parallax.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "Batch",
    "BlockChunk",
    "DeadlockError",
    "PipelineStage",
    "Program",
    "Schedule",
    "SimResult",
    "TensorMeta",
    "Timeline",
    "build_stages",
    "format_schedule",
    "format_timeline",
    "gather_events",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "make_schedule",
    "measured_bubble",
    "merge_traces",
    "one_f_one_b",
    "run_schedule",
    "simulate",
    "split",
    "theoretical_bubble",
    "validate",
    "write_chrome_trace",
]
