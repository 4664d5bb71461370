"""``--finetune lora --quantize-base nf4|int8`` through the Trainer: every layout equals one
process holding the same (dequantized) base weights, the codes stay as built, checkpoints say
which base they grew on and refuse another, the export writes the dequantized base merged with
the adapters, and the tiny model learns with a quantized base about as well as without."""

import json

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.checkpoint import latest_checkpoint
from parallax.tensor.quant import quantized_weights
from parallax.tensor.sharding import unshard_tensor
from parallax.testing import context, one_thread, run_ranks
from parallax.train import resolve
from tests.families.openvla.test_lora_train import _cfg, _losses
from tests.families.openvla.test_trainer import _batches, separate

STEPS = 3


def _bases(trainer, ctx) -> dict[str, torch.Tensor]:
    """The dequantized base weights of this rank's stages, whole (tp gathered), fp32."""
    out = {}
    for chunk in trainer.chunks:
        for name, q in quantized_weights(chunk):
            local = q.dequantize(torch.float32)
            full = local if q.tp_shard is None else unshard_tensor(local, q.tp_shard, ctx.tp_group)
            out[name] = full
    return out


def _train(trainer, ctx, cfg):
    from parallax.data import SyntheticTask

    data = SyntheticTask(num_episodes=8, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    return history


def _parallel(tp, pp, dp, extra):
    from parallax.train.trainer import Trainer

    ctx = context(tp=tp, pp=pp, dp=dp)
    cfg = _cfg(tp=tp, pp=pp, dp=dp, steps=STEPS, **extra)
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    codes = {n: q.codes.clone() for c in trainer.chunks for n, q in quantized_weights(c)}
    bases = _bases(trainer, ctx)
    history = _train(trainer, ctx, cfg)
    still = all(
        torch.equal(q.codes, codes[n]) for c in trainer.chunks for n, q in quantized_weights(c)
    )
    trained = {n for n, p in trainer.named_parameters() if p.requires_grad}
    weights = {}
    for name, full in trainer.full_weights():  # whole, at any zero stage
        if name in trained and ctx.dp_rank == 0 and ctx.tp_rank == 0:
            weights.update(separate(name, full.detach().clone()))
    return history, weights, bases if ctx.dp_rank == 0 and ctx.tp_rank == 0 else {}, still


def _reference(bases: dict[str, torch.Tensor]):
    """One process, no quantization, its base linears set to the parallel run's values."""
    from parallax.train.trainer import Trainer

    ctx = ParallelContext.local()
    cfg = _cfg(steps=STEPS)
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    params = dict(trainer.named_parameters())
    assert bases.keys() <= params.keys()
    with torch.no_grad():
        for name, value in bases.items():
            params[name].copy_(value)
    history = _train(trainer, ctx, cfg)
    weights = {}
    for name, p in trainer.named_parameters():
        if p.requires_grad:
            weights.update(separate(name, p.detach()))
    return history, weights


@pytest.mark.parametrize(
    "tp,pp,dp,extra",
    [
        (2, 2, 2, dict(quantize_base="nf4", activation_checkpointing=True)),
        (2, 1, 2, dict(quantize_base="int8", zero=3)),
        (1, 1, 2, dict(quantize_base="nf4", zero=2, offload="optimizer")),
    ],
    ids=["tp2pp2dp2-nf4-ckpt", "tp2dp2-int8-zero3", "dp2-nf4-zero2-offload"],
)
def test_layouts_match_one_process_holding_the_same_weights(tp, pp, dp, extra):
    with one_thread():
        results = run_ranks(_parallel, tp * pp * dp, tp, pp, dp, extra)
        bases = {n: v for _, _, b, _ in results for n, v in b.items()}
        ref_history, ref_weights = _reference(bases)
    assert len(bases) > 30 and all(still for *_, still in results)  # the codes never change
    seen = {}
    for history, weights, _, _ in results:
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
        seen.update(weights)
    assert seen.keys() == ref_weights.keys() and any(".lora_A" in n for n in seen)
    # The weights after 3 AdamW steps at lr 2e-3: an element whose gradient is at float32's
    # rounding level gets an update g / sqrt(v) that the parallel summation order moves by up
    # to ~1 % of a step (one element in 25,600 by 2.6e-5 here): atol 5e-5, 2.5 % of a step.
    for name, value in ref_weights.items():
        assert_close(seen[name], value, rtol=1e-5, atol=5e-5, msg=name)


def _cli(out, *extra):
    """``parallax.train`` in this process; the refusal's message, or None."""
    from parallax.train import parse_args
    from parallax.train.cli import UserError, resolve_run, run

    args = ["--out", str(out), *RUN, *extra]
    try:
        run(resolve_run(parse_args(args)), ParallelContext.local())
    except UserError as err:
        return str(err)
    return None


RUN = (
    *("--finetune", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--seed", "3"),
    *("--global-batch-size", "2", "--micro-batch-size", "2", "--save-interval", "2"),
)


def test_checkpoints_name_their_base_and_the_export_is_the_dequantized_merge(tmp_path):
    from parallax.families.openvla.model import OpenVLA
    from parallax.train.session import export_hf
    from parallax.train.trainer import Trainer

    out = tmp_path / "q"
    assert _cli(out, "--steps", "2", "--quantize-base", "nf4") is None
    saved = json.loads((latest_checkpoint(out / "checkpoints") / "meta.json").read_text())
    assert saved["lora"]["quantize_base"] == "nf4"
    for other in (("--quantize-base", "int8"), ()):
        refused = _cli(out, "--steps", "3", "--resume", *other)
        assert refused and "--quantize-base nf4" in refused, refused
    assert _cli(out, "--steps", "3", "--resume", "--quantize-base", "nf4") is None
    assert sorted(_losses(out)) == [1, 2, 3]
    # the export: each quantized weight dequantized, the adapter added in fp32, bf16 once
    trainer = Trainer(resolve(_cfg(quantize_base="int8", steps=1)), ParallelContext.local())
    with torch.no_grad():
        for _, p in trainer.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.01)  # adapters away from zero: the merge must show
    export_hf(trainer, tmp_path / "hf")
    chunk = trainer.chunks[0]
    exported = OpenVLA.from_pretrained(
        tmp_path / "hf", None, dtype=torch.float32, config=chunk.config
    )
    got = dict(exported.named_parameters())
    held = dict(quantized_weights(chunk))
    assert len(held) > 30
    for name, q in held.items():
        layer = chunk.get_submodule(name.rpartition(".")[0])
        want = q.dequantize(torch.float32) + layer.lora_delta()
        assert torch.equal(got[name], want.to(torch.bfloat16).float()), name
    head = "language_model.lm_head.weight"
    kept = dict(chunk.named_parameters())[head].detach()  # the output head is not quantized
    assert head not in held and torch.equal(got[head], kept.to(torch.bfloat16).float())


def test_tiny_openvla_learns_as_well_on_a_quantized_base(tmp_path):
    """The same run on the unquantized, the NF4 and the int8 base: the action accuracy of the
    steps after the first few within 0.03 of the unquantized run's (all start near 0)."""
    learn = ("--steps", "8", "--global-batch-size", "8", "--micro-batch-size", "8")
    learn += ("--lora-rank", "16", "--lr", "3e-3", "--log-interval", "1", "--save-interval", "0")
    accuracy = {}
    for kind in ("none", "nf4", "int8"):
        extra = () if kind == "none" else ("--quantize-base", kind)
        assert _cli(tmp_path / kind, *learn, *extra) is None
        rows = [json.loads(r) for r in (tmp_path / kind / "metrics.jsonl").read_text().splitlines()]
        acc = {r["step"]: r["action_accuracy"] for r in rows}
        assert acc[1] < 0.1
        accuracy[kind] = sum(acc[s] for s in range(3, 9)) / 6
    # seed 3 (deterministic): none 0.464, nf4 0.476, int8 0.467 over steps 3-8
    assert accuracy["none"] > 0.4, accuracy
    for kind in ("nf4", "int8"):
        assert abs(accuracy[kind] - accuracy["none"]) <= 0.03, accuracy


def test_a_policy_loaded_from_a_qlora_run_predicts_on_its_quantized_base(tmp_path):
    """``load_policy`` of the run's --out rebuilds the quantized base it trained on, adapters
    on it; its chunk agrees with the merged bf16 export's (rounded to bf16: within 0.02)."""
    from parallax.families.openvla.oft.policy import load_policy

    out = tmp_path / "oft"
    oft = ("--action-head", "l1", "--action-chunk", "2", "--quantize-base", "nf4")
    assert _cli(out, "--steps", "2", *oft, "--export-hf") is None
    policy, merged = load_policy(out), load_policy(out / "hf")
    assert len(list(quantized_weights(policy))) > 30 and not list(quantized_weights(merged))
    gen = torch.Generator().manual_seed(0)
    images = [[torch.rand(3, 224, 224, generator=gen) for _ in range(2)] for _ in range(2)]
    words = ["pick up the cup", "open the drawer"]
    state = torch.randn(2, policy.config.oft.proprio_dim, generator=gen)
    got, want = (m.predict_action_chunk(images, words, state) for m in (policy, merged))
    assert got.shape == (2, 2, 7)
    assert abs(got - want).max() < 0.02
