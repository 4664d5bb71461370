"""Data: the built-in synthetic robot task, the on-disk episode format, the loaders and
length-grouped batching (a family's own formats, such as LLaVA's conversations, live in its
package).

Everything here produces *raw* samples ``{"image": (H, W, 3) uint8, "instruction": str,
"action": (7,) float32}`` plus OpenVLA-style ``norm_stats``; the model side tokenises and
preprocesses them.

Other projects' robot datasets (RLDS / Open X-Embodiment, LIBERO HDF5, LeRobot) are read in place by
the readers of :mod:`parallax.data.mixture` (optional extras: ``pip install '.[data]'`` in the
checkout) and streamed, mixed and augmented by :class:`StreamLoader`; their samples also carry
``"dataset"`` (the name their statistics are keyed by), ``"episode"`` and ``"step"``. Image-text
pairs for the dual encoders (folders, WebDataset tar shards, a synthetic task) are ``{"image",
"caption", "key"}`` samples read through :class:`PairLoader`.
"""

from parallax.data.augment import AugmentConfig
from parallax.data.collate import collate
from parallax.data.episodes import Episode, EpisodeDataset, Sample, write_dataset
from parallax.data.keys import KeyConfig, load_key_configs
from parallax.data.length_grouped import (
    LengthGroupedLoader,
    length_grouped_order,
    padding_fraction,
)
from parallax.data.loader import BatchLoader, Dataset, check_batch_sizes, load_dataset
from parallax.data.mixture import Mixture, load_mixture, open_source, parse_data_spec
from parallax.data.pair_loader import PairLoader
from parallax.data.pairs import PairFolder, PairSample, PairSource, write_pair_folder
from parallax.data.stats import (
    DatasetError,
    compute_statistics,
    merge_statistics,
    write_statistics,
)
from parallax.data.stream import StreamLoader
from parallax.data.synthetic import SyntheticConfig, SyntheticTask
from parallax.data.synthetic_pairs import SyntheticPairs
from parallax.data.tar_shards import TarShards, write_tar_shards

__all__ = [
    "AugmentConfig",
    "BatchLoader",
    "Dataset",
    "DatasetError",
    "Episode",
    "EpisodeDataset",
    "LengthGroupedLoader",
    "KeyConfig",
    "Mixture",
    "PairFolder",
    "PairLoader",
    "PairSample",
    "PairSource",
    "Sample",
    "StreamLoader",
    "SyntheticConfig",
    "SyntheticPairs",
    "SyntheticTask",
    "TarShards",
    "check_batch_sizes",
    "collate",
    "compute_statistics",
    "length_grouped_order",
    "padding_fraction",
    "load_dataset",
    "load_key_configs",
    "load_mixture",
    "merge_statistics",
    "open_source",
    "parse_data_spec",
    "write_dataset",
    "write_statistics",
    "write_pair_folder",
    "write_tar_shards",
]
