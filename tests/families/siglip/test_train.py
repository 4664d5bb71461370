"""The SigLIP/CLIP recipe through the Trainer: every layout equals one process over the global
batch (sigmoid and softmax), evaluation while training, the CLI, and the bad-input messages."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.families.siglip.model import Siglip
from parallax.families.siglip.recipe import SiglipRecipe
from parallax.recipe import registry, resolve
from parallax.run import TrainConfig
from parallax.tensor import full_tensor
from parallax.tensor.sharding import unshard_tensor
from parallax.testing import context, run_ranks
from parallax.train.trainer import Trainer
from tests.families.siglip.helpers import tiny

GLOBAL, STEPS = 8, 3


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="siglip-tiny",
        steps=STEPS,
        global_batch_size=GLOBAL,
        micro_batch_size=2,
        warmup_steps=1,
        lr=3e-3,
        seed=5,
        save_interval=0,
    )
    return TrainConfig(**{**base, **kw})


def _batch(config, n: int = GLOBAL, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    s, t = config.image_size, config.text
    px = torch.randn(n, 3, s, s, generator=g)
    ids = torch.randint(3, t.vocab_size, (n, t.max_length), generator=g)
    ids[:, -1] = t.eos_id  # CLIP pools its end token (none: position 0, which sees only itself)
    return px, ids


def _without_key_bias(name: str, w: torch.Tensor) -> torch.Tensor:
    """Attention is invariant to the key bias: its gradient is 0 up to rounding, which Adam
    scales up to a full step of either sign, so it is left out of the weight comparison."""
    if name.endswith(("qkv.bias", "in_proj_bias")):
        q, _, v = w.chunk(3)
        return torch.cat([q, v])
    return w


def _local(ctx, cfg, px, ids) -> list[dict]:
    """This dp rank's microbatches of the global batch."""
    dp, rank = max(ctx.dp_size, 1), ctx.dp_rank if ctx.dp_size > 1 else 0
    per = px.shape[0] // dp
    px, ids = px[rank * per : (rank + 1) * per], ids[rank * per : (rank + 1) * per]
    m = cfg.micro_batch_size
    return [{"pixel_values": px[i : i + m], "input_ids": ids[i : i + m]} for i in range(0, per, m)]


def dense_loss(out) -> torch.Tensor:
    """The global batch's loss in one process, written out densely."""
    x, y, t = out.image_embeds, out.text_embeds, out.logit_scale.exp()
    logits = t * x @ y.T
    if out.logit_bias is None:  # CLIP
        labels = torch.arange(len(x))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    z = 2 * torch.eye(len(x)) - 1  # +1 on the diagonal, -1 elsewhere
    return -F.logsigmoid(z * (logits + out.logit_bias)).sum() / len(x)


def _ctx(tp: int, dp: int) -> ParallelContext:
    return ParallelContext.local() if tp * dp == 1 else context(tp=tp, dp=dp)


# -- gradients of the recipe's step against the dense loss -----------------------------------------


def _grads(tp: int, dp: int, micro: int, n: int = GLOBAL) -> dict:
    """Per family: the step's loss and every gradient (dp mean, full over tp) on this rank."""
    ctx, recipe, out = _ctx(tp, dp), SiglipRecipe(), {}
    for family in ("siglip", "clip"):
        config = tiny(family)
        cfg = _cfg(tp=tp, dp=dp, micro_batch_size=micro, global_batch_size=n)
        run = resolve(cfg, recipe=recipe, model_config=config)
        model = recipe.model.build(
            run, range(1), ctx, dtype=torch.float32, device="cpu", checkpoint=None
        )
        mbs = _local(ctx, cfg, *_batch(config, n))
        loss, sums = recipe.objective.forward_backward([model], mbs, ctx, run)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            if ctx.dp_size > 1:
                torch.distributed.all_reduce(g, group=ctx.dp_group)
                g /= ctx.dp_size
            info = getattr(p, "tp_shard", None)
            grads[name] = g if info is None else unshard_tensor(g, info, ctx.tp_group)
        out[family] = (float(loss), float(sums[-1]), grads)
    return out


