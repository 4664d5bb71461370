"""Read LLaVA-NeXT checkpoints in their three published layouts; describe the one parallax writes.

The layout is found from the tensor names (and must agree with config.json):

- ``llava-hf`` (the Hub uploads): ``vision_tower.vision_model.*``, ``multi_modal_projector.
  linear_{1,2}``, ``image_newline``, ``language_model.model.*``, ``language_model.lm_head``;
- ``transformers-5`` (what its ``save_pretrained`` writes): ``model.vision_tower[.vision_model].*``,
  ``model.multi_modal_projector.*``, ``model.image_newline``, ``model.language_model.*``,
  ``lm_head.weight``;
- ``original`` (``liuhaotian/llava-v1.6-*``): ``model.vision_tower.vision_tower.vision_model.*``,
  ``model.mm_projector.{0,2}``, ``model.image_newline``, ``model.*``, ``lm_head.weight``, with a
  32000-row vocabulary that is extended on load (:mod:`parallax.families.llava_next.vocab`).

CLIP stores q, k and v separately (parallax's ViT holds one fused ``qkv``), the class embedding
as ``(w,)`` and the position embedding as ``(n, w)``: a parameter is the concatenation of its
checkpoint tensors along dim 0, viewed to its own shape. As for OpenVLA, every rank checks the
whole checkpoint's names and shapes from the headers (so a bad checkpoint fails identically
everywhere), then reads only its stage's tensors and its tp slice of each. The tower's last layer
and ``post_layernorm`` are never used; rank 0 keeps them (under their llava-hf names) to write
them back. ``save_pretrained`` always writes the llava-hf layout.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from parallax.families.llava_next import vocab as llava_vocab
from parallax.families.llava_next.config import LlavaNextConfig
from parallax.models.hf_io import CheckpointReader, fit_problems, fused_parts, read_param
from parallax.models.meta import materialize
from parallax.models.vit_config import ViTConfig
from parallax.tensor import logical_shape

EMBED, HEAD = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"
_IGNORED = re.compile(r"(\.inv_freq|\.position_ids)$")  # buffers some writers saved


@dataclass(frozen=True)
class Layout:
    """Where each part of the model lives in one checkpoint naming scheme."""

    name: str
    vision: str  # prefix of the CLIP vision transformer's tensors
    projector: tuple[str, str]  # prefixes of linear_1 and linear_2
    newline: str
    lm_body: str  # stands for "language_model.model."
    lm_head: str


LLAVA_HF = Layout(
    "llava-hf",
    "vision_tower.vision_model.",
    ("multi_modal_projector.linear_1.", "multi_modal_projector.linear_2."),
    "image_newline",
    "language_model.model.",
    HEAD,
)
TRANSFORMERS_5 = Layout(
    "transformers-5",
    "model.vision_tower.vision_model.",
    ("model.multi_modal_projector.linear_1.", "model.multi_modal_projector.linear_2."),
    "model.image_newline",
    "model.language_model.",
    "lm_head.weight",
)
ORIGINAL = Layout(
    "original",
    "model.vision_tower.vision_tower.vision_model.",
    ("model.mm_projector.0.", "model.mm_projector.2."),
    "model.image_newline",
    "model.",
    "lm_head.weight",
)
_PATCH = "embeddings.patch_embedding.weight"


def detect_layout(names, config: LlavaNextConfig, where: str = "checkpoint") -> Layout:
    """The layout of a checkpoint holding tensors ``names``; one ``ValueError`` otherwise."""
    names = set(names)
    if LLAVA_HF.lm_body + "embed_tokens.weight" in names:
        layout = LLAVA_HF
    elif TRANSFORMERS_5.lm_body + "embed_tokens.weight" in names:
        layout = TRANSFORMERS_5
        if TRANSFORMERS_5.vision + _PATCH not in names:  # the tower's own prefix dropped
            layout = replace(layout, vision="model.vision_tower.")
    elif ORIGINAL.projector[0] + "weight" in names and "model.embed_tokens.weight" in names:
        layout = ORIGINAL
    else:
        sample = ", ".join(sorted(names)[:6])
        raise ValueError(
            f"{where} has an unknown LLaVA-NeXT layout: expected llava-hf names "
            "(language_model.model.*), transformers 5.x names (model.language_model.*) or the "
            f"original LLaVA names (model.mm_projector.*); found {len(names)} tensors such as "
            + sample
        )
    original_config = config.checkpoint_vocab_size is not None
    if original_config != (layout is ORIGINAL):
        kind = "the original LLaVA" if original_config else "a llava-hf"
        raise ValueError(
            f"{where}: config.json is {kind} config but the tensors are in the {layout.name} layout"
        )
    return layout


def _vision_sources(rest: str, shape: tuple[int, ...], prefix: str) -> list[tuple[str, tuple]]:
    """CLIP tensors of the ViT parameter ``vision_tower.<rest>``."""
    if rest == "patch_embed.proj.weight":
        return [(prefix + _PATCH, shape)]
    if rest == "cls_token":
        return [(prefix + "embeddings.class_embedding", (shape[-1],))]
    if rest == "pos_embed":
        return [(prefix + "embeddings.position_embedding.weight", tuple(shape[-2:]))]
    if rest.startswith("norm_pre."):
        return [(prefix + "pre_layrnorm." + rest[len("norm_pre.") :], shape)]
    m = re.fullmatch(
        r"blocks\.(\d+)\.(\w+)\.(\w+)\.(weight|bias)|blocks\.(\d+)\.(norm[12])\.(weight|bias)", rest
    )
    if m is None:
        raise KeyError(f"no CLIP tensor for vision_tower.{rest}")
    if m.group(5) is not None:
        i, norm, kind = m.group(5), m.group(6), m.group(7)
        return [(f"{prefix}encoder.layers.{i}.layer_norm{norm[-1]}.{kind}", shape)]
    i, module, sub, kind = m.groups()[:4]
    layer = f"{prefix}encoder.layers.{i}."
    if (module, sub) == ("attn", "qkv"):
        part = (shape[0] // 3, *shape[1:])
        return [(f"{layer}self_attn.{p}_proj.{kind}", part) for p in "qkv"]
    target = {
        ("attn", "proj"): "self_attn.out_proj",
        ("mlp", "fc1"): "mlp.fc1",
        ("mlp", "fc2"): "mlp.fc2",
    }
    return [(f"{layer}{target[(module, sub)]}.{kind}", shape)]


def _clip_layer(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    w, f = cfg.width, cfg.mlp_hidden
    out = {
        f"self_attn.{p}_proj.{k}": ((w, w) if k == "weight" else (w,))
        for p in ("q", "k", "v", "out")
        for k in ("weight", "bias")
    }
    for n in ("layer_norm1", "layer_norm2"):
        out.update({f"{n}.weight": (w,), f"{n}.bias": (w,)})
    out.update(
        {
            "mlp.fc1.weight": (f, w),
            "mlp.fc1.bias": (f,),
            "mlp.fc2.weight": (w, f),
            "mlp.fc2.bias": (w,),
        }
    )
    return out


class CheckpointLayout:
    """Names and shapes of ``config``'s parameters in one layout (the ``checkpoint_layout`` that
    :func:`parallax.models.hf_export.save_pretrained` asks a model for)."""

    def __init__(
        self, config: LlavaNextConfig, layout: Layout = LLAVA_HF, model_cls: type | None = None
    ) -> None:
        self.config, self.layout = config, layout
        self.model_cls = model_cls  # the model class whose parameters expected() lists
        old = config.checkpoint_vocab_size if layout is ORIGINAL else None
        self.stored_vocab = old or config.vocab_size

    def tensors(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint tensors ``(name, shape)`` whose dim-0 concatenation, viewed to
        ``shape``, is parameter ``name`` (embedding and lm_head: the stored rows only)."""
        lay, shape = self.layout, tuple(shape)
        if name.startswith("vision_tower."):
            return _vision_sources(name[len("vision_tower.") :], shape, lay.vision)
        for i, prefix in enumerate(
            ("multi_modal_projector.linear_1.", "multi_modal_projector.linear_2.")
        ):
            if name.startswith(prefix):
                return [(lay.projector[i] + name[len(prefix) :], shape)]
        if name == "image_newline":
            return [(lay.newline, shape)]
        if name in (EMBED, HEAD):
            target = lay.lm_head if name == HEAD else lay.lm_body + "embed_tokens.weight"
            return [(target, (self.stored_vocab, *shape[1:]))]
        if not name.startswith("language_model.model."):
            raise KeyError(f"parameter {name} has no place in a LLaVA-NeXT checkpoint")
        parts = fused_parts(name)
        rows = (shape[0] // len(parts), *shape[1:])
        body = len("language_model.model.")
        return [(lay.lm_body + p[body:], rows if len(parts) > 1 else shape) for p in parts]

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the whole model reads, with its shape (built on meta, tp=1)."""
        if self.model_cls is None:
            raise TypeError("CheckpointLayout.expected() needs the model class (model_cls)")
        model = self.model_cls(self.config, None, device="meta")
        out: dict[str, tuple[int, ...]] = {}
        for name, p in model.named_parameters():
            out.update(self.tensors(name, tuple(p.shape)))
        return out

    def unused(self) -> dict[str, tuple[int, ...]]:
        """The tower's layers after the feature layer and ``post_layernorm``: in the checkpoint,
        never used by the model."""
        v, prefix = self.config.vision, self.layout.vision
        out = {}
        for i in range(v.feature_index + 1, v.depth):
            out.update({f"{prefix}encoder.layers.{i}.{k}": s for k, s in _clip_layer(v).items()})
        out.update(
            {
                f"{prefix}post_layernorm.weight": (v.width,),
                f"{prefix}post_layernorm.bias": (v.width,),
            }
        )
        return out

    def validate(self, reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
        """Raise one ``ValueError`` naming every missing, mis-shaped or unexpected tensor."""
        present = reader.shapes()
        problems = fit_problems(present, self.expected(), self.unused(), _IGNORED.search)
        if problems:
            raise ValueError(
                f"{self.layout.name} checkpoint {reader.path} does not fit the model: "
                + "; ".join(problems)
            )
        return present


def load_llava(
    cls,
    path: str | Path,
    ctx=None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    blocks: range | None = None,
    device: torch.device | str | None = None,
    fused_projections: bool = False,
    config: LlavaNextConfig | None = None,
    **model_kwargs,
):
    """Build ``cls(config, ctx, blocks=...)`` on meta and fill it from the checkpoint at ``path``.

    The result's ``load_stats`` tells what this rank read (an original-layout checkpoint also
    reads the embedding's rows on the last stage, for the statistics of the added rows).
    ``model_kwargs`` go to the model (``activation_checkpointing``, ``freeze_vision``).
    """
    t0 = time.perf_counter()
    config = config or LlavaNextConfig.from_pretrained(path)
    if fused_projections:
        config = config.with_options(fused_projections=True)
    reader = CheckpointReader(path)
    layout = CheckpointLayout(
        config, detect_layout(reader.weight_map, config, f"checkpoint {path}"), cls
    )
    present = layout.validate(reader)
    model = cls(config, ctx, blocks=blocks, dtype=dtype, device="meta", **model_kwargs)
    materialize(model, device if device is not None else (ctx.device if ctx is not None else "cpu"))
    params = dict(model.named_parameters())
    added = None
    if layout.layout is ORIGINAL and (EMBED in params or HEAD in params):
        info = (params.get(EMBED) if EMBED in params else params[HEAD]).tp_shard
        added = llava_vocab.AddedRows(
            reader,
            layout.tensors(EMBED, (config.vocab_size, 1))[0][0],
            info,
            ctx,
            config.vocab_size,
        )
    with torch.no_grad():
        for name, param in params.items():
            info = getattr(param, "tp_shard", None)
            if added is not None and name == EMBED:
                raw = added.embed_slice()
            else:
                raw = read_param(reader, layout.tensors(name, logical_shape(param)), info)
            if added is not None and name in (EMBED, HEAD):
                raw = added.fill(raw.float(), head=name == HEAD)
            param.copy_(raw.reshape(param.shape))
    if model.has_vision and (ctx is None or ctx.rank == 0):
        _keep_unused(model, reader, layout, present)
    reader.stats.seconds = time.perf_counter() - t0
    model.load_stats = reader.stats
    return model


def _keep_unused(model, reader: CheckpointReader, layout: CheckpointLayout, present) -> None:
    """Keep the checkpoint's tensors the model does not use (for the export), under their
    llava-hf names; their bytes count as ``unused_bytes``, not as read."""
    before = reader.stats.bytes_read
    canonical = CheckpointLayout(layout.config, LLAVA_HF).unused()
    for (n, _), key in zip(layout.unused().items(), canonical):
        if n in present:
            model.hf_unused[key] = reader.read(n)
    reader.stats.unused_bytes = reader.stats.bytes_read - before
    reader.stats.bytes_read = before
