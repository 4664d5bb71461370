"""One row each of ``benchmarks.step.llava``: parallax's Trainer, the plain-torch model and
Hugging Face's ``LlavaNextForConditionalGeneration``, each as ``(step_fn, first_loss)``.

All three train in bf16 with fp32 weights (parallax: bf16 parameters and fp32 masters; the
others: fp32 parameters under bf16 autocast), AdamW with LLaVA-v1.6's groups (the CLIP tower at
a tenth of the learning rate; weight decay on matrices only), gradient clipping at 1.0, and the
loss summed over supervised tokens and divided by those of the whole global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.step.llava_native import NativeLlava
from benchmarks.step.llava_workload import hf_state_dict
from parallax import ParallelContext
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.models.compile import compile_modules
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.train.trainer import Trainer

LR, VISION_LR, WEIGHT_DECAY, CLIP = 2e-5, 2e-6, 0.01, 1.0
Step = Callable[[], float]  # one optimizer step; returns its loss (a host sync)


def _units(mbs) -> float:
    return float(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs))


def parallax_row(args, config, mbs, device) -> tuple[Step, float]:
    cfg = TrainConfig(
        model=args.model,
        precision="fp32" if args.smoke else "bf16",
        global_batch_size=sum(mb["input_ids"].shape[0] for mb in mbs),
        micro_batch_size=args.micro_batch_size,
        lr=LR,
        warmup_steps=0,
        steps=10_000,
        seed=args.seed,
        activation_checkpointing=args.activation_checkpointing,
        compile="compile" in args.parallax_variant,
    )
    compile_options = {"backend": args.compile_backend} if cfg.compile else None
    trainer = Trainer(resolve(cfg), ParallelContext.local(device), compile_options=compile_options)

    def step() -> float:
        return trainer.train_step(mbs).loss.item()

    return step, step()


def _optimizer(model: nn.Module, device) -> torch.optim.Optimizer:
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            # "vision_tower." leads the native names; transformers 5.x nests it ("model.")
            vision = "vision_tower" in name.split(".")
            groups.setdefault((vision, p.dim() >= 2), []).append(p)
    param_groups = [
        {
            "params": ps,
            "lr": VISION_LR if vision else LR,
            "weight_decay": WEIGHT_DECAY if matrix else 0.0,
        }
        for (vision, matrix), ps in sorted(groups.items())
    ]
    return torch.optim.AdamW(param_groups, fused=device.type == "cuda")


def _autocast(args, device):
    if args.smoke:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _loop(args, model, loss_fn, mbs, device) -> tuple[Step, float]:
    opt, units = _optimizer(model, device), _units(mbs)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in mbs:
            mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
            with _autocast(args, device):
                loss = loss_fn(model, mb) / units
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        return float(total)

    return step, step()


def native_row(args, config: LlavaNextConfig, mbs, device) -> tuple[Step, float]:
    with torch.device(device):
        model = NativeLlava(config)
    weights = dict(hf_state_dict(config, args.seed, device))
    model.load_state_dict(weights, strict=True)
    del weights
    model.activation_checkpointing = args.activation_checkpointing
    if args.native_variant == "compile":  # each layer's forward, the recompile limit raised
        compile_modules(model.layers(), backend=args.compile_backend)

    def loss_fn(m, mb):
        return m(mb["pixel_values"], mb["input_ids"], mb["image_sizes"], mb["labels"])

    return _loop(args, model, loss_fn, mbs, device)


# transformers 5.x nests the towers and the language model under ``model.`` (and later 5.x
# releases drop the tower's ``vision_model.``)
HF5_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("image_newline", "model.image_newline"),
)
RENAMINGS = (
    (),
    HF5_PREFIXES,
    (("vision_tower.vision_model.", "model.vision_tower."),) + HF5_PREFIXES,
)


def _rename(name: str, rules) -> str:
    for old, new in rules:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _hf_names(weights: dict, wanted: set[str]) -> dict:
    """``weights`` under the names of the installed transformers' model."""
    for rules in RENAMINGS:
        out = {_rename(n, rules): v for n, v in weights.items()}
        if set(out) <= wanted:
            return out
    raise KeyError(f"LlavaNextForConditionalGeneration has other names: {sorted(wanted)[:4]}")


def hf_row(args, config: LlavaNextConfig, mbs, device) -> tuple[Step, float]:
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError(f"skipped: transformers is not importable ({err})") from None
    hf_config = transformers.LlavaNextConfig(**config.to_dict())
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.LlavaNextForConditionalGeneration(hf_config).float()
    weights = _hf_names(dict(hf_state_dict(config, args.seed, device)), set(model.state_dict()))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    del weights
    last = str(config.vision.depth - 1)
    left = [n for n in missing if f"layers.{last}." not in n and "post_layernorm" not in n]
    if left or unexpected:
        raise RuntimeError(f"HF weights: missing {left[:4]}, unexpected {unexpected[:4]}")
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def loss_fn(m, mb):
        t = mb["input_ids"].shape[1]
        mask = torch.arange(t, device=device)[None] < mb["lengths"][:, None]
        logits = m(
            pixel_values=mb["pixel_values"],
            input_ids=mb["input_ids"],
            image_sizes=mb["image_sizes"],
            attention_mask=mask.long(),
            use_cache=False,  # training: no KV cache (its guards recompile every compiled layer)
        ).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), mb["labels"][:, 1:].flatten(), reduction="sum"
        )

    return _loop(args, model, loss_fn, mbs, device)


ROWS = {"parallax": parallax_row, "torch": native_row, "hf": hf_row}
