"""The ``TrainConfig`` options of the run around the steps: the ``--config`` file, seed, output,
checkpoints, logging and evaluation; :mod:`parallax.run.config` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.run.option import ONE, at_least, opt, positive

RUN, EVAL = "run", "evaluation"


@dataclass(frozen=True)
class ConfigFileOption:
    """``--config``: declared first, so it is the first field and the first ``run`` flag."""

    config: str | None = opt(
        None, "TOML file of flag values (keys as flags, '-' or '_')", RUN, metavar="FILE"
    )


@dataclass(frozen=True)
class RunOptions:
    """The ``run`` group: seed, output directory, checkpoints, logging."""

    seed: int = opt(0, "seed of the weights (layout-free) and the data order", RUN)
    out: str = opt("runs/parallax", "output directory: metrics.jsonl, checkpoints/, hf/", RUN)
    resume: bool = opt(
        False, "continue from the newest checkpoint in --out, at any layout", RUN, switch="on"
    )
    overwrite: bool = opt(
        False,
        "delete another run's checkpoints and metrics in --out first",
        RUN,
        switch="on",
    )
    save_interval: int = opt(
        100, "checkpoint every N steps and at the end", RUN, check=at_least(0, " (0: never)")
    )
    keep_last: int = opt(2, "checkpoints to keep", RUN, check=ONE)
    log_interval: int = opt(
        10, "print every N steps (metrics.jsonl gets every step)", RUN, check=ONE
    )
    timeout: float = opt(300.0, "seconds a collective may wait", RUN, check=positive)
    export_hf: bool = opt(
        False,
        "also write the final weights in the family's Hugging Face layout to --out/hf",
        RUN,
        switch="on",
    )
    log_to: str | None = opt(
        None,
        "also log every metrics.jsonl and eval.jsonl value (rank 0) to TensorBoard (event files "
        "in --out/tb) and/or Weights & Biases (WANDB_MODE=offline works), comma separated; "
        "optional extras tensorboard, wandb",
        RUN,
        metavar="{tensorboard,wandb}[,...]",
    )
    dry_run: bool = opt(
        False, "print the plan (layout, stages, memory, schedule) and exit", RUN, switch="on"
    )


@dataclass(frozen=True)
class EvalOptions:
    """The ``evaluation`` group: the held-out split and how often it is scored."""

    eval_interval: int = opt(
        0,
        "evaluate on the held-out split every N steps and at the end",
        EVAL,
        check=at_least(0, " (0: never)"),
    )
    eval_batches: int = opt(
        2, "global batches per evaluation, the same ones each time", EVAL, check=ONE
    )
    eval_data: str | None = opt(
        None,
        "the held-out split of a dataset (synthetic tasks use episodes of another seed)",
        EVAL,
    )
