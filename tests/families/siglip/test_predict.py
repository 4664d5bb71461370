"""Zero-shot accuracy and retrieval recall: against a direct count at one process, and the same
numbers at dp 2 (each rank holding half of the held-out split)."""

import torch
import torch.nn.functional as F

from parallax.families.siglip.config import SiglipConfig
from parallax.families.siglip.model import Siglip
from parallax.families.siglip.predict import (
    class_embeddings,
    retrieval_recall,
    zero_shot_accuracy,
)
from parallax.testing import context, run_ranks


def _split(n=12, d=6, classes=5):
    g = torch.Generator().manual_seed(5)
    img = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    txt = F.normalize(img + 0.9 * torch.randn(n, d, generator=g), dim=-1)
    cls = F.normalize(torch.randn(classes, d, generator=g), dim=-1)
    labels = torch.randint(0, classes, (n,), generator=g)
    return img, txt, cls, labels


def _direct_recall(img, txt, k):
    sims = img @ txt.T
    i2t = sum(i in sims[i].topk(k).indices.tolist() for i in range(len(img))) / len(img)
    t2i = sum(i in sims.T[i].topk(k).indices.tolist() for i in range(len(img))) / len(img)
    return i2t, t2i


def test_against_direct_counts():
    img, txt, cls, labels = _split()
    rec = retrieval_recall(img, txt, ks=(1, 5))
    for k in (1, 5):
        i2t, t2i = _direct_recall(img, txt, k)
        assert abs(rec[f"image_to_text_r@{k}"] - i2t) < 1e-6
        assert abs(rec[f"text_to_image_r@{k}"] - t2i) < 1e-6
    acc = zero_shot_accuracy(img, labels, cls, ks=(1, 2))
    top = (img @ cls.T).topk(2).indices
    assert acc["zero_shot_top1"] == (top[:, 0] == labels).float().mean().item()
    assert acc["zero_shot_top2"] == (top == labels[:, None]).any(1).float().mean().item()


def _dp2_case():
    ctx = context(dp=2)
    img, txt, cls, labels = _split()
    mine = slice(ctx.dp_rank * 6, (ctx.dp_rank + 1) * 6)
    return (
        retrieval_recall(img[mine], txt[mine], ctx),
        zero_shot_accuracy(img[mine], labels[mine], cls, ctx),
    )


def test_dp2_equals_one_process():
    img, txt, cls, labels = _split()
    want = (retrieval_recall(img, txt), zero_shot_accuracy(img, labels, cls))
    for got in run_ranks(_dp2_case, 2):
        assert got == want


def test_class_embeddings_are_normalised_prompt_means():
    model = Siglip(SiglipConfig.preset("siglip-tiny"), seed=0)
    emb = class_embeddings(model, ["red circle", "blue square"], ("a {}", "{} here"))
    assert emb.shape == (2, 64)
    from parallax.families.siglip.inputs import tokenize

    ids, _ = tokenize(model.tokenizer, ["a red circle", "red circle here"], 40)
    with torch.no_grad():
        want = F.normalize(model.encode_text(ids).mean(0), dim=-1)
    assert torch.allclose(emb[0], want, atol=1e-6)
