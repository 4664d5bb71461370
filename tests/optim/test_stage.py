"""The stage object: what 1, 2 and 3 mean, its bytes per element by hand, and the arguments
ZeroOptimizer refuses for a stage (single process)."""

import pytest
import torch

import parallax
from parallax.optim import ZeroOptimizer, ZeroStage, stage_of
from parallax.optim.zero.stage import INPLACE, OWN, SHARD, STAGED, ElementBytes
from tests.optim.common import build, groups


def test_a_stage_is_built_once_from_its_number_and_reads_as_it():
    one, two, three = (stage_of(n) for n in (1, 2, 3))
    assert stage_of(three) is three is ZeroStage.SHARD_WEIGHTS
    assert three == 3 and one < 3 and f"ZeRO-{three}" == "ZeRO-3" and str(two) == "2"
    answers = [
        (s.full_grad_buffer, s.reduces_each_pass, s.launches_in_order, s.shards_weights)
        for s in (one, two, three)
    ]
    assert answers == [
        (True, False, False, False),
        (False, True, True, False),
        (False, True, False, True),
    ]
    assert [s.can_offload for s in (one, two, three)] == [False, True, True]
    for bad in (0, 4, True, "2", None):
        with pytest.raises(ValueError, match="must be 1, 2 or 3"):
            stage_of(bad)


def test_gradient_homes():
    one, two = stage_of(1), stage_of(2)
    home = one.grad_home
    assert two.grad_home(2, False, 1, partial=False, overlap=True) == SHARD  # no full buffer
    assert home(4, True, 2, partial=False, overlap=True) == OWN
    assert home(2, False, 1, partial=False, overlap=True) == STAGED
    assert home(2, False, 1, partial=True, overlap=True) == SHARD
    assert home(2, False, 2, partial=False, overlap=False) == INPLACE
    assert home(2, False, 2, partial=True, overlap=True) == INPLACE
    assert home(2, False, 2, partial=False, overlap=True) == SHARD
    assert home(1, False, 2, partial=False, overlap=False) == SHARD  # 2 bytes hold no fp32


def test_bytes_per_element_by_hand():
    """bf16 at dp 4: ZeRO-1 holds the bf16 weight and gradient, an fp32 reduced slice with
    overlap, 4/dp of master and 8/dp of moments; ZeRO-2 trades the gradient buffer for the
    slice; ZeRO-3 shards the weight too; offloaded, master, moments and the bf16 accumulator
    are on the host."""
    one, two, three = (stage_of(n) for n in (1, 2, 3))
    assert one.trainable_bytes(4, 2) == ElementBytes(2, 2 + 1, 1 + 2)
    assert one.trainable_bytes(4, 2, overlap=False) == ElementBytes(2, 2, 1 + 2)
    assert one.trainable_bytes(4, 4) == ElementBytes(4, 4, 2)  # fp32: its own master
    assert two.trainable_bytes(4, 2) == ElementBytes(2, 1, 3)
    assert three.trainable_bytes(4, 2) == ElementBytes(0.5, 1, 3)
    assert three.trainable_bytes(4, 2, offloaded=True) == ElementBytes(0.5, host=(4 + 8 + 2) / 4)
    assert two.frozen_bytes(4, 2) == ElementBytes(2) and three.frozen_bytes(4, 2) == ElementBytes(
        0.5
    )
    with pytest.raises(ValueError, match="needs ZeRO stage 2 or 3, got 1"):
        one.trainable_bytes(4, 2, offloaded=True)


def test_the_optimizer_refuses_what_its_stage_cannot_do():
    ctx = parallax.ParallelContext.local()
    model = build()
    cases = [
        (dict(stage=True), ValueError, "must be 1, 2 or 3, got True"),
        (dict(stage=3), ValueError, "ZeRO-3 needs the modules"),
        (dict(stage=2, modules=[model, 1]), TypeError, "modules must be nn.Modules"),
        (dict(stage=1, offload=True), ValueError, "needs ZeRO stage 2 or 3, got 1"),
        (dict(stage=2, offload=True, offload_fraction=0.0), ValueError, "offload_fraction"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            ZeroOptimizer(groups(model), torch.optim.AdamW, ctx, **kwargs)
    opt = ZeroOptimizer(groups(model), torch.optim.AdamW, ctx, stage=2, modules=model)
    assert opt.stage is ZeroStage.SHARD_GRADIENTS and opt.memory_report().stage == 2
