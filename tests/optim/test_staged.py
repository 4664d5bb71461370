"""Where the fp32 reduced gradient lives: staged per bucket at dp=1, over the 16-bit gradient
bytes when dp >= 2 reduces inside step(), a persistent slice only where overlap needs one.

Every home must give the results of the persistent slice (bf16 models), and the per-bucket
stepping those of plain torch (fp32 models, where it is forced): bit for bit where the two
compute the same arithmetic in the same order, to a stated tolerance where a reduction (the
clip norm) is ordered differently. Each comparison says which and why."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import parallax
from parallax.optim import ZeroOptimizer
from parallax.optim.zero.buffers.homes import INPLACE, OWN, SHARD, STAGED
from parallax.optim.zero.memory_report import tensor_bytes
from parallax.testing import context, run_ranks
from tests.optim.common import (
    OPTIMIZERS,
    batch,
    build,
    groups,
    local_rows,
    train_reference,
    train_zero,
)

BF16 = torch.bfloat16


class PersistentSlice(ZeroOptimizer):
    """The layout before staging: every 16-bit bucket's fp32 gradient in a persistent slice."""

    def _grad_homes(self) -> list[str]:
        fp32 = [self.layout.dtypes[b.buffer] == torch.float32 for b in self.layout.buckets]
        return [OWN if f else SHARD for f in fp32]


class StagedFp32(ZeroOptimizer):
    """Per-bucket stepping forced on fp32 buckets too (dp=1 only), to compare it with torch."""

    def _grad_homes(self) -> list[str]:
        return [STAGED for _ in self.layout.buckets]


def _make(cls, ctx, name="adamw", sp=False, dtype=None, **kw):
    opt_cls, kwargs = OPTIMIZERS[name]
    model = build(ctx, sp, dtype)
    kw.setdefault("bucket_numel", 100)  # several buckets, some spanning both groups
    opt = cls(groups(model), opt_cls, ctx, param_order=model.parameters(), **kwargs, **kw)
    return model, opt


def _train(cls, ctx, case: tuple, dtype=BF16, steps: int = 4):
    """Train one case; (clip norms, weights, full optimizer state, the buckets' homes)."""
    name, overlap, accum, clip, sp, extra = case
    model, opt = _make(
        cls, ctx, name, sp, dtype, overlap=overlap, backward_passes_per_step=accum, **extra
    )
    lists = [g["params"] for g in opt.param_groups]
    norms = train_zero(model, opt, ctx, steps, accum, clip, dtype=dtype)
    assert all(g["params"] is m for g, m in zip(opt.param_groups, lists))  # narrowing undone
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.equal(weights["unused"], torch.ones(5, dtype=dtype))  # never stepped
    return norms, weights, opt.state_dict()["tensors"], tuple(sorted(set(opt.flat.homes)))


