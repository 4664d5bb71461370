"""The planner's own flags, declared as ``parallax.train``'s are (:func:`parallax.run.option.opt`)
and parsed by the same code (:mod:`parallax.run.command_line`), so one check refuses a value
everywhere: the GPUs (``--gpus``, ``--nodes``, ``--gpus-per-node``), the search (``--margin``,
``--top``) and ``calibrate``'s. ``--gpu-memory``, ``--host-memory``, ``--interconnect`` and
``--machine`` are the trainer's own declarations (:func:`~parallax.run.option.shared`), bounds
included. Every value is checked before a model is built, every problem said in one message.
"""

from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from typing import Any

from parallax.atomic import file_problems
from parallax.plan.search import MARGIN
from parallax.run import command_line as cl
from parallax.run.option import ONE, at_most, opt, problems, shared, within
from parallax.run.options_layout import LayoutOptions
from parallax.run.options_model import DataOptions

MACHINE, SEARCH, CALIBRATE = "the GPUs", "the search", "calibrate"
PER_NODE = 8  # a node's GPUs when only --gpus is given
DESCRIPTION = (
    "The fastest dp x tp x pp x ZeRO layout of a parallax.train run that fits the GPUs given, "
    "predicted, and the torchrun command that runs it."
)
EPILOG = (
    "The run: every parallax.train flag after the planner's own, as parallax.train takes it "
    "(--model MODEL, default tiny; --finetune; --global-batch-size; --data; --precision, bf16 "
    "unless given): python -m parallax.train --help lists them. Layout flags given (--tp, --pp, "
    "--dp, --zero, --micro-batch-size...) are kept, the rest searched. 'python -m parallax.plan "
    "calibrate --out FILE' measures this machine's profile for --machine (calibrate --help)."
)


def _trainer(name: str, help: str, default_text: str) -> object:
    """``parallax.train``'s declaration of ``name`` (its checks), in the planner's words."""
    return shared(LayoutOptions, name, help=help, group=MACHINE, needs=None,
                  default_text=default_text)  # fmt: skip


def _count(help: str, most: int, why: str, default_text: str) -> Any:
    """A count of GPUs or nodes: at least one, at most what any machine has."""
    checks = (ONE, at_most(most, f" ({why})"))
    return opt(None, help, MACHINE, checks=checks, metavar="N", default_text=default_text)


@dataclass(frozen=True)
class PlanOptions:
    """``python -m parallax.plan``'s own flags (the run's are parallax.train's)."""

    gpus: int | None = _count(
        "GPUs in all", 1_000_000, "no cluster has more", "--nodes x --gpus-per-node, else 1"
    )
    nodes: int | None = _count(
        "nodes, each of --gpus-per-node GPUs",
        100_000,
        "no cluster has more",
        "--gpus / --gpus-per-node, else 1",
    )
    gpus_per_node: int | None = _count(
        "GPUs per node (tp stays within a node)",
        256,
        "no node holds more",
        f"--gpus / --nodes, at most {PER_NODE}",
    )
    gpu_memory: float | None = _trainer(
        "gpu_memory",
        "GiB of each GPU (the profile's rates kept: this GPU's own, or --machine's)",
        "the --machine profile's, else this GPU's, else the default profile's (an H200's 139.8)",
    )
    host_memory: float | None = _trainer(
        "host_memory", "GiB of host memory per node", "the --machine or default profile's"
    )
    interconnect: str | None = _trainer(
        "interconnect",
        "how a node's GPUs talk",
        "the --machine profile's, else NVLink on data-centre GPUs, PCIe without peer-to-peer "
        "below 70 GiB",
    )
    machine: str | None = _trainer(
        "machine",
        "a profile file (python -m parallax.plan calibrate --out FILE) or a shipped card's name "
        "(h200, h100, rtx4090, rtx5090)",
        "this GPU's own (calibrated, else shipped, by its name); without a GPU a shipped "
        "default, by --gpu-memory",
    )
    margin: float = opt(
        MARGIN,
        "share of each GPU's and each node's memory kept free",
        SEARCH,
        check=within(0, 1, "[)"),
        metavar="F",
    )
    top: int = opt(5, "layouts to show", SEARCH, check=ONE, metavar="N")


