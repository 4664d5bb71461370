"""Training flags: one dataclass, filled from an optional TOML file and then the command line.

Every flag has a TOML key of the same name with underscores (``--global-batch-size`` ->
``global_batch_size``); command-line flags override the file. Defaults do not depend on the
layout, so the same command trains the same model at every ``dp x tp x pp``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallax.models.compile import CHECKPOINT_SCOPES
from parallax.train.values import convert, field_kinds, out_problems, read_toml, show

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def default_lr(model: str, finetune: str = "full") -> float:
    """The peak learning rate of ``--model`` when ``--lr`` is not given (its recipe's)."""
    from parallax.recipe import registry

    try:
        recipe = registry.find(model)
    except ValueError:
        return 2e-5  # an unknown model fails later, with its own message
    family, sep, rest = model.partition(":")
    spec = rest if sep and family == recipe.name and rest else model
    return recipe.default_lora_lr(spec) if finetune == "lora" else recipe.default_lr(spec)


def lora_problems(cfg) -> list[str]:
    """What is wrong with the LoRA flags (the layout-dependent checks come with the model)."""
    if cfg.finetune != "lora":
        given = [f"--{n.replace('_', '-')}" for n in ("train", "lora_init") if getattr(cfg, n)]
        return [f"{', '.join(given)} need --finetune lora"] if given else []
    problems = []
    if cfg.lora_rank < 1:
        problems.append(f"--lora-rank must be >= 1, got {cfg.lora_rank}")
    if cfg.lora_alpha <= 0:
        problems.append(f"--lora-alpha must be > 0, got {cfg.lora_alpha:g}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        problems.append(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout:g}")
    if not cfg.lora_targets.strip(", "):
        problems.append("--lora-targets must be 'all-linear' or module-name globs")
    if cfg.lora_init and not Path(cfg.lora_init).is_dir():
        problems.append(f"--lora-init {cfg.lora_init}: no such adapter directory")
    if cfg.lora_dropout > 0 and cfg.tp > 1:
        problems.append(
            f"--lora-dropout {cfg.lora_dropout:g} at --tp {cfg.tp}: the column-parallel adapters "
            "need one dropout mask on every tp rank; use 0 (OpenVLA's recipe) or --tp 1"
        )
    if cfg.lora_init and cfg.chunks > 1:
        problems.append("--lora-init needs one model chunk per pipeline rank (--chunks 1)")
    return problems


PRECISIONS = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")
LOGITS = ("labelled", "all")
FINETUNES = ("full", "lora")
OFFLOADS = ("none", "optimizer")
ZERO_STAGES = (1, 2, 3)
CHOICES = {
    "checkpoint_scope": CHECKPOINT_SCOPES,
    "schedule": SCHEDULES,
    "precision": PRECISIONS,
    "lr_schedule": LR_SCHEDULES,
    "logits": LOGITS,
    "finetune": FINETUNES,
    "offload": OFFLOADS,
}
# what ``None`` means for the optimisation flags: full fine-tuning's defaults, and OpenVLA's LoRA
# recipe (5e-4 constant, no warm-up, no clipping; ``lr`` from the recipe, see Recipe.default_lr)
FULL_DEFAULTS = {"warmup_steps": 20, "lr_schedule": "cosine", "grad_clip": 1.0}
LORA_DEFAULTS = {"warmup_steps": 0, "lr_schedule": "constant", "grad_clip": 0.0}


@dataclass
class TrainConfig:
    """Everything a training run needs to know; saved into every checkpoint."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    model: str = "tiny"
    data: Any = "synthetic"  # a --data spec, or the [[data]] list of a TOML config
    data_config: str | None = None  # TOML of per-dataset key configs
    workers: int | None = None  # None: as many as the host's cores allow (auto_workers)
    augment: bool | None = None  # None: on for robot datasets, off for the synthetic task
    steps: int = 150
    global_batch_size: int = 32
    micro_batch_size: int = 4
    seed: int = 0
    out: str = "runs/parallax"
    resume: bool = False
    overwrite: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    lr: float | None = None  # None: the model's default (DEFAULT_LR; with LoRA 5e-4)
    min_lr: float = 0.0
    warmup_steps: int | None = None  # None: 20, with LoRA 0 (FULL_DEFAULTS, LORA_DEFAULTS)
    lr_schedule: str | None = None  # None: cosine, with LoRA constant
    weight_decay: float = 0.01
    grad_clip: float | None = None  # None: 1.0, with LoRA 0 (off)
    precision: str = "fp32"
    activation_checkpointing: bool = False
    checkpoint_scope: str = "all"  # which blocks --activation-checkpointing recomputes
    activation_memory_budget: float = 1.0
    freeze_vision: bool = False
    freeze: str | None = None  # globs of global parameter names (parallax.train.groups)
    finetune: str = "full"  # "lora": adapters on the frozen base (parallax.train.lora)
    lora_rank: int = 32
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"  # or module-name globs, comma separated
    train: str | None = None  # globs of modules trained fully beside the adapters
    lora_init: str | None = None  # a PEFT adapter directory to start from
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
    zero: int = 1  # ZeRO stage over dp: 1 optimizer state, 2 also gradients, 3 also weights
    reshard_after_forward: bool = True  # zero 3: free each block's gathered weights after use
    offload: str = "none"  # "optimizer": fp32 masters and moments in host memory
    offload_fraction: float = 1.0  # with --offload optimizer: the share of buckets on the host
    gpu_memory_limit: float | None = None  # GiB this process may allocate on its GPU
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
            self.lr = default_lr(self.model, self.finetune)
        for name, value in (LORA_DEFAULTS if self.finetune == "lora" else FULL_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        problems += lora_problems(self)
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
        problems += data_problems(self.data)
        if self.workers is not None and self.workers < 0:
            problems.append(
                f"--workers must be >= 0 (0: decode in the training process), got {self.workers}"
            )
        if self.dp is not None and self.dp < 1:
            problems.append(f"--dp must be >= 1, got {self.dp}")
        if self.export_hf and self.chunks > 1:
            problems.append("--export-hf needs one model chunk per pipeline rank (--chunks 1)")
        if not 0.0 < self.activation_memory_budget <= 1.0:
            problems.append(
                f"--activation-memory-budget must be in (0, 1], got {self.activation_memory_budget}"
            )
        elif self.activation_memory_budget < 1.0 and not self.compile:
            problems.append(
                "--activation-memory-budget tells the compiler what to recompute: it needs "
                "--compile"
            )
        if self.checkpoint_scope != "all" and not self.activation_checkpointing:
            problems.append(
                f"--checkpoint-scope {self.checkpoint_scope} says which blocks recompute: it "
                "needs --activation-checkpointing"
            )
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
        problems += memory_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def checkpointing(self) -> bool | str:
        """What the models' ``activation_checkpointing`` takes: off, or the scope."""
        if not self.activation_checkpointing:
            return False
        return True if self.checkpoint_scope == "all" else self.checkpoint_scope

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# every flag's type, from the annotations above (``extra`` is not a flag)
FLAG_KINDS = field_kinds(TrainConfig)
TABLE_FIELDS = ("lr_groups", "data")  # also a TOML table (or [[data]] list) in --config


def memory_problems(cfg) -> list[str]:
    """What is wrong with the ZeRO, offload and memory-cap flags (from the flags alone)."""
    problems = []
    if cfg.zero not in ZERO_STAGES:
        problems.append(f"--zero must be 1, 2 or 3, got {cfg.zero}")
    if not cfg.reshard_after_forward and cfg.zero != 3:
        problems.append(
            f"--no-reshard-after-forward keeps zero-3 weights gathered: it needs --zero 3 "
            f"(got --zero {cfg.zero})"
        )
    if cfg.zero == 3 and cfg.cuda_graphs:
        problems.append(
            "--cuda-graphs cannot replay blocks under --zero 3: a CUDA graph reads each weight "
            "at the address it was recorded with, and zero 3 frees each block's gathered "
            "weights after use and gathers them again elsewhere; use --zero 2 or drop "
            "--cuda-graphs"
        )
    if cfg.offload != "none" and cfg.zero < 2:
        problems.append(
            f"--offload {cfg.offload} steps each bucket on the host as its reduction completes: "
            f"it needs --zero 2 or 3 (got --zero {cfg.zero})"
        )
    if not 0.0 < cfg.offload_fraction <= 1.0:
        problems.append(f"--offload-fraction must be in (0, 1], got {cfg.offload_fraction:g}")
    elif cfg.offload_fraction < 1.0 and cfg.offload == "none":
        problems.append("--offload-fraction says how much to offload: it needs --offload optimizer")

    if cfg.gpu_memory_limit is not None and cfg.gpu_memory_limit <= 0:
        problems.append(f"--gpu-memory-limit must be > 0 GiB, got {cfg.gpu_memory_limit:g}")
    return problems


def data_problems(data: Any) -> list[str]:
    """Why ``data`` is neither a ``--data`` spec nor a ``[[data]]`` list (the datasets
    themselves are checked when they are opened)."""
    if isinstance(data, str):
        return [] if data.strip() else ["--data is empty: give synthetic or a dataset"]
    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        missing = [i for i, d in enumerate(data) if "path" not in d]
        if missing:
            return [f"[[data]] entries {missing} need a path (FORMAT:PATH or a directory)"]
        return []
    return [
        f"data = {show(data)}: expected a --data spec (a string) or a [[data]] list of tables "
        "with a path each"
    ]


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


def _flags_parser():
    from parallax.train.flags import parser

    return parser()


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    args = _flags_parser().parse_args(sys.argv[1:] if argv is None else argv)
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
