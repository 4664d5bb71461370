"""Put LoRA adapters on a model by module names, freeze its base, and merge them back.

Adapters are named after the modules of the model's checkpoint, not after parallax's own
modules: a model whose checkpoint stores a fused weight as separate modules (Llama's q/k/v_proj
behind parallax's ``qkv_proj``, CLIP's q/k/v_proj behind the ViT's ``qkv``) says so through
``model.checkpoint_layout().tensors(name, shape)`` (the checkpoint tensors that make up a
parameter), and such a layer gets one adapter per stored module, with the shapes a user of the
separate projections expects. The names seed the layout-free init (the same seed gives the same
adapters at every tp, pp and dp, fused or not) and key the PEFT export. A model without a
checkpoint layout names its adapters after its own modules, one per layer.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from parallax.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallax.tensor.lora import LORA_PARAMS, add_adapter, is_lora_layer, remove_adapter
from parallax.tensor.quant import is_quantized, quantized_weights
from parallax.tensor.replicated import ReplicatedLinear
from parallax.tensor.sharding import logical_shape

ALL_LINEAR = "all-linear"
OUTPUT_HEADS = ("lm_head",)
NamesFn = Callable[[str, tuple[int, ...]], list[str]]


@dataclass
class LoRAReport:
    """What :func:`apply_lora` did on this rank (its pipeline stage).

    ``adapted``: parallax module name -> the checkpoint module names of its adapters.
    ``skipped``: checkpoint linear modules the targets select that the model never builds (the
    towers' blocks after the feature layer, SigLIP's attention pool): no adapter, for the
    export's notes. ``unmatched``: target patterns that matched no module of this stage (with
    pipeline stages, gather them before calling a pattern unused). Counts are this rank's
    elements: ``adapters`` (of A and B), ``trainable`` (everything with ``requires_grad``) and
    ``frozen``.
    """

    rank: int
    alpha: float
    dropout: float
    seed: int | None
    targets: str | tuple[str, ...]
    adapted: dict[str, tuple[str, ...]] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()
    adapters: int = 0
    trainable: int = 0
    frozen: int = 0

    @property
    def target_modules(self) -> list[str]:
        """Checkpoint module names with an adapter on this stage, sorted."""
        return sorted(n for names in self.adapted.values() for n in names)


def checkpoint_module_names(model: nn.Module) -> NamesFn:
    """``names(module, weight_shape)``: the checkpoint modules a linear layer stands for."""
    make = getattr(model, "checkpoint_layout", None)
    if make is None:
        return lambda name, shape: [name]
    layout = make()

    def names(name: str, shape: tuple[int, ...]) -> list[str]:
        tensors = [n for n, _ in layout.tensors(f"{name}.weight", shape)]
        bad = [n for n in tensors if not n.endswith(".weight")]
        if bad:
            raise ValueError(f"{name}.weight is stored as {bad}: not a linear module's weight")
        return [n[: -len(".weight")] for n in tensors]

    return names


def unbuilt_linears(model: nn.Module) -> list[str]:
    """Checkpoint linear modules (2-D ``.weight`` among the checkpoint-only tensors) that the
    model never builds."""
    make = getattr(model, "checkpoint_layout", None)
    if make is None:
        return []
    unused = make().unused()
    weights = [n for n, shape in unused.items() if n.endswith(".weight") and len(shape) == 2]
    return [n[: -len(".weight")] for n in weights]


def target_patterns(targets: str | Sequence[str]) -> tuple[str, ...] | None:
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return None
        targets = targets.split(",")
    out = tuple(t.strip() for t in targets if t.strip())
    if not out:
        raise ValueError(f"LoRA targets must be {ALL_LINEAR!r} or module globs, got {targets!r}")
    return out


def matches_target(pattern: str, name: str) -> bool:
    """A glob over the whole name, or over a dot-separated tail (``q_proj``, ``attn.*``), as
    PEFT's ``target_modules`` match name suffixes."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _selected(
    patterns: tuple[str, ...] | None, exclude: Sequence[str], names: Sequence[str]
) -> set[str]:
    """Which of ``names`` (a module's own name first, then its checkpoint names) are targets."""
    if patterns is None:
        return {n for n in names if n.rsplit(".", 1)[-1] not in exclude}
    return {n for n in names if any(matches_target(p, n) for p in patterns)}


def _plan(model, patterns, exclude, names: NamesFn, dropout: float) -> tuple[list, set[str]]:
    """The linears to adapt as ``(name, module, checkpoint names)``, and the patterns that
    selected something; a ``ValueError`` for a half-selected fused layer, or dropout under a
    column-parallel adapter at tp > 1 (checked before any layer changes)."""
    plan: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    hit: set[str] = set()
    for mname, module in model.named_modules():
        if type(module) not in (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear):
            continue
        own = tuple(names(mname, logical_shape(module.weight)))
        chosen = _selected(patterns, exclude, (mname, *own))
        if patterns is not None:
            hit.update(p for p in patterns for n in (mname, *own) if matches_target(p, n))
        if mname in chosen:
            chosen = set(own)
        if not chosen:
            continue
        if chosen != set(own):
            raise ValueError(
                f"LoRA targets select {sorted(chosen)} but not {sorted(set(own) - chosen)}: "
                f"{mname} holds them as one fused weight; select all of them, or build the model "
                "with separate projections"
            )
        if dropout > 0 and module.tp_size > 1 and not isinstance(module, RowParallelLinear):
            raise ValueError(
                f"LoRA dropout {dropout} at tp={module.tp_size}: a column-parallel or "
                "replicated adapter needs the same dropout mask on every tp rank, whose random "
                "states parallax does not keep in step; use dropout 0 (OpenVLA's recipe) or tp=1"
            )
        plan.append((mname, module, own))
    return plan, hit


