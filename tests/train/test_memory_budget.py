"""``--activation-memory-budget``: the compiler's partitioner keeps less of a compiled block's
activations for the backward, inside the trainer's steps only, and the step stays the same."""

import pytest
import torch
import torch._functorch.config as functorch_config
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from parallax import ParallelContext
from parallax.models.compile import memory_budget
from parallax.train import parse_args
from tests.families.openvla.test_speed_options import _same
from tests.families.openvla.test_trainer import _cfg, _run


def _bytes(fw: torch.fx.GraphModule) -> int | None:
    """A forward graph's outputs in bytes (the block's output and what it saves for its
    backward), or None for a recompile with dynamic lengths (symbolic sizes)."""
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    vals = [a.meta.get("val") for a in out if hasattr(a, "meta")]
    sizes = [v.numel() * v.element_size() for v in vals if torch.is_tensor(v)]
    return sum(sizes) if all(isinstance(n, int) for n in sizes) else None


def _saving_backend(graphs: list[tuple[float, int, int]]):
    """``aot_eager`` with inductor's partitioner. Each joint graph is partitioned twice: at
    budget 1.0 (what the same block would save with no budget, for comparison only) and at the
    budget the trainer set, which is the partition that runs; ``graphs`` records (budget seen,
    bytes saved at 1.0, bytes saved at that budget) for the graphs of static shapes."""

    def partition(joint, inputs, **kw):
        budget = functorch_config.activation_memory_budget
        with functorch_config.patch(activation_memory_budget=1.0):
            full = _bytes(min_cut_rematerialization_partition(joint, inputs, **kw)[0])
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        if full is not None:
            graphs.append((budget, full, _bytes(fw)))
        return fw, bw

    return aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
    )


def test_a_budget_saves_less_and_computes_the_same_step():
    reference = _run(ParallelContext.local(), _cfg(finetune="lora"))  # eager
    graphs = []
    torch._dynamo.reset()
    cfg = _cfg(finetune="lora", compile=True, activation_memory_budget=0.5)
    lean = _run(ParallelContext.local(), cfg, compile_options={"backend": _saving_backend(graphs)})
    assert graphs and {budget for budget, _, _ in graphs} == {0.5}, graphs
    full_bytes, lean_bytes = sum(g[1] for g in graphs), sum(g[2] for g in graphs)
    assert lean_bytes < 0.9 * full_bytes, (lean_bytes, full_bytes)  # recomputed instead
    _same(lean, reference)  # recomputation gives the same losses, gradients and weights
    assert functorch_config.activation_memory_budget == 1.0  # scoped to the steps


def test_the_budget_option_is_checked():
    cfg = parse_args(["--compile", "--activation-memory-budget", "0.7"])
    assert cfg.activation_memory_budget == 0.7
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
            _cfg(compile=True, activation_memory_budget=bad).check()
    with pytest.raises(ValueError, match="needs --compile"):
        _cfg(activation_memory_budget=0.7).check()
    with memory_budget(0.6):
        assert functorch_config.activation_memory_budget == 0.6
    assert functorch_config.activation_memory_budget == 1.0
