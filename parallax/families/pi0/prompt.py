"""pi0's prompts: the text the prefix reads, and a built-in tokenizer for models without one.

pi0: the task followed by a newline. pi0.5: the state goes into the prompt, each normalised
value cut into 256 bins over [-1, 1] (``digitize(s, linspace(-1, 1, 257)) - 1``):
``Task: <task>, State: <b1> <b2> ...;\\nAction: ``. The PaliGemma tokenizer adds BOS; prompts
are right-padded (or cut) to the model's ``text_length``. The built-in :class:`ByteTokenizer`
(UTF-8 bytes, for the tiny presets and tests) stands in when no tokenizer files are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from parallax.models.tokenizer import FileTokenizer

STATE_BINS = 256


class ByteTokenizer:
    """UTF-8 bytes as ids ``3 + byte``; 0 pad, 1 EOS, 2 BOS (a vocabulary of 259 or more)."""

    pad_id, eos_id, bos_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [3 + b for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if add_bos else ids


class PaliGemmaTokenizer(FileTokenizer):
    """The PaliGemma (Gemma) tokenizer of a folder (:class:`~parallax.models.tokenizer.
    FileTokenizer`: ``tokenizer.json`` or ``tokenizer.model``); BOS 2, EOS 1, pad 0 (Gemma's
    ids), BOS added here as LeRobot's processor adds it."""

    pad_id, eos_id, bos_id = 0, 1, 2


def find_tokenizer(path: str | Path | None, model_folder: str | Path | None = None):
    """``--tokenizer``'s folder, else the model folder's own tokenizer files, else the built-in
    :class:`ByteTokenizer`."""
    for folder in (path, model_folder):
        if folder is None:
            continue
        files = [Path(folder) / f for f in ("tokenizer.json", "tokenizer.model")]
        if any(f.is_file() for f in files) or folder is path:
            return PaliGemmaTokenizer(folder)
    return ByteTokenizer()


def state_bins(state) -> np.ndarray:
    """Normalised state values -> their bins 0 .. 255 (pi0.5's discretisation)."""
    edges = np.linspace(-1, 1, STATE_BINS + 1)
    return np.digitize(np.asarray(state, dtype=np.float64), edges[:-1]) - 1


def prompt_text(task: str, state=None, pi05: bool = False) -> str:
    """The prompt of ``task`` (pi0.5: with its discretised ``state``)."""
    task = task.strip().replace("_", " ")
    if not pi05:
        return task + "\n"
    if state is None:
        raise ValueError("pi0.5's prompt holds the state: give the state")
    bins = " ".join(str(int(b)) for b in state_bins(state))
    return f"Task: {task}, State: {bins};\nAction: "


def padded_ids(ids: Sequence[Sequence[int]], length: int, pad: int):
    """``(tokens, token_mask)`` ``(b, length)``: each right-padded or cut to ``length``."""
    tokens = torch.full((len(ids), length), pad, dtype=torch.long)  # (b, L)
    mask = torch.zeros((len(ids), length), dtype=torch.bool)  # (b, L)
    for row, i in enumerate(ids):
        i = list(i)[:length]
        tokens[row, : len(i)] = torch.tensor(i, dtype=torch.long)
        mask[row, : len(i)] = True
    return tokens, mask
