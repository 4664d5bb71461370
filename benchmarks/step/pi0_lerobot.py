"""The pi0 benchmark's peer: LeRobot's own pi0 / pi0.5 PyTorch policy, in a process of its own.

Run by :mod:`benchmarks.step.pi0` with ``PYTHONPATH`` leading with the peer folder
(``benchmarks/tools/make_lerobot_peer.sh``: lerobot 0.4.4 on transformers 4.53.2 with openpi's
``transformers_replace``, the ``fix/lerobot_openpi`` branch its ``pi`` extra names), so that
folder's transformers shadows the machine's only here. Nothing in parallax imports this; it
imports nothing from parallax (one JSON line per row goes to ``--json``).

The policy is ``PI05Policy`` / ``PI0Policy`` built from its config (random weights, made on
the device: no download), ``dtype="bfloat16"`` (LeRobot's bf16: the tower's embeddings and
every norm stay float32, the rest bf16), 3 cameras of ``(3, 224, 224)`` in [0, 1], a state of
8 and actions of 7 (padded to 32 by the policy), chunks of 50; the prompt as its processor
hands it over: ``observation.language.tokens`` right-padded to ``tokenizer_max_length`` (pi0.5
200, pi0 48) with ``--prompt-tokens`` real ones. Rows:

- ``train``: ``policy.forward(batch)`` (its loss and its loss dict), backward, gradient
  clipping at the config's ``optimizer_grad_clip_norm`` and the config's AdamW preset, as
  ``lerobot_train`` steps it (every parameter trains, bf16 weights and moments).
- ``lora``: PEFT on the policy (``--lora-rank``, alpha = rank, as openpi's ``gemma_2b_lora``
  / ``gemma_300m_lora`` scale them) on both Gemma streams' q/k/v/o and gate/up/down, the rest
  frozen but the suffix heads and pi0.5's adaptive norms' dense layers (trained whole: the
  set parallax's ``--finetune lora`` trains).
- ``infer``: ``policy.reset(); policy.select_action(batch)`` at batch 1: the queue is empty,
  so each call samples one chunk (``predict_action_chunk``: the prefix once, 10 Euler steps of
  the expert over its cache); latency per chunk.
- ``+compile``: the config's ``compile_model=True`` (``torch.compile`` of the model's
  ``forward`` and ``sample_actions``) in ``--compile-mode`` (LeRobot's default is
  ``max-autotune``).

``--model pi05-tiny`` / ``pi0-tiny`` shrink LeRobot's PaliGemma for the CPU: its Gemma
variants and its SigLIP config are patched to small shapes (LeRobot hard-codes 8 query heads,
the 257,152-token vocabulary, the tower's MLP of 4304 and a projector to 2048, which is
replaced by one to the tiny width), in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time

import torch

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
STATE_DIM, ACTION_DIM = 8, 7
SUFFIX_HEADS = (
    "action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out", "state_proj",
    "action_time_mlp_in", "action_time_mlp_out",
)  # fmt: skip
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="pi05", choices=("pi05", "pi0", "pi05-tiny", "pi0-tiny"))
    p.add_argument("--rows", default="train,lora,infer", help="train, lora, infer [+compile]")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=60, help="real prompt tokens")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--compile-mode", default="max-autotune")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--infer-iters", type=int, default=20)
    p.add_argument("--json", default=None, help="append one JSON line per row here")
    return p.parse_args(argv)


def _tiny_patches(modeling) -> None:
    """Small Gemma variants and a small SigLIP for the CPU (module doc)."""
    gemma = modeling.GemmaConfig
    sizes = {"gemma_2b": gemma(64, 2, 128, 8, 1, 16), "gemma_300m": gemma(32, 2, 64, 8, 1, 16)}
    modeling.get_gemma_config = lambda variant: sizes[variant]
    real = modeling.CONFIG_MAPPING

    class Mapping:
        def __getitem__(self, key):
            if key != "paligemma":
                return real[key]

            def make(**kw):
                cfg = real["paligemma"](**kw)
                v = cfg.vision_config
                v.hidden_size, v.num_hidden_layers, v.num_attention_heads = 32, 2, 2
                v.patch_size = 8
                return cfg

            return make

    modeling.CONFIG_MAPPING = Mapping()


def build_policy(args, device, lora: bool, compile: bool):
    from lerobot.configs.types import FeatureType, PolicyFeature

    tiny = args.model.endswith("-tiny")
    pi05 = args.model.startswith("pi05")
    if pi05:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config

        policy_class = modeling.PI05Policy
    else:
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config

        policy_class = modeling.PI0Policy
    if tiny:
        _tiny_patches(modeling)
    size = 32 if tiny else 224
    features = {
        f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, size, size))
        for c in CAMERAS
    }
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    config = Config(
        input_features=features,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))},
        dtype="float32" if tiny else "bfloat16",
        device=device.type,
        compile_model=compile,
        compile_mode=args.compile_mode,
        image_resolution=(size, size),
        chunk_size=4 if tiny else 50,
        n_action_steps=4 if tiny else 50,
    )
    with torch.device(device):  # random weights made where they run
        policy = policy_class(config)
    if tiny:  # LeRobot's projector maps to 2048 whatever the width
        mm = policy.model.paligemma_with_expert.paligemma.model.multi_modal_projector
        v, t = 32, policy.model.paligemma_with_expert.paligemma.config.text_config.hidden_size
        mm.linear = torch.nn.Linear(v, t, device=device)
    policy.to(device)
    if lora:
        policy = _peft(policy, args.lora_rank)
    return policy, config


def _peft(policy, rank: int):
    """PEFT adapters on both Gemma streams (module doc); the suffix heads and adaptive norms'
    dense layers trained whole beside them."""
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        target_modules=r".*(language_model|gemma_expert)\..*layers\.\d+\.(self_attn|mlp)\."
        r"(q|k|v|o|gate|up|down)_proj",
    )
    # PEFT's injection (get_peft_model reads a transformers config the policy does not have),
    # and into the two streams' module: the policy's `config` is no transformers config
    inject_adapter_in_model(lora, policy.model.paligemma_with_expert)
    for name, p in policy.named_parameters():
        whole = any(f".{h}." in name for h in SUFFIX_HEADS) or ".dense." in name
        p.requires_grad_("lora_" in name or whole)
    return policy


def make_batch(args, config, b: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    size = config.image_resolution[0]
    n = config.tokenizer_max_length
    batch = {f"observation.images.{c}": torch.rand(b, 3, size, size, generator=g) for c in CAMERAS}
    batch["observation.state"] = torch.rand(b, STATE_DIM, generator=g) * 2 - 1
    batch["action"] = torch.rand(b, config.chunk_size, ACTION_DIM, generator=g) * 2 - 1
    real = min(args.prompt_tokens, n)
    tokens = torch.zeros(b, n, dtype=torch.long)
    tokens[:, :real] = torch.randint(2, 1000, (b, real), generator=g)
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[:, :real] = True
    batch["observation.language.tokens"], batch["observation.language.attention_mask"] = (
        tokens,
        mask,
    )
    return {k: v.to(device) for k, v in batch.items()}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn, device, warmup: int, iters: int) -> tuple[list[float], object]:
    first = None
    for i in range(warmup):
        out = fn()
        first = out if i == 0 else first
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, first if first is not None else out


def train_step(policy, config, batch):
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=config.optimizer_lr,
        betas=config.optimizer_betas,
        eps=config.optimizer_eps,
        weight_decay=config.optimizer_weight_decay,
    )
    policy.train()

    def step() -> float:
        loss, _ = policy(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.optimizer_grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, sum(p.numel() for p in params)


def run_row(args, row: str, device) -> dict:
    kind, compile = row.split("+")[0], row.endswith("+compile")
    name = f"lerobot{'+compile' if compile else ''} " + {
        "train": "train", "lora": "LoRA (PEFT) train", "infer": "select_action chunk",
    }[kind]  # fmt: skip
    out = {"row": name, "stack": "lerobot", "kind": kind, "compile": compile}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.monotonic()
    try:
        policy, config = build_policy(args, device, kind == "lora", compile)
        if kind == "infer":
            batch = make_batch(args, config, 1, device)
            policy.eval()

            def chunk():
                policy.reset()
                return policy.select_action(batch)

            times, _ = _times(chunk, device, args.warmup, args.infer_iters)
            out.update(batch=1, step_s=statistics.median(times), actions=config.chunk_size)
        else:
            batch = make_batch(args, config, args.batch, device)
            step, trainable = train_step(policy, config, batch)
            times, first = _times(step, device, args.warmup, args.steps)
            out.update(
                batch=args.batch, step_s=statistics.median(times), first_loss=float(first),
                trainable=trainable,
            )  # fmt: skip
        out["status"] = "ok"
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if "out of memory" not in str(err).lower():
            raise
        out["status"] = "OOM"
    finally:
        policy = batch = step = None  # noqa: F841
        if device.type == "cuda":
            out["peak"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
    out["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["build_and_time_s"] = time.monotonic() - began
    import transformers

    out["versions"] = f"lerobot 0.4.4, transformers {transformers.__version__}"
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    tiny = args.model.endswith("-tiny")
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    for row in args.rows.split(","):
        rec = run_row(args, row, device)
        rec.setdefault("peak", math.nan)
        print(json.dumps(rec), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
