"""The speed options compute the same training step: logits at the labelled positions only,
fused projections, compiled blocks and a pipeline without per-step host syncs, each against the
step without it; checkpoints resume whether projections are fused or not."""

import pytest
import torch
from torch.testing import assert_close

from benchmarks.step.native import synthetic_batch
from parallax import ParallelContext
from parallax.checkpoint import Checkpoint
from parallax.data import BatchLoader, SyntheticTask
from parallax.families.openvla.batches import BatchBuilder, text_tokenizer
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.pipeline import executor, p2p
from parallax.recipe import resolve
from parallax.tensor import full_tensor
from parallax.testing import assert_adam_close, context, run_ranks
from parallax.train import checkpoints, parse_args
from parallax.train.trainer import Trainer
from tests.families.openvla.test_trainer import LR, _cfg, _run, separate

BASE = dict(logits="all", fused_projections=False, pipeline_syncs=True)  # every option off


@pytest.fixture(scope="module")
def reference():
    """One process, the default options (labelled logits, fused projections)."""
    return _run(ParallelContext.local(), _cfg())


def _same(got, ref):
    (history, weights), (ref_history, ref_weights) = got, ref
    assert_close(torch.tensor(history), torch.tensor(ref_history), rtol=1e-5, atol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert_adam_close(weights[name], value, LR, msg=name)


def test_options_off_match_the_defaults(reference):
    # loss, grad norm, metric sums and updated weights of the all-positions, separate-projection
    # step equal those of the labelled-rows, fused step (weights under the separate names)
    _same(_run(ParallelContext.local(), _cfg(**BASE)), reference)


def test_fused_init_is_the_separate_init():
    cfg = OpenVLAConfig.preset("tiny")
    plain = OpenVLA(cfg, seed=5)
    fused = OpenVLA(cfg.with_options(fused_projections=True), seed=5)
    assert hasattr(fused.language_model.model.layers["0"].self_attn, "qkv_proj")
    weights = {}
    for name, p in fused.named_parameters():
        weights.update(separate(name, p.detach()))
    assert weights.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        assert torch.equal(weights[name], p.detach()), name
    batch = synthetic_batch(cfg, 2, 9, 4)
    args = batch["pixel_values"], batch["input_ids"]
    assert_close(fused(*args), plain(*args), rtol=1e-5, atol=1e-6)


def _beyond_the_matmuls(text_tokens: int) -> int:
    """What the model-FLOPs formula counts per tiny sample beyond the matmul, convolution and
    attention FLOPs that torch's FlopCounterMode sees, written out from the architecture (56 px
    images: 16 patches of 3 x 14 x 14 = 588 inputs; towers run their first 2 of 3 blocks):

    - 6 FLOPs per token for every parameter that is not a matrix (biases, norms, LayerScale),
      which the formula counts like matrix entries and the counter does not (elementwise);
    - the patch embeddings' input gradients (2 per weight entry and patch), which the formula
      counts (3 x forward) but never run (pixels need no gradient);
    - minus half of the causal attention (the counter sees the whole score square, the
      formula the causal half): 3 x 2 x S^2 x 64 per Llama layer."""
    seq = 16 + text_tokens
    dino = 6 * 2 * (4 * 32 + 96 + 32 + 128 + 32 + 2 * 32) * 21  # norms, biases, LayerScale
    siglip = 6 * 2 * (4 * 48 + 144 + 48 + 184 + 48) * 16
    patches = 6 * (32 + 48) * 16 + 2 * 588 * (32 + 48) * 16  # conv biases, input gradients
    projector = 6 * (320 + 64 + 64) * 16  # fc1, fc2, fc3 biases
    llama = 6 * (4 * 2 * 64 + 64) * seq - 4 * 3 * 2 * seq * seq * 64  # RMSNorms; causal half
    return dino + siglip + patches + projector + llama


def test_model_flops_count_what_runs():
    """The step's model FLOPs against the FLOPs torch counts in that very step (forward and
    backward, math attention so that its products are counted), plus what the formula counts
    beyond them, by hand: exact. The lm_head's rows are what the step ran, the labelled 4 per
    sample or all 25."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    mbs = [synthetic_batch(OpenVLAConfig.preset("tiny"), 2, 9, 4, seed=i) for i in range(2)]
    counted, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only wait for each other on shared cores
    try:
        for logits in ("labelled", "all"):
            cfg = _cfg(global_batch_size=4, micro_batch_size=2, logits=logits)
            trainer = Trainer(resolve(cfg), context())
            with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                trainer.train_step(mbs)
            counted[logits] = counter.get_total_flops()
            assert trainer.model_flops(mbs) == counted[logits] + 4 * _beyond_the_matmuls(9)
    finally:
        torch.set_num_threads(threads)
    # the lm_head (64 x 576, forward + 2 backward products) over 4 x 25 rows, against 4 x 4
    assert counted["all"] - counted["labelled"] == 6 * 64 * 576 * 4 * (25 - 4)
    defaults = _cfg()
    assert defaults.logits == "labelled" and defaults.fused_projections and not defaults.compile


def test_flags():
    cfg = parse_args(["--no-fused-projections", "--logits", "all", "--compile", "--pipeline-syncs"])
    assert (cfg.fused_projections, cfg.logits, cfg.compile, cfg.pipeline_syncs) == (
        False,
        "all",
        True,
        True,
    )
    assert parse_args(["--fused-projections"]).fused_projections
    with pytest.raises(ValueError, match="--logits some: expected one of labelled, all"):
        resolve(parse_args(["--logits", "some"]))


# -- compiled blocks ---------------------------------------------------------------------------
def _compiled(tp):
    """Compiled ViT blocks and decoder layers at tp (collectives inside the blocks), with
    activation checkpointing and microbatches of different lengths. ``aot_eager`` runs the
    compiler's graph capture and autograd split without generating kernels (CPU inductor
    takes ~30 s to build this model's kernels on two cores)."""
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = _cfg(tp=tp, compile=True, activation_checkpointing=True)
    result = _run(context(tp=tp), cfg, compile_options={"backend": "aot_eager"})
    return result, counters["aot_autograd"]["ok"]


def test_compiled_blocks_match_eager(reference):
    """(At tp > 1 the blocks are checkpointed from outside their compiled pieces: traced
    inside, the collectives' graph breaks would leave no compiled graph at all.)"""
    runs = run_ranks(_compiled, 2, 2)
    for (history, _), graphs in runs:
        assert graphs > 0  # the compiled code ran (graphs between the tp collectives)
        _same((history, runs[0][0][1]), reference)  # weights gathered on tp rank 0


def _record_checkpoints(gm, example_inputs):
    """A compiler backend: ``aot_eager``, counting the graphs that trace a checkpoint."""
    from torch._dynamo.backends.debugging import aot_eager

    hop = torch.ops.higher_order.tag_activation_checkpoint
    if any(node.target is hop for node in gm.graph.nodes):
        _record_checkpoints.traced += 1
    return aot_eager(gm, example_inputs)


def test_compiled_blocks_trace_their_recomputation(reference):
    """At tp=1 a checkpointed block recomputes inside its compiled forward: the compiler traces
    the checkpoint into the block's graph (what lets CUDA graphs replay it), and the step is
    the eager one."""
    _record_checkpoints.traced = 0
    cfg = _cfg(compile=True, activation_checkpointing=True)
    result = _run(ParallelContext.local(), cfg, compile_options={"backend": _record_checkpoints})
    assert _record_checkpoints.traced >= 2  # a decoder layer's graph and a ViT block's
    _same(result, reference)


# -- the pipeline without host syncs -----------------------------------------------------------
def _pipeline_syncs(**kw):
    calls = {"agree": 0, "decode": 0}
    agree, decode = executor._agree, p2p.decode

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)

        return wrapped

    executor._agree, p2p.decode = count("agree", agree), count("decode", decode)
    try:
        result = _run(context(pp=2), _cfg(pp=2, **kw))
    finally:
        executor._agree, p2p.decode = agree, decode
    return result, calls


