"""What a :class:`~parallax.optim.zero.optimizer.ZeroOptimizer` lets others read and write
outside its step: the weights (deferred all-gathers, stage 3's sharded weights, whole-model
contexts for an export) and the optimizer state as full logical tensors (checkpoints). The step
itself is :mod:`parallax.optim.zero.optimizer`'s; this base class only asks the parts it built
(``gathers``, ``zero3``, ``state_io``, ``stage``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn


class WeightsAndState:
    """The weights and the state of a ZeroOptimizer, for checkpoints, exports and evaluation."""

    # -- the parameter all-gather under the next forward ------------------------------------------
    def overlap_param_gather(self, *modules: nn.Module) -> list:
        """Let each step's all-gather of the updated parameters run under the next forward.

        ``step()`` then returns with the all-gathers in flight, launched in forward order, and a
        forward pre-hook on each of ``modules``' parameter holders (see
        :func:`parallax.optim.zero.weights.deferred_gathers.hook_points`) waits for the buckets it
        reads. Every parameter must be read inside the forward of a module that holds it (or of a
        compiled ancestor), not through another module's attribute. Anything else that reads
        parameters between ``step()`` and the next forward calls :meth:`wait_params` first; this
        optimizer's own methods do. Returns the hooks' handles; removing them all turns the deferral
        off again. At stage 3 there is nothing to defer (every use gathers): []."""
        if self.stage.shards_weights:
            return []
        return self.gathers.register(modules)

    def overlap_host_step(self, *modules: nn.Module) -> bool:
        """With ``--offload optimizer``: let ``step()`` return while the host still steps and
        uploads, the next forward waiting bucket by bucket for the weights it reads (forward
        pre-hooks as :meth:`overlap_param_gather`'s at stage 2, ZeRO-3's own gathers at stage
        3). Only where no all-gather must follow an upload: stage 3, or stage 2 at dp 1. Whether
        it is on. The same contract as :meth:`overlap_param_gather`: anything else that reads
        the weights or the optimizer's state calls :meth:`wait_params` first."""
        if self.host is None or (not self.stage.shards_weights and self.ctx.dp_size > 1):
            return False
        if self.zero3 is not None:
            trainable, host = self.flat.store, self.host
            self.zero3.gathers.before = lambda store, b: (
                host.wait_bucket(b) if store is trainable else None
            )
        elif not self.gathers.deferred:
            self.gathers.register(modules)
        self._defer_host = True
        return True

    def wait_params(self) -> None:
        """Finish every parameter all-gather and host step still in flight (see
        :meth:`overlap_param_gather`, :meth:`overlap_host_step`): call it before reading
        parameters or state outside a hooked forward, e.g. to save or evaluate."""
        self.gathers.wait_all()
        if self.host is not None:
            self.host.wait()

    # -- the weights outside a forward (stage 3 shards them) ------------------------------------
    def weight(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter ``p``'s current values on this tp rank, whole (any parameter of the
        modules, frozen ones included). At stage 3 a collective over dp: every dp rank asks
        for the same parameters in the same order; one tensor is made, never a whole block."""
        self.wait_params()
        if self.zero3 is None:
            return p.detach()
        return self.zero3.weight(p)

    def materialized(self, unit: int) -> AbstractContextManager:
        """Stage 3: a context in which unit ``unit``'s weights (``self.units[unit]``) can be
        overwritten whole, with no collective (see :meth:`ShardedWeights.materialized`)."""
        self.wait_params()
        return self.zero3.materialized(unit)

    def gathered(self) -> AbstractContextManager:
        """A context with every weight whole, e.g. to export the model (at stage 3 a collective
        that gathers the whole stage on every rank; otherwise it only waits for the weights)."""
        self.wait_params()
        if self.zero3 is None:
            return nullcontext()
        return self.zero3.gathered()

    # -- the state, as full logical tensors (:mod:`~parallax.optim.zero.state_io`) ---------------
    def state_meta(self) -> dict[str, Any]:
        """JSON-able description of the state: hyperparameters and, per parameter name, the
        state keys that :meth:`state_tensors` yields. Collective: call on every rank."""
        self.wait_params()
        return self.state_io.meta()

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``("<name>.<state>", full logical tensor)`` one at a time. Collective: every
        rank must consume it all."""
        self.wait_params()
        return self.state_io.tensors()

    def load_state_tensors(self, meta: dict[str, Any], get: Callable[[str], torch.Tensor]) -> None:
        """Load from ``meta`` and ``get(key) -> full tensor``, one tensor at a time, at any
        dp and tp size. Also writes the masters into the model. No collective: a caller whose
        ranks may fail differently (a rank-local read error) agrees on the outcome itself."""
        self.wait_params()
        self.state_io.load(meta, get)
        if self.host is not None:  # its worker's handle on the optimizer reads the new state
            self.host.end_step()
