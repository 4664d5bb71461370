"""Data: the built-in synthetic robot task, the on-disk episode format, and the loader.

Everything here produces *raw* samples ``{"image": (H, W, 3) uint8, "instruction": str,
"action": (7,) float32}`` plus OpenVLA-style ``norm_stats``; the model side tokenises and
preprocesses them.
"""

from parallax.data.collate import collate
from parallax.data.episodes import Episode, EpisodeDataset, Sample, write_dataset
from parallax.data.loader import BatchLoader, Dataset, check_batch_sizes, load_dataset
from parallax.data.stats import DatasetError, compute_statistics
from parallax.data.synthetic import SyntheticConfig, SyntheticTask

__all__ = [
    "BatchLoader",
    "Dataset",
    "DatasetError",
    "Episode",
    "EpisodeDataset",
    "Sample",
    "SyntheticConfig",
    "SyntheticTask",
    "check_batch_sizes",
    "collate",
    "compute_statistics",
    "load_dataset",
    "write_dataset",
]
