"""``--fp8`` as a run sees it: refused on a CPU with one message before anything is built (and
with a quantized base, or without bf16), and, with the emulated GEMMs the tests switch on
(``PARALLAX_FP8_EMULATE=1``), a tiny OpenVLA trains end to end with its linears in FP8 and a
loss that follows the bf16 and fp32 runs'."""

import pytest
import torch

from parallax import ParallelContext
from parallax.run import TrainConfig
from parallax.run.rules import FP8_EMULATE_ENV, config_problems
from parallax.testing import one_thread
from parallax.train import resolve
from tests.families.openvla.test_trainer import _batches

STEPS = 3
# the losses of the first steps agree within 2 % (measured: FP8 within 0.1 % of bf16, bf16
# within 0.6 % of fp32)
LOSS_RTOL = 0.02
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: the tiny model gains nothing from more on a busy 2-core machine."""
    with one_thread():
        yield


@needs_cpu
def test_fp8_is_refused_on_a_cpu_with_one_message_before_anything_is_built(tmp_path, capsys):
    from parallax.train.cli import main

    out = tmp_path / "run"
    assert main(["--fp8", "--precision", "bf16", "--out", str(out)]) != 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert text.count("--fp8 needs a GPU with FP8 tensor cores") == 1, text
    assert not out.exists()  # nothing was built or written


def test_fp8_needs_bf16_and_refuses_a_quantized_base(monkeypatch):
    monkeypatch.setenv(FP8_EMULATE_ENV, "1")
    assert config_problems(TrainConfig(fp8=True, precision="bf16")) == []
    assert config_problems(TrainConfig(fp8=True)) == [
        "--fp8 needs --precision bf16 (FP8 GEMMs take and give bf16)"
    ]
    (problem,) = config_problems(
        TrainConfig(fp8=True, precision="bf16", finetune="lora", quantize_base="nf4")
    )
    assert "--fp8 with --quantize-base nf4" in problem


def _losses(**kw) -> list[float]:
    from parallax.data import SyntheticTask
    from parallax.train.trainer import Trainer

    ctx = ParallelContext.local()
    cfg = TrainConfig(steps=STEPS, global_batch_size=2, micro_batch_size=2, seed=5, **kw)
    torch.manual_seed(0)
    trainer = Trainer(resolve(cfg), ctx)
    if kw.get("fp8"):
        fp8 = [n for c in trainer.chunks for n, m in c.named_modules() if getattr(m, "fp8", 0)]
        assert fp8 and not any(n.endswith("lm_head") for n in fp8)
    data = SyntheticTask(num_episodes=8, episode_length=2, image_size=32, seed=cfg.seed)
    next_batch = _batches(trainer, ctx, cfg, data)
    return [trainer.train_step(next_batch()).loss.item() for _ in range(STEPS)]


def test_a_tiny_model_trains_in_emulated_fp8_as_in_bf16_and_fp32(monkeypatch):
    monkeypatch.setenv(FP8_EMULATE_ENV, "1")
    fp8 = _losses(precision="bf16", fp8=True)
    bf16 = _losses(precision="bf16")
    fp32 = _losses(precision="fp32")
    assert fp8 != bf16  # the FP8 path ran
    for got, ref in ((fp8, bf16), (fp8, fp32), (bf16, fp32)):
        assert all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(got, ref)), (got, ref)
    assert fp8[-1] < fp8[0]  # and it learns
