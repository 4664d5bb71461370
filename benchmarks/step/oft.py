"""OpenVLA-7B with OpenVLA-OFT's LIBERO recipe on one GPU: parallax against the stack OFT runs.

The recipe (``shared/oft.md``): two images (third-person and wrist, each through both towers),
the 8-dim proprio token, chunks of 8 seven-dim actions (56 action slots), LoRA r 32 alpha 16
dropout 0 on every linear but the lm_head, the L1 head and the proprio projector trained whole,
AdamW 5e-4, batch 8, bf16; a prompt of 30 tokens, so 1 + 512 + 1 + 29 + 56 + 1 = 600 positions.
Synthetic batches (random pixels, prompt ids, actions and states): the work, not the data.

Rows (one invocation, one table):

- ``parallax`` train: the Trainer with ``--action-head l1 --finetune lora`` (bf16 base, fp32
  adapters and head as their own ZeRO masters, no gradient or state for the base, the lm_head
  never run); ``--compile`` adds ``parallax+compile`` (each ViT block and decoder layer), and
  ``--memory`` adds parallax's memory-saving forms, each also compiled: ``+offload`` (``--zero 2
  --offload optimizer``: the trainables' fp32 masters and AdamW moments on the host; the peer
  keeps its trainables, their gradients and moments in bf16 on the GPU, as OFT does, where
  parallax steps fp32 masters) and ``+ckpt-vision`` (``--activation-checkpointing
  --checkpoint-scope vision``: the two towers recompute, the LLM keeps its activations) and,
  compiled only, ``+budget`` (``--activation-memory-budget 0.8``: each compiled block keeps
  80 % of its saved activations and recomputes the cheapest of the rest).
- ``hf`` train: :mod:`benchmarks.step.oft_hf`, timm + transformers + PEFT with OFT's head and
  projector as its repository writes them, under bf16 autocast (``eager``, and with
  ``--compile`` each block compiled: its best form where it compiles).
- inference, batch 1, bf16: ``predict_action_chunk`` (one forward, the whole chunk), OpenVLA's
  autoregressive ``predict_action`` in parallax (7 tokens, KV cache: one action), and the
  peer's forward. Latency per call; actions/s = actions per call / latency.

Figures: training samples/s, peak memory (``torch.cuda.max_memory_allocated``, reset per row),
MFU = model FLOPs / (step time x 989 TFLOP/s), the FLOPs of the recipe per sample from
:func:`parallax.families.openvla.oft.objective.oft_flops_per_sample` (LoRA: 2 x the frozen
base's forward, 3 x the head's; bidirectional attention counts the full square; the peer's
extra lm_head over every position is not counted: the same useful work for both rows). The
table goes to ``RESULTS.md`` and each row to ``results.jsonl`` (hardware, date, commit,
command), except for ``--model tiny`` on the CPU unless ``--write``.

    python -m benchmarks.step.oft               # H200: parallax, hf, inference
    python -m benchmarks.step.oft --compile     # + the compiled rows
    python -m benchmarks.step.oft --model tiny  # CPU smoke: writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile

import torch

from benchmarks.step.timing import free_memory, time_steps
from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    append_results,
    env_info,
    median,
    peak_memory_gib,
    print_table,
    time_it,
)
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.oft.config import OFTConfig
from parallax.recipe import resolve
from parallax.train.memory_limit import default_allocator

RANK, ALPHA, LR = 32, 16.0, 5e-4
COLUMNS = [
    "row", "stack", "batch", "s per step/call", "samples/s", "actions/s", "TFLOP/s", "MFU",
    "peak GiB", "x HF", "first loss", "status",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="openvla-7b", help="openvla-7b, or tiny (CPU smoke)")
    p.add_argument("--batch", type=int, default=None, help="training batch (8; tiny 2)")
    p.add_argument("--prompt-tokens", type=int, default=30, help="prompt ids, BOS included")
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--action-dim", type=int, default=7)
    p.add_argument("--proprio-dim", type=int, default=8)
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also the compiled training rows")
    p.add_argument("--memory", action="store_true", help="also parallax's memory-saving rows")
    p.add_argument(
        "--rows", default="parallax,hf,infer", help="stacks or row names, comma separated"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (3, compile 5)")
    p.add_argument("--write", action="store_true", help="write the results (tiny: off)")
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    args.batch = args.batch or (2 if tiny else 8)
    args.steps = args.steps or (2 if tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.write = args.write or not tiny
    return args


def oft_config(args) -> OpenVLAConfig:
    oft = OFTConfig(args.chunk, args.action_dim, args.proprio_dim, args.images)
    return dataclasses.replace(OpenVLAConfig.preset(args.model), oft=oft)


def make_batch(config: OpenVLAConfig, b: int, prompt: int, device, seed: int = 0) -> dict:
    """Synthetic OFT microbatch (host tensors; the trainer moves them): BOS + ``prompt - 1``
    ids, the slots, the stop token, no padding."""
    g = torch.Generator().manual_seed(seed)
    oft, s = config.oft, config.image_size
    t = prompt + oft.slots + 1
    ids = torch.randint(3, config.tokenizer_vocab_size - 300, (b, t), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    slots = torch.zeros(b, t, dtype=torch.bool)
    slots[:, prompt : prompt + oft.slots] = True
    out = {
        "pixel_values": torch.randn(b, 6 * oft.num_images, s, s, generator=g),
        "input_ids": ids,
        "attention_mask": torch.ones(b, t, dtype=torch.bool),
        "action_mask": slots,
        "prompt_lengths": torch.full((b,), prompt, dtype=torch.long),
        "actions": torch.rand(b, oft.chunk, oft.action_dim, generator=g) * 2 - 1,
    }
    if oft.proprio_dim:
        out["proprio"] = torch.rand(b, oft.proprio_dim, generator=g) * 2 - 1
    return out


def _on(mb: dict, device, dtype=None) -> dict:
    return {
        k: v.to(device, dtype=dtype if v.is_floating_point() and dtype else None)
        for k, v in mb.items()
    }


# parallax's memory-saving forms (``--memory``): their TrainConfig fields
SAVING = {
    "offload": dict(zero=2, offload="optimizer"),
    "ckpt-vision": dict(activation_checkpointing=True, checkpoint_scope="vision"),
    "budget": dict(activation_memory_budget=0.8),  # compiled only: the compiler recomputes
    # QLoRA on a 16 GiB card: the base in NF4, every block recomputed, the process capped
    "nf4-16": dict(quantize_base="nf4", gpu_memory_limit=16.0, activation_checkpointing=True),
}


def parallax_train(args, config, device, dtype, compile: bool, saving: str = ""):
    from parallax import ParallelContext
    from parallax.run import TrainConfig
    from parallax.train.trainer import Trainer

    cfg = TrainConfig.of(
        model=args.model,
        action_head="l1",
        action_chunk=args.chunk,
        finetune="lora",
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lr=LR,
        precision="bf16" if dtype == torch.bfloat16 else "fp32",
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        compile=compile,
        **SAVING.get(saving, {}),
        out=tempfile.mkdtemp(prefix="parallax-oft-bench-"),  # nothing is written
    )
    options = {"backend": "inductor" if device.type == "cuda" else "aot_eager"}
    trainer = Trainer(
        resolve(cfg, model_config=config),
        ParallelContext.local(device=device),
        compile_options=options,
    )
    mbs = [make_batch(trainer.model_config, args.batch, args.prompt_tokens, device)]
    return (lambda: trainer.train_step(mbs)), trainer


def hf_train(args, config, device, dtype, compile: bool, saving: str = ""):
    """The peer (``saving`` is parallax's alone: never asked of this stack)."""
    from benchmarks.step import oft_hf  # the peer needs timm, transformers and peft

    parts, opt = oft_hf.build(config, device, dtype, RANK, ALPHA, compile)
    mb = _on(make_batch(config, args.batch, args.prompt_tokens, device), device)
    autocast = torch.bfloat16 if dtype == torch.bfloat16 else None
    return oft_hf.step_fn(parts, opt, mb, autocast), parts


def measure_train(args, build, device) -> dict:
    free_memory(device, reset_peak=True)
    try:
        step, keep = build()
        times, first, _ = time_steps(step, device, args.warmup, args.steps)
        peak = peak_memory_gib(device)
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if "out of memory" not in str(err).lower():
            raise
        return {"status": "OOM"}
    finally:
        step = keep = None  # noqa: F841 - the stack is freed before the next row
        free_memory(device)
    return {"step_s": median(times), "first_loss": first, "peak": peak, "status": "ok"}


def time_calls(fn, device, warmup: int, iters: int) -> float:
    """Median seconds per call of ``fn``."""
    return median(time_it(fn, device, warmup, iters))


class _Prompt:
    """A tokenizer of fixed-length prompts (the benchmark's ``--prompt-tokens``), with the
    model's special ids (Llama-2's, or the tiny preset's "▁" 3)."""

    bos_id, eos_id = 1, 2

    def __init__(self, n: int, config: OpenVLAConfig) -> None:
        self.n = n
        self.action_space_id = 3 if config.tokenizer == "tiny" else 29871

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [1] + [100 + i for i in range(self.n - 2)]


def inference_rows(args, config, device, dtype) -> list[dict]:
    """Latency of one chunk (parallax, the peer) and of one autoregressive action."""
    from parallax.families.openvla.model import OpenVLA

    s, rows = config.image_size, []
    images = [torch.rand(3, s, s) for _ in range(config.oft.num_images)]
    state = torch.rand(config.oft.proprio_dim) if config.oft.proprio_dim else None
    tok = _Prompt(args.prompt_tokens, config)
    iters, warm = (3, 1) if args.model == "tiny" else (20, 3)
    free_memory(device, reset_peak=True)
    model = OpenVLA(config, None, dtype=dtype, device=device, seed=0)
    latency = time_calls(
        lambda: model.predict_action_chunk(images, "x", state, tokenizer=tok), device, warm, iters
    )
    rows.append(("parallax predict_action_chunk", "parallax", latency, config.oft.chunk, device))
    model = None
    free_memory(device, reset_peak=True)
    plain = OpenVLA(dataclasses.replace(config, oft=None), None, dtype=dtype, device=device, seed=0)
    ids = tok.encode("x") + [tok.action_space_id]
    latency = time_calls(
        lambda: plain.predict_action(images[0], input_ids=ids), device, warm, iters
    )
    rows.append(("parallax OpenVLA autoregressive", "parallax", latency, 1, device))
    plain = None
    if "hf" in args.rows.split(","):
        from benchmarks.step import oft_hf  # the peer needs timm, transformers and peft

        reason = oft_hf.missing()
        if reason is None:
            free_memory(device, reset_peak=True)
            parts, _ = oft_hf.build(config, device, dtype, RANK, ALPHA, False)
            mb = _on(make_batch(config, 1, args.prompt_tokens, device), device)
            auto = torch.bfloat16 if dtype == torch.bfloat16 else None
            latency = time_calls(oft_hf.predict_fn(parts, mb, auto), device, warm, iters)
            rows.append(("hf OFT forward", "hf", latency, config.oft.chunk, device))
            parts = None
    out = []
    for name, stack, latency, actions, dev in rows:
        out.append(
            {"row": name, "stack": stack, "batch": 1, "step_s": latency,
             "actions_per_s": actions / latency, "peak": peak_memory_gib(dev), "status": "ok"}
        )  # fmt: skip
        free_memory(device)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    default_allocator()  # as parallax.train runs, and as the planner assumes
    device = torch.device("cuda" if torch.cuda.is_available() and args.model != "tiny" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a small shared CPU: threads only contend
    try:
        return _run(args, device, dtype)
    finally:
        torch.set_num_threads(threads)


# (stack, --compile, memory-saving form): the training rows, in the table's order
TRAIN_ROWS = (
    ("parallax", False, ""),
    ("parallax", True, ""),
    *(("parallax", c, form) for form in SAVING for c in (False, True) if c or form != "budget"),
    ("hf", False, ""),
    ("hf", True, ""),
)


def _train_plan(args) -> list[tuple[str, str, bool, str]]:
    """(name, stack, compile, saving) of each training row asked for: a row named in
    ``--rows``, or each row of a stack named there that ``--compile``/``--memory`` allow."""
    rows, wanted = [], set(args.rows.split(","))
    for stack, compile, saving in TRAIN_ROWS:
        name = stack + "+compile" * compile + (f"+{saving}" if saving else "")
        allowed = (args.compile or not compile) and (args.memory or not saving)
        if name in wanted or (stack in wanted and allowed):
            rows.append((name, stack, compile, saving))
    return rows


def _run(args, device, dtype) -> list[dict]:
    from parallax.families.openvla.oft.objective import oft_flops_per_sample

    info, config, records = env_info(), oft_config(args), []
    text = args.prompt_tokens + config.oft.slots + 1
    per_sample = oft_flops_per_sample(config, text, lora=True)
    builders = {"parallax": parallax_train, "hf": hf_train}
    for name, stack, compile, saving in _train_plan(args):
        if stack == "hf":
            from benchmarks.step import oft_hf  # the peer needs timm, transformers and peft

            if oft_hf.missing():
                records.append({"row": f"{name} train", "stack": stack, "status": oft_hf.missing()})
                continue

        def build(s=stack, c=compile, f=saving):
            return builders[s](args, config, device, dtype, c, f)

        got = measure_train(args, build, device)
        if device.type == "cuda":  # a row's --gpu-memory-limit caps only that row
            torch.cuda.set_per_process_memory_fraction(1.0)
        step = got.get("step_s", math.nan)
        records.append(
            {"row": f"{name} train", "stack": stack, "batch": args.batch, "step_s": step,
             "samples_per_s": args.batch / step, "tflops": args.batch * per_sample / step / 1e12,
             "mfu": args.batch * per_sample / step / (PEAK_BF16_TFLOPS * 1e12),
             "peak": got.get("peak", math.nan), "first_loss": got.get("first_loss", math.nan),
             "status": got["status"]}
        )  # fmt: skip
        print(f"{name}: {records[-1]}", flush=True)
    if "infer" in args.rows.split(","):
        records += inference_rows(args, config, device, dtype)
    rows = _table(records)
    seq = config.prefix_tokens + text
    title = (
        f"OpenVLA-OFT step ({args.model}, LIBERO recipe: {args.images} images, proprio "
        f"{args.proprio_dim}, chunk {args.chunk}, LoRA r {RANK}, batch {args.batch}, {seq} "
        "positions)"
    )
    print_table(title, COLUMNS, rows)
    if args.write:
        notes = (
            f"MFU: oft_flops_per_sample = {per_sample:.4g} FLOPs per sample (2 x frozen-base "
            "forward + 3 x head, bidirectional attention) / step / 989 TFLOP/s; x HF: against "
            "the fastest HF training row (samples/s) or the HF forward (actions/s)"
        )
        recs = [{"benchmark": "oft_step", "model": args.model, **r} for r in records]
        append_results(title, COLUMNS, rows, notes=notes, records=recs, info=info)
    return records


def _table(records: list[dict]) -> list[list[object]]:
    def ok(r: dict, key: str) -> float:
        return r.get(key, math.nan) if r["status"] == "ok" else math.nan

    hf_sps = max((ok(r, "samples_per_s") for r in records if r["stack"] == "hf"), default=math.nan)
    hf_aps = next(
        (ok(r, "actions_per_s") for r in records if r["row"] == "hf OFT forward"), math.nan
    )
    rows = []
    for r in records:
        sps, aps = ok(r, "samples_per_s"), ok(r, "actions_per_s")
        ratio = sps / hf_sps if "train" in r["row"] else aps / hf_aps
        rows.append(
            [r["row"], r["stack"], r.get("batch", "-"), r.get("step_s", math.nan), sps, aps,
             r.get("tflops", math.nan), r.get("mfu", math.nan), r.get("peak", math.nan),
             ratio, r.get("first_loss", math.nan), r["status"]]
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
