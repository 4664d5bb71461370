"""pi0.5 (and pi0) on one GPU: parallax against LeRobot's own policy, in one invocation.

The workload (issue 38): the released shapes (``--model pi05``, or ``pi0``; random weights:
speed and memory do not depend on the values), bf16, LIBERO-shaped synthetic batches: 3
cameras at 224 px (768 image tokens), chunks of 50 actions, actions and state padded to 32,
a prompt of ``--prompt-tokens`` real tokens right-padded to the model's text length (pi0.5
200, pi0 48); both stacks compute the padded positions. Rows (one table):

- ``parallax`` train, full fine-tuning: the Trainer (``precision bf16``: bf16 weights, fp32
  masters and AdamW moments as ZeRO's, every parameter trained, batch ``--batch`` in one
  microbatch); ``+compile``: each ViT block and joint layer ``torch.compile``'d; ``+budget``
  (compiled, ``--activation-memory-budget 0.8``).
- ``parallax`` LoRA: ``--finetune lora`` r ``--lora-rank`` alpha = r on both Gemma streams'
  q/k/v/o and gate/up/down (openpi's ``gemma_2b_lora`` / ``gemma_300m_lora`` targets; the
  tower frozen), the suffix heads and pi0.5's adaptive norms trained whole; ``+compile``.
- small cards (``--rows small``: ``lora16``, ``full24``): the planner's first choice
  (``--layout auto``) under ``--gpu-memory-limit 16`` for LoRA and ``24`` for full
  fine-tuning, compiled; their ``x uncapped`` column is against the same stack's compiled
  uncapped row.
- ``lerobot``: :mod:`benchmarks.step.pi0_lerobot` in a process of its own (``PYTHONPATH``
  led by ``--peer`` (``.peers/lerobot``): lerobot 0.4.4 on transformers 4.53.2 with openpi's
  ``transformers_replace``, the branch LeRobot's ``pi`` extra names), its rows ``train``,
  ``lora`` (PEFT on its policy, the same targets, rank and trained set), ``infer``, each also
  ``+compile`` (its config's ``compile_model``, ``--peer-compile-mode``; LeRobot's default is
  max-autotune) with ``--compile``. Its JSON rows join the table.
- inference, batch 1: parallax's ``predict_action_chunk`` (the prefix once, 10 Euler steps of
  the expert over its keys and values; the prompt as ids) against the peer's
  ``select_action`` chunk (reset, then one call: one chunk). Chunks/s and actions/s.

Figures: samples/s; MFU = model FLOPs / (step time x 989 TFLOP/s), the FLOPs per sample of
:func:`parallax.families.pi0.flops.flops_per_sample` stated by stream in the notes: training
3 x the forward (full fine-tuning; LoRA counted the same, the useful work of the step, as
``x peer`` compares equal work), the forward per camera the SigLIP tower and projector, per
joint layer each stream's projections and MLP over its own tokens, attention ``4 T_q T_k q``
over the full squares (prefix: prefix keys; suffix: prefix and suffix keys), pi0.5's adaptive
norms, the suffix heads; the last layer's prefix stream after its k/v is not counted (neither
stack needs it; LeRobot computes it). Peak GPU memory (``max_memory_allocated``, reset per row)
and the process's peak host RSS (cumulative over the rows of a process). ``RESULTS.md`` and
``results.jsonl`` get the table unless ``--model pi05-tiny`` / ``pi0-tiny`` (the CPU smoke:
fp32, 2 steps, writes nothing unless ``--write``).

    python -m benchmarks.step.pi0 --compile --rows full         # H200: full fine-tuning
    python -m benchmarks.step.pi0 --compile --rows lora,infer   # LoRA, inference
    python -m benchmarks.step.pi0 --compile --compile-only --rows small --stacks parallax
    python -m benchmarks.step.pi0 --model pi05-tiny             # CPU smoke
    (benchmarks/tools/pi0_session.sh: the GPU session's commands)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.step.timing import free_memory, time_steps
from benchmarks.tools.common import (
    PEAK_BF16_TFLOPS,
    ROOT,
    append_results,
    env_info,
    median,
    peak_memory_gib,
    print_table,
    time_it,
)
from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.flops import flops_per_sample, forward_flops
from parallax.recipe import resolve
from parallax.train.memory_limit import default_allocator

LORA_TARGETS = "self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj"
LORA_TARGETS += ",mlp.gate_proj,mlp.up_proj,mlp.down_proj"
COLUMNS = [
    "row", "stack", "batch", "s per step/chunk", "samples/s", "chunks/s", "TFLOP/s", "MFU",
    "peak GiB", "host GiB", "x peer", "x uncapped", "first loss", "status",
]  # fmt: skip
# parallax's training rows: name -> (finetune, compile, TrainConfig fields)
PARALLAX_ROWS = {
    "parallax": ("full", False, {}),
    "parallax+compile": ("full", True, {}),
    "parallax+compile+budget": ("full", True, {"activation_memory_budget": 0.8}),
    "parallax lora": ("lora", False, {}),
    "parallax+compile lora": ("lora", True, {}),
    "parallax+compile lora16": ("lora", True, {"gpu_memory_limit": 16.0, "layout": "auto"}),
    "parallax+compile full24": ("full", True, {"gpu_memory_limit": 24.0, "layout": "auto"}),
}
KIND = {"full": "train", "lora": "lora"}  # the peer's names of the two
UNCAPPED = {
    "parallax+compile lora16": "parallax+compile lora",
    "parallax+compile full24": "parallax+compile",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="pi05", help="pi05, pi0, or pi05-tiny / pi0-tiny (CPU)")
    p.add_argument("--batch", type=int, default=None, help="training batch (8; tiny 2)")
    p.add_argument("--prompt-tokens", type=int, default=60, help="real prompt tokens")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="also the compiled rows")
    p.add_argument(
        "--rows",
        default="full,lora,infer",
        help="kinds, comma separated: full, lora, infer, small (the capped rows and the "
        "uncapped ones they are compared with)",
    )
    p.add_argument("--stacks", default="parallax,lerobot", help="parallax, lerobot")
    p.add_argument("--compile-only", action="store_true", help="with --compile: no eager rows")
    p.add_argument("--peer", default=".peers/lerobot", help="the peer's package folder")
    p.add_argument("--peer-compile-mode", default="max-autotune", help="its config's")
    p.add_argument("--peer-timeout", type=int, default=480, help="seconds a peer row may take")
    p.add_argument("--steps", type=int, default=None, help="timed steps (10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (3; tiny 1)")
    p.add_argument("--infer-iters", type=int, default=None, help="timed chunks (20; tiny 2)")
    p.add_argument("--write", action="store_true", help="write the results (tiny: off)")
    args = p.parse_args(argv)
    args.tiny = args.model.endswith("-tiny")
    args.batch = args.batch or (2 if args.tiny else 8)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.infer_iters = args.infer_iters or (2 if args.tiny else 20)
    args.write = args.write or not args.tiny
    return args


def make_batch(config: Pi0Config, b: int, prompt: int, seed: int = 0) -> dict:
    """A synthetic microbatch as :class:`~parallax.families.pi0.batches.Pi0Batches` makes
    them (host tensors; the trainer moves them): every camera present, ``prompt`` real ids."""
    g = torch.Generator().manual_seed(seed)
    s, n, L = config.vision.image_size, config.num_cameras, config.text_length
    real = min(prompt, L)
    tokens = torch.zeros(b, L, dtype=torch.long)
    tokens[:, :real] = torch.randint(2, config.prefix.vocab_size, (b, real), generator=g)
    token_mask = torch.zeros(b, L, dtype=torch.bool)
    token_mask[:, :real] = True
    actions = torch.zeros(b, config.chunk, config.max_action_dim)
    actions[..., :7] = torch.rand(b, config.chunk, 7, generator=g) * 2 - 1
    state = torch.zeros(b, config.max_state_dim)
    state[:, :8] = torch.rand(b, 8, generator=g) * 2 - 1
    return {
        "images": torch.rand(b, n, 3, s, s, generator=g) * 2 - 1,
        "image_masks": torch.ones(b, n, dtype=torch.bool),
        "tokens": tokens,
        "token_mask": token_mask,
        "state": state,
        "actions": actions,
        "action_dim": 7,
        "noise": torch.randn(b, config.chunk, config.max_action_dim, generator=g),
        "time": 0.001 + 0.999 * torch.distributions.Beta(1.5, 1.0).sample((b,)),
    }


def host_gib() -> float:
    """This process's peak resident memory so far (Linux ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parallax_train(args, device, dtype, name: str):
    from parallax import ParallelContext
    from parallax.plan.auto import choose
    from parallax.run import TrainConfig
    from parallax.train.trainer import Trainer

    finetune, compile, extra = PARALLAX_ROWS[name]
    extra = dict(extra)
    lora = (
        dict(lora_rank=args.lora_rank, lora_alpha=float(args.lora_rank), lora_targets=LORA_TARGETS)
        if finetune == "lora"
        else {}
    )
    cfg = TrainConfig.of(
        model=args.model,
        finetune=finetune,
        **lora,
        precision="bf16" if dtype == torch.bfloat16 else "fp32",
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        compile=compile,
        **({"layout_given": "compile"} if extra.get("layout") == "auto" else {}),
        **extra,
        out=tempfile.mkdtemp(prefix="parallax-pi0-bench-"),  # nothing is written
    )
    run = resolve(cfg)
    if run.layout == "auto":
        run = choose(run)
    options = {"backend": "inductor" if device.type == "cuda" else "aot_eager"}
    trainer = Trainer(run, ParallelContext.local(device=device), compile_options=options)
    mbs = [make_batch(trainer.model_config, args.batch, args.prompt_tokens)]
    chosen = {k: getattr(run, k) for k in ("micro_batch_size", "zero", "offload")}
    chosen["activation_checkpointing"] = run.activation_checkpointing
    return (lambda: trainer.train_step(mbs)), (trainer, chosen)