@dataclass(frozen=True)
class CalibrateOptions:
    """``python -m parallax.plan calibrate``'s flags."""

    out: str | None = opt(
        None,
        "the profile to write (JSON; missing folders are made); on a GPU the profile is also "
        "cached for the device (the planner's default there)",
        CALIBRATE,
        metavar="FILE",
        default_text="on a GPU the device's cache only (~/.cache/parallax/machines/NAME.json); "
        "required without one",
    )
    model: str | None = opt(
        None,
        "measure the matmuls at this parallax.train --model's decoder shapes",
        CALIBRATE,
        metavar="MODEL",
        default_text="a 7B Llama's",
    )
    precision: str = shared(
        DataOptions, "precision", default="bf16", help="dtype of the measured work",
        group=CALIBRATE, params=False,
    )  # fmt: skip


def _usage(p: argparse.ArgumentParser, head: str, tail: str) -> str:
    """``p``'s usage with words before and after its flags, wrapped as argparse wraps it."""
    flags = " ".join(p.format_usage().split()[2:])  # less "usage:" and the program's name
    words = re.findall(r"\[[^\]]*\]|\S+", f"{head} {flags} {tail}".strip())
    width = shutil.get_terminal_size().columns - 2
    indent = " " * len(f"usage: {p.prog} ")
    lines, line = [], f"usage: {p.prog}"
    for word in words:
        if len(line) + 1 + len(word) > width and line.strip() != f"usage: {p.prog}":
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}"
    text = "\n".join([*lines, line]).removeprefix("usage: ")
    return "%(prog)s" + text.removeprefix(p.prog)


def plan_parser() -> argparse.ArgumentParser:
    p = cl.parser([PlanOptions], "parallax.plan", DESCRIPTION)
    p.epilog = EPILOG
    p.allow_abbrev = False  # an abbreviation is parallax.train's to read
    p.usage = _usage(p, "[calibrate]", "[--model MODEL] [any parallax.train flag]")
    return p


def calibrate_parser() -> argparse.ArgumentParser:
    description = (
        "Measure this machine once and write its profile for parallax.plan --machine: matmul "
        "and attention rates at the model's shapes, element-wise bandwidth, host copies, the "
        "host's AdamW, and under torchrun the collectives. Well under two minutes; on a CPU at "
        "tiny sizes."
    )
    return cl.parser([CalibrateOptions], "parallax.plan calibrate", description)


def _refuse(found: list[str]) -> None:
    if found:
        raise ValueError("; ".join(found))


def parse_plan(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """The planner's options, checked, and the rest of ``argv`` (parallax.train's flags)."""
    values, rest = cl.parse_known(argv, [PlanOptions], plan_parser())
    opts = PlanOptions(**values)
    _refuse(problems(opts))
    return opts, rest


def parse_calibrate(argv: list[str], cache: str | None = None) -> CalibrateOptions:
    """``calibrate``'s options, checked, ``--out`` and the device's ``cache`` file (``None``:
    no GPU) among them (before anything is measured)."""
    opts = CalibrateOptions(**cl.parse(argv, [CalibrateOptions], calibrate_parser()))
    found = problems(opts)
    if cache is not None:
        found += file_problems("the device's profile cache", cache)
    if opts.out is not None:
        found += file_problems("--out", opts.out)
    elif cache is None:
        found.insert(0, "calibrate needs --out FILE (where to write the profile) without a GPU")
    _refuse(found)
    return opts


def world(opts: PlanOptions) -> tuple[int, int, int]:
    """(GPUs, nodes, GPUs per node) of ``--gpus``, ``--nodes`` and ``--gpus-per-node``: any two
    give the third; all three must agree."""
    gpus, nodes, per_node = opts.gpus, opts.nodes, opts.gpus_per_node
    if gpus is None:
        nodes, per_node = nodes or 1, per_node or 1
        return nodes * per_node, nodes, per_node
    if nodes is not None and per_node is not None:
        if nodes * per_node != gpus:
            raise ValueError(
                f"--nodes {nodes} x --gpus-per-node {per_node} is {nodes * per_node} GPUs, not "
                f"--gpus {gpus}: give two of the three (or all three agreeing)"
            )
        return gpus, nodes, per_node
    if per_node is not None or nodes is None:
        per_node = per_node or min(gpus, PER_NODE)
        if gpus % per_node:
            why = "--gpus-per-node" if opts.gpus_per_node else "a node's most by default"
            raise ValueError(
                f"--gpus {gpus} is not a whole number of nodes of {per_node} GPUs ({why}); give "
                f"--nodes A --gpus-per-node B with A x B = {gpus}"
            )
        return gpus, gpus // per_node, per_node
    if gpus % nodes:
        raise ValueError(f"--gpus {gpus} does not split into --nodes {nodes} of the same size")
    return gpus, nodes, gpus // nodes
