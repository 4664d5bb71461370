"""pi0's robot data streamed (:mod:`parallax.families.pi0.stream_data`): a two-dataset mixture
(LeRobot v2.1 and LIBERO) through the trainer; dp2's first step has the one process's loss;
the dp ranks' shares and a resume mid-epoch give the one-process batches, flow-matching noise
and times included (keyed by the global stream position)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import write_libero
from parallax import ParallelContext
from parallax.families.pi0.stream_data import robot_stream, stream_loader
from parallax.recipe import resolve
from parallax.run import TrainConfig
from parallax.testing import context, one_thread, run_ranks
from tests.families.pi0.test_data import _episodes
from tests.train.test_cli import metrics, single

pytest.importorskip("pyarrow")
pytest.importorskip("h5py")
KEYS = ("images", "state", "actions", "action_pad", "tokens", "noise", "time", "mean_action")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0mix")
    a = write_lerobot(root / "so", _episodes(6), version="v2.1")
    b = write_libero(root / "libero_spatial", {"pick": _episodes(8, "pick")})
    return f"lerobot:{a}@0.6,libero:{b}@0.4"


def test_a_mixture_trains_through_the_trainer(mixture, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--model", "pi0-tiny", "--data", mixture, "--out", str(out), "--steps", "2"]
    args += ["--global-batch-size", "4", "--micro-batch-size", "2", "--workers", "1"]
    status, _, err = single(capsys, *args)
    assert status == 0, err
    losses = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(losses) == 2 and np.isfinite(losses).all()
    stats = json.loads((out / "dataset_statistics.json").read_text())
    assert sorted(stats) == ["libero_spatial", "so"]


def _batch(loader, collate) -> dict[str, torch.Tensor]:
    """One step of ``loader`` collated, its microbatches concatenated."""
    mbs = [collate(m) for m in loader.next_batch()]
    return {k: torch.cat([mb[k] for mb in mbs]) for k in KEYS}


def test_dp_shares_and_a_resume_give_the_one_process_batches(mixture, tmp_path):
    cfg = TrainConfig.of(model="pi0-tiny", data=mixture, out=str(tmp_path), workers=0, seed=3,
                         global_batch_size=4, micro_batch_size=1)  # fmt: skip
    run = resolve(cfg)
    data = robot_stream(mixture, run)
    collate = run.recipe.data.collator(run, data)

    def loader(rank=0, size=1):
        return stream_loader(data, run, SimpleNamespace(dp_rank=rank, dp_size=size))

    one = loader()
    whole = [_batch(one, collate) for _ in range(6)]  # 24 of 21 + 21 samples: mixed, padded
    assert any(b["action_pad"].any() for b in whole)
    ranks = [loader(r, 2) for r in range(2)]
    for step in range(2):
        shares = [_batch(r, collate) for r in ranks]
        for k in KEYS:
            assert torch.equal(torch.cat([s[k] for s in shares]), whole[step][k]), (step, k)
    first = loader()
    for _ in range(3):
        first.next_batch()
    resumed = loader(1, 2)  # another dp split
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got = _batch(resumed, collate)
    for k in KEYS:
        assert torch.equal(got[k], whole[3][k][2:]), k


def _first_loss(ctx, spec: str, out: str, dp: int) -> float:
    from parallax.train.trainer import Trainer  # the trainer imports every layer below it

    cfg = TrainConfig.of(model="pi0-tiny", data=spec, out=out, workers=0, seed=3, dp=dp,
                         global_batch_size=4, micro_batch_size=1, lr=1e-3)  # fmt: skip
    trainer = Trainer(resolve(cfg), ctx)
    data = robot_stream(spec, trainer.run)
    collate = trainer.recipe.data.collator(trainer.run, data)
    loader = stream_loader(data, trainer.run, ctx)
    return trainer.train_step([collate(m) for m in loader.next_batch()]).loss.item()


def _dp2(spec: str, out: str) -> float:
    return _first_loss(context(dp=2), spec, out, 2)


def test_dp2_first_step_matches_one_process(mixture, tmp_path):
    with one_thread():
        one = _first_loss(ParallelContext.local(), mixture, str(tmp_path / "one"), 1)
    got = run_ranks(_dp2, 2, mixture, str(tmp_path / "dp2"))
    assert got == pytest.approx([one, one], rel=1e-5)
