"""The drill of "what a new user hit" over the planner, calibrate and the report: each bad input
ends in one message naming it and a non-zero status, before any model is built, anything is
measured or drawn, and nothing is written. The planner refuses what the trainer refuses, with
the same words (one declaration); ``--help`` says how the commands are used."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from parallax.plan import calibrate, cli
from parallax.plan.machine import H200
from parallax.plan.options import calibrate_parser, plan_parser
from parallax.recipe.flags import parse_args, train_parser

READ_ONLY = "/proc"  # refuses new files even to root, whom chmod does not stop


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _one_error(err: str, prog: str) -> str:
    """The one message a command said on stderr."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def _no_model(monkeypatch) -> None:
    """Fail the test if the planner gets as far as resolving the run."""

    def refuse(cfg):
        raise AssertionError("the run was resolved before the flags were checked")

    monkeypatch.setattr(cli, "resolve", refuse)


# -- the planner's own flags: refused as the trainer refuses them, before any model -------------
@pytest.mark.parametrize(
    "argv, said",
    [
        (["--gpus", "0"], "--gpus must be >= 1, got 0"),
        (["--gpu-memory", "-24"], "--gpu-memory must be positive, got -24"),
        (["--host-memory", "-1"], "--host-memory must be positive, got -1"),
        (["--gpu-memory", "1e9"], "--gpu-memory must be <= 4096 GiB"),
        (["--margin", "1.5"], "--margin must be in [0, 1), got 1.5"),
        (["--top", "0"], "--top must be >= 1, got 0"),
        (["--gpus", "two"], "--gpus two: expected an integer"),
        (["--interconnect", "carrier-pigeon"], "--interconnect carrier-pigeon: expected one of"),
        (
            ["--nodes", "2", "--gpus-per-node", "4", "--gpus", "4"],
            "--nodes 2 x --gpus-per-node 4 is 8 GPUs, not --gpus 4",
        ),
        (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of 8 GPUs"),
        (["--bogus", "1"], "unrecognized arguments: --bogus 1 (neither the planner's"),
    ],
)
def test_a_bad_planner_flag_is_one_message_before_any_model(argv, said, capsys, monkeypatch):
    _no_model(monkeypatch)
    status, out, err = _plan(argv, capsys)
    assert status == 2 and out == ""
    assert said in _one_error(err, "parallax.plan")


def test_a_bad_run_flag_after_the_planners_is_the_trainers_message(capsys):
    status, out, err = _plan(["--gpus", "2", "--lr", "-1e-3"], capsys)  # "-1e-3": a value
    assert status == 2 and out == ""
    assert "--lr must be positive, got -0.001" in _one_error(err, "parallax.plan")


def test_every_bad_flag_is_in_the_one_message(capsys, monkeypatch):
    _no_model(monkeypatch)
    status, _, err = _plan(["--gpus", "0", "--margin", "2", "--top", "0"], capsys)
    line = _one_error(err, "parallax.plan")
    assert status == 2 and all(f in line for f in ("--gpus", "--margin", "--top")), line


@pytest.mark.parametrize(
    "argv", [["--gpu-memory", "1e9"], ["--host-memory", "-1"], ["--gpu-memory-limit", "5000"]]
)
def test_the_trainer_refuses_the_same_values_in_the_same_words(argv, capsys, monkeypatch):
    auto = [] if argv[0] == "--gpu-memory-limit" else ["--layout", "auto"]
    with pytest.raises(ValueError) as trained:
        parse_args([*argv, *auto]).check()
    if argv[0] != "--gpu-memory-limit":  # the planner's own flag, the trainer's declaration
        _no_model(monkeypatch)
        _, _, err = _plan(argv, capsys)
        assert str(trained.value) in _one_error(err, "parallax.plan")
    assert f"{argv[0]} must be" in str(trained.value)


# -- --machine profiles: one check, field by field, for plan and train --layout auto ------------
PROFILES = {
    "empty": ({}, ["missing field(s) name, gpu_memory_gib", "host_adam_s"]),
    "list": ([], ["a profile must be a JSON object of fields, got []"]),
    "bad": (
        {**H200.to_json(), "gemm_tflops": "fast", "gpu_memory_gib": -1, "nodes": 1.5,
         "intra": {"busbw_gbs": 0}, "colour": "red"},
        ["gemm_tflops = \"fast\": expected a number", "gpu_memory_gib must be positive",
         "nodes = 1.5: expected an integer", "intra.busbw_gbs must be positive",
         "unknown field(s) colour"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", PROFILES)
def test_a_bad_machine_profile_names_every_bad_field(kind, tmp_path, capsys, monkeypatch):
    data, said = PROFILES[kind]
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    _no_model(monkeypatch)
    status, out, err = _plan(["--machine", str(path)], capsys)
    line = _one_error(err, "parallax.plan")
    assert status == 2 and out == "" and f"--machine {path} is not a machine profile" in line
    assert all(s in line for s in said), line


def test_train_layout_auto_refuses_the_same_profile_in_the_same_words(tmp_path, capsys):
    from parallax.train.cli import main

    path = tmp_path / "machine.json"
    path.write_text("{}")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--layout", "auto", "--machine", str(path), "--out", str(tmp_path / "o")])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert status == 2 and "not a machine profile (missing field(s) name" in err, err
    assert "crashed" not in err and not (tmp_path / "o").exists()


# -- no layout to search, or none the run takes: which flag rules them out ---------------------
@pytest.mark.parametrize(
    "argv, said",
    [
        (["--gpus", "4", "--tp", "8"], "--tp 8 needs 8 GPUs in one node"),
        (["--gpus", "4", "--dp", "3"], "--dp 3 cannot make 4 GPUs"),
        (["--gpus", "4", "--micro-batch-size", "3"], "--micro-batch-size 3 does not divide"),
        (
            ["--gpus", "4", "--tp", "1", "--pp", "1", "--global-batch-size", "30"],
            "--global-batch-size 30 does not split over dp 4",
        ),
        (["--gpus", "8", "--tp", "8"], "heads cannot be split over tp=8); --tp 8 rules them out"),
        (["--gpus", "32", "--nodes", "4", "--pp", "32"], "--pp 32 rules them out"),
    ],
)
def test_when_no_layout_is_left_the_flag_that_rules_them_out_is_named(argv, said, capsys):
    status, out, err = _plan([*argv, "--gpu-memory", "80"], capsys)
    assert status == 2 and out == ""
    assert said in _one_error(err, "parallax.plan")


def test_without_a_gpu_the_default_profile_is_named(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    status, out, _ = _plan(["--gpus", "1", "--top", "1"], capsys)
    said = " ".join(out.split())
    assert status == 0 and "no GPU here and no --gpu-memory: planning for the h200" in said
    assert "--gpu-memory GIB" in said and "--machine FILE" in said


def test_a_given_offload_fraction_is_searched(capsys):
    argv = ["--gpus", "2", "--zero", "2", "--offload", "optimizer", "--offload-fraction", "0.3"]
    status, out, _ = _plan([*argv, "--top", "1", "--gpu-memory", "80"], capsys)
    assert status == 0 and "offload 0.3" in out, out


# -- output paths: checked before anything is measured or drawn -------------------------------
def _bad_outs(tmp_path: Path, name: str) -> dict[str, tuple[str, str]]:
    """``--out`` paths no file can be written at (a missing folder is made, unless a file is
    in its way)."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("mine")
    return {
        "a folder below a file": (str(tmp_path / "file" / "new" / name), "is a file, so no"),
        "read-only place": (f"{READ_ONLY}/new/{name}", f"cannot write in {READ_ONLY}"),
        "a directory": (str(tmp_path / "folder"), "is a directory"),
    }


def _untouched(tmp_path: Path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
    assert (tmp_path / "file").read_text() == "mine" and not any((tmp_path / "folder").iterdir())


def test_calibrate_checks_out_before_measuring(tmp_path, capsys, monkeypatch):
    def refuse(*args):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(calibrate, "measure", refuse)
    for what, (out, said) in _bad_outs(tmp_path, "machine.json").items():
        assert cli.main(["calibrate", "--out", out]) == 2, what
        line = _one_error(capsys.readouterr().err, "parallax.plan calibrate")
        assert f"--out {out}" in line and said in line, (what, line)
    assert cli.main(["calibrate"]) == 2
    assert "calibrate needs --out FILE" in capsys.readouterr().err
    _untouched(tmp_path)


def test_calibrate_makes_a_missing_folder_as_train_makes_its_out(tmp_path):
    out = tmp_path / "profiles" / "cpu.json"
    assert cli.main(["calibrate", "--out", str(out), "--precision", "fp32"]) == 0
    assert json.loads(out.read_text())["measured"] is True


def test_report_checks_out_and_dpi_before_drawing(tmp_path, capsys, monkeypatch):
    report = pytest.importorskip("parallax.report")
    pytest.importorskip("matplotlib")

    def refuse(folder):
        raise AssertionError("read a run before the arguments were checked")

    monkeypatch.setattr(report, "read_run", refuse)
    cases = {what: ([out], said) for what, (out, said) in _bad_outs(tmp_path, "c.png").items()}
    good = str(tmp_path / "c.png")
    cases["dpi 0"] = ([good, "--dpi", "0"], "--dpi must be positive, got 0")
    cases["dpi absurd"] = ([good, "--dpi", "100000"], "--dpi must be <= 1200")
    cases["dpi text"] = ([good, "--dpi", "high"], "invalid int value: 'high'")
    cases["format"] = ([str(tmp_path / "c.xyz")], "no picture format 'xyz'")
    for what, (args, said) in cases.items():
        assert report.main(["run", "--out", *args]) == 2, what
        line = _one_error(capsys.readouterr().err, "parallax.report")
        assert said in line, (what, line)
    _untouched(tmp_path)


# -- --help: how the planner is used, every default, no RST ------------------------------------
def test_plan_help_shows_calibrate_the_run_flags_and_every_default():
    text = plan_parser().format_help()
    usage = " ".join(text.split("\n\n")[0].split())
    assert usage.startswith("usage: parallax.plan [calibrate] [-h] [--gpus N]"), usage
    assert usage.endswith("[--model MODEL] [any parallax.train flag]"), usage
    flags = [a for a in plan_parser()._actions if a.option_strings != ["-h", "--help"]]
    assert all("(default " in a.help for a in flags), [a.dest for a in flags]
    assert "this GPU's, else the default profile's" in " ".join(text.split())


def test_no_help_has_rst_and_log_to_takes_a_list():
    from parallax.report import _parser as report_parser

    parsers = (plan_parser(), calibrate_parser(), train_parser(), report_parser())
    for p in parsers:
        assert "`" not in p.format_help(), p.prog
    log_to = next(a for a in train_parser()._actions if a.dest == "log_to")
    assert log_to.metavar == "{tensorboard,wandb}[,...]"