def _reference_grads(n: int = GLOBAL) -> dict:
    recipe, out = SiglipRecipe(), {}
    for family in ("siglip", "clip"):
        config = tiny(family)
        run = resolve(_cfg(), recipe=recipe, model_config=config)
        model = recipe.model.build(
            run, range(1), ParallelContext.local(), dtype=torch.float32, device="cpu",
            checkpoint=None,
        )  # fmt: skip
        loss = dense_loss(model(*_batch(config, n)))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[family] = (float(loss.detach()), grads)
    return out


def _check_grads(got: dict, ref: dict, what: str, n: int = GLOBAL) -> None:
    for family, (loss, pairs, grads) in got.items():
        ref_loss, ref_grads = ref[family]
        assert pairs == n
        assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=f"{what} {family} loss")
        assert {"logit_scale"} <= grads.keys() and grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            scale = float(ref_grads[name].abs().max()) + 1e-12
            assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=f"{family} {name}")
        if family == "siglip":
            assert grads["logit_bias"].abs().item() > 0


def test_step_gradients_equal_the_dense_global_loss_at_every_layout():
    """dp 2, 3 and 4 and tp2 dp2, with one microbatch per rank and with GradCache over several:
    the step's loss is the dense single-process loss over all 8 pairs, and the dp mean of the
    gradients (towers, logit_scale, logit_bias) its gradient."""
    ref = _reference_grads()
    _check_grads(_grads(1, 1, 2), ref, "1 process, 4 microbatches (GradCache)")
    for got in run_ranks(_grads, 2, 1, 2, 4):
        _check_grads(got, ref, "dp2")
    for got in run_ranks(_grads, 4, 1, 4, 1):
        _check_grads(got, ref, "dp4 GradCache")
    for got in run_ranks(_grads, 4, 2, 2, 2):
        _check_grads(got, ref, "tp2 dp2 GradCache")
    ref = _reference_grads(6)
    for got in run_ranks(_grads, 3, 1, 3, 1, 6):
        _check_grads(got, ref, "dp3 GradCache", 6)


# -- the Trainer: losses, grad norms and updated weights -------------------------------------------


def _train(tp: int, dp: int, micro: int) -> dict:
    ctx, out = _ctx(tp, dp), {}
    for family in ("siglip", "clip"):
        config, cfg = tiny(family), _cfg(tp=tp, dp=dp, micro_batch_size=micro)
        trainer = Trainer(resolve(cfg, recipe=SiglipRecipe(), model_config=config), ctx)
        history = []
        for step in range(STEPS):
            o = trainer.train_step(_local(ctx, cfg, *_batch(config, step=step)))
            history.append([o.loss.item(), o.grad_norm.item(), *o.metrics.tolist()])
        weights = {n: full_tensor(p, ctx.tp_group) for n, p in trainer.named_parameters()}
        out[family] = (history, weights)
    return out


def test_trainer_at_dp2_dp4_tp2dp2_equals_one_process():
    ref = _train(1, 1, GLOBAL)  # one process, the whole global batch in one microbatch
    runs = [("dp2", r) for r in run_ranks(_train, 2, 1, 2, 2)]
    runs += [("dp4", r) for r in run_ranks(_train, 4, 1, 4, 1)]
    runs += [("tp2dp2", r) for r in run_ranks(_train, 4, 2, 2, 1)]
    for layout, got in runs:
        for family, (history, weights) in got.items():
            ref_history, ref_weights = ref[family]
            assert_close(
                torch.tensor(history),
                torch.tensor(ref_history),
                rtol=1e-5,
                atol=1e-5,
                msg=f"{layout} {family}",
            )
            for name, w in weights.items():
                a, b = _without_key_bias(name, w), _without_key_bias(name, ref_weights[name])
                atol = 1e-5 * float(b.abs().max())
                assert_close(a, b, rtol=1e-5, atol=atol, msg=f"{layout} {family} {name}")
            changed = weights["logit_scale"] != tiny(family).logit_scale_init
            assert changed.all(), "logit_scale was not trained"
    assert ref["siglip"][0][-1][0] < ref["siglip"][0][0][0]  # the loss falls on a fixed batch


