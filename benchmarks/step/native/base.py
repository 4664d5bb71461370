"""What every PyTorch-native baseline shares: the same OpenVLA as plain ``nn`` modules, synthetic
batches, the loss, AdamW, global gradient-norm clipping and version shims.

The model is parallax's own OpenVLA built at tp=1 and *densified*: its parallax layers become
``nn.Linear`` / ``nn.Embedding`` holding the very same ``Parameter`` objects (a parallax layer at
tp=1 computes exactly ``F.linear`` / ``F.embedding``), so PyTorch's tools (DDP, FSDP2, DTensor
plans, pipelining) see the modules they expect and every framework trains the same network.

Precision policy, the same for every baseline: bf16 compute, fp32 master weights and fp32 AdamW
state. The natives keep fp32 parameters and run the forward under ``torch.autocast(bf16)``
(FSDP2 instead casts its fp32 shards with ``MixedPrecisionPolicy``); CPU smoke runs stay fp32.

Weights: every framework builds the model through the same layout-free init
(``OpenVLA(..., seed=wl.seed)``: each parameter's full tensor drawn from a generator seeded by
its name), so parallax's rows and the natives start from the same logical weights (parallax
holds them in bf16) and, on the same batch, from the same first loss.

Each baseline's best form: ``Workload.compile_backend`` compiles each ViT block and decoder
layer (:func:`compile_blocks`, parallax's own per-block compile), AdamW is fused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.objective import vla_loss
from parallax.pipeline import split
from parallax.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard  # noqa: F401

IGNORE_INDEX = -100
Batch = dict[str, torch.Tensor]


class MissingAPI(RuntimeError):
    """This torch lacks what a baseline's best form needs: the benchmark skips the row and
    prints why, instead of measuring a weaker form under the same name."""


@dataclass(frozen=True)
class Workload:
    """Model, micro-batch and optimisation settings every framework of one run shares."""

    config: OpenVLAConfig
    micro_batch: int
    autocast: torch.dtype | None = torch.bfloat16  # None: fp32 throughout (CPU smoke)
    lr: float = 2e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    optimizer: str = "fused"  # AdamW implementation: "fused" or "foreach"
    seed: int = 0
    compile_backend: str | None = None  # torch.compile each block with it; None: eager
    stage_dtype: torch.dtype | None = None  # pipelining's activations; None: autocast's or fp32
    # FSDP2: keep the parameters unsharded between the micro-batches of one step
    fsdp_unsharded_accumulation: bool = False

    @property
    def activation_dtype(self) -> torch.dtype:
        """What pipeline stages send each other: bf16 under bf16 autocast, as parallax's bf16
        stages do (the residual stream would otherwise stay fp32 and double the traffic)."""
        return self.stage_dtype or self.autocast or torch.float32


def densify(module: nn.Module) -> nn.Module:
    """Swap every parallax tensor layer of ``module`` (in place) for the plain ``nn`` layer it
    equals at tp=1, sharing the same ``Parameter`` objects; returns ``module``."""
    for name, child in list(module.named_children()):
        if isinstance(child, ColumnParallelLinear | RowParallelLinear):
            _check_dense(child, name)
            layer = nn.Linear(
                child.in_features, child.out_features, child.bias is not None, device="meta"
            )
            layer.weight = child.weight
            layer.bias = child.bias
            setattr(module, name, layer)
        elif isinstance(child, VocabParallelEmbedding):
            _check_dense(child, name)
            layer = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
            layer.weight = child.weight
            setattr(module, name, layer)
        else:
            densify(child)
    return module


def _check_dense(layer: nn.Module, name: str) -> None:
    if layer.tp_size != 1 or layer.sequence_parallel:
        raise ValueError(
            f"densify: {name} is sharded (tp={layer.tp_size}, sequence_parallel="
            f"{layer.sequence_parallel}); build the model with ctx=None"
        )


def stage_ranges(config: OpenVLAConfig, pp: int) -> list[range]:
    """The block ranges of ``pp`` pipeline stages, split by cost as parallax's Trainer splits
    them (the vision block, with both towers, the projector and the embedding, on stage 0)."""
    return split([b.cost for b in OpenVLA.stage_blocks(config)], pp, 1, pin_first=1)


def dense_openvla(wl: Workload, device: torch.device, blocks: range | None = None) -> OpenVLA:
    """The fp32 OpenVLA (or the ``blocks`` of one stage) with layout-free weights, densified."""
    model = OpenVLA(
        wl.config,
        None,
        blocks=blocks,
        dtype=torch.float32,
        device=device,
        activation_checkpointing=wl.activation_checkpointing,
        seed=wl.seed,
    )
    return densify(model)


def compile_blocks(model: OpenVLA, wl: Workload) -> OpenVLA:
    """``torch.compile`` each ViT block and decoder layer in place (the forward of each, as
    parallax compiles its own), when the workload asks for it; returns ``model``.

    Static shapes (``dynamic=False``): the benchmark's shapes never change, so each block shape
    (two ViT widths, the Llama layer) compiles once, specialised. With the default, the second
    ViT width recompiles with symbolic shapes, and tracing a DTensor block's backward with
    symbolic shapes recursed without end (torch 2.13, aot_eager)."""
    if wl.compile_backend is not None:
        model.compile_blocks(backend=wl.compile_backend, dynamic=False)
    return model


def synthetic_batch(
    config: OpenVLAConfig,
    batch: int,
    text_tokens: int,
    labelled: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """``pixel_values (b, 6, S, S)``, ``input_ids (b, t)`` starting with BOS, ``labels (b, t)``:
    -100 except the last ``labelled`` positions (OpenVLA's 7 action tokens and EOS)."""
    if not 1 <= labelled < text_tokens:
        raise ValueError(f"need 1 <= labelled < text_tokens, got {labelled}, {text_tokens}")
    g = torch.Generator().manual_seed(seed)
    s, vocab = config.image_size, config.tokenizer_vocab_size
    pixels = torch.randn(batch, 6, s, s, generator=g)
    ids = torch.randint(3, vocab, (batch, text_tokens), generator=g)
    ids[:, 0] = 1  # BOS: the image patches go right after it
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, -labelled:] = ids[:, -labelled:]
    out = {"pixel_values": pixels, "input_ids": ids, "labels": labels}
    return {k: v.to(device) for k, v in out.items()}


