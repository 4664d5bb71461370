"""llava-tiny learns the synthetic visual question task in a few dozen steps on one process, and
answers by greedy generation with the KV cache."""

import torch

from parallax.families.llava_next.config import LlavaNextConfig
from parallax.families.llava_next.model import LlavaNext
from parallax.families.llava_next.predict import answer
from parallax.families.llava_next.processor import LlavaNextProcessor
from parallax.families.llava_next.synthetic import SyntheticVQA


def _accuracy(model, batch):
    with torch.no_grad():
        logits = model(batch["pixel_values"], batch["input_ids"], batch["image_sizes"])
        m = model.metrics(logits, batch["labels"])
    return m["answers_correct"].item() / m["answers"].item()


def test_tiny_model_learns_the_colour_of_the_square():
    torch.manual_seed(0)
    cfg = LlavaNextConfig.preset("llava-tiny")
    model = LlavaNext(cfg, seed=0)
    proc = LlavaNextProcessor(cfg, system="A chat.")
    train = SyntheticVQA(num_samples=960, seed=0)
    held_out = SyntheticVQA(num_samples=48, seed=1, text_only_fraction=0.0)  # image questions
    evaluation = proc([held_out[i] for i in range(len(held_out))])
    before = _accuracy(model, evaluation)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(60):
        batch = proc([train[step * 16 + i] for i in range(16)])
        loss = model.loss(
            model(batch["pixel_values"], batch["input_ids"], batch["image_sizes"]), batch["labels"]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _accuracy(model, evaluation)
    assert before < 0.1 and after > 0.7, (before, after)  # chance is 0.25
    said = [
        answer(model, proc, held_out[i]["image"], "What colour is the square?", 8)
        for i in range(12)
    ]
    right = sum(s == held_out[i]["answer"] for i, s in enumerate(said))
    assert right >= 8, said
