"""OpenVLA's prompt and label layout, and the tiny preset's character tokenizer.

The tokenizers share the surface :mod:`parallax.models.tokenizer` describes. The checkpoint's
own tokenizer needs the optional ``tokenizers`` or ``sentencepiece`` package; without one,
callers pass token ids. The tiny preset has a built-in character tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from parallax.families.openvla.action_tokenizer import ActionTokenizer
from parallax.models.tokenizer import IGNORE_INDEX, HFTokenizer

PROMPT = "In: What action should the robot take to {instruction}?\nOut:"


class TinyTokenizer:
    """Character-level stand-in for the Llama-2 tokenizer, with the same id scheme.

    Text vocabulary 512 (the analogue of 32000): 0 unk, 1 bos, 2 eos, 3 the "▁" before the
    actions, printable ASCII and newline at their code points, and ids 256..511 free for the 256
    action bins (``512 - bin``). The pad token is 512 and the embedding has 576 rows (padded to a
    multiple of 64), as OpenVLA has 32000 / 32064.
    """

    vocab_size = 512
    unk_id, bos_id, eos_id, action_space_id = 0, 1, 2, 3
    pad_id = 512

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [ord(c) if (32 <= ord(c) < 127 or c == "\n") else self.unk_id for c in text]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if 32 <= i < 127 or i == 10:
                out.append(chr(i))
            elif i == self.action_space_id:
                out.append(" ")
            elif 256 <= i < self.vocab_size:
                out.append(f"<a{self.vocab_size - i}>")
        return "".join(out)


def get_tokenizer(config, path: str | Path | None = None):
    """The tokenizer for ``config``: built in for ``tiny``, else the checkpoint's own (needs an
    optional package and the checkpoint directory); ``None`` when neither is available."""
    if config.tokenizer == "tiny":
        return TinyTokenizer()
    path = path or config.source
    if path is None:
        return None
    try:
        return HFTokenizer(path)
    except (ImportError, FileNotFoundError):
        return None


def build_prompt(instruction: str) -> str:
    return PROMPT.format(instruction=instruction)


def prompt_ids(tokenizer, instruction: str) -> list[int]:
    """``[bos] + prompt + [▁]``: what the model sees before it writes the action tokens."""
    ids = tokenizer.encode(build_prompt(instruction), add_bos=True)
    if ids[-1] != tokenizer.action_space_id:
        ids.append(tokenizer.action_space_id)
    return ids


def training_example(
    tokenizer, action_tokenizer: ActionTokenizer, instruction: str, normalized_action
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one training sample, as OpenVLA builds it: the instruction is
    lower-cased, and only the action tokens and the closing EOS carry labels."""
    action_ids = action_tokenizer.encode(np.asarray(normalized_action)).tolist()
    ids = prompt_ids(tokenizer, instruction.lower()) + action_ids + [tokenizer.eos_id]
    n_label = len(action_ids) + 1
    labels = [IGNORE_INDEX] * (len(ids) - n_label) + ids[-n_label:]
    return ids, labels
