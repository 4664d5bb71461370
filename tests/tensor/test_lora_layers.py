"""LoRA on the parallel linears against ``W x + b + (alpha / r) B A x`` written densely here.

Each case builds the base layer from a dense ``nn.Linear``, adds the adapter, overwrites A and
B with random logical values (B starts at zero), and compares the output, the input gradient,
the adapters' gradients (summed over tp where partial) and the merged weight with the formula;
the tp=2 merge gathered against the tp=1 merge. Then: the replicated factor is identical on the
tp ranks by construction, and no weight-gradient matmul ever runs for a frozen weight.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallax import comm
from parallax.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_tensor,
    shard_tensor,
    sync_sequence_parallel_grads,
    unshard_tensor,
)
from parallax.tensor.lora import add_adapter, remove_adapter
from parallax.testing import context, run_ranks


def close(actual, expected, rel=1e-5):
    """Within ``rel`` of the tensor's scale: float32 results whose sums run in another order
    (the adapter's factors against the dense product, tp's split matmuls) agree to ~1e-6 of
    it, while a wrong shard, block or scale is off by far more."""
    err = (actual.detach() - expected.detach()).abs().max().item()
    scale = expected.detach().abs().max().item()
    assert actual.shape == expected.shape and err <= rel * scale, (err, scale)


R, ALPHA = 3, 6.0  # scaling 2
IN, OUT = 8, 12


def _set(param, full):
    info = getattr(param, "tp_shard", None)
    with torch.no_grad():
        param.copy_(full if info is None else shard_tensor(full, info))


def _grad(param, group):
    """The full logical gradient of a (possibly sharded) parameter."""
    info = getattr(param, "tp_shard", None)
    return param.grad if info is None else unshard_tensor(param.grad, info, group)


def dense_delta(a, b, groups):
    """(alpha / r) B A, block j of B's rows fed by adapter j's rows of A (written out)."""
    if groups == 1:
        return ALPHA / R * b @ a
    return ALPHA / R * torch.cat([bj @ aj for bj, aj in zip(b.chunk(groups), a.chunk(groups))])


def _layer(kind, dense, ctx, partitions, groups, sp):
    if kind == "column":
        layer = ColumnParallelLinear.from_dense(
            dense, ctx, partitions=partitions, sequence_parallel=sp
        )
    else:
        layer = RowParallelLinear.from_dense(
            dense, ctx, input_is_parallel=False, sequence_parallel=sp
        )
    return add_adapter(layer, tuple(f"m.part{j}" for j in range(groups)), R, ALPHA, seed=5)


def _case(tp, kind, partitions=1, groups=1, sp=False):
    """One layer at ``tp`` against the dense formula; returns (initial A, merged weight)."""
    ctx = context(tp=tp) if tp > 1 else None
    group, rank = (None, 0) if ctx is None else (ctx.tp_group, ctx.tp_rank)
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    a = torch.randn(groups * R, IN, requires_grad=True)
    b = torch.randn(OUT, R, requires_grad=True)
    x, grad_out = torch.randn(2, 6, IN), torch.randn(2, 6, OUT)
    w = dense.weight.detach() + dense_delta(a, b, groups)
    xd = x.clone().requires_grad_()
    (F.linear(xd, w, dense.bias.detach()) * grad_out).sum().backward()

    layer = _layer(kind, dense, ctx, partitions, groups, sp)
    assert not layer.lora_B.any()  # B starts at zero: the adapter adds nothing yet
    init_a = full_tensor(layer.lora_A, group).clone()  # (one rank: may be a view)
    _set(layer.lora_A, a.detach())
    _set(layer.lora_B, b.detach())
    xp = x.clone().requires_grad_()
    split_in = sp and kind == "column"  # sequence parallel: this rank's tokens come in
    y = layer(xp.chunk(tp, dim=1)[rank] if split_in else xp)
    ref, g = F.linear(x, w, dense.bias).detach(), grad_out
    if kind == "column":  # this rank's output features
        info = replace(layer.weight.tp_shard, dim=-1)
        ref, g = shard_tensor(ref, info), shard_tensor(grad_out, info)
    elif sp:  # this rank's tokens go out
        ref, g = ref.chunk(tp, dim=1)[rank], grad_out.chunk(tp, dim=1)[rank]
    close(y, ref)
    (y * g).sum().backward()
    sync_sequence_parallel_grads(layer, group)  # the replicated factor's partial gradient
    want_dx = xd.grad.chunk(tp, dim=1)[rank] if split_in else xd.grad
    got_dx = xp.grad.chunk(tp, dim=1)[rank] if split_in else xp.grad
    close(got_dx, want_dx)
    close(_grad(layer.lora_A, group), a.grad)
    close(_grad(layer.lora_B, group), b.grad)
    remove_adapter(layer, merge=True)
    assert type(layer) is (ColumnParallelLinear if kind == "column" else RowParallelLinear)
    assert not hasattr(layer, "lora_A") and len(list(layer.parameters())) == 2
    merged = layer.to_dense().weight.detach()
    close(merged, w)
    return init_a, merged


CASES = [
    ("column", 1, 1, False),
    ("row", 1, 1, False),
    ("column", 3, 1, False),  # fused qkv stored fused (timm): one adapter, B (3 out, r)
    ("column", 3, 3, False),  # fused q/k/v stored split (Llama): three adapters
    ("column", 2, 2, False),  # fused gate/up stored split
    ("column", 1, 1, True),  # sequence parallel
    ("row", 1, 1, True),
]


def _tp2_against_tp1():
    out = []
    for case in CASES:
        init2, merged2 = _case(2, *case)
        init1, merged1 = _case(1, *case)
        assert torch.equal(init2, init1)  # layout-free init: the same logical A
        close(merged2, merged1)
        out.append(case)
    return out


def test_lora_layers_match_the_dense_formula_at_tp1():
    for case in CASES:
        _case(1, *case)


def test_lora_layers_match_the_dense_formula_at_tp2_and_merge_as_tp1():
    assert run_ranks(_tp2_against_tp1, 2) == [CASES, CASES]


def _replicated_factors():
    """Each tp rank's generator seeded differently; the adapters drawn from (seed, name)."""
    ctx = context(tp=2)
    torch.manual_seed(100 + ctx.rank)
    col = add_adapter(ColumnParallelLinear(8, 12, ctx=ctx), ("c",), R, ALPHA, seed=3)
    row = add_adapter(RowParallelLinear(12, 8, ctx=ctx), ("r",), R, ALPHA, seed=3)
    replicated = [col.lora_A, row.lora_B]
    assert all(not hasattr(p, "tp_shard") and p.sequence_parallel for p in replicated)
    assert col.lora_A.abs().sum() > 0 and col.lora_A.std() < 1.0 / R * 1.5  # N(0, 1/r)
    copies = [comm.all_gather(p.detach()[None], ctx.tp_group, dim=0) for p in replicated]
    return [bool(torch.equal(c[0], c[1])) for c in copies]


