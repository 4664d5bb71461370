"""A whole run with ``--prefetch``: the same losses, bit for bit, as with ``--prefetch 0`` (the
same computations on the same batches), also across a resume, and an error in the prefetch
thread ends the run naming the step."""

import json
import signal
from pathlib import Path

import pytest

from parallax import ParallelContext
from parallax.train import parse_args, resolve_run, run

RUN = [
    "--steps", "4", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--save-interval", "2", "--warmup-steps", "1", "--log-interval", "4",
]  # fmt: skip


def _train(out: Path, *extra: str, stop_after=None) -> list[dict]:
    cfg = parse_args(["--out", str(out), *RUN, *extra])
    run(resolve_run(cfg), ParallelContext.local(), stop_after=stop_after)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def test_losses_are_the_same_with_prefetch_and_across_a_resume(tmp_path):
    plain = _train(tmp_path / "plain", "--prefetch", "0")
    assert _train(tmp_path / "ahead") == plain  # --prefetch 1, the default: exactly equal
    _train(tmp_path / "resumed", "--prefetch", "2", stop_after=2)
    assert _train(tmp_path / "resumed", "--prefetch", "2", "--resume") == plain


def test_an_error_in_the_prefetch_thread_ends_the_run_naming_the_step(tmp_path, capsys):
    from parallax.data.prefetch import Serialized
    from parallax.train.cli import main

    calls = []
    real = Serialized.__call__  # the session's collator, whatever the family

    def failing(self, samples):
        calls.append(1)
        if len(calls) == 5:  # the first microbatch of step 3
            raise RuntimeError("the collator broke")
        return real(self, samples)

    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Serialized, "__call__", failing)
            status = main(["--out", str(tmp_path / "broken"), *RUN])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert status != 0
    assert "RuntimeError: the collator broke" in err, err[-3000:]
    assert "prefetch thread while making the batch of step 3" in err, err[-3000:]
    assert "in failing" in err  # the producer's own traceback
    steps = (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2  # steps 1 and 2 ran and were recorded
