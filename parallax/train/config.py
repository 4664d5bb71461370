"""Training flags: one dataclass, filled from an optional TOML file and then the command line.

Every flag has a TOML key of the same name with underscores (``--global-batch-size`` ->
``global_batch_size``); command-line flags override the file. Defaults do not depend on the
layout, so the same command trains the same model at every ``dp x tp x pp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallax.train.values import convert, field_kinds, out_problems, read_toml, show

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def default_lr(model: str) -> float:
    """The peak learning rate of ``--model`` when ``--lr`` is not given (its recipe's)."""
    from parallax.train import registry

    try:
        recipe = registry.find(model)
    except ValueError:
        return 2e-5  # an unknown model fails later, with its own message
    family, sep, rest = model.partition(":")
    return recipe.default_lr(rest if sep and family == recipe.name and rest else model)


PRECISIONS = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")
LOGITS = ("labelled", "all")
CHOICES = {
    "schedule": SCHEDULES,
    "precision": PRECISIONS,
    "lr_schedule": LR_SCHEDULES,
    "logits": LOGITS,
}


@dataclass
class TrainConfig:
    """Everything a training run needs to know; saved into every checkpoint."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    model: str = "tiny"
    data: str = "synthetic"
    steps: int = 300
    global_batch_size: int = 32
    micro_batch_size: int = 4
    seed: int = 0
    out: str = "runs/parallax"
    resume: bool = False
    overwrite: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    lr: float | None = None  # None: the model's default (DEFAULT_LR)
    min_lr: float = 0.0
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool = False
    freeze_vision: bool = False
    freeze: str | None = None  # globs of global parameter names (parallax.train.groups)
    lr_groups: Any = None  # "glob=lr,...", a TOML file, or a [lr_groups] table
    save_interval: int = 100
    keep_last: int = 2
    log_interval: int = 10
    eval_interval: int = 0  # 0: no evaluation
    eval_batches: int = 2
    eval_data: str | None = None
    timeout: float = 300.0
    overlap_grad_reduce: bool = True
    logits: str = "labelled"
    fused_projections: bool = True
    compile: bool = False
    cuda_graphs: bool = False
    pipeline_syncs: bool = False
    overlap_param_gather: bool = True
    export_hf: bool = False
    dry_run: bool = False
    config: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ``ValueError`` for values no layout could run (layout checks come later);
        fills in what defaults to the model's (the learning rate)."""
        problems = []
        for name, kind in FLAG_KINDS.items():  # types first: the checks below compare values
            value = getattr(self, name)
            try:
                value = convert(
                    f"{name} = {show(value)}", value, kind, CHOICES.get(name), text=False
                )
            except ValueError as err:
                problems.append(str(err))
            setattr(self, name, value)
        if problems:
            raise ValueError("; ".join(problems))
        if self.lr is None:
            self.lr = default_lr(self.model)
        problems += out_problems(self.out)
        for name in (
            "steps",
            "global_batch_size",
            "micro_batch_size",
            "chunks",
            "tp",
            "pp",
            "log_interval",
            "keep_last",
            "eval_batches",
        ):
            if getattr(self, name) < 1:
                problems.append(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.eval_interval < 0:
            problems.append(f"--eval-interval must be >= 0 (0: never), got {self.eval_interval}")
        if self.save_interval < 0:
            problems.append(
                f"--save-interval must be >= 0 (0: no checkpoints), got {self.save_interval}"
            )
        if self.dp is not None and self.dp < 1:
            problems.append(f"--dp must be >= 1, got {self.dp}")
        if self.export_hf and self.chunks > 1:
            problems.append("--export-hf needs one model chunk per pipeline rank (--chunks 1)")
        if self.cuda_graphs and not self.compile:
            problems.append("--cuda-graphs replays the compiled blocks: it needs --compile")
        # pp: untested (two ranks on one GPU talk over gloo, which sends CPU tensors only).
        # tp > 1 with checkpointing: the recomputation runs outside the compiled pieces
        # (models/compile.py), and torch's checkpoint rejects it on a GPU: two int64 scalars
        # saved on the CPU in the forward come back on the GPU in the recomputation
        if self.cuda_graphs and self.pp > 1:
            problems.append("--cuda-graphs does not support --pp > 1 yet")
        if self.cuda_graphs and self.activation_checkpointing and self.tp > 1:
            problems.append(
                "--cuda-graphs with --activation-checkpointing needs --tp 1 (at tp > 1 the "
                "recomputation runs outside the compiled graphs)"
            )
        if self.chunks > 1 and self.schedule != "interleaved":
            problems.append(f"--chunks {self.chunks} needs --schedule interleaved")
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# every flag's type, from the annotations above (``extra`` is not a flag)
FLAG_KINDS = field_kinds(TrainConfig)
TABLE_FIELDS = ("lr_groups",)  # also a TOML table in --config


class _Parser(argparse.ArgumentParser):
    """Raises its errors instead of printing them, so the CLI decides which rank says them."""

    def error(self, message: str):
        raise ValueError(f"{message} (--help lists the flags)")


def _choices(options: tuple[str, ...]) -> str:
    return "{" + ",".join(options) + "}"


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _Parser(
        prog="parallax.train",
        description="Train OpenVLA (tiny by default, on a built-in synthetic robot task) in any "
        "dp x tp x pp layout. Launch with torchrun; flags override --config (TOML).",
    )
    p.add_argument("--config", help="TOML file of flag values (keys as flags, '-' -> '_')")
    g = p.add_argument_group("layout")
    g.add_argument("--tp", help=f"tensor-parallel size (default {d.tp})")
    g.add_argument("--pp", help=f"pipeline stages (default {d.pp})")
    g.add_argument("--dp", help="data-parallel size (default: world / (tp*pp))")
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model", help=f"tiny, openvla-7b, or an OpenVLA checkpoint dir (default {d.model})"
    )
    g.add_argument("--data", help=f"synthetic or a dataset dir (default {d.data})")
    g.add_argument(
        "--freeze-vision", action="store_true", default=None, help="freeze both vision towers"
    )
    g.add_argument(
        "--freeze",
        help="GLOB,...: freeze the parameters whose global names match (or an alias such as "
        "'vision'); frozen ones get no gradients and no optimizer state",
    )
    g.add_argument(
        "--lr-groups",
        help="GLOB=LR,... or a TOML file of glob = lr: peak learning rates by parameter name "
        "(first match wins; the rest get --lr)",
    )
    g.add_argument("--precision", metavar=_choices(PRECISIONS), help=f"default {d.precision}")
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each block's activations in the backward pass",
    )
    g = p.add_argument_group("schedule")
    g.add_argument("--steps", help=f"optimizer steps (default {d.steps})")
    g.add_argument("--global-batch-size", help=f"samples per step (default {d.global_batch_size})")
    g.add_argument(
        "--micro-batch-size",
        help=f"samples per microbatch (default {d.micro_batch_size})",
    )
    g.add_argument(
        "--schedule", metavar=_choices(SCHEDULES), help=f"pipeline schedule (default {d.schedule})"
    )
    g.add_argument("--chunks", help="model chunks per pipeline rank (interleaved)")
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--lr",
        help="peak learning rate (default: the model's, e.g. tiny 1e-3, 7B 2e-5)",
    )
    g.add_argument("--min-lr", help=f"final lr of the cosine schedule (default {d.min_lr})")
    g.add_argument("--warmup-steps", help=f"linear warm-up steps (default {d.warmup_steps})")
    g.add_argument("--lr-schedule", metavar=_choices(LR_SCHEDULES), help=f"default {d.lr_schedule}")
    g.add_argument(
        "--weight-decay",
        help=f"AdamW weight decay on matrices (default {d.weight_decay})",
    )
    g.add_argument("--grad-clip", help=f"global grad-norm clip, 0 = off (default {d.grad_clip})")
    g.add_argument(
        "--no-overlap",
        dest="overlap_grad_reduce",
        action="store_false",
        default=None,
        help="reduce gradients after the backward instead of during it",
    )
    g = p.add_argument_group("speed (same results either way)")
    g.add_argument(
        "--logits",
        metavar=_choices(LOGITS),
        help="where the last stage applies the final norm and lm_head: at the labelled "
        f"positions only, inside the loss, or at every position (default {d.logits})",
    )
    g.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="q/k/v and gate/up as one weight each: fewer, larger matmuls; checkpoints keep "
        f"the separate tensors (default {'on' if d.fused_projections else 'off'})",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each ViT block and decoder layer (the first steps compile)",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="with --compile on GPUs: replay each compiled block as a CUDA graph "
        "(torch.compile's reduce-overhead mode; fewer kernel launches on the host)",
    )
    g.add_argument(
        "--pipeline-syncs",
        action="store_true",
        default=None,
        help="agree on the pipeline program every step and size received activations from "
        "their metadata (host syncs); default: agree once, sizes from the batch",
    )
    g.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at dp > 1, let the ZeRO all-gather of updated weights run under the next "
        "forward, each block waiting for its own weights "
        f"(default {'on' if d.overlap_param_gather else 'off'})",
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", help=f"seed of weights and data (default {d.seed})")
    g.add_argument("--out", help=f"output dir: metrics.jsonl, checkpoints/ (default {d.out})")
    g.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the latest checkpoint in --out (any layout)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="delete the checkpoints and metrics of another run in --out first (a fresh run "
        "refuses such a folder without --resume or --overwrite)",
    )
    g.add_argument(
        "--save-interval",
        help=f"checkpoint every N steps and at the end; 0: never (default {d.save_interval})",
    )
    g.add_argument("--keep-last", help=f"checkpoints to keep (default {d.keep_last})")
    g.add_argument("--log-interval", help=f"print every N steps (default {d.log_interval})")
    g.add_argument("--timeout", help=f"collective timeout in seconds (default {d.timeout:g})")
    g.add_argument(
        "--export-hf",
        action="store_true",
        default=None,
        help="also write the final weights in the Hugging Face OpenVLA layout",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        default=None,
        help="print the plan (layout, stages, memory, schedule) and exit",
    )
    return p


