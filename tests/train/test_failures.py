"""Who says what when a run ends early (the torchrun launches are in test_cli.py)."""

import json

import pytest

from parallax.train.failures import Ending, is_comm_failure, short_cause

GLOO = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:42655. This is typically caused by a remote worker crashing. Check the logs."
)


def test_each_rank_says_at_most_one_line(capsys):
    ending = Ending(rank=3, world=4)
    assert ending.peer_failed(RuntimeError(GLOO), 300.0) == 1
    assert ending.user_error(ValueError("late"), agreed=False) == 1  # the first decision stands
    err = capsys.readouterr().err
    assert err == (
        "parallax.train: rank 3: stopped: a collective failed or timed out (--timeout 300 s): "
        "Connection closed by peer [127.0.0.1]:42655; most likely another rank died or hung; "
        "restart with --resume to continue from the last checkpoint\n"
    )


@pytest.mark.parametrize("rank, said", [(0, True), (1, False)])
def test_an_agreed_user_error_is_said_by_rank_0(rank, said, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no lingering outside torchrun
    assert Ending(rank, world=2).user_error(ValueError("bad --tp"), agreed=True) == 2
    assert capsys.readouterr().err == ("parallax.train: error: bad --tp\n" if said else "")
    assert (tmp_path / "error.json").exists() == said
    if said:  # the reply torchrun's summary prints as rank 0's root cause
        reply = json.loads((tmp_path / "error.json").read_text())["message"]
        assert reply["extraInfo"]["py_callstack"] == "parallax.train: error: bad --tp"
        assert int(reply["extraInfo"]["timestamp"]) > 0


def test_a_rank_local_error_names_its_rank(capsys):
    assert Ending(rank=2, world=4).user_error(FileNotFoundError("x.json"), agreed=False) == 2
    assert capsys.readouterr().err == "parallax.train: rank 2: error: x.json\n"
    assert Ending(rank=0, world=1).user_error(ValueError("y"), agreed=False) == 2
    assert capsys.readouterr().err == "parallax.train: error: y\n"  # one process: no rank


def test_communication_failures_are_told_from_bugs():
    assert short_cause(RuntimeError(GLOO)) == "Connection closed by peer [127.0.0.1]:42655"
    assert is_comm_failure(RuntimeError(GLOO))
    assert is_comm_failure(RuntimeError("Timed out waiting 300000ms for recv operation"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_failure(KeyError("peer"))


def _leave(monkeypatch, stop: bool = True) -> list[int]:
    """``os._exit`` recorded and (``stop``) turned into SystemExit (the handler leaves at
    once)."""
    import os

    left: list[int] = []

    def leave(status: int):
        left.append(status)
        if stop:
            raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", leave)
    return left


def test_sigterm_while_training_asks_for_a_checkpoint_and_a_second_one_leaves(monkeypatch, capsys):
    import time

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no torchrun deadline watchdog
    left = _leave(monkeypatch)
    ending = Ending(rank=0, world=2)
    released: list[bool] = []
    ending.preemption.cleanups.append(lambda: released.append(True))
    ending.preemption.armed = True  # the step loop runs
    ending.on_sigterm(15, None)
    assert ending.preemption.requested and left == [] and capsys.readouterr().err == ""
    ending.on_sigterm(15, None)  # the same signal delivered twice (scheduler and torchrun)
    assert left == []
    later = ending.preemption.first_at + 2.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    with pytest.raises(SystemExit):
        ending.on_sigterm(15, None)  # a second signal: at once
    assert left == [143] and released == [True]
    assert capsys.readouterr().err == (
        "parallax.train: rank 0: stopped by a second SIGTERM before saving; --resume "
        "continues from the last checkpoint\n"
    )


def test_sigterm_after_the_preemption_saved_says_so_and_before_training_stops(monkeypatch, capsys):
    left = _leave(monkeypatch)
    ending = Ending(rank=0, world=2)
    ending.preemption.saved = 7
    with pytest.raises(SystemExit):
        ending.on_sigterm(15, None)
    assert left == [143]
    assert capsys.readouterr().err == (
        "parallax.train: preempted (SIGTERM): saved step 7; --resume continues from it\n"
    )
    ending = Ending(rank=1, world=2)  # not training yet: a launcher stopping a failed run
    with pytest.raises(SystemExit):
        ending.on_sigterm(15, None)
    assert "rank 1: stopped by the launcher (SIGTERM), most likely because another rank" in (
        capsys.readouterr().err
    )


def test_under_torchrun_a_rank_that_reaches_no_step_boundary_says_why(monkeypatch, capsys):
    """A peer hung in a collective: no step boundary comes, and torchrun's SIGKILL would come
    30 s after its SIGTERM with nothing said; the rank says why before then."""
    import time

    from parallax.train import failures

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setattr(failures, "PREEMPT_GRACE_S", 0.05)
    left = _leave(monkeypatch, stop=False)  # recorded in the timer's thread
    ending = Ending(rank=1, world=2)
    ending.preemption.armed = True
    ending.on_sigterm(15, None)
    deadline = time.monotonic() + 10
    while not left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left == [143]
    assert "rank 1: stopped by SIGTERM: no step boundary within 0.05 s" in capsys.readouterr().err
