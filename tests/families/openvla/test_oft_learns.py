"""The tiny OpenVLA-OFT learns the synthetic task's OFT form on the CPU: after 80 steps of 8
samples its L1 on held-out episodes (another seed's scenes) is below what predicting the mean
action gives. (The default run, ``python -m parallax.train --action-head l1``: 150 steps of
32, goes from 0.54 to 0.060 against the mean's 0.232; this is its CPU-budget form.)"""

import json

import numpy as np
import torch

from parallax import ParallelContext
from parallax.families.openvla.action_tokenizer import normalize_actions
from parallax.families.openvla.oft.data import synthetic_task
from parallax.families.openvla.oft.options import OFTOptions

FLAGS = (
    *("--action-head", "l1", "--steps", "80", "--global-batch-size", "8"),
    *("--micro-batch-size", "8", "--lr", "2e-3", "--warmup-steps", "5", "--save-interval", "0"),
    *("--log-interval", "40", "--eval-interval", "80", "--eval-batches", "4", "--seed", "0"),
)


def mean_action_l1(seed: int = 0, episodes: int = 200) -> float:
    """L1 of predicting the mean normalised action for every chunk of the held-out episodes
    (the training data's statistics normalise, as the model's targets)."""
    options = OFTOptions(action_head="l1")
    train, held_out = synthetic_task(options, seed), synthetic_task(options, seed + 1)
    stats = train.statistics[train.name]["action"]
    k, steps = held_out.config.chunk, held_out.samples_per_episode
    chunks = []
    for e in range(episodes):
        actions = normalize_actions(held_out.scene(e).actions, stats)
        chunks += [actions[t : t + k] for t in range(steps)]
    chunks = np.stack(chunks)  # (n, K, D)
    return float(np.abs(chunks - chunks.reshape(-1, chunks.shape[-1]).mean(0)).mean())


def test_tiny_oft_learns_the_synthetic_task(tmp_path):
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(resolve_run(parse_args([*FLAGS, "--out", str(tmp_path)])), ParallelContext.local())
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (last,) = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    baseline = mean_action_l1()
    assert 0.2 < baseline < 0.26  # 0.232
    assert rows[0]["loss"] > 2 * baseline  # 0.54 at the start
    assert last["eval_loss"] < 0.9 * baseline, (last, baseline)  # 0.199 (seeded)