def test_pipeline_agrees_once_and_reads_no_metadata(reference):
    runs = run_ranks(_pipeline_syncs, 2)
    weights = {}
    for (_, stage_weights), calls in runs:
        assert calls == {"agree": 1, "decode": 0}, calls  # one agreement, on the first step
        weights.update(stage_weights)
    _same((runs[1][0][0], weights), reference)  # the loss is read on every rank
    runs = run_ranks(_pipeline_syncs, 2, **BASE)
    steps, microbatches = 3, 4
    assert runs[0][1] == {"agree": steps, "decode": 0}  # stage 0 receives no activations
    assert runs[1][1] == {"agree": steps, "decode": steps * microbatches}


# -- checkpoints across fused and separate projections ------------------------------------------
def _resume(out):
    """A (fused) steps once and saves; B (separate) resumes and steps; C (fused) resumes from
    B. B's second step must be A's, and C must hold B's weights."""
    ctx = context(tp=2)
    data = SyntheticTask(num_episodes=20, episode_length=2, image_size=32, seed=3)

    def build(fused, sub):
        cfg = _cfg(tp=2, fused_projections=fused, out=f"{out}/{sub}")
        trainer = Trainer(resolve(cfg), ctx)
        loader = BatchLoader(
            data, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=3
        )
        mc = trainer.model_config
        builder = BatchBuilder(mc, data.statistics, text_tokenizer(mc))
        return trainer, loader, builder

    def step(trainer, loader, builder):
        out = trainer.train_step([builder(m) for m in loader.next_batch()])
        return [out.loss.item(), out.grad_norm.item(), *out.metrics.tolist()]

    def weights(trainer):
        w = {}
        for name, p in trainer.named_parameters():
            w.update(separate(name, full_tensor(p, ctx.tp_group)))
        return w

    a = build(True, "a")
    step(*a)
    checkpoints.save(a[0], 1, a[1])
    second = step(*a)
    b = build(False, "b")
    b_ckpt = checkpoints.find_resume(f"{out}/a")
    checkpoints.check_resumable(b_ckpt, b[0])
    assert checkpoints.load(b[0], b_ckpt, b[1]) == 1
    b_second = step(*b)
    checkpoints.save(b[0], 2, b[1])
    c = build(True, "c")
    c_ckpt = checkpoints.find_resume(f"{out}/b")
    checkpoints.check_resumable(c_ckpt, c[0])
    checkpoints.load(c[0], c_ckpt, c[1])
    names = Checkpoint(b_ckpt.path).names()
    stored = [n for n in names if "proj" in n and "layers.0." in n and ".master" in n]
    return second, b_second, weights(a[0]), weights(b[0]), weights(c[0]), step(*b), step(*c), stored