def measure_train(args, build, device) -> dict:
    free_memory(device, reset_peak=True)
    chosen = None
    try:
        step, keep = build()
        chosen = keep[1]
        times, first, _ = time_steps(step, device, args.warmup, args.steps)
        peak = peak_memory_gib(device)
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if "out of memory" not in str(err).lower():
            raise
        return {"status": "OOM", "layout": chosen}
    finally:
        step = keep = None  # noqa: F841 - the stack is freed before the next row
        free_memory(device)
        if device.type == "cuda":  # a row's --gpu-memory-limit caps only that row
            torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        "step_s": median(times), "first_loss": first, "peak": peak, "status": "ok",
        "layout": chosen,
    }  # fmt: skip


class _Ids:
    """A tokenizer of fixed prompts: ``n`` ids (the benchmark's ``--prompt-tokens``)."""

    pad_id = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def encode(self, text: str) -> list[int]:
        return [2] + [100 + i for i in range(self.n - 1)]


def parallax_infer(args, device, dtype) -> dict:
    from parallax import ParallelContext
    from parallax.families.pi0.model import Pi0Model
    from parallax.families.pi0.predict import predict_action_chunk

    config = Pi0Config.preset(args.model)
    free_memory(device, reset_peak=True)
    ctx = ParallelContext.local(device=device)
    model = Pi0Model(config, ctx, dtype=dtype, device=device, seed=0).eval()
    s = config.vision.image_size
    images = [torch.rand(3, s, s) * 2 - 1 for _ in range(config.num_cameras)]
    state = torch.rand(8) * 2 - 1
    tok = _Ids(min(args.prompt_tokens, config.text_length))
    warm = 1 if args.tiny else 3
    latency = median(
        time_it(
            lambda: predict_action_chunk(model, images, "x", state, tokenizer=tok),
            device,
            warm,
            args.infer_iters,
        )
    )
    out = {
        "row": "parallax predict_action_chunk", "stack": "parallax", "kind": "infer",
        "batch": 1, "step_s": latency, "actions": config.chunk, "status": "ok",
        "peak": peak_memory_gib(device), "host_rss_gib": host_gib(),
    }  # fmt: skip
    model = None
    free_memory(device)
    return out