# -- evaluation, the CLI and bad input -------------------------------------------------------------


def _cli(tp: int, dp: int, out: str, steps: int) -> dict:
    from parallax.train.cli import resolve_run, run

    cfg = _cfg(
        model="clip-tiny",  # the same recipe; the softmax loss learns the task in a few steps
        tp=tp,
        dp=dp,
        steps=steps,
        global_batch_size=32,
        micro_batch_size=16 // dp,
        data="synthetic:512",
        lr=3e-3,
        warmup_steps=5,
        eval_interval=steps,
        eval_batches=2,
        out=out,
        log_interval=100,
        export_hf=True,
    )
    return run(resolve_run(cfg), _ctx(tp, dp))


def test_cli_run_logs_eval_metrics_and_learns():
    """tp2 dp2 through ``parallax.train.cli.run``: metrics.jsonl and eval.jsonl hold the loss and
    every evaluation metric, the loss falls, --export-hf writes the HF layout."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_cli, 4, 2, 2, root, 16)  # the loss levels off after ~13 steps
        rows = [json.loads(x) for x in (Path(root) / "metrics.jsonl").read_text().splitlines()]
        evals = [json.loads(x) for x in (Path(root) / "eval.jsonl").read_text().splitlines()]
        hf = Path(root) / "hf"  # --export-hf: the HF SiglipModel layout, found by config.json
        assert registry.find(str(hf)).name == "siglip"
        assert json.loads((hf / "config.json").read_text())["model_type"] == "clip"
        assert Siglip.from_pretrained(hf).logit_scale.item() != 2.6592  # trained
    assert len(rows) == 16 and {"temperature", "logit_bias", "truncated"} <= rows[0].keys()
    assert sum(r["loss"] for r in rows[-5:]) < 0.9 * sum(r["loss"] for r in rows[:5])
    (last,) = evals
    keys = {f"eval_{d}_r@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    assert keys | {"eval_loss", "eval_zero_shot_top1", "eval_zero_shot_top5"} <= last.keys()


def _eval_sums(tp: int, dp: int) -> list[float]:
    from parallax.train.evaluate import Evaluator

    ctx, recipe = _ctx(tp, dp), SiglipRecipe()
    cfg = _cfg(tp=tp, dp=dp, eval_interval=1, eval_batches=2, data="synthetic:64")
    trainer = Trainer(resolve(cfg, recipe=recipe), ctx)
    data = recipe.data.eval_dataset(None, trainer.run)
    evaluator = Evaluator(trainer, data, recipe.data.collator(trainer.run, data), Path())
    evaluator.path = Path("/dev/null")
    return list(evaluator.run(0).values())


def test_evaluation_is_the_same_at_every_layout():
    ref = _eval_sums(1, 1)
    assert len(ref) == 1 + 1 + 6 + 2 and ref[1] > 0  # step, loss, recalls, zero-shot
    for got in run_ranks(_eval_sums, 4, 2, 2):
        assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_resume_continues_the_pair_stream_exactly(tmp_path):
    """A run stopped after 2 of 4 steps and resumed gives the uninterrupted run's losses (the
    PairLoader's position and the weights come back from the checkpoint)."""
    from parallax.train.cli import resolve_run, run

    def losses(out, **kw) -> list[float]:
        cfg = _cfg(steps=4, data="synthetic:64", out=str(out), save_interval=2, **kw)
        run(resolve_run(cfg), ParallelContext.local())
        return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]

    straight = losses(tmp_path / "a")
    cfg = _cfg(steps=4, data="synthetic:64", out=str(tmp_path / "b"), save_interval=2)
    run(resolve_run(cfg), ParallelContext.local(), stop_after=2)
    resumed = losses(tmp_path / "b", resume=True)
    assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=0)
