"""Every check of a training config, in one pass: types, each option's own checks, the options
that need another (both declared with the option, :mod:`parallax.run.option`), and the
few rules between options that a declaration cannot say (:data:`RULES`).

Checks see the config alone (no processes, no data, no weights), so every rank reaches the same
verdict before any collective; the layout's own checks come with the model
(``ModelSide.check_layout``) and the schedule.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from parallax.run.option import needs_problems, options, problems
from parallax.run.values import convert, field_kinds, out_problems, show


def type_problems(cfg: Any) -> list[str]:
    """Each simple option's value against its annotation (an int is a fine float)."""

    choices = {f.name: o.choices for f, o in options(type(cfg)) if o.choices}
    found = []
    for name, kind in field_kinds(type(cfg)).items():
        value = getattr(cfg, name)
        try:
            convert(f"{name} = {show(value)}", value, kind, choices.get(name), text=False)
        except ValueError as err:
            found.append(str(err))
    return found


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


def _lora_under_tp(cfg: Any) -> str | None:
    if cfg.finetune == "lora" and cfg.lora_dropout > 0 and cfg.tp > 1:
        return (
            f"--lora-dropout {cfg.lora_dropout:g} at --tp {cfg.tp}: the column-parallel adapters "
            "need one dropout mask on every tp rank; use 0 (OpenVLA's recipe) or --tp 1"
        )
    return None


def _one_chunk(cfg: Any) -> str | None:
    wanting = [
        f for f, on in (("--lora-init", cfg.lora_init), ("--export-hf", cfg.export_hf)) if on
    ]
    if wanting and cfg.chunks > 1:
        return f"{' and '.join(wanting)} need one model chunk per pipeline rank (--chunks 1)"
    return None


def _cuda_graphs(cfg: Any) -> str | None:
    # pp: untested (two ranks on one GPU talk over gloo, which sends CPU tensors only).
    # tp > 1 with checkpointing: the recomputation runs outside the compiled pieces
    # (models/compile.py), and torch's checkpoint rejects it on a GPU: two int64 scalars saved
    # on the CPU in the forward come back on the GPU in the recomputation
    if cfg.cuda_graphs and cfg.pp > 1:
        return "--cuda-graphs does not support --pp > 1 yet"
    if cfg.cuda_graphs and cfg.activation_checkpointing and cfg.tp > 1:
        return (
            "--cuda-graphs with --activation-checkpointing needs --tp 1 (at tp > 1 the "
            "recomputation runs outside the compiled graphs)"
        )
    return None


# tests only: lets --fp8 run on a CPU with the emulated FP8 GEMM (parallax.tensor.fp8.gemm)
FP8_EMULATE_ENV = "PARALLAX_FP8_EMULATE"


def _fp8(cfg: Any) -> str | None:
    """``--fp8`` composes with neither a quantized base (its weights are codes, not bf16) nor a
    CPU run (no FP8 GEMMs there). The device is the one :func:`parallax.init_parallel` will
    pick: a GPU when CUDA is available; a dry run plans for elsewhere and is not refused."""
    if not cfg.fp8:
        return None
    if cfg.quantize_base is not None:
        return (
            f"--fp8 with --quantize-base {cfg.quantize_base}: the quantized base is rebuilt into "
            "bf16 GEMMs; use one or the other"
        )
    if cfg.dry_run or torch.cuda.is_available() or os.environ.get(FP8_EMULATE_ENV) == "1":
        return None
    return "--fp8 needs a GPU with FP8 tensor cores (Ada, Hopper or newer); this run is on the CPU"


def _zero(cfg: Any) -> str | None:
    if cfg.offload != "none" and cfg.zero < 2:
        return (
            f"--offload {cfg.offload} steps each bucket on the host as its reduction completes: "
            f"it needs --zero 2 or 3 (got --zero {cfg.zero})"
        )
    if cfg.host_masters == "split" and (cfg.grad_clip == 0 or cfg.host_adamw == "torch"):
        return (
            "--host-masters split keeps offloaded masters that only the one-pass host AdamW "
            "steps, in a clipped run: it needs --grad-clip above 0 and --host-adamw one-pass "
            "(or auto, on a GPU)"
        )
    if cfg.host_masters == "split" and cfg.precision != "bf16":
        return (
            f"--host-masters split keeps the low halves of bf16 weights' fp32 masters: "
            f"--precision {cfg.precision} has no bf16 weights (use --precision bf16)"
        )
    if cfg.zero == 3 and cfg.cuda_graphs:
        return (
            "--cuda-graphs cannot replay blocks under --zero 3: a CUDA graph reads each weight "
            "at the address it was recorded with, and zero 3 frees each block's gathered "
            "weights after use and gathers them again elsewhere; use --zero 2 or drop "
            "--cuda-graphs"
        )
    return None


def _outputs(cfg: Any) -> str | None:
    """What the run writes inside ``--out`` must be writable where it goes: a file standing where
    a folder goes (or the reverse) would fail only after training, with the weights unsaved."""
    out = Path(cfg.out)
    wanted = {"checkpoints": True, "metrics.jsonl": False, "eval.jsonl": False}
    if cfg.export_hf:
        wanted["hf"] = True
    if cfg.log_to and "tensorboard" in cfg.log_to:
        wanted["tb"] = True
    for name, folder in wanted.items():
        path = out / name
        if path.exists() and path.is_dir() != folder:
            kind = "a file" if folder else "a folder"
            flag = {"hf": "--export-hf", "tb": "--log-to tensorboard"}.get(name, "the run")
            return (
                f"{flag} writes {path}, which is {kind} here: move it away or give another --out "
                "(nothing has run yet)"
            )
    return None


def _step_schedule(cfg: Any) -> str | None:
    if cfg.lr_schedule == "step" and cfg.lr_decay_steps is None:
        return "--lr-schedule step needs --lr-decay-steps N (the step the lr drops at)"
    return None


RULES: tuple[Callable[[Any], str | None], ...] = (
    _lora_under_tp,
    _one_chunk,
    _cuda_graphs,
    _step_schedule,
    _zero,
    _fp8,
)


def config_problems(cfg: Any) -> list[str]:
    """Every problem of ``cfg`` (empty: it can run at some layout). Types first: the other
    checks compare values."""
    found = type_problems(cfg)
    if found:
        return found
    found += problems(cfg)
    found += needs_problems(cfg)
    found += data_problems(cfg.data)
    outside = out_problems(cfg.out)  # the folder itself, then what goes inside it
    found += outside or [p for p in (_outputs(cfg),) if p]
    found += [p for rule in RULES if (p := rule(cfg))]
    return found
