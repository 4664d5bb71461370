"""ZeroOptimizer against plain torch optimizers on one process, at dp=2, dp=4 and dp=2 x tp=2."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import parallax
from parallax.optim import ZeroOptimizer
from parallax.testing import context, run_ranks
from tests.optim.common import (
    batch,
    build,
    groups,
    local_rows,
    logical_weights,
    make_zero,
    train_reference,
    train_zero,
)

STEPS = 4
# Not bitwise: each rank averages its own rows before the dp sum, one process averages all rows
# at once, so gradients differ in the last bits and AdamW's normalisation carries that through.
TOL = dict(rtol=1e-6, atol=1e-7)

# (optimizer, overlap, backward passes per step, clip norm, sequence parallel)
CASES = {
    2: [
        ("adamw", True, 2, 0.5, False),
        ("adamw", False, 2, 0.5, False),
        ("adamw", True, 1, None, False),
        ("sgd", True, 2, 0.5, False),
        ("adam", False, 1, 0.5, False),
        ("adamw-fused", True, 2, 0.5, False),
        ("adamw-fused", False, 1, None, False),
        ("sgd-fused", True, 2, 0.5, False),
    ],
    4: [
        ("adamw", True, 2, 0.5, False),
        ("sgd", False, 1, 0.5, False),
        ("adamw-fused", True, 2, 0.5, False),
    ],
    "2x2": [
        ("adamw", True, 2, 0.5, True),
        ("adamw", False, 2, 0.5, False),
        ("adamw-fused", True, 2, 0.5, True),
    ],
}


def _equivalence(tp: int, cases: list[tuple]) -> list[float]:
    ctx = context(tp=tp)
    worst = []
    for name, overlap, accum, clip, sp in cases:
        ref, _, ref_norms = train_reference(name, STEPS, accum, clip)
        model, opt = make_zero(ctx, name, sp, overlap=overlap, backward_passes_per_step=accum)
        norms = train_zero(model, opt, ctx, STEPS, accum, clip)
        case = f"{name} overlap={overlap} accum={accum} clip={clip} sp={sp}"
        # fused optimizers get the dp average and the clip as grad_scale: no pass of our own
        assert opt._fold == name.endswith("-fused") and opt.reducer.average != opt._fold, case
        assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL, msg=case)
        got, err = logical_weights(model, ctx), 0.0
        for n, want in ref.named_parameters():
            assert_close(got[n], want.detach(), **TOL, msg=f"{case}: {n}")
            err = max(err, ((got[n] - want).abs().max() / want.abs().max().clamp(min=1e-30)).item())
        assert torch.equal(got["unused"], torch.ones(5))  # never had a gradient: never stepped
        keys = opt.state_meta()["keys"]
        assert keys["unused"] == ["master"] and "frozen.weight" not in keys
        worst.append(err)
    return worst


@pytest.mark.parametrize("layout", [2, 4, "2x2"])
def test_matches_single_process(layout):
    """Weights and clip norms after several steps equal plain torch on the concatenated batch:
    weight decay on some groups only, gradient accumulation, clipping active, overlap on and
    off, AdamW / SGD / Adam, a frozen, an unused and a sometimes-used parameter; with tp=2 also
    sharded, replicated and sequence-parallel parameters."""
    tp, world = (2, 4) if layout == "2x2" else (1, layout)
    worst = run_ranks(_equivalence, world, tp, CASES[layout])
    assert len({tuple(w) for w in worst}) == 1  # every rank holds the same weights


def _gather_under_forward(tp: int, cases: list[tuple]) -> list[int]:
    """With ``overlap_param_gather`` the weights still equal plain torch's; step() leaves the
    all-gathers in flight and a forward waits for exactly the buckets it reads."""
    ctx = context(tp=tp)
    in_flight = []
    for name, overlap, accum, clip, sp in cases:
        ref, _, ref_norms = train_reference(name, STEPS, accum, clip)
        model, opt = make_zero(ctx, name, sp, overlap=overlap, backward_passes_per_step=accum)
        assert opt.overlap_param_gather(model)
        norms = train_zero(model, opt, ctx, STEPS, accum, clip)
        in_flight.append(len(opt.gathers.works))
        case = f"{name} overlap={overlap} accum={accum} clip={clip} sp={sp}"
        assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL, msg=case)
        opt.wait_params()
        got = logical_weights(model, ctx)
        for n, want in ref.named_parameters():
            assert_close(got[n], want.detach(), **TOL, msg=f"{case}: {n}")
        # one more step, then a forward that skips the tower: only the tower's buckets (and
        # those of parameters never read) stay in flight
        train_zero(model, opt, ctx, 1, 1, None, start=STEPS + 1)
        assert opt.gathers.works
        x, _, use = (local_rows(t, ctx) for t in batch(0, 0))
        model(x, torch.zeros_like(use))
        slots = opt.layout.slots
        unread = {
            slots[i].bucket for i, n in enumerate(opt.names) if n.startswith(("tower", "unused"))
        }
        assert set(opt.gathers.works) <= unread, case
    return in_flight


@pytest.mark.parametrize("layout", [2, "2x2"])
def test_param_gather_under_the_next_forward(layout):
    tp, world = (2, 4) if layout == "2x2" else (1, layout)
    cases = CASES[layout][:2]
    in_flight = run_ranks(_gather_under_forward, world, tp, cases)
    assert all(n > 0 for rank in in_flight for n in rank)  # the deferral really happened


def _overlap_launches_during_backward() -> tuple[int, int, int]:
    """With overlap, buckets go out from the backward hooks, and only after the last pass; the
    2- and inf-norms of the reduced gradients are those of one process."""
    ctx = context()
    model, opt = make_zero(ctx, "adamw", overlap=True, backward_passes_per_step=2)
    ref = build()
    launched = []
    opt.zero_grad()  # opens the step: only then do the hooks launch buckets
    for micro in range(2):
        x, y, use = batch(0, micro)
        F.mse_loss(ref(x, use), y).backward()
        x, y, use = (local_rows(t, ctx) for t in (x, y, use))
        F.mse_loss(model(x, use), y).backward()
        launched.append(opt.reducer.launched)
    for norm_type in (2.0, float("inf")):
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), norm_type)
        assert_close(opt.grad_norm(norm_type), want, **TOL)
    opt.step()
    return launched[0], launched[1], len(opt.layout.buckets)


def test_overlap_reduces_during_backward():
    for first, second, buckets in run_ranks(_overlap_launches_during_backward, 2):
        assert first == 0 and 0 < second <= buckets


def _bf16_smoke() -> tuple[float, bool]:
    ctx = context()
    model, opt = make_zero(ctx, "adamw", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.flat.master_flat.dtype == torch.float32
    before = logical_weights(model, ctx)
    train_zero(model, opt, ctx, 3, 1, 0.5, dtype=torch.bfloat16)
    ref, _, _ = train_reference("adamw", 3, 1, 0.5)
    after, err = logical_weights(model, ctx), 0.0
    for n, want in ref.named_parameters():
        err = max(err, (after[n] - want).abs().max().item())
    tensors = opt.state_dict()["tensors"]
    exact = all(  # the model holds exactly the bf16 rounding of the fp32 masters
        torch.equal(after[n], tensors[f"{n}.master"].bfloat16().float()) for n in opt.names
    )
    assert not torch.equal(after["fc1.weight"], before["fc1.weight"])
    with torch.no_grad():  # weights written behind the optimizer's back reach the masters
        model.head.weight.fill_(0.5)
    opt.reload_master_weights()
    assert torch.equal(opt.state_dict()["tensors"]["head.weight.master"], torch.full((4, 8), 0.5))
    return err, exact


def test_bf16_model_smoke():
    """bf16 parameters and gradients, fp32 masters: close to the fp32 run (bf16 rounding)."""
    for err, exact in run_ranks(_bf16_smoke, 2):
        assert err < 3e-2 and exact


def _zero_grad_modes() -> None:
    """``zero_grad()`` sets ``.grad`` to None (the first gradient is then copied into the
    buffer, not added to zeros), ``zero_grad(set_to_none=False)`` keeps zeroed views; both
    train to bitwise the same weights, with accumulation and a sometimes-used parameter."""
    ctx = context()
    weights = []
    for set_to_none in (True, False):
        model, opt = make_zero(ctx, "adamw", overlap=True, backward_passes_per_step=2)
        for step in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            views = [g.data_ptr() for g in opt.flat.grad_views]
            if set_to_none:
                assert all(p.grad is None for p in opt.params)
            else:
                assert [p.grad.data_ptr() for p in opt.params] == views
                assert all(not g.any() for g in opt.flat.grad_views)
            for micro in range(2):
                x, y, use = (local_rows(t, ctx) for t in batch(step, micro))
                (F.mse_loss(model(x, use), y) / 2).backward()
            got = [i for i, p in enumerate(opt.params) if p.grad is not None]
            assert all(opt.params[i].grad.data_ptr() == views[i] for i in got)
            opt.clip_grad_norm_(0.5)
            opt.step()
        weights.append(logical_weights(model, ctx))
    for n, w in weights[0].items():  # the same kernels on the same values, and 0 + g == g
        assert torch.equal(w, weights[1][n]), n


def test_zero_grad_to_none_or_to_zero():
    run_ranks(_zero_grad_modes, 2)


def _memory(dtype: torch.dtype) -> tuple[int, int, dict]:
    ctx = context()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64))
    model[3].requires_grad_(False)  # frozen: outside the optimizer entirely
    model.to(dtype)
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx, lr=1e-3)
    model(torch.randn(4, 64, dtype=dtype)).float().pow(2).mean().backward()
    opt.step()
    states = [v for s in opt.inner.state.values() for v in s.values() if v.dim() > 0]
    state_bytes = sum(v.numel() * v.element_size() for v in states)
    buffers = [b.data_ptr() for b in opt.flat.param_buffers]
    assert model[3].weight.data_ptr() not in buffers and "3.weight" not in opt.names
    report = opt.memory_report()
    assert report.state_bytes == state_bytes
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return state_bytes, numel, vars(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_one_over_dp(dtype):
    """Optimizer state per rank, measured from the tensors, is 1/dp of the unsharded 8 bytes
    per parameter (and exactly that in total); bf16 adds fp32 masters and reduced grads of 1/dp."""
    results = run_ranks(_memory, 4, dtype)
    numel = results[0][1]
    assert sum(r[0] for r in results) == 8 * numel  # every element's moments on exactly one rank
    for state_bytes, _, report in results:
        assert abs(state_bytes - 8 * numel / 4) <= 0.05 * 8 * numel / 4
        assert report["numel"] == numel and report["dp"] == 4
        if dtype == torch.float32:  # masters and reduced grads live in the model's own buffers
            assert report["master_bytes"] == report["grad_shard_bytes"] == 0
        else:
            assert abs(report["master_bytes"] - 4 * numel / 4) <= 0.05 * numel
            assert report["grad_shard_bytes"] == report["master_bytes"]
        assert report["plain_adamw_bytes"] == 16 * numel  # 4+4+8 fp32; 2+2+4+8 bf16


def _gradient_on_one_rank_only() -> list[float]:
    """dp rank 0 reaches every parameter, rank 1 not the second one: rank 0 trusts its own
    flags (no read-back), rank 1 reads the all-reduced ones, and both step it."""
    ctx = context()
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = ZeroOptimizer([("a", a), ("b", b)], torch.optim.SGD, ctx, lr=0.5, bucket_numel=1)
    loss = a.sum() + (b.sum() if ctx.dp_rank == 0 else 0.0)
    loss.backward()
    opt.step()
    return b.detach().tolist()


def test_a_gradient_on_one_dp_rank_steps_the_parameter_everywhere():
    # b's gradient: ones on rank 0, none on rank 1 -> the dp mean 0.5; SGD lr 0.5: 1 - 0.25
    assert run_ranks(_gradient_on_one_rank_only, 2, timeout=60) == [[0.75] * 3] * 2


def _mismatched_layout() -> str | None:
    ctx = context()
    model = build(ctx)
    if ctx.dp_rank == 1:
        model.head.bias.requires_grad_(False)
    try:
        ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, ctx)
    except ValueError as err:
        return str(err)
    return None


def test_mismatched_layout_fails_on_every_rank():
    for msg in run_ranks(_mismatched_layout, 2, timeout=60):
        assert msg and "dp ranks disagree on the trainable parameters" in msg


def _too_many_passes() -> str | None:
    ctx = context()
    model, opt = make_zero(ctx, "adamw", overlap=True, backward_passes_per_step=1)
    opt.zero_grad()  # open the step: the first pass launches buckets
    try:
        for micro in range(2):
            x, y, use = (local_rows(t, ctx) for t in batch(0, micro))
            F.mse_loss(model(x, use), y).backward()
    except RuntimeError as err:
        opt.zero_grad()  # completes what was launched, the same way on every rank
        return str(err)
    return None


def test_more_backward_passes_than_declared_fail():
    for msg in run_ranks(_too_many_passes, 2, timeout=60):
        assert msg and "backward_passes_per_step" in msg


def test_one_process_is_exact_and_plays_with_torch():
    """dp=1 is bitwise torch AdamW; model.zero_grad() (set to None) and an LR scheduler work.

    Bitwise by construction: no clipping, so no reduction enters the update; the gradients are
    autograd's on both sides and AdamW is elementwise (a flat shard or one tensor per parameter
    changes only which elements a kernel takes together)."""
    ctx = parallax.ParallelContext.local()
    ref, ref_opt, _ = build(), None, None
    ref_opt = torch.optim.AdamW(groups(ref, named=False), lr=1e-2, weight_decay=0.1)
    model = build()
    opt = ZeroOptimizer(groups(model), torch.optim.AdamW, ctx, lr=1e-2, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ref_opt, opt)]
    for step in range(3):
        x, y, use = batch(step, 0)
        for m, o in ((ref, ref_opt), (model, opt)):
            m.zero_grad()  # sets .grad to None: the optimizer re-attaches its views
            F.mse_loss(m(x, use), y).backward()
            o.step()
        for s in scheds:
            s.step()
    for (n, want), got in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(got, want), n
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)


def test_bad_arguments():
    ctx = parallax.ParallelContext.local()
    model = build()
    named, bare = list(model.named_parameters()), list(model.parameters())
    with pytest.raises(ValueError, match="mixes named"):
        ZeroOptimizer([{"params": named[:2]}, {"params": bare[2:]}], torch.optim.SGD, ctx, lr=1)
    with pytest.raises(ValueError, match="given twice"):
        ZeroOptimizer([bare[0], bare[0]], torch.optim.SGD, ctx, lr=1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        ZeroOptimizer(bare, torch.optim.SGD, ctx, backward_passes_per_step=0, lr=1)
    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroOptimizer(bare, "adamw", ctx, lr=1)
    opt = ZeroOptimizer(bare, torch.optim.SGD, ctx, lr=1)
    assert opt.names[:2] == ["0", "3"]  # positions in the list given; 1 and 2 are frozen


def test_a_torch_optimizer_to_schedulers_and_hooks():
    """ZeroOptimizer is built by torch.optim.Optimizer.__init__ (see optim/zero/torch_contract.py):
    step hooks run once around its whole step, state-dict hooks around its state_dict, and its
    groups stay the wrapped optimizer's own, also after load_state_dict replaced them."""
    ctx = parallax.ParallelContext.local()
    model = build()
    opt = ZeroOptimizer(groups(model), torch.optim.AdamW, ctx, lr=1e-2, bucket_numel=50)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "seen": True})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    x, y, use = batch(0, 0)
    F.mse_loss(model(x, use), y).backward()
    opt.step()
    assert calls == ["pre", "post"]
    saved = opt.state_dict()
    assert saved["seen"] and opt.param_groups is opt.inner.param_groups
    opt.load_state_dict(saved)
    assert calls[-1] == "loaded" and opt.param_groups is opt.inner.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    opt.zero_grad()
    F.mse_loss(model(x, use), y).backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.inner.param_groups] == [5e-3, 5e-3]
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [torch.zeros(1)]})
