"""Inputs staged ahead on a GPU: pinned, copied on a side stream, waited for by the step's
stream and recorded on it. The stream logic is checked on a CPU with stand-ins; the copies
themselves need a GPU (skipped without one; on a GPU machine:
``python3 -m pytest -q tests/train/test_staging_cuda.py``)."""

import json
import threading

import pytest
import torch

from parallax import ParallelContext
from parallax.train import Trainer, parse_args, resolve, resolve_run, run
from parallax.train.staging import Staged

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ARGS = ["--global-batch-size", "4", "--micro-batch-size", "2"]


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class _Tensor:
    def __init__(self):
        self.streams = []

    def record_stream(self, stream):
        self.streams.append(stream)


def test_ready_waits_for_the_copies_and_records_them_on_the_step_s_stream(monkeypatch):
    stream, event = _Stream(), object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    copies = [_Tensor(), _Tensor()]
    staged = Staged(event=event, device=torch.device("cuda", 0), tensors=list(copies))
    staged.ready()
    assert stream.waited == [event]
    assert all(t.streams == [stream] for t in copies)
    staged.ready()  # once only: a second call neither waits nor records again
    assert stream.waited == [event] and all(len(t.streams) == 1 for t in copies)


def test_ready_without_copies_ahead_does_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pytest.fail("called"))
    Staged(inputs=[()]).ready()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@gpu
def test_copies_ahead_match_the_host_batch_while_the_stream_is_busy():
    r = resolve(parse_args(ARGS))
    ctx = ParallelContext.local("cuda")
    trainer = Trainer(r, ctx)
    side = r.recipe.data
    data = side.dataset(r.data, r)
    builder, loader = side.collator(r, data), side.loader(data, r, ctx)
    batches = [[builder(s) for s in loader.next_batch()] for _ in range(3)]
    x = torch.randn(4096, 4096, device="cuda")
    for mbs in batches:
        for _ in range(20):  # keep the step's stream busy while the thread copies
            x = torch.tanh(x @ x) / 64
        made = []  # made in another thread, as the prefetch thread does
        thread = threading.Thread(target=lambda m=mbs, o=made: o.append(trainer.stager(m, True)))
        thread.start()
        thread.join()
        (staged,) = made
        assert staged.event is not None and staged.tensors
        assert all(t.is_cuda for t in staged.tensors)
        staged.ready()
        plain = trainer.stager(mbs)  # the step's own copies, on its stream
        assert _same(staged.inputs, plain.inputs) and _same(staged.targets, plain.targets)
        del staged  # freed while the stream may still be busy: recorded, so not reused early
    torch.cuda.synchronize()


@gpu
def test_losses_on_a_gpu_are_the_same_with_and_without_prefetch(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    got = {}
    for depth in ("0", "1", "2"):
        out = tmp_path / depth
        flags = ["--out", str(out), "--steps", "4", "--save-interval", "0", *ARGS]
        run(resolve_run(parse_args([*flags, "--prefetch", depth])), ParallelContext.local("cuda"))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        got[depth] = [(r["loss"], r["grad_norm"]) for r in rows]
    assert got["1"] == got["0"] and got["2"] == got["0"]
