"""``--checkpoint-scope``: activation checkpointing of the vision towers alone or of the language
model alone recomputes exactly those blocks (counted) and gives the step without checkpointing;
the flag, its checks, and the dry-run's activation estimate."""

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.model import Siglip
from parallax.models.compile import checkpoint_parts
from parallax.testing import assert_adam_close
from parallax.train import TrainConfig, parse_args, resolve
from parallax.train.dry_run import _dims, memory_plan
from parallax.train.trainer import Trainer
from tests.families.openvla.test_trainer import LR, _cfg, train_steps


def test_checkpoint_parts():
    assert checkpoint_parts(False) == (False, False)
    assert checkpoint_parts(True) == checkpoint_parts("all") == (True, True)
    assert checkpoint_parts("vision") == (True, False)
    assert checkpoint_parts("text") == (False, True)
    with pytest.raises(ValueError, match="expected one of all, vision, text"):
        checkpoint_parts("mlp")


def _flags(model) -> tuple[set[bool], set[bool]]:
    """The ``checkpointed`` flags of the vision towers' blocks and of the decoder layers."""
    towers = {b.checkpointed for t in model.vision_towers() for b in t._blocks()}
    layers = {b.checkpointed for b in model.language_model._blocks()}
    return towers, layers


@pytest.mark.parametrize(
    "scope, want", [(False, (False, False)), (True, (True, True)), ("vision", (True, False))]
)
def test_openvla_scope_sets_the_blocks(scope, want):
    model = OpenVLA(OpenVLAConfig.preset("tiny"), activation_checkpointing=scope)
    assert _flags(model) == ({want[0]}, {want[1]})
    model.set_activation_checkpointing("text")
    assert _flags(model) == ({False}, {True})


def _run_counting(cfg):
    """``_run`` of test_trainer, counting forward calls of the first vision block's and the
    first decoder layer's first norm."""
    torch.manual_seed(0)
    ctx = ParallelContext.local()
    trainer = Trainer(resolve(cfg), ctx)
    model = trainer.chunks[0]
    block = next(iter(model.vision_towers()[0]._blocks()))
    norms = {
        "vision": next(m for m in block.modules() if "Norm" in type(m).__name__),
        "text": next(iter(model.language_model._blocks())).input_layernorm,
    }
    calls = dict.fromkeys(norms, 0)
    for part, norm in norms.items():
        norm.register_forward_hook(lambda *_, part=part: calls.__setitem__(part, calls[part] + 1))
    history = train_steps(trainer, ctx, cfg)
    weights = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return history, weights, calls


@pytest.mark.parametrize("scope", ["vision", "text"])
def test_scope_recomputes_its_blocks_and_gives_the_same_step(scope):
    """Without checkpointing and with one scope, on one process: each forward of a
    checkpointed block runs twice (again in the backward), the others' once; the losses, grad
    norms, metrics and updated weights are the same."""
    ref_history, ref_weights, ref_calls = _run_counting(_cfg())
    cfg = _cfg(activation_checkpointing=True, checkpoint_scope=scope)
    assert cfg.checkpointing == scope
    history, weights, calls = _run_counting(cfg)
    other = "text" if scope == "vision" else "vision"
    assert ref_calls["vision"] == ref_calls["text"] > 0
    assert calls[scope] == 2 * ref_calls[scope] and calls[other] == ref_calls[other]
    assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
    for name, value in ref_weights.items():  # one process, the recomputation the same ops
        assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_siglip_scope_picks_a_tower():
    config = SiglipConfig.preset("siglip-tiny")
    model = Siglip(config, activation_checkpointing="text", seed=0)
    assert model.text.activation_checkpointing and not model.vision.trunk.activation_checkpointing
    model.set_activation_checkpointing("vision")
    assert model.vision.trunk.activation_checkpointing and not model.text.activation_checkpointing
    plain = Siglip(config, seed=0)
    g = torch.Generator().manual_seed(1)
    px = torch.randn(3, 3, config.image_size, config.image_size, generator=g)
    ids = torch.randint(2, config.text.vocab_size, (3, config.text.max_length), generator=g)
    grads = []
    for m in (plain, model):
        out = m(px, ids)
        (out.image_embeds.square().sum() + out.text_embeds.sum()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_scope_flag():
    cfg = parse_args(["--activation-checkpointing", "--checkpoint-scope", "vision"])
    assert cfg.checkpoint_scope == "vision" and cfg.checkpointing == "vision"
    assert parse_args(["--activation-checkpointing"]).checkpointing is True
    assert parse_args([]).checkpointing is False
    with pytest.raises(ValueError, match="needs --activation-checkpointing"):
        resolve(parse_args(["--checkpoint-scope", "vision"]))
    with pytest.raises(ValueError, match="one of all, vision, text"):
        resolve(parse_args(["--activation-checkpointing", "--checkpoint-scope", "mlp"]))


def test_plan_counts_the_activations_that_stay():
    def activations(**kw):
        cfg = resolve(TrainConfig(model="tiny", dp=1, **kw))
        return memory_plan(cfg, _dims(cfg))[0].activations

    kept = activations()
    vision = activations(activation_checkpointing=True, checkpoint_scope="vision")
    text = activations(activation_checkpointing=True, checkpoint_scope="text")
    everything = activations(activation_checkpointing=True)
    # each scope leaves the other part's activations; recomputing both keeps the blocks' inputs
    assert kept > vision > everything > 0
    assert kept > text > everything


def _scoped_at_tp2(tp):
    from parallax.testing import context
    from tests.families.openvla.test_trainer import _run

    cfg = _cfg(tp=tp, activation_checkpointing=True, checkpoint_scope="vision")
    return _run(context(tp=tp), cfg)


def test_scope_at_tp2_equals_one_process():
    """At tp 2 (gloo) the scoped recomputation (checkpointed from outside the blocks there)
    gives the single-process step without checkpointing: losses, grad norms, metrics and the
    updated weights (gathered on tp rank 0)."""
    from parallax.testing import run_ranks
    from tests.families.openvla.test_trainer import _run

    ref_history, ref_weights = _run(ParallelContext.local(), _cfg())
    runs = run_ranks(_scoped_at_tp2, 2, 2)
    for history, _ in runs:
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
    weights = runs[0][1]
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert_adam_close(weights[name], value, LR, msg=name)