def apply_lora(
    model: nn.Module,
    targets: str | Sequence[str] = ALL_LINEAR,
    rank: int = 32,
    alpha: float = 16,
    dropout: float = 0.0,
    seed: int | None = 0,
    *,
    exclude: Sequence[str] = OUTPUT_HEADS,
    names: NamesFn | None = None,
    dtype: torch.dtype = torch.float32,
    freeze: bool = True,
) -> LoRAReport:
    """Add adapters to the column- and row-parallel (and replicated) linears ``targets`` selects.

    ``targets``: ``"all-linear"`` (every linear whose last name part is not in ``exclude``: the
    output head) or module-name globs (a list or a comma string) matched against the parallax
    name or the checkpoint names, whole or as a dotted tail. A fused layer is adapted whole or
    not at all. ``seed``: the layout-free init (``None``: zeros, e.g. to load an adapter next).
    ``freeze``: every other parameter stops training (``requires_grad=False``). Apply it after
    the model has its device and dtype, before building the optimizer and compiling.
    """
    patterns = target_patterns(targets)
    plan, hit = _plan(model, patterns, exclude, names or checkpoint_module_names(model), dropout)
    skipped = tuple(n for n in unbuilt_linears(model) if _selected(patterns, exclude, (n,)))
    if patterns is not None:
        hit.update(p for p in patterns for n in skipped if matches_target(p, n))
    report = LoRAReport(rank, float(alpha), float(dropout), seed, targets, skipped=skipped)
    report.unmatched = () if patterns is None else tuple(p for p in patterns if p not in hit)
    for mname, module, own in plan:
        add_adapter(module, own, rank, alpha, dropout, seed=seed, dtype=dtype)
        report.adapted[mname] = own
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            report.adapters += p.numel()
        elif freeze:
            p.requires_grad_(False)
    report.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report.frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return report


def reset_lora(model: nn.Module, seed: int) -> int:
    """Draw every adapter again layout-free from ``seed`` (B zero): e.g. after the model was
    built and adapted on the meta device and then materialized. Returns the layers reset."""
    layers = list(lora_layers(model))
    for _, layer in layers:
        layer.reset_adapter(seed)
    return len(layers)


def unfreeze(model: nn.Module, patterns: str | Sequence[str]) -> list[str]:
    """Make the base parameters matching ``patterns`` train again (a LoRA run's fully trained
    modules, PEFT's ``modules_to_save``): globs over the parameter's name or its module's name,
    whole or as a dotted tail (``norm``, ``projector.fc1``, ``*layernorm*``). Returns the names
    this rank unfroze (with pipeline stages, gather them before calling a pattern unused)."""
    patterns = target_patterns(patterns) or ()
    out = []
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if not is_adapter_name(name) and any(
            matches_target(pat, name) or matches_target(pat, module) for pat in patterns
        ):
            p.requires_grad_(True)
            out.append(name)
    return out


def is_adapter_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every layer carrying an adapter, in module order."""
    for name, module in model.named_modules():
        if is_lora_layer(module):
            yield name, module


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            yield name, p


def base_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter but the adapters, then every weight held quantized (``--quantize-base``)
    as a meta tensor of its shape and split, whose value :func:`merged_value` gives: what a
    merged export writes."""
    for name, p in model.named_parameters():
        if not is_adapter_name(name):
            yield name, p
    for name, q in quantized_weights(model):
        yield name, q.placeholder()


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What trains (adapters and any module left or made trainable): what a LoRA checkpoint
    holds, with the optimizer's state for it."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def merged_value(model: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of parameter ``name`` as the merged model holds it: for an adapted
    weight ``W + (alpha/r) B A`` in fp32 (round it once, when writing), else the value itself;
    a weight held quantized is its dequantized value (in fp32, the adapter's term added).
    Nothing is modified and no rank communicates."""
    owner, _, leaf = name.rpartition(".")
    if leaf == "weight":
        module = model.get_submodule(owner)
        if is_quantized(module):
            base = module.quantized.dequantize(torch.float32)  # (out, in) on this rank
            return base + module.lora_delta() if is_lora_layer(module) else base
        if is_lora_layer(module):
            return param.detach().float() + module.lora_delta()
    return param.detach()


def merged_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's merged slice)`` of every base parameter, one at a time (adapted
    weights in fp32), without touching the model: for an export that streams."""
    for name, p in base_parameters(model):
        yield name, merged_value(model, name, p)


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (fp32 sum, one rounding; each rank its own
    slice, no gather) and remove the adapters; returns how many layers were merged. The base
    parameters keep their ``requires_grad`` (frozen after :func:`apply_lora`)."""
    layers = list(lora_layers(model))
    held = [name for name, layer in layers if is_quantized(layer)]
    if held:
        raise ValueError(
            f"merge_lora: {len(held)} adapted layers (e.g. {held[0]}) hold their base quantized; "
            "a merge into codes would quantize the adapters away: export the merged model "
            "(--export-hf writes it in bf16 from the dequantized base) instead"
        )
    for _, layer in layers:
        remove_adapter(layer, merge=True)
    return len(layers)


def remove_lora(model: nn.Module) -> int:
    """Drop every adapter without merging (the base model as it was)."""
    layers = list(lora_layers(model))
    for _, layer in layers:
        remove_adapter(layer, merge=False)
    return len(layers)
