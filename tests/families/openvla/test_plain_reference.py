"""The whole trainer at tp2 pp2 dp2 (8 gloo ranks) against plain torch on one process.

The reference shares nothing with parallax but its initial weights and its input tensors: the tiny
OpenVLA written from the architecture in plain tensor ops (``ref_openvla`` in
``tests/families/openvla/helpers.py``: manual softmax attention, RMSNorm, RoPE, LayerScale), the
loss written out below (next-token cross-entropy summed over the labelled tokens of the whole global
batch, divided by their count), ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW`` with
weight decay on tensors of two or more dimensions, and the learning-rate warm-up written out by
hand. The trainer runs with its defaults (1F1B, the head on the labelled rows only, fused q/k/v and
gate/up, gradient reduction overlapped with the backward). Two steps: losses, gradient norms and
learning rates on every rank, and every weight after them.
"""

import pytest
import torch
import torch.nn.functional as F

from parallax.data import BatchLoader, SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer
from tests.families.openvla.helpers import ref_openvla
from tests.families.openvla.test_trainer import separate

STEPS, DP = 2, 2
LR, WARMUP, WEIGHT_DECAY, CLIP = 3e-3, 2, 0.1, 1.0
SEED = 3


def _cfg(**kw) -> TrainConfig:
    base = dict(
        steps=4,  # the schedule's length: the two steps run are its warm-up
        global_batch_size=8,
        micro_batch_size=2,
        warmup_steps=WARMUP,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        grad_clip=CLIP,
        seed=SEED,
    )
    return TrainConfig(**{**base, **kw})


def _data() -> SyntheticTask:
    return SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=SEED)


def _microbatches(config: OpenVLAConfig, data, dp_rank: int, dp_size: int):
    """Per step, this dp rank's microbatches, as the trainer's data path builds them."""
    loader = BatchLoader(
        data, global_batch_size=8, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=SEED
    )
    build = BatchBuilder(config, data.statistics, text_tokenizer(config))
    return [[build(m) for m in loader.next_batch()] for _ in range(STEPS)]


# -- parallax ----------------------------------------------------------------------------------
def _parallel():
    ctx = context(tp=2, pp=2, dp=DP)
    trainer = Trainer(resolve(_cfg(tp=2, pp=2, dp=DP)), ctx)
    history = []
    for mbs in _microbatches(trainer.model_config, _data(), ctx.dp_rank, DP):
        out = trainer.train_step(mbs)
        history.append((out.loss.item(), out.grad_norm.item(), out.lr))
    weights = {}
    for name, p in trainer.named_parameters():
        full = full_tensor(p, ctx.tp_group)
        weights.update(separate(name, full) if ctx.dp_rank == ctx.tp_rank == 0 else {})
    return history, weights


# -- plain torch -------------------------------------------------------------------------------
def _loss_sum(logits: torch.Tensor, labels: torch.Tensor, patches: int) -> torch.Tensor:
    """Cross-entropy summed over the labelled tokens: the sequence is [BOS, patches, text 1..],
    position i predicts token i + 1, and the first label is never a target."""
    ignore = torch.full((labels.shape[0], patches), -100)
    full = torch.cat([labels[:, :1], ignore, labels[:, 1:]], dim=1)  # (b, 1 + P + t - 1)
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), full[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def _reference(lr: float = LR, weight_decay: float = WEIGHT_DECAY, clip: float = CLIP):
    config = OpenVLAConfig.preset("tiny")  # separate q/k/v and gate/up: the Hugging Face names
    init = OpenVLA(config, seed=SEED)  # the layout-free init, whole, on one process
    weights = {n: p.detach().clone().requires_grad_() for n, p in init.named_parameters()}
    matrices = [p for p in weights.values() if p.dim() >= 2]
    vectors = [p for p in weights.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        weight_decay=weight_decay,
    )
    data = _data()
    steps = zip(*(_microbatches(config, data, r, DP) for r in range(DP)))  # both dp shares
    history = []
    for step, shares in enumerate(steps):
        mbs = [mb for share in shares for mb in share]  # the global batch
        tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
        opt.zero_grad()
        loss = 0.0
        for mb in mbs:
            logits = ref_openvla(weights, config, mb["pixel_values"], mb["input_ids"])
            loss = loss + _loss_sum(logits, mb["labels"], config.num_patches) / tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(weights.values()), clip)
        step_lr = lr * min(1.0, (step + 1) / WARMUP)  # linear warm-up over WARMUP steps
        for group in opt.param_groups:
            group["lr"] = step_lr
        opt.step()
        history.append((loss.item(), norm.item(), step_lr))
    return history, {n: p.detach() for n, p in weights.items()}


def _mismatches(weights: dict, ref: dict, rel: float) -> list[str]:
    """Tensors whose largest difference exceeds ``rel`` of the reference tensor's scale."""
    out = []
    for name, want in ref.items():
        err = (weights[name] - want).abs().max().item()
        if err > rel * want.abs().max().item():
            out.append(f"{name}: {err:.3g} of {want.abs().max().item():.3g}")
    return out


# Float32 sums in other orders (tp splits the matmuls, pp and dp the batch, ZeRO the norm): the
# losses and norms agree to ~1e-7. Adam's first steps divide each element's gradient by its own
# magnitude, so an element whose gradient is a nearly cancelling sum carries that sum's rounding
# into its update: the weights agree to 1.7e-5 of each tensor's scale at worst (measured), checked
# at 1e-4. A 1% larger learning rate, no weight decay or no clipping moves most tensors by 4e-4
# to 1e-2 of their scale (the second test).
LOSS_REL, WEIGHT_REL = 1e-5, 1e-4


def _one_thread(fn, *args, **kw):
    """Tiny ops: more threads only wait for each other on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kw)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    return _one_thread(_reference)


def test_tp2_pp2_dp2_trainer_matches_plain_torch(reference):
    ref_history, ref_weights = reference
    assert ref_history[0][1] > CLIP and ref_history[1][1] > CLIP  # clipping is exercised
    results = run_ranks(_parallel, 8, timeout=300)
    weights = {}
    for history, rank_weights in results:
        assert len(history) == len(ref_history) == STEPS
        for got, want in zip(history, ref_history):
            assert got == pytest.approx(want, rel=LOSS_REL)  # loss, grad norm, lr on every rank
        weights.update(rank_weights)
    assert weights.keys() == ref_weights.keys()  # every parameter lives on some stage
    assert _mismatches(weights, ref_weights, WEIGHT_REL) == []


@pytest.mark.parametrize(
    "change",
    [dict(lr=LR * 1.01), dict(weight_decay=0.0), dict(clip=float("inf"))],
    ids=["lr+1%", "no-weight-decay", "no-clipping"],
)
def test_the_comparison_fails_for_a_slightly_different_step(reference, change):
    """The reference changed slightly (what the parallel run is compared with must be this
    precise): the weights fall outside the tolerance."""
    _, ref_weights = reference
    _, other = _one_thread(_reference, **change)
    assert len(_mismatches(other, ref_weights, WEIGHT_REL)) > 50  # of 105 tensors
