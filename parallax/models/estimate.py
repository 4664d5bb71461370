"""What one sample costs in the pieces of a model, for planning: activation bytes and FLOPs.

A family describes each pipeline block as :class:`Part` s: ``count`` identical pieces (a
tower's ViT blocks, one decoder layer, an embedding, a projector), each with what one sample
keeps for the backward (``saved``), what it keeps when the piece recomputes in the backward
(``kept``: its input, under activation checkpointing), its forward matmul and attention FLOPs,
and the bytes it all-reduces over tp. The planner (:mod:`parallax.plan`) multiplies these by the
micro-batch, the microbatches in flight and the layout.

Bytes are split by what tensor parallelism divides (:class:`Split`): the head-sharded q, k, v
and the MLP's hidden activations are ``1/tp`` per rank, the residual stream and the norms' inputs
are whole on every tp rank (no sequence parallelism). The counts follow what autograd saves in
parallax's blocks (eager, SDPA with a flash kernel: q, k, v and the output, not the scores),
checked against ``torch.autograd.graph.saved_tensors_hooks`` in
``tests/models/test_estimate.py``:

- a Llama decoder layer (``e`` bytes per element): each RMSNorm keeps its input cast to fp32
  (4), the normalised value cast back (e) and its output (e): ``2 (4 + 2e) h`` whole;
  attention ``4 e h`` (q, k after RoPE, v, the output; grouped-query k and v repeated to
  every head; with fused projections v is a view that keeps the whole qkv output alive:
  ``6 e h``), the SwiGLU MLP ``4 e f``, both /tp;
- a ViT block: each LayerNorm keeps its input and its output (``4 e w``), LayerScale its input
  (``2 e w``), the whole; the qkv output (q, k, v are views of it) and the attention output
  (``4 e w``) and the MLP's hidden activations (GELU ``2 e f``, quick GELU ``3 e f``), /tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from parallax.models.llama import LlamaConfig
from parallax.models.vit import ViTConfig

SCOPES = ("vision", "text")  # what --checkpoint-scope names; "all" recomputes both


@dataclass(frozen=True)
class Split:
    """A per-sample amount: ``sharded`` is divided over tp ranks, ``replicated`` is not."""

    sharded: float = 0.0
    replicated: float = 0.0

    def at(self, tp: int) -> float:
        """The amount on one of ``tp`` ranks."""
        return self.sharded / tp + self.replicated

    def __add__(self, other: Split) -> Split:
        return Split(self.sharded + other.sharded, self.replicated + other.replicated)

    def __mul__(self, k: float) -> Split:
        return Split(self.sharded * k, self.replicated * k)

    __rmul__ = __mul__


@dataclass(frozen=True)
class Part:
    """``count`` identical pieces of one pipeline block; every number is per piece and sample.

    ``scope``: which ``--checkpoint-scope`` recomputes the pieces ("vision" or "text"; ``None``:
    never recomputed); ``kept`` is then what one sample keeps (the piece's input). ``tokens``
    is the rows the piece's matmuls see (their efficiency grows with it), ``seq`` the sequence
    its attention sees (0: ``tokens``); ``tp_reduces`` the all-reduces of one forward at
    tp > 1, ``tp_bytes`` their bytes. ``compiled``: what a compiled piece keeps instead of
    ``saved`` (``None``: the same), where the compiler's fusion drops intermediates. ``fp8``:
    its matmuls are parallel linears that ``--fp8`` runs in FP8 (not an output head or a
    convolution).
    """

    name: str
    count: int = 1
    saved: Split = field(default_factory=Split)
    scope: str | None = None
    kept: Split = field(default_factory=Split)
    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    tokens: int = 1
    tp_reduces: int = 0
    tp_bytes: float = 0.0
    seq: int = 0
    compiled: Split | None = None
    fp8: bool = True

    def recomputes(self, checkpointing: bool | str) -> bool:
        """Whether ``--activation-checkpointing`` (``True``, or a scope) recomputes it."""
        if self.scope is None or not checkpointing:
            return False
        return checkpointing is True or checkpointing == "all" or checkpointing == self.scope

    def keeps(self, checkpointing: bool | str, compiled: bool = False) -> Split:
        """What the ``count`` pieces keep for one sample between forward and backward."""
        if self.recomputes(checkpointing):
            return self.kept * self.count
        fused = self.compiled if compiled and self.compiled is not None else self.saved
        return fused * self.count


@dataclass(frozen=True)
class BlockEstimate:
    """One pipeline block: its parts, and the bytes per sample of its output (what a pipeline
    stage ending with it sends, and holds until the backward)."""

    parts: tuple[Part, ...]
    output_bytes: float = 0.0

    def keeps(self, checkpointing: bool | str, compiled: bool = False) -> Split:
        total = Split()
        for part in self.parts:
            total = total + part.keeps(checkpointing, compiled)
        return total


# -- the pieces parallax's models are made of ----------------------------------------------------
def llama_layer(cfg: LlamaConfig, tokens: int, e: int, scope: str | None = "text") -> Part:
    """One :class:`~parallax.models.llama.LlamaDecoderLayer` (see the module docstring)."""
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_heads * cfg.head_dim
    # q, k, v and the output; grouped-query keys and values are repeated to every head first
    attention = e * (6 * h if cfg.fused_projections else 4 * h)
    sharded = tokens * (attention + 4 * e * f + 4 * cfg.num_attention_heads)  # + logsumexp
    replicated = tokens * 2 * (4 + 2 * e) * h
    return Part(
        "decoder layer",
        saved=Split(sharded, replicated),
        compiled=Split(sharded, tokens * 2 * e * h),  # the norms' fp32 copies fused away
        scope=scope,
        kept=Split(0.0, tokens * e * h),
        gemm_flops=2.0 * tokens * (2 * h * h + 2 * h * kv + 3 * h * f),
        attention_flops=2.0 * tokens * tokens * h,  # QK^T and AV, half of them masked
        tokens=tokens,
        tp_reduces=2,
        tp_bytes=2.0 * tokens * h * e,
    )


def vit_blocks(
    cfg: ViTConfig, tokens: int, e: int, count: int, scope: str | None, images: int = 1
) -> Part:
    """``count`` :class:`~parallax.models.vit.ViTBlock` s over ``tokens`` tokens, per image,
    ``images`` images (tiles) per sample."""
    w, f = cfg.width, cfg.mlp_hidden
    act = 3 if cfg.act == "quick_gelu" else 2
    sharded = tokens * (4 * e * w + act * e * f + 4 * cfg.num_heads)
    replicated = tokens * e * w * (4 + (2 if cfg.layer_scale else 0)) + tokens * 16  # + LN stats
    attention = (2.0 if cfg.causal else 4.0) * tokens * tokens * w
    return Part(
        f"{count} ViT blocks",
        count=count,
        saved=Split(sharded, replicated) * images,
        scope=scope,
        kept=Split(0.0, tokens * e * w) * images,
        gemm_flops=2.0 * tokens * (4 * w * w + 2 * w * f) * images,
        attention_flops=attention * images,
        tokens=tokens * images,
        seq=tokens,
        tp_reduces=2,
        tp_bytes=2.0 * tokens * w * e * images,
    )


def vit_stem(cfg: ViTConfig, e: int, images: int = 1) -> Part:
    """A tower's patch embedding and position embeddings: the image (cast to the model's
    dtype) is kept for the convolution's weight gradient, and with ``pre_norm`` (CLIP) the
    LayerNorm's input."""
    p, w = cfg.num_patches, cfg.width
    pre = (p + cfg.num_prefix_tokens) * w * e if cfg.pre_norm else 0.0
    return Part(
        "patch embedding",
        saved=Split(0.0, (3.0 * cfg.image_size**2 * e + pre) * images),
        gemm_flops=2.0 * p * 3 * cfg.patch_size**2 * w * images,
        tokens=p * images,
        fp8=False,  # a convolution
    )


