"""The vicuna_v1 template and LLaVA's label masking on hand-written conversations, and the
processor's checks on bad samples."""

import pytest
import torch

from parallax.data import DatasetError
from parallax.families.llava_next.processor import LlavaNextProcessor
from parallax.families.llava_next.template import LlavaTinyTokenizer, encode_conversation
from tests.families.llava_next.helpers import tiny_config

SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions."
)


def _chars(text):
    return [ord(c) for c in text]


def _sample(image, *turns):
    conv = []
    for q, a in zip(turns[0::2], turns[1::2]):
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return {"id": "s1", "image": image, "conversations": conv}


def test_two_round_conversation_ids_and_masks():
    cfg = tiny_config()
    proc = LlavaNextProcessor(cfg)
    image = torch.zeros(30, 40, 3, dtype=torch.uint8)  # 24 image tokens
    # the tag is moved to the start of its turn, followed by a newline
    sample = _sample(image, "Hi?\n<image>", "Yo", "And?", "No")
    enc = proc.encode(sample)
    prompt1 = _chars(SYSTEM + " USER: ") + [128] * 24 + _chars("\nHi? ASSISTANT:")
    answer1 = _chars(" Yo") + [2]
    prompt2 = _chars("USER: And? ASSISTANT:")
    answer2 = _chars(" No") + [2]
    assert enc["input_ids"] == [1] + prompt1 + answer1 + prompt2 + answer2
    ignore = lambda ids: [-100] * len(ids)  # noqa: E731
    assert enc["labels"] == [-100] + ignore(prompt1) + answer1 + ignore(prompt2) + answer2
    assert enc["image_size"] == (30, 40) and enc["pixel_values"].shape == (5, 3, 28, 28)


def test_text_only_sample_and_batch_padding():
    cfg = tiny_config()
    proc = LlavaNextProcessor(cfg)
    batch = proc(
        [
            _sample(None, "Q", "A"),
            _sample(torch.zeros(60, 20, 3, dtype=torch.uint8), "<image>\nQ", "AB"),
        ]
    )
    short = [1] + _chars(SYSTEM + " USER: Q ASSISTANT:") + _chars(" A") + [2]
    width = batch["input_ids"].shape[1]
    assert width == len(short) + 22 + 2  # the image sample: 22 image tokens, "\n", one more letter
    assert batch["input_ids"][0].tolist() == short + [cfg.pad_token_id] * (width - len(short))
    assert batch["labels"][0, len(short) :].eq(-100).all()
    assert batch["labels"][0, len(short) - 3 :].tolist()[:3] == _chars(" A") + [2]
    assert batch["image_sizes"].tolist() == [[0, 0], [60, 20]]
    assert batch["pixel_values"].shape == (2, 4, 3, 28, 28) and not batch["pixel_values"][0].any()


class _WordStart:
    """A SentencePiece-like stand-in: records what it is asked to encode."""

    adds_prefix_space = True
    bos_id, eos_id = 1, 2

    def __init__(self):
        self.seen = []

    def encode(self, text, add_bos=True):
        self.seen.append(text)
        return [10 + len(text)]


def test_word_start_tokenizers_get_answers_without_the_separating_space():
    tok = _WordStart()
    ids, labels = encode_conversation([("Q", "Yes")], tok)
    assert tok.seen == [SYSTEM + " USER: Q ASSISTANT:", "Yes"]
    assert labels == [-100, -100, 13, 2]


def test_bad_samples_fail_naming_the_sample():
    cfg = tiny_config()
    proc = LlavaNextProcessor(cfg)
    img = torch.zeros(30, 40, 3, dtype=torch.uint8)
    with pytest.raises(DatasetError, match="sample 's1': the last question .* has no answer"):
        proc.encode({"id": "s1", "image": None, "conversations": [{"from": "human", "value": "Q"}]})
    with pytest.raises(DatasetError, match="sample 's1': has a <image> tag but no image"):
        proc.encode(_sample(None, "<image>\nQ", "A"))
    with pytest.raises(DatasetError, match="sample 's1': has an image but no <image> tags"):
        proc.encode(_sample(img, "Q", "A"))
    with pytest.raises(DatasetError, match="an empty answer"):
        proc.encode(_sample(None, "Q", " "))
    with pytest.raises(
        ValueError,
        match="sample .s1.: its image of 30x40 gives 24 tokens, which end past the maximum length",
    ):
        LlavaNextProcessor(cfg, max_length=100).encode(_sample(img, "<image>\nQ", "A"))
    cut = LlavaNextProcessor(cfg, max_length=200).encode(_sample(img, "<image>\nQ", "A" * 50))
    assert len(cut["input_ids"]) == len(cut["labels"]) == 200


def test_tiny_tokenizer_round_trip():
    tok = LlavaTinyTokenizer()
    ids = tok.encode("What colour?\nred")
    assert ids[0] == 1 and max(ids) < 128
    assert tok.decode(ids + [2, 128, 129]) == "What colour?\nred"


def test_checkpoint_tokenizer_pieces_equal_whole_string_tokenization(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = (SYSTEM + " USER: Hi there? ASSISTANT: Yes indeed").split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for w in words:
        vocab.setdefault("▁" + w, len(vocab))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="always"
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_config()
    cfg.tokenizer, cfg.source = "llama2", str(tmp_path)
    proc = LlavaNextProcessor(cfg)  # the checkpoint's tokenizer, through `tokenizers`
    enc = proc.encode(_sample(None, "Hi there?", "Yes indeed"))
    whole = tok.encode(
        SYSTEM + " USER: Hi there? ASSISTANT: Yes indeed", add_special_tokens=False
    ).ids
    assert enc["input_ids"] == [1, *whole, 2]
    supervised = [i for i in enc["labels"] if i != -100]
    assert supervised == [vocab["▁Yes"], vocab["▁indeed"], 2]
