"""The steps' batches made ahead (``--prefetch``): the same batches in the same order as made
between steps, the same after a resume, staged only where a stage uses them, and the wait
that ``data_wait_s`` reports is the step's real wait."""

import time
from types import SimpleNamespace

import pytest
import torch

from parallax import ParallelContext
from parallax.pipeline import make_schedule
from parallax.train import Trainer, parse_args, resolve
from parallax.train.staging import Stager
from parallax.train.step_batches import StepBatches

STEPS = 5


@pytest.fixture(scope="module")
def tiny():
    """A tiny OpenVLA trainer on the synthetic task, its data and its collator."""
    run = resolve(parse_args(["--global-batch-size", "4", "--micro-batch-size", "2"]))
    ctx = ParallelContext.local()
    side = run.recipe.data
    data = side.dataset(run.data, run)
    trainer = Trainer(run, ctx)
    return SimpleNamespace(
        run=run,
        ctx=ctx,
        trainer=trainer,
        data=data,
        builder=side.collator(run, data),
        loader=lambda: side.loader(data, run, ctx),
    )


def _batches(t, depth, start=0, steps=STEPS, state=None, take=None, builder=None):
    loader = t.loader()
    if state is not None:
        loader.load_state_dict(state)
    stream = StepBatches(loader, builder or t.builder, t.trainer, start, steps, depth)
    try:
        got = [stream.next() for _ in range(take or steps - start)]
        return got, stream.state_dict()
    finally:
        stream.close()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("depth", [1, 2])
def test_the_batches_are_those_made_between_steps(tiny, depth):
    plain, plain_state = _batches(tiny, 0)
    ahead, state = _batches(tiny, depth)
    assert all(b.problem is None and b.staged is None for b in plain)
    assert all(b.problem is None and b.staged is not None for b in ahead)
    for k, (x, y) in enumerate(zip(plain, ahead)):
        assert _same(x.microbatches, y.microbatches), f"step {k + 1}"
        assert x.state == y.state
    assert state == plain_state


def test_a_resume_continues_with_the_same_batches(tiny):
    whole, _ = _batches(tiny, 0)
    first, state = _batches(tiny, 1, take=2)  # the loader ran ahead; the state did not
    assert state == whole[1].state
    rest, _ = _batches(tiny, 1, start=2, state=state)
    for k, (x, y) in enumerate(zip(whole[2:], rest)):
        assert _same(x.microbatches, y.microbatches), f"step {k + 3}"


def test_staged_inputs_on_a_cpu_are_the_host_tensors(tiny):
    (batch,), _ = _batches(tiny, 1, take=1)
    data, objective = tiny.run.recipe.data, tiny.run.recipe.objective
    for m, mb in enumerate(batch.microbatches):
        assert _same(batch.staged.inputs[m], tuple(data.stage_inputs(mb)))
        assert _same(batch.staged.targets[m], objective.loss_target(tiny.run, mb))
    batch.staged.ready()  # nothing to wait for on a CPU


@pytest.mark.parametrize("pp_rank", [0, 1, 2])
def test_under_pp_only_the_stages_that_use_them_get_copies(tiny, pp_rank, monkeypatch):
    (batch,), _ = _batches(tiny, 0, take=1)
    fake = SimpleNamespace(
        run=tiny.run,
        recipe=tiny.run.recipe,
        ctx=SimpleNamespace(device=torch.device("cpu"), pp_rank=pp_rank),
        schedule=make_schedule("gpipe", 3, 2, 1),
    )
    copied = []
    monkeypatch.setattr(Stager, "_copy", lambda self, x: copied.append(x) or x)
    staged = Stager(fake)(batch.microbatches, ahead=True)
    first, last = pp_rank == 0, pp_rank == 2
    mb = batch.microbatches[0]
    inputs = len(tiny.run.recipe.data.stage_inputs(mb))
    targets = _count(tiny.run.recipe.objective.loss_target(tiny.run, mb))  # rows, labels
    assert len(staged.inputs) == 2  # every rank passes its inputs' count to the schedule
    assert (staged.targets is not None) == last
    assert len(copied) == 2 * (inputs * first + targets * last)


def _count(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    return sum(_count(v) for v in value) if isinstance(value, list | tuple) else 0


class _Slow:
    """A collator that takes ``seconds`` per microbatch."""

    def __init__(self, builder, seconds):
        self.builder, self.seconds = builder, seconds

    def __call__(self, samples):
        time.sleep(self.seconds)
        return self.builder(samples)


def _waits(tiny, depth, step_s):
    loader = tiny.loader()
    stream = StepBatches(loader, _Slow(tiny.builder, 0.1), tiny.trainer, 0, 4, depth)
    waits = []
    try:
        for _ in range(4):
            waits.append(stream.next().waited_s)
            time.sleep(step_s)  # the step
    finally:
        stream.close()
    return waits


def test_data_wait_is_what_the_step_waited(tiny):
    between = _waits(tiny, 0, 0.05)
    assert min(between) >= 0.2  # two microbatches of 0.1 s, every step
    ahead = _waits(tiny, 1, 0.6)  # a step longer than making a batch: no wait after the first
    assert ahead[0] >= 0.15 and max(ahead[1:]) < 0.1, ahead


def test_an_error_making_a_batch_is_raised_at_its_step(tiny):
    calls = []

    def failing(samples):
        calls.append(1)
        if len(calls) == 3:  # the first microbatch of step 2
            raise RuntimeError("the tokenizer broke")
        return tiny.builder(samples)

    stream = StepBatches(tiny.loader(), failing, tiny.trainer, 0, STEPS, 1)
    try:
        assert stream.next().problem is None
        with pytest.raises(RuntimeError, match="the tokenizer broke") as info:
            stream.next()
        assert "making the batch of step 2" in "".join(info.value.__notes__)
    finally:
        stream.close()
