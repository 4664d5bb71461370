"""The LLaVA conversation format (JSON and JSONL with an image folder), its checks, and the
length-grouped order."""

import json

import numpy as np
import pytest
import torch

from parallax.data import (
    BatchLoader,
    DatasetError,
    LengthGroupedLoader,
    length_grouped_order,
    padding_fraction,
)
from parallax.families.llava_next.conversations import LlavaConversationDataset
from parallax.families.llava_next.synthetic import SyntheticVQA


def _write(tmp_path, records, suffix=".json"):
    from PIL import Image

    (tmp_path / "img").mkdir(exist_ok=True)
    Image.fromarray(np.full((30, 40, 3), 200, dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    else:
        path.write_text(json.dumps(records))
    return path


def _rec(i, image=None, q="<image>\nWhat?", a="This."):
    r = {
        "id": f"s{i}",
        "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
    }
    if image:
        r["image"] = image
    return r


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_reads_samples_with_and_without_images(tmp_path, suffix):
    path = _write(tmp_path, [_rec(0, "a.png"), _rec(1, q="Hello?")], suffix)
    ds = LlavaConversationDataset(path, tmp_path / "img")
    assert len(ds) == 2 and ds.name == "data"
    s = ds[0]
    assert s["id"] == "s0" and s["image"].shape == (30, 40, 3) and s["image"].dtype == torch.uint8
    assert ds[1]["image"] is None and ds.image_size(1) is None
    assert ds.image_size(0) == (30, 40)
    assert ds.meta(0) == {"id": "s0", "image_size": (30, 40), "conversations": s["conversations"]}


@pytest.mark.parametrize(
    "record, message",
    [
        (_rec(0, "b.png"), "sample 's0': image .*b.png does not exist"),
        (_rec(0, "a.png", q="What?"), "sample 's0': has an image but no <image> tags"),
        (_rec(0), "sample 's0': has a <image> tag but no image"),
        (_rec(0, "a.png", q="<image> <image>"), "sample 's0': has an image but 2 <image> tags"),
        (
            {
                "id": "s0",
                "image": "a.png",
                "conversations": [{"from": "human", "value": "<image>"}],
            },
            "sample 's0': the last question .* has no answer",
        ),
        (
            {"id": "s0", "conversations": [{"from": "gpt", "value": "x"}]},
            "turn 0 is from 'gpt', expected 'human'",
        ),
        ({"id": "s0", "conversations": []}, "non-empty list of turns"),
    ],
)
def test_bad_samples_fail_when_opened(tmp_path, record, message):
    path = _write(tmp_path, [_rec(9, "a.png"), record])
    with pytest.raises(DatasetError, match=message):
        LlavaConversationDataset(path, tmp_path / "img")


def test_length_grouped_order_keeps_each_global_batch_and_groups_it():
    rng = np.random.default_rng(0)
    n, g, m = 203, 32, 4
    images = [bool(x) for x in rng.random(n) < 0.8]
    lengths = [int(rng.integers(900, 3000)) if im else int(rng.integers(50, 400)) for im in images]
    perm = BatchLoader(list(range(n)), global_batch_size=g, micro_batch_size=m, seed=5).order(3)
    for dp in (1, 2, 4):
        order = length_grouped_order(
            lengths,
            global_batch_size=g,
            micro_batch_size=m,
            dp_size=dp,
            seed=5,
            epoch=3,
            has_image=images,
        )
        assert sorted(order.tolist()) == list(range(n))
        again = length_grouped_order(
            lengths,
            global_batch_size=g,
            micro_batch_size=m,
            dp_size=dp,
            seed=5,
            epoch=3,
            has_image=images,
        )
        assert torch.equal(order, again)
        for k in range(0, n - n % g, g):  # the same samples in each step, at every dp
            assert set(order[k : k + g].tolist()) == set(perm[k : k + g].tolist())
        mbs = [order[k : k + m].tolist() for k in range(0, n - n % g, m)]
        random = [perm[k : k + m].tolist() for k in range(0, n - n % g, m)]
        assert padding_fraction(lengths, mbs) < 0.5 * padding_fraction(lengths, random)
        mixed = sum(len({images[i] for i in mb}) > 1 for mb in mbs)
        assert mixed <= (n // g)  # at most the one microbatch per step where the kinds meet
        if dp > 1:  # ranks get about the same padded tokens per step
            per_rank = g // dp
            for k in range(0, n - n % g, g):
                costs = []
                for r in range(dp):
                    rank = order[k + r * per_rank : k + (r + 1) * per_rank].tolist()
                    costs.append(
                        sum(
                            len(rank[j : j + m]) * max(lengths[i] for i in rank[j : j + m])
                            for j in range(0, per_rank, m)
                        )
                    )
                assert max(costs) < 1.5 * min(costs)
    other = length_grouped_order(lengths, global_batch_size=g, micro_batch_size=m, seed=5, epoch=4)
    assert not torch.equal(other, order)


def test_length_grouped_loader_slices_and_resumes():
    ds = SyntheticVQA(num_samples=40)
    lengths = [30 + (i * 7) % 50 for i in range(40)]
    kw = dict(global_batch_size=8, micro_batch_size=2, dp_size=2, seed=1)
    loaders = [LengthGroupedLoader(ds, lengths, dp_rank=r, **kw) for r in range(2)]
    order = loaders[0].order(0)
    step = [loader.next_batch() for loader in loaders]
    ids = [s["id"] for rank in step for mb in rank for s in mb]
    assert ids == [f"vqa-{i}" for i in order[:8].tolist()]
    state = loaders[0].state_dict()
    resumed = LengthGroupedLoader(ds, lengths, dp_rank=0, **kw)
    resumed.load_state_dict(state)
    assert [s["id"] for mb in resumed.next_batch() for s in mb] == [
        s["id"] for mb in loaders[0].next_batch() for s in mb
    ]
