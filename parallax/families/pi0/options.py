"""pi0's own options (``--tokenizer``), declared here and shown by ``--help`` under the family's
group. Only the declarations: importing this module imports no model code."""

from __future__ import annotations

from dataclasses import dataclass

from parallax.run.option import opt

GROUP = "pi0: prompts"


@dataclass(frozen=True)
class Pi0Options:
    """Where the prompt's tokenizer comes from."""

    tokenizer: str | None = opt(
        None,
        "a folder with the PaliGemma tokenizer (tokenizer.model for sentencepiece, or "
        "tokenizer.json for tokenizers); default: a model folder's own, else the built-in "
        "byte tokenizer (the tiny presets)",
        GROUP,
    )