def load_toml(path: str) -> dict[str, Any]:
    """The flag values of a TOML file (keys as flags, ``-`` or ``_``), each type-checked."""
    kinds = {k: v for k, v in FLAG_KINDS.items() if k != "config"}
    return read_toml(path, kinds, CHOICES, tables=TABLE_FIELDS)


def _flag_value(key: str, value: Any) -> Any:
    """A command-line value (text, or a switch's bool: always valid) as its field's type."""
    if key in TABLE_FIELDS:
        return value  # text; its own parser checks it (parallax.train.groups)
    label = f"--{key.replace('_', '-')} {value}"
    return convert(label, value, FLAG_KINDS[key], CHOICES.get(key), text=True)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig()
    if args.config:
        for key, value in load_toml(args.config).items():
            setattr(cfg, key, value)
        cfg.config = args.config
    for key, value in vars(args).items():
        if value is not None and key != "config":
            setattr(cfg, key, _flag_value(key, value))
    cfg.check()
    return cfg


def load_toml_table(path: Path, what: str) -> dict[str, Any]:
    """A TOML file given to ``what`` as a table: its ``[lr_groups]``-style table named after
    the flag if present, else the whole file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{what} {path}: {err}") from err
    key = what.lstrip("-").replace("-", "_")
    table = data.get(key, data)
    if not isinstance(table, dict):
        raise ValueError(f"{what} {path}: expected a table of glob = value")
    return table
