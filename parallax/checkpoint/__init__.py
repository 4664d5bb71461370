"""Layout-free checkpoints: full logical tensors in safetensors shards plus JSON metadata.

Saving (any layout)::

    from parallax.checkpoint import TensorSource, save_checkpoint
    save_checkpoint("out/checkpoints", step, sources, meta, group=ctx.world_group, keep_last=3)

Loading (any other layout)::

    from parallax.checkpoint import Checkpoint, latest_checkpoint
    ckpt = Checkpoint(latest_checkpoint("out/checkpoints"))   # validates everything up front
    ckpt.require(expected_names)
    full = ckpt.get("layers.0.mlp.up.weight")
    mine = ckpt.shard("layers.0.mlp.up.weight", dim=0, rank=ctx.tp_rank, world=ctx.tp_size)

Every read verifies the checksums of the bytes it reads (only a slice's, for a slice); wrap a
rank's reads in ``read_agreed(group, fn)`` so that every rank raises the same error or none.

See :mod:`parallax.checkpoint.store` for the directory layout.
"""

from parallax.checkpoint.checksum import Chunking
from parallax.checkpoint.distributed import read_agreed, save_checkpoint
from parallax.checkpoint.modules import load_module, module_sources
from parallax.checkpoint.reader import Checkpoint
from parallax.checkpoint.rng import rng_state, set_rng_state
from parallax.checkpoint.store import (
    begin_checkpoint,
    commit_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    remove_checkpoints,
    staging_dir,
    step_dir,
    write_shard,
)
from parallax.checkpoint.stream import (
    CheckpointError,
    TensorSource,
    read_header,
    sources,
    write_safetensors,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Chunking",
    "TensorSource",
    "begin_checkpoint",
    "commit_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_module",
    "module_sources",
    "prune_checkpoints",
    "read_agreed",
    "read_header",
    "remove_checkpoints",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "sources",
    "staging_dir",
    "step_dir",
    "write_safetensors",
    "write_shard",
]
