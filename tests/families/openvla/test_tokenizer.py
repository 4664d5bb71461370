"""The checkpoint tokenizer path (optional `tokenizers` package) on a small Llama-style file."""

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the optional tokenizers extra is absent")

from parallax.families.openvla.action_tokenizer import ActionTokenizer  # noqa: E402
from parallax.families.openvla.prompt import get_tokenizer, prompt_ids, training_example  # noqa: E402
from parallax.models.tokenizer import HFTokenizer  # noqa: E402


def _write_llama_like(path, size: int = 600) -> dict[str, int]:
    """A WordLevel tokenizer with SentencePiece-style "▁" pieces and Llama's special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [
        "in:",
        "what",
        "action",
        "should",
        "the",
        "robot",
        "take",
        "to",
        "pick",
        "up",
        "red",
        "cube?",
        "out:",
    ]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for w in words:
        vocab["▁" + w] = len(vocab)
    while len(vocab) < size:
        vocab[f"<filler{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(["<PAD>"])
    tok.save(str(path / "tokenizer.json"))
    return vocab


def test_hf_tokenizer_reads_tokenizer_json(tmp_path):
    vocab = _write_llama_like(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.vocab_size == len(vocab) and tok.pad_id == len(vocab)  # <PAD> comes after
    assert tok.action_space_id == 3
    ids = tok.encode("in: what action should the robot take to pick up the red cube?")
    assert ids[0] == 1 and 0 not in ids  # BOS added once, every word known
    assert (
        tok.decode(ids[1:]).strip() == "in: what action should the robot take to pick up "
        "the red cube?"
    )
    prompt = prompt_ids(tok, "pick up the red cube")
    assert prompt[0] == 1 and prompt[-1] == 3  # ... "Out:" then the "▁" before the actions


def test_training_example_with_the_checkpoint_tokenizer(tmp_path):
    _write_llama_like(tmp_path)
    tok = HFTokenizer(tmp_path)
    actions = ActionTokenizer(tok.vocab_size)
    ids, labels = training_example(tok, actions, "Pick up the red cube", [-1, 0, 1, 0, 0, 0, 1])
    assert ids[-1] == tok.eos_id and labels[-8:] == ids[-8:]  # 7 action tokens and EOS
    assert all(label == -100 for label in labels[:-8])
    assert ids[-8] == tok.vocab_size - 1  # -1 -> bin 1 -> the last id of the text vocabulary


def test_get_tokenizer_falls_back_without_a_file(tmp_path):
    from parallax.families.openvla.config import OpenVLAConfig

    config = OpenVLAConfig.preset("openvla-7b")
    assert get_tokenizer(config, tmp_path) is None  # no tokenizer.json or .model there
