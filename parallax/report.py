"""``python -m parallax.report OUT [OUT2 ...] --out curves.png``: a run's curves in one picture.

Reads each run folder's ``metrics.jsonl`` (and ``eval.jsonl`` where there is one) and draws, against
the step: the loss (evaluations as points), the family's main metric (the first of its own
metrics in the rows, e.g. OpenVLA's action accuracy; evaluations as points), the learning rate,
the gradient norm, tokens/s, MFU and peak memory. Several runs share one figure, each one colour,
labelled by its folder's name. Needs matplotlib (the optional extra ``plots``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallax.atomic import file_problems, write_file
from parallax.run.option import at_most, positive
from parallax.train.monitor import METRIC_FIELDS

COMMON = set(METRIC_FIELDS)  # every family's metrics.jsonl keys
# a 16 x 8 inch figure of 19200 x 9600 pixels at most (matplotlib's own limit: 2^16 a side)
MAX_DPI = 1200
DPI = (positive, at_most(MAX_DPI, " (a 16 x 8 inch figure: 19200 x 9600 pixels)"))
# (title, the metrics.jsonl key, the eval.jsonl key drawn as points); "metric" is the family's
PANELS = (
    ("loss", "loss", "eval_loss"),
    ("main metric", "metric", "eval_metric"),
    ("learning rate", "lr", None),
    ("gradient norm", "grad_norm", None),
    ("tokens/s", "tokens_per_s", None),
    ("MFU", "mfu", None),
    ("peak memory (GiB)", "memory_gib", None),
)


@dataclass
class Run:
    """One run folder's rows."""

    name: str
    rows: list[dict[str, Any]]
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def metric(self) -> str | None:
        """The family's main metric: the first key of the rows that every family does not have
        (the monitor writes the recipe's metrics right after the loss), else the first of the
        evaluation's own (pi0's sampled-chunk error, which training steps do not measure)."""
        for key in self.rows[0] if self.rows else ():
            if key not in COMMON:
                return key
        for key in self.evals[0] if self.evals else ():
            if key.startswith("eval_") and key != "eval_loss":
                return key.removeprefix("eval_")
        return None

    def series(self, key: str, evaluation: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` (``"metric"``: the main metric), skipping missing and
        null values (MFU on a CPU)."""
        rows = self.evals if evaluation else self.rows
        if key in ("metric", "eval_metric"):
            if self.metric is None:
                return [], []
            key = f"eval_{self.metric}" if evaluation else self.metric
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [s for s, _ in points], [float(v) for _, v in points]


def read_run(folder: str | Path) -> Run:
    """The rows of a run folder (``ValueError`` when it has no ``metrics.jsonl``)."""
    folder = Path(folder)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{folder} has no metrics.jsonl: not a parallax run folder")
    rows = _jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no steps yet")
    evals = _jsonl(folder / "eval.jsonl") if (folder / "eval.jsonl").is_file() else []
    return Run(folder.resolve().name, rows, evals)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON lines ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it ({err})") from None


def draw(runs: list[Run]):
    """The figure (a ``matplotlib.figure.Figure``, no pyplot state): one panel per quantity,
    one line per run in each, evaluations as points on the loss and the main metric."""
    try:  # matplotlib: an optional dependency (the extra 'plots')
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "parallax.report draws with matplotlib: pip install matplotlib (or the extra: "
            "pip install -e '.[plots]')"
        ) from err
    from matplotlib.ticker import MaxNLocator  # optional, as above

    fig = Figure(figsize=(16, 8), layout="constrained")
    axes = fig.subplots(2, 4).flatten()
    metrics = sorted({r.metric for r in runs if r.metric})
    for ax, (title, key, eval_key) in zip(axes, PANELS):
        ax.set_title(", ".join(metrics) if key == "metric" and metrics else title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for k, run in enumerate(runs):
            colour = f"C{k % 10}"
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, color=colour, label=run.name, linewidth=1.2)
            if eval_key:
                steps, values = run.series(eval_key, evaluation=True)
                if steps:
                    ax.plot(steps, values, "o", color=colour, label=f"{run.name} (eval)")
        if not ax.lines:
            ax.text(0.5, 0.5, "no values (MFU: CPU runs have none)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)  # fmt: skip
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    legend = axes[-1]
    legend.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    legend.legend(handles, labels, loc="center", title="runs")
    return fig


class _Parser(argparse.ArgumentParser):
    """Raises its errors, so :func:`main` says each one alike and returns its status."""

    def error(self, message: str):
        raise ValueError(f"{message} (--help lists the flags)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="parallax.report",
        description="Draw the curves of one or more parallax run folders into one picture.",
    )
    p.add_argument("runs", nargs="+", metavar="OUT", help="run folders (their --out)")
    p.add_argument(
        "--out",
        default="curves.png",
        metavar="FILE",
        help="the picture to write, its format by its suffix (png, pdf, svg...; missing "
        "folders are made; default %(default)s)",
    )
    p.add_argument(
        "--dpi",
        type=int,
        default=100,
        metavar="N",
        help=f"dots per inch of the 16 x 8 inch figure, 1 to {MAX_DPI} (default %(default)s)",
    )
    return p


def argument_problems(out: str, dpi: int) -> list[str]:
    """Why ``--out`` and ``--dpi`` cannot make the picture: checked before any run is read."""
    found = [f"--dpi {problem}" for check in DPI if (problem := check(dpi))]
    found += file_problems("--out", out)
    kind = _format(out)
    formats = _formats()
    if formats and kind not in formats:
        found.append(f"--out {out}: no picture format {kind!r}; use {', '.join(sorted(formats))}")
    return found


def _format(out: str) -> str:
    return Path(out).suffix[1:].lower() or "png"


def _formats() -> set[str]:
    """The formats matplotlib writes (none known without it: :func:`draw` says so)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase  # optional, as in draw
    except ImportError:
        return set()
    return set(FigureCanvasBase.get_supported_filetypes())


def main(argv: list[str] | None = None) -> int:
    """Check the arguments, read the runs, draw, write; one message and status 2 for a bad
    argument or run folder (nothing written), 1 when the picture cannot be written."""
    try:
        args = _parser().parse_args(argv)
        found = argument_problems(args.out, args.dpi)
        if found:
            raise ValueError("; ".join(found))
        runs = [read_run(folder) for folder in args.runs]
        picture = io.BytesIO()
        draw(runs).savefig(picture, format=_format(args.out), dpi=args.dpi)
    except (ValueError, ImportError) as err:
        print(f"parallax.report: error: {err}", file=sys.stderr)
        return 2
    try:
        write_file(args.out, picture.getvalue())  # a complete picture or none
    except OSError as err:
        print(f"parallax.report: error: cannot write --out {args.out} ({err})", file=sys.stderr)
        return 1
    steps = ", ".join(f"{r.name} ({len(r.rows)} steps)" for r in runs)
    print(f"wrote {args.out}: {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
