"""pi0 / pi0.5 inference under a pipeline: each stage runs its own joint layers.

The prefix walks the stages once: the first embeds the cameras and the prompt, each stage fills
the cache of its own layers (:meth:`~.model.Pi0Model.cache_prefix`) and hands the prefix's
hidden states (and its padding mask) to the next. At every Euler step the suffix walks them the
same way (:meth:`~.model.Pi0Model.cached_layers`, with pi0.5's time conditioning beside it),
and the last stage's velocity is broadcast over the pipeline group, so every rank integrates
the same flow and returns the same chunk. The hand-offs are point-to-point sends with their
shapes and dtypes first (:func:`~parallax.pipeline.p2p.send_tensors`), in stage order, so
they cannot cross; they and the broadcast wait as long as the groups' timeout. Under tp each
rank talks to its own tp position on the neighbouring stages.
"""

from __future__ import annotations

import torch

from parallax import comm
from parallax.families.pi0.suffix import embed_suffix
from parallax.pipeline.p2p import recv_tensors, send_tensors


class StagedVelocity:
    """``v(x, t)`` of a pipeline stage's :class:`~.model.Pi0Model` chunk over the prefix of
    ``prefix_inputs`` (images, image masks, tokens, token mask; only the first stage reads
    them), its cache filled at construction (collective over the pipeline group)."""

    def __init__(self, model, prefix_inputs, state: torch.Tensor | None) -> None:
        ctx = model.ctx
        if getattr(ctx, "pp_group", None) is None:
            raise ValueError(
                "sampling with a pipeline stage's chunk needs the ParallelContext it was built "
                f"with (its pp group); the chunk holds blocks {model.block_range}"
            )
        self.model, self.ctx, self.state = model, ctx, state
        self.device = next(model.parameters()).device
        if model.has_embed:
            prefix, pad = model.embed_prefix(*prefix_inputs)  # (b, P, w_p), (b, P)
        else:
            prefix, pad = self._receive()
        self.cache, out = model.cache_prefix(prefix, pad.bool())
        if not model.has_head:
            self._send(out, pad)

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity ``(b, H, A)`` float32 at ``x`` (b, H, A) and ``t`` (b,), on every rank."""
        model = self.model
        if model.has_embed:
            suffix, cond = embed_suffix(model, self.state, x, t)  # (b, S, w_e), (b, w_e) | None
        else:
            suffix, *rest = self._receive()
            cond = rest[0] if rest else None
        suffix = model.cached_layers(self.cache, suffix, cond)  # (b, S, w_e)
        if model.has_head:
            v = model.actions_out(suffix, cond)  # (b, H, A)
        else:
            self._send(suffix, *(() if cond is None else (cond,)))
            v = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        last = self.ctx.pp_peer(self.ctx.pp_size - 1)
        return comm.broadcast(v, last, self.ctx.pp_group)

    def _send(self, *tensors: torch.Tensor) -> None:
        what = f"pi0 inference, pipeline stage {self.ctx.pp_rank}"
        send_tensors(tensors, self.ctx.pp_next, self.ctx.pp_group, what)

    def _receive(self) -> list[torch.Tensor]:
        return recv_tensors(self.ctx.pp_prev, self.ctx.pp_group, self.device)
