"""ZeRO 1, 2 and 3 (:class:`ZeroOptimizer`) and the parts it is made of, each given what it reads.

- :mod:`~parallax.optim.zero.stage`: what stage 1, 2 or 3 means (:class:`ZeroStage`): where the
  gradients live, which reducer, how the weights are held, and what an element costs in bytes
  (the planner counts with the same terms).
- :mod:`~parallax.optim.zero.buffers`: the layout of parameters in buckets and flat buffers
  (``packing``: pure arithmetic the planner also uses; ``homes``: where each bucket's reduced
  gradient lives; ``flat_buffers``: the tensors on one rank).
- :mod:`~parallax.optim.zero.reduction`: gradients arriving (``arrivals``) and their reduction
  over dp, bucketed once per step (``bucket_reducer``, stage 1) or every backward pass
  (``pass_reducer``, stages 2 and 3).
- :mod:`~parallax.optim.zero.weights`: the weights outside the step: ZeRO-3's units, shards and
  gathers around each use, and the deferred all-gathers of stages 1 and 2.
- :mod:`~parallax.optim.zero.offload`: ``--offload optimizer``: the host's steps, its gradient
  accumulators, its kernels, the upload ring and which buckets go there.
- :mod:`~parallax.optim.zero.norms`: the global gradient norm, clipping and the scales a step owes.
- :mod:`~parallax.optim.zero.bucketwise`: stepping the wrapped optimizer one bucket at a time.
- :mod:`~parallax.optim.zero.state_io`: the state as layout-free logical tensors (``STATE_FORMAT``).
- :mod:`~parallax.optim.zero.memory_report`: what a rank holds, measured from the tensors.
- :mod:`~parallax.optim.zero.arguments` and :mod:`~parallax.optim.zero.plane`: the arguments
  checked, then agreed on by the stage's dp x tp plane.
- :mod:`~parallax.optim.zero.torch_contract`: the ``torch.optim.Optimizer`` face and everything
  relied on beyond torch's documented API.
- :mod:`~parallax.optim.zero.assembly` and :mod:`~parallax.optim.zero.optimizer`: the parts put
  together, and the step that asks them; :mod:`~parallax.optim.zero.weights_and_state`: the
  weights and the state as checkpoints, exports and evaluation read them.
"""

from parallax.optim.zero.memory_report import MemoryReport
from parallax.optim.zero.optimizer import ZeroOptimizer
from parallax.optim.zero.stage import ZeroStage, stage_of
from parallax.optim.zero.state_io import FORMAT as STATE_FORMAT

__all__ = ["STATE_FORMAT", "MemoryReport", "ZeroOptimizer", "ZeroStage", "stage_of"]