def vision_tower(cfg: ViTConfig, e: int, images: int = 1) -> tuple[Part, Part]:
    """A tower as it runs up to its feature layer: the stem, then the blocks over the patches
    and prefix tokens, ``images`` images (tiles) per sample."""
    tokens = cfg.num_patches + cfg.num_prefix_tokens
    blocks = vit_blocks(cfg, tokens, e, cfg.feature_index + 1, "vision", images=images)
    return vit_stem(cfg, e, images=images), blocks


def decoder_model(
    first: Sequence[Part], layer: Part, layers: int, head: Part, hidden: float
) -> list[BlockEstimate]:
    """A vision-language model's blocks: the first (towers, projector, embedding), ``layers``
    decoder layers alike, the head; each block but the head hands ``hidden`` bytes on."""
    body = [BlockEstimate((layer,), hidden)] * layers
    return [BlockEstimate(tuple(first), hidden), *body, BlockEstimate((head,), 0.0)]


@dataclass(frozen=True)
class Linear:
    """One linear of a small stack (a projector): ``sharded_in`` when its input is split over
    tp (it follows a column-parallel linear), ``sharded_out`` when it is column-parallel (its
    output split; otherwise its output is whole, all-reduced), ``act`` when a GELU follows
    (which keeps the linear's output)."""

    d_in: int
    d_out: int
    sharded_in: bool = False
    sharded_out: bool = False
    act: bool = False


def linears(name: str, tokens: int, layers: Sequence[Linear], e: int) -> Part:
    """A stack of linears over ``tokens`` tokens per sample: each keeps its input."""
    saved, flops, reduces = Split(), 0.0, 0
    for lin in layers:
        saved = saved + _whole_or_split(tokens * lin.d_in * e, lin.sharded_in)
        if lin.act:
            saved = saved + _whole_or_split(tokens * lin.d_out * e, lin.sharded_out)
        flops += 2.0 * tokens * lin.d_in * lin.d_out
        reduces += 0 if lin.sharded_out else 1
    return Part(
        name,
        saved=saved,
        gemm_flops=flops,
        tokens=tokens,
        tp_reduces=reduces,
        tp_bytes=reduces * tokens * layers[-1].d_out * e,
    )


def _whole_or_split(nbytes: float, sharded: bool) -> Split:
    return Split(nbytes, 0.0) if sharded else Split(0.0, nbytes)


def embedding(tokens: int, width: int, e: int) -> Part:
    """A vocab-parallel token embedding: nothing kept, one all-reduce of its output."""
    return Part("embedding", tokens=tokens, tp_reduces=1, tp_bytes=1.0 * tokens * width * e)


def lm_head(cfg: LlamaConfig, rows: int, e: int) -> Part:
    """The final RMSNorm and the vocab-parallel lm_head over ``rows`` positions per sample, and
    the cross-entropy's fp32 logits (its softmax and their gradient)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    return Part(
        "head",
        saved=Split(rows * v * (e + 8.0), rows * (4 + 2 * e) * h),
        gemm_flops=2.0 * rows * h * v,
        tokens=rows,
        tp_reduces=2,
        tp_bytes=8.0 * rows,
        fp8=False,  # the LM head stays in bf16
    )