def peer_rows(args, wanted: set[str]) -> list[dict]:
    """The peer's rows from its own process (module doc); a row whose process failed says so."""
    kinds = [k for k in ("train", "lora", "infer") if k.replace("train", "full") in wanted]
    rows = []
    for k in kinds:
        rows += [] if args.compile and args.compile_only else [k]
        rows += [k + "+compile"] if args.compile else []
    peer = Path(args.peer)
    peer = peer if peer.is_absolute() else ROOT / peer
    if not (peer / "lerobot").is_dir():
        why = f"no peer folder {args.peer} (benchmarks/tools/make_lerobot_peer.sh)"
        return [{"row": f"lerobot {r}", "stack": "lerobot", "status": why} for r in rows]
    out = []
    for row in rows:  # one process a row: a crash or a compile hang costs that row alone
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
            cmd = [
                sys.executable, "-m", "benchmarks.step.pi0_lerobot", "--model", args.model,
                "--rows", row, "--batch", str(args.batch), "--prompt-tokens",
                str(args.prompt_tokens), "--lora-rank", str(args.lora_rank), "--compile-mode",
                args.peer_compile_mode, "--steps", str(args.steps), "--warmup",
                str(args.warmup), "--infer-iters", str(args.infer_iters), "--json", f.name,
            ]  # fmt: skip
            env = dict(os.environ)
            extra = [p for p in os.environ.get("PEER_EXTRA_PATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join([str(peer), *extra, str(ROOT)])
            print(f"peer: {' '.join(cmd[1:])}", flush=True)
            try:
                done = subprocess.run(
                    cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                    timeout=args.peer_timeout,
                )  # fmt: skip
                code, err = done.returncode, done.stderr or done.stdout
            except subprocess.TimeoutExpired as late:
                code, err = "timeout", f"timeout after {args.peer_timeout} s\n{late.stderr or ''}"
            got = [json.loads(line) for line in Path(f.name).read_text().splitlines() if line]
        if code or not got:
            tail = [line for line in str(err).strip().splitlines() if line][-1:] or ["no output"]
            status = "timeout" if code == "timeout" else f"failed: {tail[0][:80]}"
            kind = row.split("+")[0]
            got = [{"row": f"lerobot {row}", "stack": "lerobot", "kind": kind, "status": status}]
            print(str(err)[-4000:], file=sys.stderr)
        out += got
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    default_allocator()  # as parallax.train runs, and as the planner assumes
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a small shared CPU: threads only contend
    try:
        return _run(args, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _plan(args) -> list[str]:
    """The parallax training rows of the kinds in ``--rows`` that ``--compile``,
    ``--compile-only`` allow (``small``: the capped rows and their uncapped compiled ones)."""
    kinds, rows = set(args.rows.split(",")), []
    if "parallax" not in args.stacks.split(","):
        return rows
    for name, (finetune, compile, extra) in PARALLAX_ROWS.items():
        if "activation_memory_budget" in extra and name not in kinds:
            continue  # asked for by name only
        eager_ok = compile or not args.compile_only
        plain = "gpu_memory_limit" not in extra and finetune in kinds
        small = "small" in kinds and ("gpu_memory_limit" in extra or name in UNCAPPED.values())
        if name in kinds or ((args.compile or not compile) and eager_ok and (plain or small)):
            rows.append(name)
    return rows


def _run(args, device, dtype) -> list[dict]:
    info, config, records = env_info(), Pi0Config.preset(args.model), []
    per_sample = flops_per_sample(config)
    wanted, stacks = set(args.rows.split(",")), set(args.stacks.split(","))
    for name in _plan(args):
        got = measure_train(args, lambda n=name: parallax_train(args, device, dtype, n), device)
        kind = KIND[PARALLAX_ROWS[name][0]]
        records.append({"row": name + " train", "stack": "parallax", "kind": kind,
                        "batch": args.batch, "host_rss_gib": host_gib(), **got})  # fmt: skip
        print(f"{name}: {records[-1]}", flush=True)
    if "infer" in wanted and "parallax" in stacks:
        records.append(parallax_infer(args, device, dtype))
        print(f"infer: {records[-1]}", flush=True)
    if wanted & {"full", "lora", "infer"} and "lerobot" in stacks:
        records += peer_rows(args, wanted)
    for r in records:
        if r.get("status") == "ok" and r.get("kind") != "infer":
            r["samples_per_s"] = r["batch"] / r["step_s"]
            r["tflops"] = r["batch"] * per_sample / r["step_s"] / 1e12
            r["mfu"] = r["tflops"] / PEAK_BF16_TFLOPS
        elif r.get("status") == "ok":
            r["chunks_per_s"] = 1 / r["step_s"]
            r["actions_per_s"] = r["actions"] / r["step_s"]
    rows = _table(records)
    title = (
        f"pi0 step ({args.model}: {config.num_cameras} cameras at {config.vision.image_size} px, "
        f"horizon {config.chunk}, text {config.text_length} ({args.prompt_tokens} real), "
        f"batch {args.batch}, LoRA r {args.lora_rank}; {info['hardware']})"
    )
    print_table(title, COLUMNS, rows)
    if args.write:
        parts = forward_flops(config)
        stated = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items())
        notes = (
            f"MFU: flops_per_sample = 3 x forward = {per_sample / 1e12:.3f} TFLOP per sample "
            f"(forward GFLOP by stream: {stated}; 2 per multiply-add, attention over the full "
            "squares) x samples/s / 989 TFLOP/s, LoRA rows counted the same; x peer: against "
            "the fastest lerobot row of the same kind (train, LoRA, chunk rate); x uncapped: "
            "a --gpu-memory-limit row against its uncapped compiled row; host GiB: the "
            "process's peak RSS so far"
        )
        recs = [{"benchmark": "pi0_step", "model": args.model, **r} for r in records]
        append_results(title, COLUMNS, rows, notes=notes, records=recs, info=info)
    return records


def _table(records: list[dict]) -> list[list[object]]:
    def ok(r: dict, key: str) -> float:
        return r.get(key, math.nan) if r.get("status") == "ok" else math.nan

    def best_peer(kind: str, key: str) -> float:
        vals = [ok(r, key) for r in records if r["stack"] == "lerobot" and r.get("kind") == kind]
        vals = [v for v in vals if v == v]
        return max(vals, default=math.nan)

    speed = {r["row"]: ok(r, "samples_per_s") for r in records}
    rows = []
    for r in records:
        kind = r.get("kind", "")
        key = "chunks_per_s" if kind == "infer" else "samples_per_s"
        ratio = ok(r, key) / best_peer(kind, key) if r["stack"] == "parallax" else math.nan
        base = UNCAPPED.get(r["row"].removesuffix(" train"))
        uncapped = ok(r, key) / speed.get(f"{base} train", math.nan) if base else math.nan
        rows.append(
            [r["row"], r["stack"], r.get("batch", "-"), r.get("step_s", math.nan),
             ok(r, "samples_per_s"), ok(r, "chunks_per_s"), ok(r, "tflops"), ok(r, "mfu"),
             r.get("peak", math.nan), r.get("host_rss_gib", math.nan), ratio, uncapped,
             r.get("first_loss", math.nan), r.get("status", "?")]
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