def test_replicated_factor_is_identical_on_every_tp_rank_by_construction():
    assert run_ranks(_replicated_factors, 2) == [[True, True], [True, True]]


class _Matmuls(TorchDispatchMode):
    """The output shapes of every matrix product that runs."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.OPS:
            self.shapes.append(tuple(out.shape))
        return out


def _backward_matmuls(tp, frozen=True, lora=True):
    """A column (fused, three adapters) then row block, base frozen or not: the shapes of the
    backward's products, and the frozen weights' shapes (with their transposes)."""
    ctx = context(tp=tp) if tp > 1 else None
    torch.manual_seed(0)
    col = ColumnParallelLinear(12, 30, partitions=3, ctx=ctx)  # 3 x 10 rows
    row = RowParallelLinear(30, 8, ctx=ctx)
    if lora:
        add_adapter(col, ("q", "k", "v"), 2, 4.0)
        add_adapter(row, ("o",), 2, 4.0)
        for layer in (col, row):
            nn.init.normal_(layer.lora_B)
    for layer in (col, row):
        for p in (layer.weight, layer.bias):
            p.requires_grad_(not frozen)
    x = torch.randn(2, 7, 12, requires_grad=True)  # 14 tokens: no dimension of a weight
    y = row(F.gelu(col(x)))
    with _Matmuls() as seen:
        y.square().sum().backward()
    weights = {tuple(layer.weight.shape) for layer in (col, row)}
    weights |= {s[::-1] for s in weights}
    return seen.shapes, weights


@pytest.mark.parametrize("tp", [1, 2])
def test_no_weight_gradient_matmul_for_frozen_weights(tp):
    """Only input-gradient products run for the frozen weights, plus the adapters' own; the
    same model with trainable weights shows their weight-gradient products (the check can
    fail), and without adapters the frozen block's backward has input gradients only."""
    runs = run_ranks(_backward_matmuls, tp, tp) if tp > 1 else [_backward_matmuls(1)]
    for shapes, weights in runs:
        assert not weights & set(shapes), (shapes, weights)
        assert (14, 12) in shapes and (14, 30 // tp) in shapes  # the input gradients
        assert (6, 12) in shapes or (12, 6) in shapes  # the fused column's A gradient
        assert len(shapes) >= 6
    trained = (
        run_ranks(_backward_matmuls, tp, tp, False) if tp > 1 else [_backward_matmuls(1, False)]
    )
    for shapes, weights in trained:
        assert weights & set(shapes)
    plain = (
        run_ranks(_backward_matmuls, tp, tp, True, False)
        if tp > 1
        else [_backward_matmuls(1, True, False)]
    )
    for shapes, _ in plain:
        assert sorted(shapes) == sorted([(14, 12), (14, 30 // tp)])
