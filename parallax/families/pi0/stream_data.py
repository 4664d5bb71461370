"""pi0's robot data streamed: LeRobot, LIBERO and RLDS datasets, one or a weighted mixture
(``--data lerobot:A@0.7,libero:B@0.3`` or a ``[[data]]`` list, :mod:`parallax.data.mixture`),
through the streaming loader OpenVLA trains with (:class:`~parallax.data.StreamLoader`:
workers, one seeded global order, mixtures by weight, resumable exactly).

Each sample is pi0's (:func:`~.robot_data.pi0_sample`, run in the loader's workers): the
cameras in the model's slots, the state, a chunk of ``H`` actions with its pad mask (every step
of an episode a sample, LeRobot's rule), the instruction; frames stay as stored (uint8, any
size) and are resized with padding by the collator (:mod:`.batches`); pi0 does not augment.

The flow-matching noise and time of a sample are keyed by its **global stream position**
(``sample["position"]``, what the stream already keys augmentation by): the stream is a pure
function of the seed, a step's positions are the same at every dp split and worker count (dp
rank ``r`` takes the ``r``-th contiguous share of them), and a resume continues at the saved
position; so the draws are the same whatever the layout and after a resume, and a sample the
order serves twice (a later epoch, a small dataset oversampled) draws afresh each time.

Each dataset is normalised by its own statistics (or all by ``--model FOLDER``'s processor
statistics); the mixture's datasets must give the same action width (one microbatch, one
loss over ``D`` dims). The exported processor files hold the first dataset's statistics (by
name; LeRobot's processors hold one set); ``dataset_statistics.json`` holds every dataset's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.data.keys import load_key_configs
from parallax.data.mixture import Mixture, load_mixture
from parallax.data.stats import DatasetError
from parallax.data.stream import StreamLoader
from parallax.data.workers import auto_workers
from parallax.families.pi0.config import Pi0Config
from parallax.families.pi0.robot_data import check_source, data_specs, pi0_sample, run_statistics
from parallax.recipe import batch_args
from parallax.run import Run


@dataclass
class Pi0Stream:
    """Robot datasets opened for streaming, and what each is normalised by (name -> the
    ``norm_stats`` entry)."""

    mixture: Mixture
    statistics: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return self.mixture.names


def robot_stream(data: str | list, run: Run) -> Pi0Stream:
    """Every dataset of ``--data`` opened and scanned (the scan kept in ``OUT/data_index``),
    checked for pi0 (module doc)."""
    config: Pi0Config = run.model_config
    specs = data_specs(data, run, config)
    user = load_key_configs(run.data_config) if run.data_config else None
    index = Path(run.out) / "data_index"
    mixture = load_mixture(specs, user_configs=user, seed=run.seed, cache_dir=index)
    for source in mixture.sources:
        check_source(source, config)
    widths = {s.name: int(s.action_dim) for s in mixture.sources}
    if len(set(widths.values())) > 1:
        raise DatasetError(
            f"the mixture's datasets have different action widths {widths}: one pi0 run "
            "trains on one width (select the same action keys with --data-config)"
        )
    return Pi0Stream(mixture, run_statistics(mixture.statistics, run))


def stream_loader(data: Pi0Stream, run: Run, ctx) -> StreamLoader:
    """This rank's streaming loader of pi0 samples (module doc)."""
    return StreamLoader(
        data.mixture,
        **batch_args(run, ctx),
        images="none",
        chunk=run.model_config.chunk,
        pad_chunks=True,
        sampler=pi0_sample,
        workers=auto_workers() if run.workers is None else run.workers,
    )
