"""LLaVA's ``vicuna_v1`` prompt, its label masking, and the tokenizers LLaVA-NeXT uses.

The prompt (``conv_vicuna_v1``: separators " " and "</s>") is::

    {system} USER: <image>\\n{q1} ASSISTANT: {a1}</s>USER: {q2} ASSISTANT: {a2}</s>

``vicuna_v1`` is the training template (system: "A chat between a curious user and ..."), and
``llava_v1`` the one LLaVA's inference picks for v1.6-vicuna ("... curious human ..."). Only the
answers and their closing ``</s>`` are supervised; BOS, the system text, the questions, each
"ASSISTANT:" and the image tokens carry ``-100``, as LLaVA's ``preprocess_v1`` masks them.

The ids are built piece by piece (the text before and after ``<image>``, each answer, each
``</s>``), so the mask is exact by construction instead of LLaVA's re-tokenised length counts.
A piece is encoded on its own, as LLaVA's legacy Llama tokenizer does around ``<image>`` and
``</s>``: SentencePiece-style tokenizers give it a word-start "▁", so the space that separates an
answer from "ASSISTANT:" is dropped there (it is the answer's "▁"); the character tokenizer keeps
it as a supervised space.

``system`` replaces the template's system text (``""``: none, the prompt starts at "USER:"); a
tiny model learns a task several times faster without 40 words of preamble to attend past.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from parallax.families.llava_next.conversations import IMAGE_TAG
from parallax.models.tokenizer import IGNORE_INDEX, HFTokenizer

SYSTEMS = {
    "vicuna_v1": (
        "A chat between a curious user and an artificial intelligence assistant. The assistant "
        "gives helpful, detailed, and polite answers to the user's questions."
    ),
    "llava_v1": (
        "A chat between a curious human and an artificial intelligence assistant. The assistant "
        "gives helpful, detailed, and polite answers to the human's questions."
    ),
}
USER, ASSISTANT = "USER", "ASSISTANT"


class LlavaTinyTokenizer:
    """Character tokenizer of ``llava-tiny``, with Llama's id scheme: 0 unk, 1 ``<s>``, 2 ``</s>``,
    newline and printable ASCII at their code points, 128 ids in all (the analogue of 32000);
    ``<image>`` (128) and ``<pad>`` (129) come from the model config."""

    vocab_size = 128
    unk_id, bos_id, eos_id = 0, 1, 2
    adds_prefix_space = False

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [ord(c) if (32 <= ord(c) < 127 or c == "\n") else self.unk_id for c in text]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(int(i)) for i in ids if 32 <= int(i) < 127 or int(i) == 10)


def llava_tokenizer(config, path: str | Path | None = None, required: bool = False):
    """The tokenizer for ``config``: built in for ``llava-tiny``, else the checkpoint's own
    (``tokenizer.json`` through ``tokenizers`` or ``tokenizer.model`` through ``sentencepiece``,
    the optional tokenizer extra). ``None`` when unavailable, unless ``required``."""
    if config.tokenizer == "tiny":
        return LlavaTinyTokenizer()
    path = path or config.source
    if path is None:
        if required:
            raise ValueError(
                "this LLaVA-NeXT model has no checkpoint directory to read its tokenizer from; "
                "pass a tokenizer (or token ids)"
            )
        return None
    try:
        return HFTokenizer(path)
    except (ImportError, FileNotFoundError):
        if required:
            raise
        return None


def _head(template: str, system: str | None) -> str:
    if template not in SYSTEMS:
        raise ValueError(f"unknown template {template!r}; choose one of {sorted(SYSTEMS)}")
    text = SYSTEMS[template] if system is None else system
    return text + " " if text else ""


def _encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "adds_prefix_space", True) and text.startswith(" "):
        text = text[1:]  # the tokenizer's own word-start marker stands for this space
    return list(tokenizer.encode(text, add_bos=False)) if text else []


def _add(ids: list, labels: list, piece: list[int], supervised: bool) -> None:
    ids.extend(piece)
    labels.extend(piece if supervised else [IGNORE_INDEX] * len(piece))


def _add_text(ids, labels, tokenizer, text: str, image: list[int]) -> None:
    """Unsupervised text with the image tokens where ``<image>`` stands."""
    parts = text.split(IMAGE_TAG)
    for k, part in enumerate(parts):
        if k:
            _add(ids, labels, image, False)
        _add(ids, labels, _encode(tokenizer, part), False)


def encode_conversation(
    turns: Sequence[tuple[str, str]],
    tokenizer,
    *,
    image_tokens: int = 0,
    image_token_id: int = -1,
    template: str = "vicuna_v1",
    system: str | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of rounds ``[(question, answer), ...]``; the ``<image>`` tag in a
    question becomes ``image_tokens`` copies of ``image_token_id``."""
    image = [image_token_id] * image_tokens
    ids, labels = [tokenizer.bos_id], [IGNORE_INDEX]
    head = _head(template, system)
    for question, answer in turns:
        _add_text(ids, labels, tokenizer, f"{head}{USER}: {question} {ASSISTANT}:", image)
        _add(ids, labels, _encode(tokenizer, " " + answer), True)
        _add(ids, labels, [tokenizer.eos_id], True)
        head = ""  # the next round follows "</s>" directly
    return ids, labels


def prompt_ids(
    question: str,
    tokenizer,
    *,
    image_tokens: int = 0,
    image_token_id: int = -1,
    template: str = "llava_v1",
    system: str | None = None,
    history: Sequence[tuple[str, str]] = (),
) -> list[int]:
    """The ids a model sees before it writes the answer to ``question`` (after ``history``)."""
    ids, labels = encode_conversation(
        history,
        tokenizer,
        image_tokens=image_tokens,
        image_token_id=image_token_id,
        template=template,
        system=system,
    )
    head = "" if history else _head(template, system)
    _add_text(
        ids,
        labels,
        tokenizer,
        f"{head}{USER}: {question} {ASSISTANT}:",
        [image_token_id] * image_tokens,
    )
    return ids
