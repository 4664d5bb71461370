"""The three systems of ``benchmarks/step/siglip.py``, each built from the same
HF-layout weights and returning ``step(pixel_values, input_ids) -> loss`` (one optimizer step;
the loss of the batch before the update)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from parallax.recipe import resolve

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LR = 1e-5  # small: the first losses are what is compared, later ones barely move


def make_batch(config, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixels and token ids (the end token last, as SigLIP's padding leaves it)."""
    g = torch.Generator().manual_seed(0)
    s, t = config.image_size, config.text
    px = torch.randn(b, 3, s, s, generator=g)
    ids = torch.randint(2, t.vocab_size, (b, t.max_length), generator=g)
    ids[:, -1] = t.eos_id
    return px.to(device), ids.to(device)


def _autocast(device: torch.device, smoke: bool):
    if smoke:  # CPU autocast to bf16 is slow and not what the GPU rows run
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def parallax_system(args, config, weights: Path, device: torch.device, b: int) -> Step:
    from parallax import ParallelContext
    from parallax.families.siglip.recipe import SiglipRecipe
    from parallax.run import TrainConfig
    from parallax.train.trainer import Trainer

    cfg = TrainConfig(
        model=str(weights),
        precision="fp32" if args.smoke else "bf16",
        global_batch_size=b,
        micro_batch_size=b,
        lr=LR,
        warmup_steps=0,
        lr_schedule="constant",
        grad_clip=0.0,
        compile=not args.no_compile and not args.smoke,
        cuda_graphs=args.cuda_graphs and not args.smoke,
        activation_checkpointing=args.checkpointing,
    )
    trainer = Trainer(resolve(cfg, recipe=SiglipRecipe()), ParallelContext.local(device=device))

    def step(px: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return trainer.train_step([{"pixel_values": px, "input_ids": ids}]).loss

    return step


def _native_step(model, device, smoke: bool, cuda_graphs: bool = False) -> Step:
    """``cuda_graphs``: the compiled blocks replay CUDA graphs; each step starts a new round
    (the last step's graph outputs are dead by then)."""
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, **fused)

    def step(px: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with _autocast(device, smoke):
            loss = model(px, ids)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def torch_system(args, config, weights: Path, device: torch.device, b: int) -> Step:
    from safetensors.torch import load_file

    from benchmarks.step.siglip_native import TorchSiglip

    model = TorchSiglip(config, checkpointing=args.checkpointing)
    state = {}
    for file in sorted(weights.glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.to(device)
    graphs = args.cuda_graphs and not args.smoke
    if not args.no_compile and not args.smoke:
        for block in model.blocks():
            block.compile(**({"mode": "reduce-overhead"} if graphs else {}))
    return _native_step(model, device, args.smoke, graphs)


class _HFLoss(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, px: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, pixel_values=px, return_loss=True).loss


def hf_system(args, config, weights: Path, device: torch.device, b: int) -> Step:
    try:
        from transformers import SiglipModel
    except ImportError as err:
        raise RuntimeError("skipped: transformers is not installed") from err
    model = SiglipModel.from_pretrained(
        str(weights), torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    return _native_step(_HFLoss(model), device, args.smoke)


SYSTEMS = {"parallax": parallax_system, "torch": torch_system, "hf": hf_system}
