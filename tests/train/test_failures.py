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
