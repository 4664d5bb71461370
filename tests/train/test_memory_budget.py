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
from tests.train.test_speed_options import _same
from tests.train.test_trainer import _cfg, _run


def _saving_backend(saved: list[int], budgets: list[float]):
    """``aot_eager`` with inductor's partitioner, recording each forward graph's outputs in
    bytes (the block's output and what it saves for its backward: graphs of static shapes, the
    first compile of each block) and the budget it saw."""

    def forward(gm, example_inputs):
        budgets.append(functorch_config.activation_memory_budget)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [a.meta.get("val") for a in out if hasattr(a, "meta")]
        sizes = [v.numel() * v.element_size() for v in vals if torch.is_tensor(v)]
        if all(isinstance(n, int) for n in sizes):  # a recompile for dynamic lengths: symbolic
            saved.append(sum(sizes))
        return make_boxed_func(gm)

    return aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=min_cut_rematerialization_partition,
    )


def _lora(budget: float):
    saved, budgets = [], []
    torch._dynamo.reset()
    cfg = _cfg(finetune="lora", compile=True, activation_memory_budget=budget)
    result = _run(
        ParallelContext.local(),
        cfg,
        compile_options={"backend": _saving_backend(saved, budgets)},
    )
    return result, sum(saved), budgets


def test_a_budget_saves_less_and_computes_the_same_step():
    reference = _run(ParallelContext.local(), _cfg(finetune="lora"))  # eager
    full, full_bytes, seen = _lora(1.0)
    lean, lean_bytes, lean_seen = _lora(0.5)
    assert seen and set(seen) == {1.0} and lean_seen and set(lean_seen) == {0.5}
    assert lean_bytes < 0.9 * full_bytes, (lean_bytes, full_bytes)  # recomputed instead
    _same(full, reference)
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
