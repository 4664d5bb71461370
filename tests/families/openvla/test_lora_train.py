"""``--finetune lora`` through the Trainer: every layout equals one process (loss, grad norm,
updated adapters and ``--train`` modules), the base stays bitwise as built, nothing is kept for
it; checkpoints hold only what trains, resume at another layout, refuse another base; the
export writes the merged model and the PEFT adapter."""

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from parallax import ParallelContext
from parallax.checkpoint import Checkpoint, latest_checkpoint
from parallax.tensor import full_tensor
from parallax.testing import context, run_ranks
from parallax.train import TrainConfig, resolve
from tests.families.openvla.test_trainer import _batches, separate
from tests.recipe.test_custom_recipe import library_families_only  # noqa: F401 (a fixture)

STEPS = 3
LORA = dict(finetune="lora", lora_rank=4, lora_alpha=8.0, train="projector.fc1")


def _cfg(**kw):
    base = dict(
        steps=STEPS,
        global_batch_size=4,
        micro_batch_size=1,
        lr=2e-3,
        lr_groups="projector.*=1e-3",  # the fully trained module in a group of its own
        seed=3,
        **LORA,
    )
    if kw.get("finetune") == "full":  # the adapters' options mean nothing then, and are refused
        base = {k: v for k, v in base.items() if k not in LORA or k == "finetune"}
    return TrainConfig(**{**base, **kw})


def _run(ctx, cfg):
    from parallax.data import SyntheticTask
    from parallax.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    frozen = {n: p.detach().clone() for n, p in trainer.named_parameters() if not p.requires_grad}
    data = SyntheticTask(num_episodes=8, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    history = []
    for _ in range(STEPS):
        out = trainer.train_step(next_batch())
        history.append([out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()])
    named = trainer.named_parameters()
    trainable = [(n, p) for n, p in named if p.requires_grad]
    facts = {
        # the base: bitwise as built, no gradient was ever made for it, no optimizer entry
        "base_unchanged": all(torch.equal(frozen[n], p) for n, p in named if n in frozen),
        "base_grads": sum(p.grad is not None for n, p in named if n in frozen),
        "optimizer": sorted(trainer.optimizer.names) == sorted(n for n, _ in trainable),
        "frozen": len(frozen),
    }
    weights = {}
    for name, p in trainable:  # the updated adapters and --train modules
        full = full_tensor(p, ctx.tp_group)
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            weights.update(separate(name, full))
    return history, weights, facts


def _parallel(tp, pp, dp):
    return _run(context(tp=tp, pp=pp, dp=dp), _cfg(tp=tp, pp=pp, dp=dp))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread in this process, as the pool's ranks run (two threads on a shared
    two-core machine made the single-process reference 30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(ParallelContext.local(), _cfg())
    finally:
        torch.set_num_threads(threads)


def test_lora_defaults_are_openvlas():
    cfg = resolve(TrainConfig(finetune="lora"))  # the family's defaults filled in, once
    assert (cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.grad_clip) == (5e-4, "constant", 0, 0)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == (32, 16.0, 0.0)
    full = resolve(TrainConfig())
    assert (full.lr_schedule, full.warmup_steps, full.grad_clip) == ("cosine", 20, 1.0)
    given = resolve(TrainConfig(finetune="lora", lr=1e-4, warmup_steps=5, grad_clip=1.0))
    assert (given.lr, given.warmup_steps, given.grad_clip) == (1e-4, 5, 1.0)
    for bad, msg in (
        (dict(train="norm"), "--train norm needs --finetune lora"),
        (dict(lora_rank=8), "--lora-rank 8 needs --finetune lora"),
        (dict(finetune="lora", lora_rank=0), "--lora-rank"),
        (dict(finetune="lora", lora_dropout=0.1, tp=2), "one dropout mask"),
        (dict(finetune="lora", lora_init="/nonexistent"), "no such adapter"),
    ):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**bad).check()


def test_bad_globs_fail_before_anything_is_built():
    from parallax.train.trainer import Trainer

    for kw, msg in (
        (dict(lora_targets="nope_proj"), "match no linear"),
        (dict(train="x.*"), "--train"),
    ):
        with pytest.raises(ValueError, match=msg):
            Trainer(resolve(_cfg(**kw)), ParallelContext.local())


