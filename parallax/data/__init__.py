"""Data: the built-in synthetic robot task, the on-disk episode format, and the loader; the
LLaVA conversation format, a synthetic visual question task and length-grouped batching.

Everything here produces *raw* samples ``{"image": (H, W, 3) uint8, "instruction": str,
"action": (7,) float32}`` plus OpenVLA-style ``norm_stats``; the model side tokenises and
preprocesses them.
"""

from parallax.data.collate import collate
from parallax.data.episodes import Episode, EpisodeDataset, Sample, write_dataset
from parallax.data.length_grouped import (
    LengthGroupedLoader,
    length_grouped_order,
    padding_fraction,
)
from parallax.data.llava_format import LlavaConversationDataset, conversation_turns
from parallax.data.loader import BatchLoader, Dataset, check_batch_sizes, load_dataset
from parallax.data.stats import DatasetError, compute_statistics
from parallax.data.synthetic import SyntheticConfig, SyntheticTask
from parallax.data.vqa_synthetic import SyntheticVQA, VQAConfig

__all__ = [
    "BatchLoader",
    "Dataset",
    "DatasetError",
    "Episode",
    "EpisodeDataset",
    "LengthGroupedLoader",
    "LlavaConversationDataset",
    "Sample",
    "SyntheticConfig",
    "SyntheticTask",
    "SyntheticVQA",
    "VQAConfig",
    "check_batch_sizes",
    "collate",
    "compute_statistics",
    "conversation_turns",
    "length_grouped_order",
    "padding_fraction",
    "load_dataset",
    "write_dataset",
]