def test_resume_across_fused_and_separate(tmp_path):
    a2, b2, wa, wb, wc, b3, c3, stored = run_ranks(_resume, 2, str(tmp_path))[0]
    assert_close(torch.tensor(b2), torch.tensor(a2), rtol=1e-5, atol=1e-5)
    for name in wa:
        assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(wc[name], wb[name]), name  # exact: the same stored tensors
    assert_close(torch.tensor(c3), torch.tensor(b3), rtol=1e-5, atol=1e-5)  # AdamW state too
    assert all("qkv_proj" not in n and "gate_up_proj" not in n for n in stored)
    assert any(".q_proj." in n for n in stored) and any(".up_proj." in n for n in stored)


def test_cuda_graphs_option():
    cfg = parse_args(["--compile", "--cuda-graphs"])
    assert cfg.compile and cfg.cuda_graphs
    with pytest.raises(ValueError, match="needs --compile"):
        _cfg(cuda_graphs=True).check()
    with pytest.raises(ValueError, match="--pp > 1"):
        _cfg(compile=True, cuda_graphs=True, pp=2).check()
    _cfg(compile=True, cuda_graphs=True, activation_checkpointing=True).check()
    with pytest.raises(ValueError, match="--activation-checkpointing needs --tp 1"):
        _cfg(compile=True, cuda_graphs=True, activation_checkpointing=True, tp=2).check()
    trainer = Trainer(resolve(_cfg(compile=True, cuda_graphs=True)), context())
    assert trainer._compile_options(None) == {"mode": "reduce-overhead"}
    assert trainer._compile_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    assert not trainer.optimizer._side_copies  # graph outputs are copied on the compute stream
    assert Trainer(resolve(_cfg()), context()).optimizer._side_copies


def test_padded_text_matches_the_default(reference):
    # --pad-to-multiple-of 16 widens every microbatch's text with pad tokens that no label
    # reads (causal attention: no real position sees them): the same step
    cfg = _cfg(pad_to_multiple_of=16)
    data = SyntheticTask(num_episodes=2, episode_length=2, image_size=32, seed=cfg.seed)
    config = resolve(cfg).model_config
    builder = BatchBuilder(config, data.statistics, text_tokenizer(config))
    width = builder([data[0]])["input_ids"].shape[1]
    assert width % 16 == 0 and width > (builder([data[0]])["labels"] != -100).nonzero()[-1, 1] + 1
    unpadded = resolve(_cfg()).model_config
    plain = BatchBuilder(unpadded, data.statistics, text_tokenizer(unpadded))([data[0]])
    padded_run, plain_run = resolve(cfg), resolve(_cfg())  # tokens/s counts the data, not pads
    model = padded_run.recipe.model
    assert model.tokens(padded_run, [builder([data[0]])]) == model.tokens(plain_run, [plain])
    _same(_run(ParallelContext.local(), cfg), reference)