@pytest.mark.parametrize(
    "tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)], ids=["tp2", "pp2", "dp2", "tp2pp2dp2"]
)
def test_layouts_match_one_process(reference, tp, pp, dp):
    ref_history, ref_weights, ref_facts = reference
    assert ref_facts == {
        "base_unchanged": True,
        "base_grads": 0,
        "optimizer": True,
        "frozen": ref_facts["frozen"],
    }
    seen = {}
    for history, weights, facts in run_ranks(_parallel, tp * pp * dp, tp, pp, dp):
        assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
        assert facts["base_unchanged"] and facts["base_grads"] == 0 and facts["optimizer"]
        seen.update(weights)
    assert seen.keys() == ref_weights.keys()
    assert any(".lora_A" in n for n in seen) and "projector.fc1.weight" in seen
    for name, value in ref_weights.items():
        assert_close(seen[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert ref_history[-1][0] < ref_history[0][0]


RUN = (
    *("--finetune", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--train", "projector.fc1"),
    *("--steps", "4", "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "2e-3"),
    *("--save-interval", "2", "--log-interval", "2", "--seed", "3"),
)


def _cli(tp, pp, dp, out, *extra, stop_after=None):
    """``parallax.train`` in this pool's ranks; the error message of a refused run."""
    from parallax.train import parse_args
    from parallax.train.cli import UserError, resolve_run, run

    ctx = context(tp=tp, pp=pp, dp=dp)
    args = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", out, *RUN, *extra]
    try:
        run(resolve_run(parse_args(args)), ctx, stop_after=stop_after)
    except UserError as err:
        return str(err)
    return None


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _tensors(out) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(latest_checkpoint(out / "checkpoints"))
    return {n: ckpt.get(n) for n in ckpt.names()}


def test_checkpoints_hold_what_trains_resume_elsewhere_and_refuse_another_base(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_ranks(_cli, 2, 2, 1, 1, str(a)) == [None, None]  # uninterrupted at tp2
    assert run_ranks(_cli, 2, 1, 1, 2, str(b), stop_after=2) == [None, None]  # dp2, stopped
    half = Checkpoint(latest_checkpoint(b / "checkpoints"))
    weights = [n for n in half.names() if not n.startswith("optim.")]
    assert weights and all(".lora_" in n or n.startswith("projector.fc1.") for n in weights)
    assert any("q_proj.lora_A" in n for n in weights)  # fused q/k/v stored as HF's modules
    assert "language_model.model.layers.0.self_attn.q_proj.weight" not in half
    assert half.meta["lora"]["base"] and half.meta["lora"]["rank"] == 4
    # another base (another seed's random weights) is refused on every rank, untouched
    refused = run_ranks(_cli, 2, 1, 2, 1, str(b), "--resume", "--seed", "4")
    assert all(m and "different base model" in m for m in refused), refused
    assert run_ranks(_cli, 2, 1, 2, 1, str(b), "--resume") == [None, None]  # resumed at pp2
    ref, got = _losses(a), _losses(b)
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=1e-5)
    ref_t, got_t = _tensors(a), _tensors(b)
    assert ref_t.keys() == got_t.keys()
    for name, value in ref_t.items():
        assert_close(got_t[name], value, rtol=1e-5, atol=1e-5, msg=name)  # as test_trainer


def test_export_writes_the_merged_model_and_the_peft_adapter(tmp_path):
    from safetensors import safe_open

    from parallax.families.openvla.model import OpenVLA
    from parallax.models.hf_io import CheckpointReader
    from parallax.models.peft_load import load_adapter
    from parallax.tensor.lora_apply import apply_lora, merged_state
    from parallax.train.trainer import Trainer

    out = tmp_path / "exp"
    assert run_ranks(_cli, 2, 2, 1, 1, str(out), "--steps", "2", "--export-hf") == [None] * 2
    adapter = out / "hf" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (
        4,
        8,
        ["projector.fc1"],
    )
    hf_keys = CheckpointReader(out / "hf").shapes()
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
        for key in keys:  # PEFT's names: base_model.model. + the HF module + .lora_X.weight
            if ".lora_" not in key:
                assert key.removeprefix("base_model.model.") in hf_keys  # modules_to_save
                continue
            module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
            out_f, in_f = hf_keys[f"{module}.weight"]
            shape = f.get_slice(key).get_shape()
            assert shape == ([4, in_f] if kind == "A.weight" else [out_f, 4]), key
    assert "base_model.model.language_model.model.layers.0.self_attn.k_proj.lora_B.weight" in keys
    assert "base_model.model.language_model.lm_head.lora_A.weight" not in keys
    notes = json.loads((adapter / "parallax_adapter.json").read_text())
    assert notes["not_adapted"]["modules"]  # the towers' unused blocks
    # merged = the base the run built (seed 3) with the exported adapter, merged in fp32,
    # written once in bf16; at tp2 each rank merged its own slice
    base = OpenVLA(Trainer(resolve(_cfg(steps=2)), ParallelContext.local()).model_config, seed=3)
    apply_lora(base, rank=4, alpha=8.0, seed=None)
    load_adapter(base, adapter)
    exported = OpenVLA.from_pretrained(out / "hf", None, dtype=torch.float32, config=base.config)
    got = dict(exported.named_parameters())
    for name, value in merged_state(base):
        assert torch.equal(got[name], value.to(torch.bfloat16).float()), name
    # --lora-init starts a run from that adapter
    start = Trainer(resolve(_cfg(lora_init=str(adapter))), ParallelContext.local())
    params = dict(start.named_parameters())
    for name, p in base.named_parameters():
        if p.requires_grad or name.startswith("projector.fc1."):
            assert torch.equal(params[name].detach(), p.detach()), name


LEARN = (
    "--steps",
    "10",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "4",
    "--log-interval",
    "5",
)


def _learn(out, *extra):
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    args = ["--dp", "2", "--out", out, "--save-interval", "0", "--seed", "1", *LEARN, *extra]
    run(resolve_run(parse_args(args)), context(dp=2))
    return True


def test_tiny_openvla_learns_with_lora_from_a_random_and_from_an_exported_base(tmp_path):
    full, a, b = (str(tmp_path / n) for n in ("full", "a", "b"))
    run_ranks(_learn, 2, a, "--finetune", "lora", "--lr", "2e-3")  # a random base
    run_ranks(_learn, 2, full, "--warmup-steps", "2", "--export-hf")  # full, then its export
    run_ranks(_learn, 2, b, "--finetune", "lora", "--lr", "2e-3", "--model", f"{full}/hf")
    random_base, trained, lora_on_trained = (_losses(tmp_path / n) for n in ("a", "full", "b"))
    assert random_base[10] < 0.95 * random_base[1]  # 6.22 -> 5.66 (seeded: deterministic)
    # the exported base starts where full training ended (the export is bf16) and LoRA goes on
    assert lora_on_trained[1] == pytest.approx(trained[10], rel=0.02)
    first, last = (sum(lora_on_trained[s] for s in steps) / 3 for steps in ((1, 2, 3), (8, 9, 10)))
    assert last < first  # 5.16 -> 5.13 in 10 steps of batch 8


def test_dry_run_shows_what_trains(capsys):
    import io

    from parallax.train import parse_args
    from parallax.train.cli import resolve_run
    from parallax.train.dry_run import print_plan

    out = io.StringIO()
    cfg = parse_args(["--dry-run", "--finetune", "lora", "--tp", "2", "--train", "projector"])
    print_plan(resolve_run(cfg), file=out)
    text = out.getvalue()
    assert "LoRA r=32 alpha=16" in text and "fully trained: projector" in text
    assert "--quantize-base" not in text
    out = io.StringIO()
    print_plan(resolve_run(parse_args(["--finetune", "lora", "--quantize-base", "nf4"])), file=out)
    assert "--quantize-base nf4: the frozen linears" in out.getvalue()
    with pytest.raises(ValueError, match="--train 'projectr' matches no"):
        print_plan(
            resolve_run(parse_args(["--finetune", "lora", "--train", "projectr"])),
            file=io.StringIO(),
        )


def _custom(out: str, tp: int, pp: int) -> list[float]:
    """The README's own model (examples/custom_recipe.py: no HF checkpoint layout, a fused
    qkv) with --finetune lora: adapters named after its own modules."""
    from parallax.train import cli, parse_args
    from tests.recipe.test_custom_recipe import _example

    _example()
    ctx = ParallelContext.local() if tp * pp == 1 else context(tp=tp, pp=pp)
    flags = ["--model", "counting", "--out", out, "--tp", str(tp), "--pp", str(pp)]
    flags += ["--steps", "6", "--global-batch-size", "8", "--micro-batch-size", "4"]
    flags += ["--save-interval", "0", "--finetune", "lora", "--lora-rank", "4", "--lr", "1e-2"]
    cli.run(cli.resolve_run(parse_args(flags)), ctx)
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


@pytest.mark.usefixtures("library_families_only")
def test_any_recipe_on_parallel_linears_takes_lora(tmp_path):
    ref = _custom(str(tmp_path / "one"), 1, 1)
    got = run_ranks(_custom, 4, str(tmp_path / "four"), 2, 2)[0]
    assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert len(set(ref)) == len(ref)  # the adapters train (learning is OpenVLA's test above)


def _step_matmuls(finetune: str):
    """The shapes of every product one Trainer step computes, and the base weights' shapes."""
    from parallax.data import SyntheticTask
    from parallax.train.trainer import Trainer
    from tests.tensor.test_lora_layers import _Matmuls

    cfg = _cfg(finetune=finetune, train=None, lr_groups=None, global_batch_size=1)
    trainer = Trainer(resolve(cfg), ParallelContext.local())
    data = SyntheticTask(num_episodes=2, episode_length=2, image_size=32, seed=0)
    batch = _batches(trainer, ParallelContext.local(), cfg, data)()
    with _Matmuls() as seen:
        trainer.train_step(batch)
    weights = {
        tuple(p.shape)
        for n, p in trainer.named_parameters()
        if p.dim() == 2 and not n.endswith(("lora_A", "lora_B")) and "embed_tokens" not in n
    }
    return set(seen.shapes), weights | {s[::-1] for s in weights}


def test_no_weight_gradient_product_for_the_frozen_base_in_a_step():
    """No product of a LoRA step has a base weight's shape (a weight gradient would); a full
    fine-tuning step has them (the check can fail)."""
    shapes, weights = _step_matmuls("lora")
    assert not shapes & weights, sorted(shapes & weights)
    shapes, weights = _step_matmuls("full")
    assert shapes & weights