def _compare(ctx, cases: list[tuple]) -> list[tuple]:
    """Each case under the default homes and under the persistent slice: bitwise equal where
    the clip norms are (see below), else within 1e-6.

    Both homes hold the same gradient values and apply the same elementwise updates to them;
    the one reduction that may differ is the clip norm. A staged bucket's norm reads its bf16
    gradient with fp32 accumulation, the slice's norm its fp32 copy: two kernels. Where their
    sums agree (they do on the CPUs this was written on: torch accumulates both alike) every
    later result must agree bit for bit too; where they do not (another CPU's kernels), the
    clip coefficients differ in the last bit and so does each clipped update."""
    seen = []
    for case in cases:
        new, old = _train(ZeroOptimizer, ctx, case), _train(PersistentSlice, ctx, case)
        what = f"dp={ctx.dp_size} tp={ctx.tp_size} {case}"
        exact = new[0] == old[0]
        if not exact:
            assert_close(torch.tensor(new[0]), torch.tensor(old[0]), rtol=1e-6, atol=0, msg=what)
        same = torch.equal if exact else _near
        for n in new[1]:
            assert same(new[1][n], old[1][n]), f"{what}: weight {n}"
        assert list(new[2]) == list(old[2]), what
        for k in new[2]:
            assert same(new[2][k], old[2][k]), f"{what}: state {k}"
        if case[0] != "sgd":
            assert new[2]["tower.weight.step"].item() == 2, what  # only odd steps use it
        seen.append((ctx.dp_size, ctx.tp_size, case[1], new[3]))
    return seen


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 1e-6 of the tensor's scale; a bf16 tensor within one bf16 rounding step (2^-8
    relative: a last-bit change of its fp32 master may round it the other way)."""
    rel = 1e-6 if want.dtype == torch.float32 else 2.0**-8
    got, want = got.float(), want.float()
    return bool((got - want).abs().max().item() <= rel * want.abs().max().item())


# (optimizer, overlap, backward passes per step, clip, sequence parallel, optimizer kwargs)
BF16_CASES = [
    ("adamw", True, 2, 0.5, False, {}),
    ("adamw", False, 2, 0.5, False, {"foreach": True}),
    ("adamw", False, 1, None, False, {"fused": True}),
    ("sgd", True, 1, 0.5, False, {}),
]
SP_CASES = [("adamw", True, 2, 0.5, True, {}), ("adamw", False, 1, 0.5, True, {"fused": True})]


def _compare_on_ranks(world: int) -> list[tuple]:
    if world == 4:  # dp=2 x tp=2: sequence-parallel buckets wait for step(), so in place
        return _compare(context(tp=2), SP_CASES[:1])
    return _compare(context(), BF16_CASES) + _compare(context(tp=2), SP_CASES)


def test_homes_match_the_persistent_slice_bitwise():
    """bf16 models, at dp=1 (every bucket staged), dp=2 (overlap off: in place), dp=1 x tp=2
    (sequence-parallel buckets keep a slice, the others are staged) and dp=2 x tp=2 (the
    sequence-parallel buckets in place): the same weights, optimizer state and clip norms as
    the persistent fp32 slice, bit for bit (where the clip norms are: see ``_compare``). Two
    param groups, accumulation,
    clipping, AdamW (default, foreach, fused) and SGD, a frozen, an unused and a sometimes-used
    parameter (the tower: steps 1 and 3; unused shares its bucket, which on even steps has no
    gradient at all)."""
    seen = _compare(parallax.ParallelContext.local(), BF16_CASES)
    for world in (2, 4):
        seen += run_ranks(_compare_on_ranks, world, world)[0]
    homes = {(dp, tp, ov): h for dp, tp, ov, h in seen}
    assert homes[(1, 1, True)] == homes[(1, 1, False)] == (STAGED,)
    assert homes[(2, 1, True)] == (SHARD,)  # overlap may reduce during backward
    assert homes[(2, 1, False)] == (INPLACE,)
    assert homes[(1, 2, True)] == homes[(1, 2, False)] == (SHARD, STAGED)  # sp: a slice
    assert homes[(2, 2, True)] == (INPLACE, SHARD)


def _steps_per_bucket(opt: ZeroOptimizer, steps: int) -> int:
    """Wrapped-optimizer steps expected: one per bucket with a gradient, per step (the tower
    is used on odd steps only, ``unused`` never)."""
    total = 0
    for step in range(steps):
        idle = {"unused"} | ({"tower.weight", "tower.bias"} if step % 2 == 0 else set())
        total += sum(any(opt.names[i] not in idle for i in b.params) for b in opt.layout.buckets)
    return total


def _bitwise(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    assert torch.equal(got, want), msg


# With clipping the two sides compute the clip norm, a reduction, in different orders: ZeRO takes
# each piece's fp32 norm and sums their squares in fp64, torch's clip_grad_norm_ takes the norm
# of the per-parameter fp32 norms in fp32. The norms differ in the last bit (8e-8 measured), the
# clip coefficient with them, and every clipped update after it: 2e-7 of each tensor's scale
# after four AdamW steps (1e-2 lr: a wrong or missed bucket step is off by ~1e-3 of the scale).
CLIP_REL = 2e-6


def _close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    assert_close(got, want, rtol=CLIP_REL, atol=CLIP_REL * want.abs().max().item(), msg=msg)


def test_per_bucket_steps_match_torch():
    """fp32, dp=1, every bucket forced to the staged path, against plain torch AdamW (two groups,
    accumulation, overlap on and off; default, foreach and fused), with buckets spanning both
    groups or one parameter each (so some groups are empty for a step, and the unused
    parameter's bucket never steps); one wrapped step per bucket with a gradient.

    Without clipping: bitwise. No reduction enters the update at dp=1: both sides accumulate the
    same autograd gradients with the same adds in the same order, and AdamW is elementwise, so
    stepping a bucket's flat shard instead of each parameter changes which elements a kernel
    processes together, not the arithmetic done on any element. With clipping (0.5): within
    ``CLIP_REL`` of the scale, as the clip norms (see above)."""
    ctx = parallax.ParallelContext.local()
    cls, kwargs = OPTIMIZERS["adamw"]
    for clip in (None, 0.5):
        same = _bitwise if clip is None else _close
        for extra in ({}, {"foreach": True}, {"fused": True}):
            for overlap, bucket_numel in ((True, 100), (False, 100), (True, 1)):
                what = f"{extra} clip={clip} overlap={overlap} bucket_numel={bucket_numel}"
                ref = build()
                ref_opt = cls(groups(ref, named=False), **kwargs, **extra)
                _, _, ref_norms = train_reference("adamw", 4, 2, clip, model=ref, opt=ref_opt)
                model, opt = _make(
                    StagedFp32,
                    ctx,
                    overlap=overlap,
                    backward_passes_per_step=2,
                    bucket_numel=bucket_numel,
                    **extra,
                )
                calls = []
                opt.inner.register_step_post_hook(lambda o, a, k, calls=calls: calls.append(1))
                norms = train_zero(model, opt, ctx, 4, 2, clip)
                if clip is not None:
                    assert_close(
                        torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0, msg=what
                    )
                for (n, want), got in zip(ref.named_parameters(), model.parameters()):
                    same(got, want, msg=f"{what}: {n}")
                tensors = opt.state_dict()["tensors"]
                for n, p in ref.named_parameters():
                    for k, v in ref_opt.state.get(p, {}).items():
                        same(tensors[f"{n}.{k}"], v.float(), msg=f"{what}: {n}.{k}")
                assert set(opt.flat.homes) == {STAGED} and len(opt.layout.buckets) >= 3
                assert len(calls) == _steps_per_bucket(opt, 4), what
                assert all(t.grad is None for t in opt.flat.piece_params)


def _held_bytes(opt: ZeroOptimizer) -> int:
    """Bytes of every distinct tensor storage reachable from the optimizer (and the .grad of
    each tensor found): an independent count of what memory_report() must account for."""
    tensors, seen, todo = [], set(), list(vars(opt).values())
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            if obj.grad is not None:
                todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
            todo.extend(k for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(
            ("parallax", "torch.optim")
        ):
            todo.extend(vars(obj).values())
    return tensor_bytes(tensors)


def test_bf16_one_process_holds_no_fp32_gradient():
    """dp=1, bf16: measured from the tensors, 2 + 2 + 12 bytes per parameter plus one staging
    buffer of the largest bucket; no whole-model fp32 gradient (the persistent slice held 4
    more per parameter and two staging buffers). memory_report() counts every tensor the
    optimizer holds."""
    ctx = parallax.ParallelContext.local()
    out = {}
    for cls in (ZeroOptimizer, PersistentSlice):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)), nn.LayerNorm(64))
        model[1].requires_grad_(False)  # frozen: outside the optimizer
        model.to(BF16)
        opt = cls(model.named_parameters(), torch.optim.AdamW, ctx, bucket_numel=5000, lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 64, dtype=BF16)).float().pow(2).mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
        report = opt.memory_report()
        assert _held_bytes(opt) == report.total_bytes, cls.__name__
        out[cls] = report
        largest = max(b.numel for b in opt.layout.buckets)
    new, old = out[ZeroOptimizer], out[PersistentSlice]
    numel = new.numel
    assert new.grad_shard_bytes == 0 and old.grad_shard_bytes == 4 * numel
    assert new.staging_bytes == 4 * largest and old.staging_bytes == 2 * 4 * largest
    per = new.bytes_per_param()
    assert 16 <= per["total"] - per["staging"] < 16.2  # padding: 2 + 2 + 4 + 8 (+ alignment)
    assert old.total_bytes - new.total_bytes == 4 * numel + 4 * largest


def _too_many_passes_staged() -> str:
    ctx = parallax.ParallelContext.local()
    model, opt = _make(ZeroOptimizer, ctx, dtype=BF16, overlap=True, backward_passes_per_step=1)
    try:
        for micro in range(2):
            x, y, use = (local_rows(t, ctx) for t in batch(0, micro, BF16))
            F.mse_loss(model(x, use), y).backward()
    except RuntimeError as err:
        return str(err)
    return ""


def test_staged_buckets_keep_the_accumulation_checks():
    """A staged bucket is marked as reduced like any other: too many passes still raise."""
    assert "backward_passes_per_step" in _too_many_passes_staged()
