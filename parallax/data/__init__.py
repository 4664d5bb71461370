"""Data: the built-in synthetic robot task, the on-disk episode format, and the loader.

Everything here produces *raw* samples ``{"image": (H, W, 3) uint8, "instruction": str,
"action": (7,) float32}`` plus OpenVLA-style ``norm_stats``; the model side tokenises and
preprocesses them. Image-text pairs for the dual encoders (folders, WebDataset tar shards, a
synthetic task) are ``{"image", "caption", "key"}`` samples read through :class:`PairLoader`.
"""

from parallax.data.collate import collate
from parallax.data.episodes import Episode, EpisodeDataset, Sample, write_dataset
from parallax.data.loader import BatchLoader, Dataset, check_batch_sizes, load_dataset
from parallax.data.pair_loader import PairLoader
from parallax.data.pairs import PairFolder, PairSample, PairSource, write_pair_folder
from parallax.data.stats import DatasetError, compute_statistics
from parallax.data.synthetic import SyntheticConfig, SyntheticTask
from parallax.data.synthetic_pairs import SyntheticPairs
from parallax.data.tar_shards import TarShards, write_tar_shards

__all__ = [
    "BatchLoader",
    "Dataset",
    "DatasetError",
    "Episode",
    "EpisodeDataset",
    "PairFolder",
    "PairLoader",
    "PairSample",
    "PairSource",
    "Sample",
    "SyntheticConfig",
    "SyntheticPairs",
    "SyntheticTask",
    "TarShards",
    "check_batch_sizes",
    "collate",
    "compute_statistics",
    "load_dataset",
    "write_dataset",
    "write_pair_folder",
    "write_tar_shards",
]