def split_batch(batch: dict[str, torch.Tensor], micro_batch: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ``micro_batch`` samples (the batch must divide)."""
    n = batch["input_ids"].shape[0]
    if n % micro_batch:
        raise ValueError(f"a batch of {n} does not split into micro-batches of {micro_batch}")
    parts = {k: v.split(micro_batch) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(n // micro_batch)]


def dp_share(microbatches: Sequence, dp_rank: int, dp_size: int) -> list:
    """This data-parallel rank's contiguous block of the global batch's micro-batches."""
    if len(microbatches) % dp_size:
        raise ValueError(
            f"{len(microbatches)} micro-batches do not split over dp={dp_size}: make the global "
            "batch a multiple of micro-batch x dp"
        )
    k = len(microbatches) // dp_size
    return list(microbatches[dp_rank * k : (dp_rank + 1) * k])


def cat_batches(microbatches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([mb[k] for mb in microbatches]) for k in microbatches[0]}


def loss_of(config: OpenVLAConfig, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens (float32)."""
    return vla_loss(
        logits,
        labels,
        None,
        num_patches=config.num_patches,
        vocab_size=config.text.vocab_size,
    )


def autocast(wl: Workload, device: torch.device):
    if wl.autocast is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=wl.autocast)


def adamw(named_params: Iterable[tuple[str, nn.Parameter]], wl: Workload, **extra):
    """AdamW with decay on matrices only; DTensor and plain parameters in separate groups (a
    multi-tensor kernel takes one kind per call). ``extra``: other wrapper arguments."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for _, p in named_params:
        if p.requires_grad:
            groups.setdefault((isinstance(p, DTensor), p.dim() >= 2), []).append(p)
    param_groups = [
        {"params": ps, "weight_decay": wl.weight_decay if decay else 0.0}
        for (_, decay), ps in sorted(groups.items())
    ]
    impl = {"fused": True} if wl.optimizer == "fused" else {"foreach": True}
    return param_groups, dict(lr=wl.lr, **impl, **extra)  # betas, eps: torch defaults


def make_adamw(named_params, wl: Workload) -> torch.optim.AdamW:
    groups, kwargs = adamw(named_params, wl)
    return torch.optim.AdamW(groups, **kwargs)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    shard_group: dist.ProcessGroup | None = None,
    stage_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global L2 norm of the gradients, then clip them to ``max_norm`` (no host sync).

    DTensor gradients with a ``Shard`` placement are partial: their squares are summed over
    ``shard_group``. Plain and replicated gradients count once, except that pipeline stages hold
    disjoint parameters, summed over ``stage_group``.
    """
    sharded, local = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            shard = any(pl.is_shard() for pl in g.placements)
            (sharded if shard else local).append(g.to_local())
        else:
            local.append(g)
    device = (sharded + local)[0].device if sharded or local else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensors, group in ((sharded, shard_group), (local, stage_group)):
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if tensors:
            sq = torch.stack(torch._foreach_norm(tensors)).float().square().sum()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total += sq
    norm = total.sqrt()
    if max_norm > 0 and math.isfinite(max_norm) and (sharded or local):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(sharded + local, coef)
    return norm


@dataclass
class Runner:
    """One framework's training step on one rank, and what it holds (released with ``del``)."""

    name: str
    step: Callable[[Sequence[Batch]], dict[str, torch.Tensor]]
    modules: list[nn.Module] = field(default_factory=list)
    optimizer: object = None


def accumulate(
    wl: Workload,
    forward: nn.Module,
    microbatches: Sequence[Batch],
    device: torch.device,
    no_sync: Callable[[], AbstractContextManager] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    loss_context: Callable[[], AbstractContextManager] = nullcontext,
) -> torch.Tensor:
    """Forward and backward every micro-batch (its loss divided by their count), gradients
    summed in ``.grad``; ``no_sync`` (DDP's, FSDP2's) defers the gradient reduction to the last
    one. ``loss_fn(logits, labels)`` (default :func:`loss_of`) runs, with its backward, inside
    ``loss_context`` (DTensor's ``loss_parallel``). Returns the mean loss (a plain tensor)."""
    loss_fn = loss_fn or (lambda logits, labels: loss_of(wl.config, logits, labels))
    total = torch.zeros((), device=device)
    n = len(microbatches)
    for i, mb in enumerate(microbatches):
        with no_sync() if no_sync is not None and i < n - 1 else nullcontext(), loss_context():
            with autocast(wl, device):
                logits = forward(mb["pixel_values"], mb["input_ids"])  # (b, P + t, V)
                loss = loss_fn(logits, mb["labels"]) / n
            loss.backward()
        value = loss.detach()
        total += value.to_local() if isinstance(value, DTensor) else value  # replicated
    return total
