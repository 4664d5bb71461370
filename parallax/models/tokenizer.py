"""The Llama tokenizer of a Hugging Face checkpoint, and the label id that the losses ignore.

Every tokenizer parallax uses exposes the same small surface: ``vocab_size`` (the text vocabulary
that OpenVLA's action ids count down from), ``bos_id``, ``eos_id``, ``pad_id``,
``action_space_id`` (the SentencePiece "▁", 29871 for Llama-2), ``encode`` and ``decode``. The
checkpoint's own tokenizer needs the optional ``tokenizers`` or ``sentencepiece`` package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

IGNORE_INDEX = -100  # the label of positions that carry no loss


class FileTokenizer:
    """A folder's tokenizer through ``tokenizers`` (tokenizer.json) or ``sentencepiece``
    (tokenizer.model), whichever is there and installed; ``encode`` adds BOS itself (not the
    file's post-processor), so both back ends give ``[bos] + pieces``. Subclasses set the ids."""

    bos_id: int

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self._tok = self._sp = None
        try:
            from tokenizers import Tokenizer  # optional dependency (the tokenizers extra)

            if (path / "tokenizer.json").is_file():
                self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except ImportError:
            pass
        if self._tok is None:
            try:
                import sentencepiece  # optional dependency, the other back end
            except ImportError as err:
                raise ImportError(
                    "reading the checkpoint's tokenizer needs the optional 'tokenizers' or "
                    "'sentencepiece' package (pip install -e '.[tokenizers]'); without it, "
                    "pass token ids"
                ) from err
            if not (path / "tokenizer.model").is_file():
                raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")
            self._sp = sentencepiece.SentencePieceProcessor(
                model_file=str(path / "tokenizer.model")
            )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self._tok is not None:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        return self._tok.decode(ids) if self._tok is not None else self._sp.decode(ids)


class HFTokenizer(FileTokenizer):
    """The checkpoint's Llama tokenizer (:class:`FileTokenizer`): BOS 1, EOS 2, the pad and
    "▁" ids from the file."""

    bos_id, eos_id = 1, 2

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        if self._tok is not None:
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)
            self.action_space_id = self._tok.token_to_id("▁")
            pad = self._tok.token_to_id("<PAD>")
        else:
            self.vocab_size = self._sp.get_piece_size()
            self.action_space_id = self._sp.piece_to_id("▁")
            pad = None
        self.pad_id = self.vocab_size if pad is None else pad
